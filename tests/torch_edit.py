"""A torch file's pickle edited without torch: ``data.pkl`` read as a tree of plain data and
nodes (``Global``, ``Call``, ``Persistent``, ...: nothing is imported or called), changed by the
test, written back; the storages are left as they are. What a hand editing one field of a real
save makes, for the tests and the hostile harness."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import struct
import zipfile
from typing import Any, ClassVar

from jax_ucp._src.torchfiles.pickle_format import Call, Global, Persistent
from tests.ucp_testing import rewrite_zip_member


@dataclasses.dataclass
class Built:
    """``obj`` then ``BUILD(state)``: an object whose state is set after it is made."""

    obj: Any
    state: Any


@dataclasses.dataclass(eq=False)  # by identity: DCP's .metadata keys a dict by such nodes
class New:
    """``cls.__new__(cls, *args)`` (NEWOBJ), its state (None: no BUILD)."""

    cls: Any
    args: tuple
    state: Any = None


_ORDERED = Global("collections", "OrderedDict")


class _Tree(pickle._Unpickler):  # type: ignore[name-defined]
    def find_class(self, module, name):
        return Global(module, name)

    def persistent_load(self, pid):
        return Persistent(pid)

    def load_reduce(self):
        args = self.stack.pop()
        fn = self.stack[-1]
        self.stack[-1] = {} if fn == _ORDERED and not args else Call(fn, args)

    def load_newobj(self):
        args = self.stack.pop()
        self.stack[-1] = New(self.stack[-1], args)

    def load_build(self):
        state = self.stack.pop()
        top = self.stack[-1]
        if isinstance(top, New) and top.state is None:
            top.state = state
        elif isinstance(top, dict) and isinstance(state, dict):
            top.update(state)
        else:
            self.stack[-1] = Built(top, state)

    dispatch: ClassVar[dict] = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]
    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.BUILD[0]] = load_build


def loads(data: bytes) -> Any:
    """``data.pkl`` as a tree (lists and dicts mutable in place)."""
    return _Tree(io.BytesIO(data)).load()


def _emit(obj: Any, w) -> None:
    if obj is None:
        w(pickle.NONE)
    elif obj is True or obj is False:
        w(pickle.NEWTRUE if obj else pickle.NEWFALSE)
    elif isinstance(obj, int):
        raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
        w(pickle.LONG1 + bytes([len(raw)]) + raw)
    elif isinstance(obj, float):
        w(pickle.BINFLOAT + struct.pack(">d", obj))
    elif isinstance(obj, str):
        raw = obj.encode("utf-8", "surrogatepass")
        w(pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw)
    elif isinstance(obj, bytes):
        w(pickle.BINBYTES + struct.pack("<I", len(obj)) + obj)
    elif isinstance(obj, tuple):
        w(pickle.MARK)
        for item in obj:
            _emit(item, w)
        w(pickle.TUPLE)
    elif isinstance(obj, list):
        w(pickle.EMPTY_LIST + pickle.MARK)
        for item in obj:
            _emit(item, w)
        w(pickle.APPENDS)
    elif isinstance(obj, dict):
        w(pickle.EMPTY_DICT + pickle.MARK)
        for key, value in obj.items():
            _emit(key, w)
            _emit(value, w)
        w(pickle.SETITEMS)
    elif isinstance(obj, Global):
        w(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
    elif isinstance(obj, Call):
        _emit(obj.fn, w)
        _emit(tuple(obj.args), w)
        w(pickle.REDUCE)
    elif isinstance(obj, New):
        _emit(obj.cls, w)
        _emit(tuple(obj.args), w)
        w(pickle.NEWOBJ)
        if obj.state is not None:
            _emit(obj.state, w)
            w(pickle.BUILD)
    elif isinstance(obj, Built):
        _emit(obj.obj, w)
        _emit(obj.state, w)
        w(pickle.BUILD)
    elif isinstance(obj, Persistent):
        _emit(obj.pid, w)
        w(pickle.BINPERSID)
    else:
        raise TypeError(f"cannot write {type(obj).__name__}")


def dumps(tree: Any) -> bytes:
    out = io.BytesIO()
    out.write(pickle.PROTO + b"\x02")
    _emit(tree, out.write)
    out.write(pickle.STOP)
    return out.getvalue()


def edit_torch_file(path, change) -> None:
    """The torch file at ``path`` with ``change(tree)`` applied to its pickle, in place."""

    def rewrite(data: bytes) -> bytes:
        tree = loads(data)
        change(tree)
        return dumps(tree)

    rewrite_zip_member(str(path), "data.pkl", rewrite)


def state_of(obj: Any) -> Any:
    """The state (``__dict__``) of a pickled object: a ``New``'s or a ``Built``'s."""
    return obj.state


def dcp_objects(folder) -> list[str]:
    """The names of the objects (not tensors) a torch DCP ``folder``'s ``.metadata`` lists."""
    with open(os.path.join(folder, ".metadata"), "rb") as f:
        tree = loads(f.read())
    items = tree.state["state_dict_metadata"].items()
    return sorted(k for k, v in items if v.cls.name == "BytesStorageMetadata")


def _dcp_object(folder, prefix: str) -> tuple[Any, Any, str, list[tuple[str, bytes]]]:
    """(``.metadata``'s tree, the object's storage info, its name, its archive's members)."""
    with open(os.path.join(folder, ".metadata"), "rb") as f:
        tree = loads(f.read())
    key, info = next(
        (k, v) for k, v in tree.state["storage_data"].items() if k.state["fqn"].startswith(prefix)
    )
    with open(os.path.join(folder, info.state["relative_path"]), "rb") as f:
        f.seek(info.state["offset"])
        archive = f.read(info.state["length"])
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        members = [(i.filename, z.read(i)) for i in z.infolist()]
    return tree, info, key.state["fqn"], members


def dcp_object_tree(folder, prefix: str) -> Any:
    """The pickle of the DCP ``folder``'s object named ``prefix...`` as a tree."""
    members = _dcp_object(folder, prefix)[3]
    return loads(next(data for name, data in members if name.endswith("data.pkl")))


def edit_dcp_object(folder, prefix: str, change) -> str:
    """The torch DCP ``folder``'s object named ``prefix...`` (a ``torch.save`` archive inside a
    ``.distcp`` file) with ``change(tree)`` applied to its pickle: the new archive appended to
    its file and ``.metadata`` pointed at it, the old bytes left unread. Returns its name."""
    tree, info, name, members = _dcp_object(folder, prefix)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for member, data in members:
            if member.endswith("data.pkl"):
                pickled = loads(data)
                change(pickled)
                data = dumps(pickled)
            z.writestr(member, data)
    path = os.path.join(folder, info.state["relative_path"])
    info.state.update(offset=os.path.getsize(path), length=len(out.getvalue()))
    with open(path, "ab") as f:
        f.write(out.getvalue())
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        f.write(dumps(tree))
    return name
