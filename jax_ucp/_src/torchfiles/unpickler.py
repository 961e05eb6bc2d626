"""Read torch ``.pt`` files without torch and without executing pickled code.

Torch checkpoints are untrusted input: ``torch.load`` runs arbitrary pickled callables. This
module interprets the pickle with a restricted opcode dispatcher instead:

* globals resolve only through an allow-list (tensor rebuild functions, storage types, torch
  dtypes, ``collections.OrderedDict`` and a few builtins) plus the caller's ``extra_classes``,
  a mapping ``"module.QualName" -> stand-in`` (see :class:`StandIn`, :func:`standin_class`,
  :func:`int_enum_standin`); anything else is refused *before* anything is called;
* REDUCE / NEWOBJ / INST / OBJ may only call allow-listed objects, BUILD only targets
  :class:`StandIn` instances, APPEND/SETITEM/ADDITEMS only plain lists/dicts/sets;
* persistent ids must be well-formed torch storage references to members that exist.

Tensors come back as read-only ``numpy`` arrays that view a single read-only ``mmap`` of the
file (torch stores zip members uncompressed), so loading a checkpoint costs page-cache, not
anonymous memory, and only touched bytes are read. Their bytes are read out with
:func:`jax_ucp._src.format.mapped_file.read_out` (pread), never by touching the mapping: a file
truncated meanwhile is then an error naming it, not SIGBUS. bfloat16 / float8 map to
``ml_dtypes``.

Public API (stable; also used by the Megatron importer): ``load_torch_file``,
``scan_globals``, ``TorchFileError``, ``StandIn``, ``standin_class``, ``int_enum_standin``,
``BASE_ALLOWED``.
"""

from __future__ import annotations

import collections
import contextlib
import io
import itertools
import math
import os
import pickle
import pickletools
import reprlib
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from jax_ucp._src.errors import SourceError
from jax_ucp._src.format import files, mapped_file
from jax_ucp._src.torchfiles import dtypes

try:  # ISA-L's CRC-32 (carry-less multiply): ~4x zlib's; the same zip polynomial
    from isal.isal_zlib import crc32 as zip_crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same values
    from zlib import crc32 as zip_crc32

__all__ = [
    "BASE_ALLOWED",
    "MAX_COMPRESSED_MEMBER",
    "MAX_DEPTH",
    "MAX_EXPANDED_OBJECTS",
    "MAX_INFLATED_TOTAL",
    "NUMPY_CLASSES",
    "SHARDED_TENSOR_CLASSES",
    "StandIn",
    "TorchArchive",
    "TorchFileError",
    "WrapperTensor",
    "check_expansion",
    "hashable_key",
    "int_enum_standin",
    "load_torch_file",
    "scan_globals",
    "short_repr",
    "standin_class",
]


class TorchFileError(SourceError):
    """A torch file is missing, truncated, corrupt, in an unsupported format, or its pickle asks
    for something outside the allow-list (nothing was executed); ``path``: the file. A class of
    its own for the importers, which keep it as it is (it names the file already) while they
    re-word the other refusals of their readers."""

    def __init__(self, path: os.PathLike | str, message: str):
        self.path = str(path)
        super().__init__(f"{self.path}: {message}")


#: At most this many objects, or two per byte of the pickle when that is more (shared
#: references counted each time they are reached), and this nesting depth in one unpickled
#: file. Every object of a real pickle costs at least one opcode byte, so a real file expands to
#: about as many objects as it has bytes (a big model's DCP ``.metadata`` included); a few
#: hundred bytes of shared sub-lists ("billion laughs") expand to 2**100, and any later walk
#: over them (an error's repr, json.dumps, a tree flatten) would never end.
MAX_EXPANDED_OBJECTS = 4_000_000
MAX_DEPTH = 200
#: Largest deflate-compressed member inflated into memory (torch itself never compresses).
MAX_COMPRESSED_MEMBER = 256 << 20
#: Most bytes inflated from one archive's deflated members in total: inflated bytes live in
#: anonymous memory for as long as the tensors viewing them, so many members each under the
#: per-member cap would otherwise add up to any amount (16 x 255 MiB from a 4 MB file).
MAX_INFLATED_TOTAL = 256 << 20


class _BoundedRepr(reprlib.Repr):
    """``repr`` cut *before* it is built: a few levels, a few items per container."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxdict, self.maxlist, self.maxtuple = 3, 6, 8, 8
        self.maxset = self.maxfrozenset = self.maxdeque = 8
        self.maxstring, self.maxother, self.maxlong = 80, 80, 40

    def repr1(self, x: Any, level: int) -> str:
        if isinstance(x, StandIn):
            if level <= 0:
                return f"<{x.qualname} ...>"
            return f"<{x.qualname} {self.repr1(dict(x.__dict__), level - 1)}>"
        if isinstance(x, np.ndarray):
            return f"<array {x.shape} {x.dtype}>"
        if type(x) is collections.OrderedDict:
            return self.repr_dict(x, level)
        return super().repr1(x, level)

    def repr_int(self, x: int, level: int) -> str:
        # repr() of an int past Python's 4300-digit limit raises (and is quadratic before it)
        if x.bit_length() > 256:
            return f"<int of {x.bit_length()} bits>"
        return super().repr_int(x, level)

    def repr_dict(self, x: Any, level: int) -> str:  # insertion order: no sort of hostile keys
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = [
            f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
            for k, v in itertools.islice(x.items(), self.maxdict)
        ]
        return "{" + ", ".join(items) + (", ...}" if len(x) > self.maxdict else "}")


_BOUNDED_REPR = _BoundedRepr()


def short_repr(obj: Any, limit: int = 200) -> str:
    """A repr of untrusted pickled data for error messages: bounded work, at most ``limit``
    characters (never ``repr(obj)[:limit]``, which builds the whole string first)."""
    r = _BOUNDED_REPR.repr(obj)
    return r if len(r) <= limit else r[: limit - 3] + "..."


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
    """Refuses an unpickled object graph that expands beyond ``max(MAX_EXPANDED_OBJECTS, 2 *
    pickle_bytes)`` objects or nests deeper than :data:`MAX_DEPTH` when walked as a tree, or
    that contains a cycle.

    Linear in the number of distinct objects (each one's expanded size is computed once);
    atoms (numbers, strings, None) are counted, not visited, since a real pickle is mostly them.

    Args:
        obj: the unpickled object graph.
        where: names the file in errors.
        pickle_bytes: the size of the pickle it came from.
    """
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


class StandIn:
    """Inert stand-in for a pickled Python object: keeps the pickled args and state as data.

    Works for both ways objects are pickled: ``REDUCE`` (``cls(*args)``) and protocol-2
    ``NEWOBJ`` + ``BUILD`` (``cls.__new__(cls)`` then ``__setstate__(state)``). A dict state
    becomes attributes (so ``fragment_address.numel`` reads naturally).
    """

    qualname: str = "?"

    def __init__(self, *args: Any, **kwargs: Any):
        self.args = args
        if kwargs:
            self.kwargs = kwargs

    def __setstate__(self, state: Any) -> None:
        if (
            isinstance(state, tuple)
            and len(state) == 2
            and (state[1] is None or isinstance(state[1], dict))
        ):
            state, slots = state
            if slots:
                self._set_attrs(slots)
        if isinstance(state, dict):
            self._set_attrs(state)
        elif state is not None:
            self.__dict__["state"] = state

    def _set_attrs(self, d: dict) -> None:
        for k, v in d.items():
            # an attribute named like a method would shadow it (``get``, ``_set_attrs``)
            if not isinstance(k, str) or k.startswith("__") or hasattr(type(self), k):
                raise TorchFileError(
                    "<pickle>",
                    f"{self.qualname}: refusing attribute {short_repr(k, 80)} in BUILD state",
                )
            self.__dict__[k] = v

    def __repr__(self) -> str:
        return short_repr(self)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.__dict__ == self.__dict__

    __hash__ = None  # type: ignore[assignment]


def standin_class(qualname: str) -> type[StandIn]:
    """A fresh :class:`StandIn` subclass named after ``qualname`` ("module.Class")."""
    return type(qualname.rsplit(".", 1)[-1], (StandIn,), {"qualname": qualname})


def int_enum_standin(qualname: str, names: Mapping[int, str] | None = None) -> type[int]:
    """Stand-in for an ``IntEnum`` (pickled as ``REDUCE(cls, (value,))``): an ``int`` subclass."""

    def _repr(self: int) -> str:
        n = (names or {}).get(int(self))
        return f"<{qualname}.{n}: {int(self)}>" if n else f"<{qualname}: {int(self)}>"

    return type(qualname.rsplit(".", 1)[-1], (int,), {"qualname": qualname, "__repr__": _repr})


# --------------------------------------------------------------------------- torch pieces


@dataclass(frozen=True)
class _StorageType:
    """What a pickled ``torch.FloatStorage`` & co. resolve to: just the element dtype."""

    name: str
    dtype: np.dtype


@dataclass(frozen=True)
class _TensorType:
    """Marker for ``torch.Tensor`` / ``torch.nn.Parameter`` in ``_rebuild_from_type_v2``."""

    name: str


@dataclass
class _Storage:
    key: str
    dtype: np.dtype
    raw: np.ndarray  # uint8 view of the member

    def __repr__(self) -> str:
        return f"<storage {self.key!r} {self.raw.size} bytes as {self.dtype}>"


def _as_int_tuple(x: Any, what: str) -> tuple[int, ...]:
    if not isinstance(x, (tuple, list)) or not all(type(v) is int for v in x):
        raise ValueError(f"tensor {what} must be a tuple of ints, found {short_repr(x)}")
    return tuple(x)


def _rebuild_tensor(
    storage: Any, storage_offset: Any, size: Any, stride: Any, dtype: np.dtype | None = None
) -> np.ndarray:
    if not isinstance(storage, _Storage):
        raise ValueError(
            f"tensor storage must be a persistent storage reference, found {type(storage).__name__}"
        )
    if type(storage_offset) is not int or storage_offset < 0:
        raise ValueError(f"bad storage offset {short_repr(storage_offset, 80)}")
    shape = _as_int_tuple(size, "size")
    strides = _as_int_tuple(stride, "stride")
    if len(shape) != len(strides) or any(s < 0 for s in shape) or any(s < 0 for s in strides):
        raise ValueError(f"bad tensor geometry size={shape} stride={strides}")
    dt = storage.dtype if dtype is None else dtype
    n_elems = storage.raw.size // dt.itemsize
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if numel == 0:
        return np.empty(shape, dt)
    extent = storage_offset + sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    if extent > n_elems:
        raise ValueError(
            f"tensor (offset {storage_offset}, size {shape}, stride {strides}) reaches element {extent} "
            f"but storage {storage.key!r} holds {n_elems} {dt} elements"
        )
    if numel > n_elems - storage_offset:
        # stride 0 (``expand``) or overlapping strides: more elements than the storage's bytes
        # hold. Materialising it could take any amount of memory from a tiny file.
        raise ValueError(
            f"tensor of size {shape} (stride {strides}) declares {numel} elements but storage "
            f"{storage.key!r} holds {n_elems - storage_offset} from offset {storage_offset}: "
            "stride-0 or overlapping views are not materialised (save a contiguous copy)"
        )
    flat = storage.raw[: n_elems * dt.itemsize].view(dt)
    if strides == tuple(math.prod(shape[i + 1 :]) for i in range(len(shape))) or numel == 1:
        return flat[storage_offset : storage_offset + numel].reshape(shape)
    return np.lib.stride_tricks.as_strided(
        flat[storage_offset:],
        shape=shape,
        strides=tuple(s * dt.itemsize for s in strides),
        writeable=False,
    )


def _rebuild_tensor_v2(
    storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None
):
    return _rebuild_tensor(storage, storage_offset, size, stride)


def _rebuild_tensor_v3(
    storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None
):
    if not isinstance(dtype, np.dtype):
        raise ValueError(
            f"_rebuild_tensor_v3 dtype must be a torch dtype, found {short_repr(dtype, 80)}"
        )
    return _rebuild_tensor(storage, storage_offset, size, stride, dtype)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    if not isinstance(data, np.ndarray):
        raise ValueError(f"parameter data must be a tensor, found {type(data).__name__}")
    return data


@dataclass(frozen=True, slots=True, eq=False)
class _Allowed:
    """A resolved global that may be called (REDUCE/INST/OBJ) or instantiated (NEWOBJ)."""

    qualname: str
    fn: Callable[..., Any]

    def __repr__(self) -> str:
        return f"<allowed {self.qualname}>"


@dataclass(frozen=True)
class _WrapperClass:
    """A tensor subclass torch pickles through ``_rebuild_wrapper_subclass`` (DTensor,
    ShardedTensor): only its name is kept; it is never called."""

    qualname: str


@dataclass(eq=False)
class WrapperTensor:
    """A pickled tensor subclass as inert data: DTensor or ShardedTensor (``qualname``), its
    global ``shape`` and ``dtype``, and its pickled ``state`` (the local shards and how they
    lie; :mod:`jax_ucp._src.torchfiles.sharded` reads it). Loaded only with
    :data:`SHARDED_TENSOR_CLASSES` among the extra classes."""

    qualname: str
    shape: tuple[int, ...]
    dtype: np.dtype
    state: Any = None

    def __repr__(self) -> str:
        return f"<{self.qualname.rsplit('.', 1)[-1]} {self.shape} {self.dtype}>"


def _rebuild_wrapper_subclass(
    cls, dtype, size, stride, storage_offset, layout, device, requires_grad
) -> WrapperTensor:
    if not isinstance(cls, _WrapperClass):
        raise ValueError(f"_rebuild_wrapper_subclass of {short_repr(cls, 80)} is not supported")
    if not isinstance(dtype, np.dtype):
        raise ValueError(f"{cls.qualname} dtype must be a torch dtype, found {short_repr(dtype)}")
    shape = _as_int_tuple(tuple(size) if isinstance(size, (list, tuple)) else size, "size")
    if any(d < 0 for d in shape):
        raise ValueError(f"{cls.qualname} size {shape} is negative")
    return WrapperTensor(cls.qualname, shape, dtype)


def _rebuild_from_type_v2(func, new_type, args, state):
    if isinstance(func, _Allowed) and func.fn is _rebuild_wrapper_subclass:
        if not isinstance(args, tuple) or not args or args[0] != new_type:
            raise ValueError(f"_rebuild_wrapper_subclass args {short_repr(args, 80)} do not match")
        out = _rebuild_wrapper_subclass(*args)
        out.state = state
        return out
    if not isinstance(func, _Allowed) or func.fn not in (
        _rebuild_tensor_v2,
        _rebuild_tensor_v3,
        _rebuild_parameter,
    ):
        raise ValueError(
            f"_rebuild_from_type_v2 may only call tensor rebuild functions, found {short_repr(func, 80)}"
        )
    if not isinstance(new_type, _TensorType):
        raise ValueError(
            f"_rebuild_from_type_v2 with tensor subclass {short_repr(new_type, 80)} is not supported"
        )
    if not isinstance(args, tuple):
        raise ValueError("_rebuild_from_type_v2 args must be a tuple")
    return func.fn(*args)


def _torch_size(dims=()):
    return _as_int_tuple(tuple(dims), "torch.Size")


def _torch_device(*args):
    if not args or not all(isinstance(a, (str, int)) for a in args):
        raise ValueError(f"bad torch.device args {short_repr(args)}")
    return ":".join(str(a) for a in args)


def _codecs_encode(s, encoding="utf-8"):
    if not isinstance(s, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise ValueError(
            f"_codecs.encode only decodes str with latin1/utf-8, found {short_repr(encoding, 80)}"
        )
    return s.encode(encoding)


def _slice(*args):
    if not all(a is None or type(a) is int for a in args):
        raise ValueError(f"bad slice args {short_repr(args)}")
    return slice(*args)


def _complex(re=0.0, im=0.0):
    if not all(type(v) in (int, float) for v in (re, im)):
        raise ValueError(f"bad complex args {short_repr((re, im))}")
    return complex(re, im)


def _bytearray(x=b"", encoding=None):
    if isinstance(x, str):
        return bytearray(_codecs_encode(x, encoding or "latin1"))
    if isinstance(x, (bytes, list)):
        return bytearray(x)
    raise ValueError(f"bad bytearray args {short_repr(x)}")


def _ordered_dict(items=()):
    """``collections.OrderedDict(items)`` with every key checked by :func:`hashable_key` before
    it is hashed: a key that is a tuple of shared tuples hashes in time exponential in its depth
    (a 300-byte pickle would never finish). torch pickles an OrderedDict as a call with no
    arguments followed by SETITEMS, which checks keys the same way."""
    if isinstance(items, dict):  # built by this unpickler: its keys were checked
        return collections.OrderedDict(items)
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"OrderedDict items must be a list of pairs, found {type(items).__name__}")
    out = collections.OrderedDict()
    for pair in items:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"OrderedDict item {short_repr(pair, 80)} is not a (key, value) pair")
        out[hashable_key(pair[0])] = pair[1]
    return out


def _set(items=()):
    return set(hashable_key(k, "set element") for k in items)


def _frozenset(items=()):
    return frozenset(hashable_key(k, "frozenset element") for k in items)


_KEY_SCALARS = (str, bytes, int, float, bool, type(None), np.dtype)


def hashable_key(key: Any, what: str = "dict key") -> Any:
    """``key`` if hashing and comparing it takes bounded work: a scalar, a flat tuple of scalars,
    or a stand-in that defines its own bounded ``__hash__``. A tuple of shared tuples hashes in
    time exponential in its depth, so nested tuples are refused."""
    if isinstance(key, _KEY_SCALARS):
        return key
    if type(key) is tuple and len(key) <= 64 and all(isinstance(k, _KEY_SCALARS) for k in key):
        return key
    if isinstance(key, StandIn) and type(key).__hash__ is not None:
        return key
    raise ValueError(f"{what} {short_repr(key, 80)} is not a scalar or a flat tuple of scalars")


def _base_allowed() -> dict[str, Any]:
    d: dict[str, Any] = {
        "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
        "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
        "torch._utils._rebuild_parameter": _rebuild_parameter,
        "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
        "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
        "torch.Tensor": _TensorType("torch.Tensor"),
        "torch._tensor.Tensor": _TensorType("torch.Tensor"),
        "torch.nn.parameter.Parameter": _TensorType("torch.nn.Parameter"),
        "torch.Size": _torch_size,
        "torch.device": _torch_device,
        "collections.OrderedDict": _ordered_dict,
        "builtins.set": _set,
        "builtins.frozenset": _frozenset,
        "builtins.slice": _slice,
        "builtins.complex": _complex,
        "builtins.bytearray": _bytearray,
        "_codecs.encode": _codecs_encode,
    }
    for name, dt in dtypes.BY_NAME.items():
        d[f"torch.{name}"] = dt
    for name, dt in dtypes.STORAGES.items():
        st = _StorageType(name, dtypes.BY_NAME[dt])
        d[f"torch.{name}"] = st
        d[f"torch.storage.{name}"] = st
        d[f"torch.cuda.{name}"] = st
    return d


#: The allow-list every load uses: ``"module.QualName" -> value or safe callable``.
BASE_ALLOWED: Mapping[str, Any] = _base_allowed()

_SHARDED_TENSOR = "torch.distributed._shard.sharded_tensor.api.ShardedTensor"


def _process_group_state(owner: Any, name: Any) -> _Allowed:
    """``getattr(ShardedTensor, "ProcessGroupState")``, the one attribute lookup a pickled
    ShardedTensor makes; any other is refused."""
    if owner != _WrapperClass(_SHARDED_TENSOR) or name != "ProcessGroupState":
        raise ValueError(f"getattr{short_repr((owner, name), 120)} is not allowed")
    qualname = f"{_SHARDED_TENSOR}.ProcessGroupState"
    return _Allowed(qualname, standin_class(qualname))


def _get_layout(name: Any) -> str:
    if name != "torch.strided":
        raise ValueError(f"layout {short_repr(name, 80)} is not read (only torch.strided)")
    return name


def _sharded_tensor_classes() -> dict[str, Any]:
    d: dict[str, Any] = {
        "torch._utils._rebuild_wrapper_subclass": _rebuild_wrapper_subclass,
        "torch.serialization._get_layout": _get_layout,
        "torch.distributed.tensor.DTensor": _WrapperClass("torch.distributed.tensor.DTensor"),
        "torch.distributed.tensor._api.DTensor": _WrapperClass("torch.distributed.tensor.DTensor"),
        _SHARDED_TENSOR: _WrapperClass(_SHARDED_TENSOR),
        "builtins.getattr": _process_group_state,
        "torch.distributed._shard.sharded_tensor.metadata.MEM_FORMAT_ENCODING": int_enum_standin(
            "torch.distributed._shard.sharded_tensor.metadata.MEM_FORMAT_ENCODING"
        ),
    }
    for name in (
        "torch.distributed.tensor._dtensor_spec.DTensorSpec",
        "torch.distributed.tensor._dtensor_spec.TensorMeta",
        "torch.distributed.tensor._dtensor_spec.ShardOrderEntry",
        "torch.distributed.tensor.placement_types.Shard",
        "torch.distributed.tensor.placement_types.Replicate",
        "torch.distributed.tensor.placement_types._StridedShard",
        "torch.distributed.tensor.placement_types.Partial",
        "torch.distributed.device_mesh.DeviceMesh",
        "torch.distributed._mesh_layout._MeshLayout",
        "torch.distributed._mesh_layout._FlatLayout",
        "torch.distributed._shard.metadata.ShardMetadata",
        "torch.distributed._shard.sharded_tensor.shard.Shard",
        "torch.distributed._shard.sharded_tensor.metadata.ShardedTensorMetadata",
        "torch.distributed._shard.sharded_tensor.metadata.TensorProperties",
        "torch.distributed._shard.sharding_spec.chunk_sharding_spec.ChunkShardingSpec",
        "torch.distributed.remote_device._remote_device",
    ):
        d[name] = standin_class(name)
    return d


#: Extra classes for files holding DTensors and ShardedTensors (FSDP2 / FSDP1
#: ``SHARDED_STATE_DICT`` state dicts saved with ``torch.save``): each becomes a
#: :class:`WrapperTensor`, its mesh, placements and shard metadata inert stand-ins.
SHARDED_TENSOR_CLASSES: Mapping[str, Any] = _sharded_tensor_classes()


def _numpy_classes() -> dict[str, Any]:
    array, scalar = standin_class("numpy.ndarray"), standin_class("numpy.scalar")
    return {
        "numpy.ndarray": array,
        "numpy.core.multiarray._reconstruct": array,
        "numpy._core.multiarray._reconstruct": array,
        "numpy.dtype": standin_class("numpy.dtype"),
        "numpy.core.multiarray.scalar": scalar,
        "numpy._core.multiarray.scalar": scalar,
    }


#: numpy's pickled arrays, dtypes and scalars (``np.random.get_state()`` in a run's RNG state,
#: numbers in its arguments) as inert stand-ins, for files saved beside the weights.
NUMPY_CLASSES: Mapping[str, Any] = _numpy_classes()


_op = {op.name: op.code.encode("latin1")[0] for op in pickletools.opcodes}


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
        return _Allowed(q, v) if callable(v) and not isinstance(v, np.dtype) else v

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise self._err(f"unexpected persistent id {short_repr(pid)}")
        return self._persistent(pid)

    def _call(self, f: Any, args: Any, how: str) -> Any:
        if not isinstance(f, _Allowed):
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
        if not isinstance(cls, _Allowed) or not isinstance(cls.fn, type):
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
            return hashable_key(key, what)
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
    _RestrictedUnpickler.dispatch[_op[_name]] = getattr(
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
        persistent_load: resolves persistent ids (torch's storages).
    """
    allowed = {**BASE_ALLOWED, **(extra_classes or {})}
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


# --------------------------------------------------------------------------- zip archive

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_MAGIC = 0x04034B50


class _BufferFile(io.RawIOBase):
    """A seekable read-only file over a uint8 array (zipfile reads the central directory)."""

    def __init__(self, buf: np.ndarray):
        self._b = buf
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._b.size}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self._b.size - self._pos))
        b[:n] = mapped_file.read_bytes(self._b, self._pos, n, "reading the zip directory")
        self._pos += n
        return n


class TorchArchive:
    """A torch zip archive opened read-only with one ``mmap``; members resolved lazily.

    ``lazy_crc``: a tensor storage's CRC-32 is checked when its bytes are first read (through
    :mod:`jax_ucp._src.format.mapped_file`, the only way they are read), not when the pickle
    references it: loading a ZeRO rank file then reads its pickle only, and a weights-only
    import never reads the moments it skips. Every byte read is still checked first.
    """

    def __init__(self, path: os.PathLike | str, *, lazy_crc: bool = False):
        self.path = os.fspath(path)
        self.lazy_crc = lazy_crc
        try:  # a regular file only: a FIFO or device would block or never end
            mm = mapped_file.map_file(self.path)
        except files.UnsafeFileError as e:
            raise TorchFileError(self.path, str(e).split(": ", 1)[-1]) from None
        except OSError as e:
            raise TorchFileError(self.path, f"cannot open: {e.strerror}") from None
        if mm is None:
            raise TorchFileError(self.path, "file is empty")
        head = mapped_file.read_bytes(mm, 0, min(8, len(mm)), "reading the file's signature")
        if not head.startswith(b"PK"):
            if head[:1] == b"\x80":
                raise TorchFileError(
                    self.path,
                    "legacy (pre-zip, torch<1.6) serialization is not supported; "
                    "re-save it with torch.save(..., _use_new_zipfile_serialization=True)",
                )
            raise TorchFileError(self.path, f"not a torch zip archive (starts with {head!r})")
        self._filemap: mapped_file.FileMap | None = mm
        self._open_zip(np.frombuffer(mm, np.uint8), "zip archive")

    #: Storage members handed out with their CRC-32 not checked yet (``defer_crc``): member
    #: name -> (offset of its bytes in the archive, size, the CRC-32 the archive records).
    unchecked: dict[str, tuple[int, int, int]]
    defer_crc = False
    lazy_crc = False
    _filemap: mapped_file.FileMap | None = None

    @classmethod
    def from_buffer(cls, view: np.ndarray, where: str, *, defer_crc: bool = False) -> TorchArchive:
        """An archive that is a byte range of a larger file (e.g. one torch DCP chunk); its
        tensors come back as views into it, like those of a whole file.

        Args:
            view: a read-only uint8 array holding the archive (typically a memory-mapped slice).
            where: names it in errors.
            defer_crc: tensor storages are not CRC-checked here but listed in ``unchecked``; the
                caller checks each CRC-32 on the bytes it copies out (one pass over them, not
                two).
        """
        self = cls.__new__(cls)
        self.path = where
        self.defer_crc = defer_crc
        self._open_zip(view, "embedded archive")
        return self

    def _open_zip(self, view: np.ndarray, what: str) -> None:
        """Member table, pickle prefix and byte order: the same for a file and a byte range
        (``view``: its bytes, the central directory read from them with pread)."""
        self._mm = view
        self.size = int(view.size)
        self._f = _BufferFile(view)
        self._views: dict[str, np.ndarray] = {}
        self._inflated = 0  # bytes inflated from deflated members so far (MAX_INFLATED_TOTAL)
        self.unchecked = {}
        try:
            self._zip = zipfile.ZipFile(self._f)
            infos = self._zip.infolist()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
            raise TorchFileError(self.path, f"truncated or corrupt {what} ({e})") from None
        self._infos = {i.filename: i for i in infos}
        if len(self._infos) != len(infos):  # torch.load reads the first copy, a dict the last
            counts = collections.Counter(i.filename for i in infos)
            twice = sorted(n for n, c in counts.items() if c > 1)
            raise TorchFileError(
                self.path,
                f"{what}: members present twice: {', '.join(map(repr, twice[:4]))}; which copy "
                "is the tensor is no choice to make (torch.load reads the first), refused",
            )
        pkls = [n for n in self._infos if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise TorchFileError(
                self.path, f"expected one '<archive>/data.pkl' member, found {pkls or 'none'}"
            )
        self.prefix = pkls[0][: -len("data.pkl")]
        bo = self._infos.get(self.prefix + "byteorder")
        order = self.read_member(bo.filename).decode("ascii", "replace").strip() if bo else "little"
        if order not in ("little", "big"):
            raise TorchFileError(self.path, f"unknown byteorder {short_repr(order, 40)}")
        self.byteorder = "<" if order == "little" else ">"
        self._storages: dict[str, np.ndarray] = {}
        self._storage_types: dict[str, np.dtype] = {}

    def _member_view(self, name: str, declared: int | None = None) -> np.ndarray:
        """The bytes of member ``name`` (a view of the file, or inflated); ``declared``: the
        bytes the pickle's storage needs from it, which a deflated member may not exceed."""
        info = self._infos.get(name)
        if info is None:
            raise TorchFileError(self.path, f"missing archive member {name!r}")
        data_off = self._data_offset(name, info)
        view = self._views.get(name)
        if view is not None:
            return view
        if info.compress_type != zipfile.ZIP_STORED:
            view = self._inflate(name, info, data_off, declared=declared)
        else:
            if info.file_size != info.compress_size:
                raise TorchFileError(self.path, f"member {name!r}: stored size mismatch (corrupt)")
            view = np.frombuffer(self._mm, np.uint8, count=info.file_size, offset=data_off)
            storage = name.startswith(self.prefix + "data/")
            if self.defer_crc and storage:
                self.unchecked[name] = (data_off, info.file_size, info.CRC)
            elif self.lazy_crc and storage and self._filemap is not None and info.file_size:
                check = _crc_check(self.path, name, data_off, info.file_size, info.CRC)
                mapped_file.check_before_read(self._filemap, data_off, info.file_size, check)
            else:
                # The member's CRC-32, checked once, when first referenced (ISA-L's CRC-32 runs
                # at several GB/s; the copy that follows reads the same pages from the page
                # cache).
                _crc_matches(self.path, name, info.CRC, mapped_file.crc32(view, crc=zip_crc32))
        self._views[name] = view
        return view

    def _data_offset(self, name: str, info: zipfile.ZipInfo) -> int:
        """Where member ``name``'s bytes start, its local header and extent checked."""
        off = info.header_offset
        if off + _LOCAL_HEADER.size > self.size:
            raise TorchFileError(
                self.path, f"member {name!r}: local header beyond end of file (truncated)"
            )
        fields = _LOCAL_HEADER.unpack(
            mapped_file.read_bytes(self._mm, off, _LOCAL_HEADER.size, f"member {name!r}")
        )
        if fields[0] != _LOCAL_MAGIC:
            raise TorchFileError(
                self.path, f"member {name!r}: bad local header signature (corrupt)"
            )
        data_off = off + _LOCAL_HEADER.size + fields[9] + fields[10]
        if data_off + info.compress_size > self.size:
            raise TorchFileError(
                self.path,
                f"member {name!r} needs bytes up to {data_off + info.compress_size} "
                f"but the file has {self.size} (truncated)",
            )
        return data_off

    def _inflate(
        self,
        name: str,
        info: zipfile.ZipInfo,
        data_off: int,
        *,
        keep: bool = True,
        declared: int | None = None,
    ) -> np.ndarray:
        """A deflated member, streamed: never more than its declared size is produced, at most
        :data:`MAX_COMPRESSED_MEMBER` bytes, and at most :data:`MAX_INFLATED_TOTAL` kept from
        one archive (torch.save never compresses; a small deflate stream can expand a
        thousandfold). ``declared``: the bytes the pickle's storage needs, which the member may
        not exceed. ``keep=False``: only its CRC-32 is checked, nothing is kept."""
        if info.compress_type != zipfile.ZIP_DEFLATED:
            raise TorchFileError(
                self.path,
                f"member {name!r}: compression method {info.compress_type} is not supported "
                "(torch.save stores members uncompressed)",
            )
        if info.file_size > MAX_COMPRESSED_MEMBER:
            raise TorchFileError(
                self.path,
                f"member {name!r} is deflate-compressed and declares {info.file_size} bytes; "
                f"compressed members above {MAX_COMPRESSED_MEMBER} bytes are refused "
                "(torch.save stores members uncompressed: re-save the file with torch.save)",
            )
        if declared is not None and info.file_size > declared:
            raise TorchFileError(
                self.path,
                f"member {name!r} is deflate-compressed and declares {info.file_size} bytes, "
                f"but the pickle's storage needs {declared}; refused before inflating "
                "(torch.save writes a storage's bytes exactly)",
            )
        if keep and self._inflated + info.file_size > MAX_INFLATED_TOTAL:
            raise TorchFileError(
                self.path,
                f"member {name!r} is deflate-compressed and declares {info.file_size} bytes, "
                f"after {self._inflated} bytes inflated from other members: more than the "
                f"{MAX_INFLATED_TOTAL} bytes inflated in total that one archive may take "
                "(torch.save stores members uncompressed: re-save the file with torch.save)",
            )
        out = np.empty(info.file_size if keep else 0, np.uint8)
        inflater = zlib.decompressobj(-zlib.MAX_WBITS)
        pos, crc = 0, 0
        try:
            for start in range(0, info.compress_size, 1 << 20):
                n = min(1 << 20, info.compress_size - start)
                pending = mapped_file.read_bytes(self._mm, data_off + start, n, f"member {name!r}")
                while pending:
                    piece = inflater.decompress(pending, info.file_size - pos + 1)
                    if pos + len(piece) > info.file_size:
                        raise TorchFileError(
                            self.path,
                            f"member {name!r} expands beyond its declared {info.file_size} "
                            "bytes (corrupt or hostile)",
                        )
                    if keep:
                        out[pos : pos + len(piece)] = np.frombuffer(piece, np.uint8)
                    pos += len(piece)
                    crc = zlib.crc32(piece, crc)
                    pending = inflater.unconsumed_tail
                if inflater.eof:
                    break
        except zlib.error as e:
            raise TorchFileError(self.path, f"member {name!r}: cannot decompress ({e})") from None
        if not inflater.eof or pos != info.file_size:
            raise TorchFileError(
                self.path,
                f"member {name!r}: the deflate stream gives {pos} bytes, the archive declares "
                f"{info.file_size} (truncated or corrupt)",
            )
        _crc_matches(self.path, name, info.CRC, crc)
        if keep:
            self._inflated += info.file_size
        out.flags.writeable = False
        return out

    @property
    def saved_name(self) -> str:
        """The name of the archive's top folder: ``torch.save(obj, path)`` writes the stem of
        ``path`` there ("archive" when it saved to a file object), so it survives a rename."""
        return self.prefix.rstrip("/")

    def read_member(self, name: str) -> bytes:
        view = self._member_view(name)
        return mapped_file.read_bytes(view, 0, view.size, f"member {name!r}")

    def _persistent_load(self, pid: Any) -> _Storage:
        if (
            not isinstance(pid, tuple)
            or len(pid) != 5
            or pid[0] != "storage"
            or not isinstance(pid[1], _StorageType)
            or not isinstance(pid[2], str)
            or type(pid[4]) is not int
            or pid[4] < 0
        ):
            raise TorchFileError(self.path, f"unexpected persistent id {short_repr(pid)}")
        _, stype, key, _location, numel = pid
        if not key or "/" in key or key.startswith("."):
            raise TorchFileError(self.path, f"bad storage key {short_repr(key, 80)}")
        dtype = (
            stype.dtype.newbyteorder(self.byteorder) if stype.dtype.itemsize > 1 else stype.dtype
        )
        nbytes = numel * dtype.itemsize
        seen = self._storage_types.setdefault(key, dtype)
        if seen != dtype:  # torch.load types the storage by its first reference
            raise TorchFileError(
                self.path,
                f"storage {key!r} is referenced as {seen} and as {dtype}: the pickle's storage "
                "types disagree (an edited data.pkl?)",
            )
        raw = self._storages.get(key)
        if raw is None:
            name = f"{self.prefix}data/{key}"
            if name not in self._infos and nbytes == 0:
                raw = np.empty(0, np.uint8)
            else:
                raw = self._member_view(name, nbytes)
            self._storages[key] = raw
        if raw.size < nbytes:
            raise TorchFileError(
                self.path,
                f"storage {key!r}: expected {nbytes} bytes ({numel} x {dtype}), "
                f"member holds {raw.size}",
            )
        return _Storage(key, dtype, raw[:nbytes])

    def load(self, extra_classes: Mapping[str, Any] | None = None) -> Any:
        return restricted_loads(
            self.read_member(self.prefix + "data.pkl"),
            where=self.path,
            extra_classes=extra_classes,
            persistent_load=self._persistent_load,
        )

    def verify_crc(self) -> None:
        """Check every member's CRC-32 now, also members no pickle references (reads the file);
        a deflated member is inflated only to check it, nothing kept."""
        for name, info in self._infos.items():
            if info.compress_type == zipfile.ZIP_STORED or name in self._views:
                self._member_view(name)
            else:
                self._inflate(name, info, self._data_offset(name, info), keep=False)
        if self._filemap is not None:  # lazy_crc: the checks left for the first read, run now
            mapped_file.check_pending(self._filemap)

    def close(self) -> None:
        """Close the file handle and drop the caches; arrays already returned keep the mapping
        (or their inflated bytes) alive, nothing else does."""
        self._views.clear()
        self._storages.clear()
        self._filemap = None
        self._zip.close()
        self._f.close()


def _crc_matches(path: str, name: str, recorded: int, found: int) -> None:
    if found != recorded:
        raise TorchFileError(
            path,
            f"member {name!r}: CRC-32 mismatch (the archive records {recorded:08x}, its "
            f"bytes give {found:08x}): the file is corrupt",
        )


def _crc_check(
    path: str, name: str, offset: int, size: int, recorded: int
) -> Callable[[mapped_file.FileMap], None]:
    """The CRC-32 check of a stored member, run by :func:`mapped_file.check_before_read` (it
    holds no archive: the mapping outlives it)."""

    def check(mm: mapped_file.FileMap) -> None:
        view = np.frombuffer(mm, np.uint8, count=size, offset=offset)
        _crc_matches(path, name, recorded, mapped_file.crc32(view, crc=zip_crc32))

    return check


def load_torch_file(
    path: os.PathLike | str,
    extra_classes: Mapping[str, Any] | None = None,
    *,
    verify_crc: bool = False,
) -> Any:
    """Load a ``torch.save`` zip file safely; tensors become read-only memory-mapped numpy arrays.

    Args:
        path: the ``torch.save`` zip file.
        extra_classes: more allow-listed classes, ``"module.QualName"`` -> a :class:`StandIn`
            subclass (for pickled objects), an ``int_enum_standin`` (for IntEnums), or any
            side-effect-free callable that validates its arguments (REDUCE calls it with
            pickled data).
        verify_crc: check every storage's CRC-32 while loading.
    """
    with contextlib.closing(TorchArchive(path)) as arch:
        if verify_crc:
            arch.verify_crc()
        return arch.load(extra_classes)


def scan_globals(path: os.PathLike | str) -> set[str]:
    """The ``module.QualName`` globals a torch file's pickle references, found without loading it."""
    with contextlib.closing(TorchArchive(path)) as arch:
        data = arch.read_member(arch.prefix + "data.pkl")
    found: set[str] = set()
    strings: list[str] = []
    try:
        for op, arg, _pos in pickletools.genops(data):
            if op.name in ("GLOBAL", "INST"):
                found.add(str(arg).replace(" ", ".").replace("__builtin__.", "builtins."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                found.add(f"{strings[-2]}.{strings[-1]}")
            if isinstance(arg, str):
                strings.append(arg)
    except Exception as e:
        raise TorchFileError(path, f"corrupt pickle ({e})") from None
    return found
