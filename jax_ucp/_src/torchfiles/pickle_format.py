"""torch's pickles both ways: read by a restricted unpickler that executes nothing (globals through
:mod:`allow_list`, the object graph bounded), written opcode by opcode as torch 2.x writes them."""

from __future__ import annotations

import collections
import io
import pickle
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from jax_ucp._src.torchfiles import allow_list
from jax_ucp._src.torchfiles.allow_list import Allowed, StandIn, TorchFileError, short_repr

#: At most this many objects (or two per pickle byte, a real file's ratio; shared references
#: counted each time reached) and this depth: shared sub-lists ("billion laughs") expand to 2**100.
MAX_EXPANDED_OBJECTS = 4_000_000
MAX_DEPTH = 200

#: Types with no children: counted in check_expansion's walk, never pushed (exact types only).
_ATOMS = frozenset({int, float, complex, bool, str, bytes, type(None)})


def _children(x: Any) -> Iterable[Any]:
    if type(x) in (list, tuple, set, frozenset):
        return x
    if isinstance(x, dict):  # dict and OrderedDict (its __dict__ carries torch's _metadata)
        extra = list(x.__dict__.values()) if type(x) is collections.OrderedDict else []
        return [*x.keys(), *x.values(), *extra]
    if isinstance(x, StandIn):
        return list(x.__dict__.values())
    return ()


def check_expansion(obj: Any, where: str, pickle_bytes: int = 0) -> None:
    """Refuses an object graph beyond ``max(MAX_EXPANDED_OBJECTS, 2 * pickle_bytes)`` objects,
    :data:`MAX_DEPTH` deep, or cyclic.

    Args:
        obj: the unpickled object graph.
        where: names the file in errors.
        pickle_bytes: the size of the pickle it came from."""
    limit = max(MAX_EXPANDED_OBJECTS, 2 * pickle_bytes)
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    active: set[int] = set()
    keep: list[Any] = []  # ids stay valid while the walk runs
    # (object, None) to visit; (object, (its non-atom children, its atom count)) to finish
    stack: list[tuple[Any, tuple[list[Any], int] | None]] = [(obj, None)]
    while stack:
        x, done = stack.pop()
        i = id(x)
        if done is not None:
            kids, atoms = done
            size[i] = 1 + atoms + sum(size[id(k)] for k in kids)
            depth[i] = 1 + max((depth[id(k)] for k in kids), default=1 if atoms else 0)
            active.discard(i)
            if size[i] > limit:
                raise TorchFileError(
                    where,
                    f"the pickle expands to more than {limit} objects when its "
                    "shared references are followed (a 'billion laughs' structure); refused",
                )
            if depth[i] > MAX_DEPTH:
                raise TorchFileError(
                    where, f"the pickle nests deeper than {MAX_DEPTH} levels; refused"
                )
            continue
        if i in size:
            continue
        if i in active:
            raise TorchFileError(where, "the pickle holds a container that contains itself")
        kids = list(_children(x))
        if not kids:
            size[i], depth[i] = 1, 1
            continue
        inner = [k for k in kids if type(k) not in _ATOMS]
        active.add(i)
        keep.append(x)
        stack.append((x, (inner, len(kids) - len(inner))))
        stack.extend((k, None) for k in inner if id(k) not in size)


class _RestrictedUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """Pure-Python unpickler whose code-running opcodes are replaced by checked versions."""

    dispatch: ClassVar[dict] = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]
    # pickle._Unpickler's own state, which typeshed does not declare
    stack: list[Any]
    append: Callable[[Any], None]
    pop_mark: Callable[[], list[Any]]

    def __init__(
        self,
        data: bytes,
        where: str,
        allowed: Mapping[str, Any],
        persistent: Callable[[Any], Any] | None,
    ):
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._where = where
        self._allowed = allowed
        self._persistent = persistent

    def _err(self, msg: str) -> TorchFileError:
        return TorchFileError(self._where, msg)

    def find_class(self, module: str, name: str) -> Any:  # GLOBAL / STACK_GLOBAL / INST
        if module == "__builtin__":  # protocol-2 spelling of builtins
            module = "builtins"
        q = f"{module}.{name}"
        if q not in self._allowed:
            raise self._err(
                f"refusing to load global {q!r}: not in the allow-list (nothing was executed)"
            )
        v = self._allowed[q]
        return Allowed(q, v) if callable(v) and not isinstance(v, np.dtype) else v

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise self._err(f"unexpected persistent id {short_repr(pid)}")
        return self._persistent(pid)

    def _call(self, f: Any, args: Any, how: str) -> Any:
        if not isinstance(f, Allowed):
            raise self._err(
                f"{how} on {type(f).__name__} {short_repr(f, 80)}: only allow-listed callables "
                "may be called"
            )
        if not isinstance(args, tuple):
            raise self._err(
                f"{how} on {f.qualname}: args must be a tuple, found {type(args).__name__}"
            )
        try:
            return f.fn(*args)
        except TorchFileError:
            raise
        except Exception as e:  # the stand-in rejected its args
            raise TorchFileError(
                self._where, f"{how} {f.qualname}: {e} (args {short_repr(args)})"
            ) from None

    # -- opcodes that call things
    def load_reduce(self):
        args = self.stack.pop()
        self.stack[-1] = self._call(self.stack[-1], args, "REDUCE")

    def _instantiate(self, klass, args):
        self.append(self._call(klass, tuple(args), "INST/OBJ"))

    def load_newobj(self):
        args = self.stack.pop()
        cls = self.stack.pop()
        if not isinstance(cls, Allowed) or not isinstance(cls.fn, type):
            raise self._err(
                f"NEWOBJ on {short_repr(cls, 80)}: only allow-listed classes may be instantiated"
            )
        if not isinstance(args, tuple):
            raise self._err("NEWOBJ args must be a tuple")
        try:
            obj: Any = cls.fn.__new__(cls.fn, *args)
        except Exception as e:
            raise TorchFileError(self._where, f"NEWOBJ {cls.qualname}: {e}") from None
        if isinstance(obj, StandIn) and "args" not in obj.__dict__:
            vars(obj)["args"] = args
        self.append(obj)

    def load_newobj_ex(self):
        kwargs = self.stack.pop()
        if kwargs:
            raise self._err("NEWOBJ_EX with keyword arguments is not supported")
        self.load_newobj()

    def load_build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        if isinstance(inst, StandIn):
            try:
                inst.__setstate__(state)
            except TorchFileError as e:
                raise self._err(str(e).split(": ", 1)[-1]) from None
        elif type(inst) is collections.OrderedDict and isinstance(state, dict):
            # torch state_dicts carry `_metadata` as an instance attribute
            for k, v in state.items():
                # an attribute named like a dict method (``get``, ``items``) would shadow it
                if not isinstance(k, str) or k.startswith("__") or hasattr(inst, k):
                    raise self._err(f"BUILD on OrderedDict: refusing attribute {short_repr(k, 80)}")
                inst.__dict__[k] = v
        elif state:
            raise self._err(f"BUILD on {type(inst).__name__}: only stand-in objects accept state")

    # -- opcodes that mutate containers: only plain containers
    def load_append(self):
        value = self.stack.pop()
        self._target(list, "APPEND").append(value)

    def load_appends(self):
        items = self.pop_mark()
        self._target(list, "APPENDS").extend(items)

    def load_setitem(self):
        value = self.stack.pop()
        key = self.stack.pop()
        self._target(dict, "SETITEM")[self._key(key)] = value

    def load_setitems(self):
        items = self.pop_mark()
        d = self._target(dict, "SETITEMS")
        for i in range(0, len(items), 2):
            d[self._key(items[i])] = items[i + 1]

    def load_additems(self):
        items = self.pop_mark()
        self._target(set, "ADDITEMS").update(self._key(k, "set element") for k in items)

    def _key(self, key: Any, what: str = "dict key") -> Any:
        try:
            return allow_list.hashable_key(key, what)
        except ValueError as e:
            raise self._err(str(e)) from None

    def _target(self, kind: type, op: str) -> Any:
        t = self.stack[-1]
        if type(t) is not kind and not (kind is dict and type(t) is collections.OrderedDict):
            raise self._err(
                f"{op} on {type(t).__name__}: only plain {kind.__name__}s may be filled"
            )
        return t

    def load_persid(self):
        raise self._err("text PERSID opcode is not used by torch files")

    def get_extension(self, code):
        raise self._err(f"EXT opcode (extension code {code}) is not allowed")

    def load_next_buffer(self):
        raise self._err("out-of-band buffers are not allowed")


# the opcodes replaced above, each by its ``load_<name>`` method
_REPLACED = (
    "REDUCE NEWOBJ NEWOBJ_EX BUILD APPEND APPENDS SETITEM SETITEMS ADDITEMS PERSID NEXT_BUFFER"
)
for _name in _REPLACED.split():
    _RestrictedUnpickler.dispatch[getattr(pickle, _name)[0]] = getattr(
        _RestrictedUnpickler, f"load_{_name.lower()}"
    )


def restricted_loads(
    data: bytes,
    *,
    where: str = "<bytes>",
    extra_classes: Mapping[str, Any] | None = None,
    persistent_load: Callable[[Any], Any] | None = None,
) -> Any:
    """Unpickle ``data`` with the allow-list (+ ``extra_classes``); errors name ``where``.

    Args:
        data: the pickle bytes.
        where: names the data in errors.
        extra_classes: more allow-listed classes (``module.QualName`` -> stand-in).
        persistent_load: resolves persistent ids (torch's storages)."""
    allowed = {**allow_list.BASE_ALLOWED, **(extra_classes or {})}
    up = _RestrictedUnpickler(data, where, allowed, persistent_load)
    try:
        obj = up.load()
        check_expansion(obj, where, len(data))
        return obj
    except TorchFileError:
        raise
    except RecursionError:
        raise TorchFileError(where, "pickle nests too deeply") from None
    except Exception as e:
        raise TorchFileError(where, f"corrupt pickle ({type(e).__name__}: {e})") from None


# --------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class Global:
    """``module.name``, named in the pickle (GLOBAL), never imported here."""

    module: str
    name: str


@dataclass(frozen=True)
class Call:
    """``fn(*args)`` when unpickled (REDUCE)."""

    fn: Global
    args: tuple


@dataclass(frozen=True)
class New:
    """``cls.__new__(cls)`` then ``BUILD(state)``: how dataclasses pickle (NEWOBJ + BUILD)."""

    cls: Global
    state: Any


@dataclass(frozen=True)
class Pairs:
    """A dict whose keys are nodes (unhashable here, hashable once unpickled)."""

    items: tuple


@dataclass(frozen=True)
class Persistent:
    """A persistent id (BINPERSID): torch's reference to a storage member."""

    pid: tuple


def dumps(obj: Any) -> bytes:
    """A protocol-2 pickle of ``obj`` (plain data and the nodes above)."""
    out = io.BytesIO()
    out.write(pickle.PROTO + b"\x02")
    _emit(obj, out)
    out.write(pickle.STOP)
    return out.getvalue()


def _emit(obj: Any, out: io.BytesIO) -> None:
    """The opcodes of ``obj``: scalars (a bool before an int: it is one), containers, nodes."""
    w = out.write
    if obj is None:
        w(pickle.NONE)
    elif obj is True or obj is False:
        w(pickle.NEWTRUE if obj else pickle.NEWFALSE)
    elif isinstance(obj, int):
        if -(2**31) <= obj < 2**31:
            w(pickle.BININT + struct.pack("<i", obj))
        else:
            raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
            w(pickle.LONG1 + bytes([len(raw)]) + raw)
    elif isinstance(obj, float):
        w(pickle.BINFLOAT + struct.pack(">d", obj))
    elif isinstance(obj, str):
        raw = obj.encode("utf-8", "surrogatepass")
        w(pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw)
    elif isinstance(obj, (tuple, list)):
        w(pickle.MARK if isinstance(obj, tuple) else pickle.EMPTY_LIST + pickle.MARK)
        for item in obj:
            _emit(item, out)
        w(pickle.TUPLE if isinstance(obj, tuple) else pickle.APPENDS)
    elif isinstance(obj, (dict, Pairs)):  # SETITEMS from (key, value) pairs
        w(pickle.EMPTY_DICT + pickle.MARK)
        for key, value in obj.items() if isinstance(obj, dict) else obj.items:
            _emit(key, out)
            _emit(value, out)
        w(pickle.SETITEMS)
    elif isinstance(obj, Global):
        w(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
    elif isinstance(obj, Call):
        _emit(obj.fn, out)
        _emit(tuple(obj.args), out)
        w(pickle.REDUCE)
    elif isinstance(obj, New):
        _emit(obj.cls, out)
        w(pickle.EMPTY_TUPLE + pickle.NEWOBJ)
        _emit(obj.state, out)
        w(pickle.BUILD)
    elif isinstance(obj, Persistent):
        _emit(obj.pid, out)
        w(pickle.BINPERSID)
    else:
        raise TypeError(f"cannot pickle {type(obj).__name__} for torch")


def torch_size(dims: Sequence[int]) -> Call:
    """A pickled ``torch.Size(dims)``, as torch writes tensor shapes."""
    return Call(Global("torch", "Size"), (tuple(int(d) for d in dims),))
