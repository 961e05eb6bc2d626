"""Write torch files without torch: ``torch.save`` archives and torch DCP checkpoints.

A ``torch.save`` file is a zip archive (members stored, not compressed): ``<name>/data.pkl`` (a
protocol-2 pickle whose tensors are ``torch._utils._rebuild_tensor_v2`` calls on persistent
storage references), ``<name>/data/<key>`` (each storage's raw little-endian bytes),
``<name>/byteorder`` and ``<name>/version``. A ``torch.distributed.checkpoint`` directory
(``FileSystemWriter``'s layout) is ``.metadata`` (a pickled ``Metadata``: every tensor's dtype,
size and chunks, and where each chunk's bytes are) plus ``__0_0.distcp``, which holds one
``torch.save`` archive per tensor chunk back to back.

The pickles are emitted opcode by opcode from a small tree of :class:`Global` / :class:`Call` /
:class:`New` nodes, so classes are named without being imported; what is written is what torch
2.x itself writes for the same objects (checked against torch in the torch-marked tests).
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pickle
import struct
import zipfile
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jax_ucp._src.errors import RequestError
from jax_ucp._src.exporters import source
from jax_ucp._src.exporters.options import Exported, TorchDcpExport
from jax_ucp._src.exporters.source import Deferred, pieces
from jax_ucp._src.torchfiles.dtypes import TORCH_DTYPES
from jax_ucp._src.writer import durable

METADATA_FILE = ".metadata"
DATA_FILE = "__0_0.distcp"


def torch_dtype(tensor: str, dtype: np.dtype) -> tuple[str, str]:
    """(torch dtype name, storage class) of ``dtype``, or an error naming the tensor."""
    found = TORCH_DTYPES.get(np.dtype(dtype))
    if found is None:
        raise RequestError(
            f"tensor {tensor!r}: dtype {np.dtype(dtype)} has no torch storage type that "
            f"torch.save writes; pass dtype= to convert it"
        )
    return found


# --------------------------------------------------------------------------- pickle emitter


@dataclasses.dataclass(frozen=True)
class Global:
    """``module.name``, named in the pickle (GLOBAL), never imported here."""

    module: str
    name: str


@dataclasses.dataclass(frozen=True)
class Call:
    """``fn(*args)`` when unpickled (REDUCE)."""

    fn: Global
    args: tuple


@dataclasses.dataclass(frozen=True)
class New:
    """``cls.__new__(cls)`` then ``BUILD(state)``: how dataclasses pickle (NEWOBJ + BUILD)."""

    cls: Global
    state: Any


@dataclasses.dataclass(frozen=True)
class Pairs:
    """A dict whose keys are nodes (unhashable here, hashable once unpickled)."""

    items: tuple


@dataclasses.dataclass(frozen=True)
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


# --------------------------------------------------------------------------- torch.save


class _Window(io.RawIOBase):
    """A file seen from ``start`` on: zipfile's offsets become relative to the archive's start,
    so an archive can sit inside a larger file (as every chunk of a ``.distcp`` file does)."""

    def __init__(self, f, start: int):
        self._f, self._start = f, start

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b) -> int:
        return self._f.write(b)

    def tell(self) -> int:
        return self._f.tell() - self._start

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 0:
            pos += self._start
        return self._f.seek(pos, whence) - self._start

    def flush(self) -> None:
        self._f.flush()


@dataclasses.dataclass(frozen=True)
class TensorSlot:
    """Where tensor ``index`` of the ``arrays`` given to :func:`write_torch_save` goes in the
    pickled object (a contiguous tensor on its own storage)."""

    index: int
    shape: tuple[int, ...]
    dtype: np.dtype


def _rebuild(slot: TensorSlot, name: str) -> Call:
    _, storage = torch_dtype(name, slot.dtype)
    shape = tuple(int(d) for d in slot.shape)
    strides = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))  # C order
    numel = math.prod(shape)
    return Call(
        Global("torch._utils", "_rebuild_tensor_v2"),
        (
            Persistent(("storage", Global("torch", storage), str(slot.index), "cpu", numel)),
            0,
            shape,
            strides,
            False,
            Call(Global("collections", "OrderedDict"), ()),
        ),
    )


def _with_tensors(obj: Any, name: str) -> Any:
    """``obj`` with every :class:`TensorSlot` replaced by its rebuild call."""
    if isinstance(obj, TensorSlot):
        return _rebuild(obj, name)
    if isinstance(obj, dict):
        return {k: _with_tensors(v, name) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return (list if isinstance(obj, list) else tuple)(_with_tensors(v, name) for v in obj)
    if isinstance(obj, New):
        return New(obj.cls, _with_tensors(obj.state, name))
    if isinstance(obj, Call):
        return Call(obj.fn, _with_tensors(obj.args, name))
    return obj


def write_torch_save(
    f,
    obj: Any = None,
    array: np.ndarray | Deferred | None = None,
    name: str = "archive",
    arrays: Sequence[np.ndarray | Deferred] = (),
) -> int:
    """Appends one ``torch.save`` archive to the open file ``f`` at its position; returns its
    length. A ``Deferred`` is read slab by slab as its stored member is written, the CRC computed
    on the way.

    Args:
        f: a binary file open for writing, at the archive's start.
        obj: the object to pickle when ``array`` is None (plain data and nodes).
        array: a tensor to save on its own.
        name: the archive's top folder (torch uses the file's stem).
        arrays: the tensors ``TensorSlot`` nodes of ``obj`` refer to.
    """
    if array is not None:
        obj, arrays = TensorSlot(0, tuple(array.shape), array.dtype), [array]
    start = f.tell()
    with zipfile.ZipFile(_Window(f, start), "w", zipfile.ZIP_STORED, allowZip64=True) as z:
        z.writestr(_member(f"{name}/data.pkl"), dumps(_with_tensors(obj, name)))
        z.writestr(_member(f"{name}/byteorder"), "little")
        for index, value in enumerate(arrays):
            info = _member(f"{name}/data/{index}")
            nbytes = math.prod(value.shape) * np.dtype(value.dtype).itemsize
            with z.open(info, "w", force_zip64=nbytes >= 0xFFFFFFFF) as member:
                for piece in pieces(value, info.filename):
                    member.write(piece.reshape(-1).view(np.uint8).data)
                    del piece
        z.writestr(_member(f"{name}/version"), "3\n")
    return f.tell() - start


def _member(name: str) -> zipfile.ZipInfo:
    """A stored member dated 1980-01-01: the same export gives the same bytes."""
    return zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))


def save_file(path: str, obj: Any, arrays: Sequence[np.ndarray | Deferred] = ()) -> None:
    """``torch.save(obj, path)`` without torch (see :func:`write_torch_save`), fsynced. The
    archive is named after the file, as torch names it.

    Args:
        path: the file to write.
        obj: plain data and nodes (``TensorSlot(i, ...)`` for ``arrays[i]``).
        arrays: the tensors ``obj`` refers to.
    """
    stem = os.path.basename(path).removesuffix(".pt")
    with durable.durable_file(path) as f:
        write_torch_save(f, obj, name=stem, arrays=arrays)


# --------------------------------------------------------------------------- DCP


_DCP = "torch.distributed.checkpoint.metadata"


def _properties(torch_name: str) -> New:
    return New(
        Global(_DCP, "TensorProperties"),
        (
            Global("torch", torch_name),
            Call(Global("torch.serialization", "_get_layout"), ("torch.strided",)),
            False,
            Call(Global(_DCP, "_MEM_FORMAT_ENCODING"), (0,)),
            False,
        ),
    )


@dataclasses.dataclass(frozen=True)
class DcpItem:
    """One entry of a DCP state dict: a tensor (``shape``/``dtype``) or a Python value."""

    fqn: str
    path: tuple[str, ...]  # the nested state-dict keys (DCP's planner_data)
    shape: tuple[int, ...] | None = None
    dtype: np.dtype | None = None
    value: Any = None


def write_dcp(
    directory: str,
    items: Sequence[DcpItem],
    arrays: Iterable[np.ndarray | Deferred],
    save_id: str,
):
    """A single-file DCP checkpoint of ``items`` (tensors take their values from ``arrays``, in
    order). Readable by ``torch.distributed.checkpoint.load`` at any world size.

    Args:
        directory: the DCP folder (exists, empty).
        items: every entry: tensors and pickled objects, in order.
        arrays: the tensors' values, in the order of the tensor items.
        save_id: the ``storage_meta.save_id`` recorded in ``.metadata``.
    """
    storage_data: list = []
    metadata: dict = {}
    tensors = iter(arrays)
    with durable.durable_file(os.path.join(directory, DATA_FILE)) as f:
        for item in items:
            offset = f.tell()
            if item.shape is None:
                length = write_torch_save(f, obj=item.value)
                where: dict = {"index": None, "offset": None}
                metadata[item.fqn] = New(Global(_DCP, "BytesStorageMetadata"), {})
            else:
                array = next(tensors)
                if tuple(array.shape) != item.shape or array.dtype != item.dtype:
                    raise RequestError(
                        f"tensor {item.fqn!r}: read {array.shape} {array.dtype}, planned "
                        f"{item.shape} {item.dtype}"
                    )
                torch_name, _ = torch_dtype(item.fqn, array.dtype)  # == item.dtype, checked
                length = write_torch_save(f, array=array)
                zeros = torch_size([0] * len(item.shape))
                where = {"index": 0, "offset": zeros}
                chunk = New(
                    Global(_DCP, "ChunkStorageMetadata"),
                    {"offsets": zeros, "sizes": torch_size(item.shape)},
                )
                metadata[item.fqn] = New(
                    Global(_DCP, "TensorStorageMetadata"),
                    {
                        "properties": _properties(torch_name),
                        "size": torch_size(item.shape),
                        "chunks": [chunk],
                    },
                )
            info = New(
                Global("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                {"relative_path": DATA_FILE, "offset": offset, "length": length},
            )
            index = New(Global(_DCP, "MetadataIndex"), {"fqn": item.fqn, **where})
            storage_data.append((index, info))
    meta = New(
        Global(_DCP, "Metadata"),
        {
            "state_dict_metadata": metadata,
            "planner_data": {item.fqn: item.path for item in items},
            "storage_data": Pairs(tuple(storage_data)),
            "storage_meta": New(
                Global(_DCP, "StorageMeta"),
                {"checkpoint_id": None, "save_id": save_id, "load_id": None, "modules": []},
            ),
            "version": "1.0.0",
        },
    )
    durable.write_file(os.path.join(directory, METADATA_FILE), dumps(meta))


def export(root: str, dst: str, options: TorchDcpExport) -> Exported:
    """The tensors and saved Python values under ``select`` as a single-file DCP checkpoint,
    under their key paths below ``select`` (DCP's nested state dicts).

    Args:
        root: the UCP checkpoint directory (a manager step already resolved).
        dst: the directory to create.
        options: this format's options (``engine.export`` checked them).
    """
    chosen = source.select(root, options, torch_dtype, with_values=True)
    items = [DcpItem(t.name, p, t.shape, t.dtype) for t, p in zip(chosen.tensors, chosen.paths)]
    items += [DcpItem(name, path, value=v) for name, path, v in chosen.values]

    def write(tmp: str) -> list[str]:
        write_dcp(tmp, items, chosen.arrays, chosen.save_id)
        return [METADATA_FILE, DATA_FILE]

    return chosen.exported(dst, source.write_atomically(dst, write, options.force))
