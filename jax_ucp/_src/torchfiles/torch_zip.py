"""The ``torch.save`` zip archive both ways, without torch. Read through one read-only ``mmap``
(tensors are views; bytes read out by pread, so a file truncated meanwhile is an error, not SIGBUS),
every CRC-32 checked, deflate bounded, duplicate members refused; an archive in an object store
fetches only the members it reads."""

from __future__ import annotations

import collections
import contextlib
import io
import math
import os
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jax_ucp._src.format import files, mapped_file
from jax_ucp._src.store.storage import LocalDirectory
from jax_ucp._src.store.storage import Storage as BaseStorage
from jax_ucp._src.store.storage.sparse import RemoteArchive
from jax_ucp._src.torchfiles import pickle_format
from jax_ucp._src.torchfiles.allow_list import Storage, StorageType, TorchFileError, short_repr
from jax_ucp._src.torchfiles.dtypes import torch_dtype
from jax_ucp._src.torchfiles.pickle_format import Call, Global, New, Persistent
from jax_ucp._src.writer import durable

try:  # ISA-L's CRC-32 (carry-less multiply): ~4x zlib's; the same zip polynomial
    from isal.isal_zlib import crc32 as zip_crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same values
    from zlib import crc32 as zip_crc32

#: Largest deflate-compressed member inflated into memory (torch itself never compresses).
MAX_COMPRESSED_MEMBER = 256 << 20
#: Most bytes inflated from one archive in total (they stay in memory as long as their tensors).
MAX_INFLATED_TOTAL = 256 << 20

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_MAGIC = 0x04034B50
HEADER_GAP = 64 << 10  # local headers this close are fetched in one GET (the members between too)


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
    """A torch zip archive, file ``name`` of ``storage``, opened read-only with one ``mmap``
    (``Storage.mapped``: a remote one's ranges fetched as they are read). ``lazy_crc``: a
    storage's CRC-32 is checked when first read, so skipped moments are never read."""

    def __init__(self, storage: BaseStorage, name: str, *, lazy_crc: bool = False):
        self.path = storage.join(name)
        self.lazy_crc = lazy_crc
        try:  # a regular file only: a FIFO or device would block or never end
            mm, remote = storage.mapped(name, sealed=lazy_crc)
        except files.UnsafeFileError as e:
            raise TorchFileError(self.path, str(e).split(": ", 1)[-1]) from None
        except OSError as e:
            raise TorchFileError(self.path, f"cannot open: {e.strerror}") from None
        self._remote = remote
        if mm is None:  # empty, or (remote) no zip directory at its end
            head = storage.reader(name).read(0, 8) or b""
            _refuse_head(self.path, head, "no zip directory at its end")
            raise TorchFileError(self.path, "file is empty")
        mm.path = self.path
        what = "reading the file's signature"
        _refuse_head(self.path, mapped_file.read_bytes(mm, 0, min(8, len(mm)), what), "")
        self._filemap: mapped_file.FileMap | None = mm
        self._open_zip(np.frombuffer(mm, np.uint8), "zip archive")

    #: Members handed out unchecked (``defer_crc``): name -> (offset, size, recorded CRC-32).
    unchecked: dict[str, tuple[int, int, int]]
    defer_crc = False
    lazy_crc = False
    _filemap: mapped_file.FileMap | None = None
    _remote: RemoteArchive | None = None

    @classmethod
    def from_buffer(cls, view: np.ndarray, where: str, *, defer_crc: bool = False) -> TorchArchive:
        """An archive inside a larger file (one DCP chunk); its tensors are views into it.

        Args:
            view: a read-only uint8 array holding the archive (typically a memory-mapped slice).
            where: names it in errors.
            defer_crc: storages are not CRC-checked but listed in ``unchecked``, for the caller to
                check on the bytes it copies out (one pass, not two)."""
        self = cls.__new__(cls)
        self.path = where
        self.defer_crc = defer_crc
        self._open_zip(view, "embedded archive")
        return self

    def _open_zip(self, view: np.ndarray, what: str) -> None:
        """Member table, pickle prefix and byte order, for a file or a byte range."""
        self._mm = view
        self.size = int(view.size)
        self._f = _BufferFile(view)
        self._views: dict[str, np.ndarray] = {}
        self._inflated = 0  # bytes inflated from deflated members so far (MAX_INFLATED_TOTAL)
        self.unchecked = {}
        try:
            self._zip = zipfile.ZipFile(self._f)
            infos = self._zip.infolist()
        # NotImplementedError: a zip version or feature zipfile does not read (flipped bytes)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as e:
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
        if self._remote is not None:  # every local header, neighbours in one GET
            spans: list[list[int]] = []
            for off in sorted({i.header_offset for i in infos}):
                end = min(off + _LOCAL_HEADER.size, self.size)
                if spans and off - spans[-1][1] <= HEADER_GAP:
                    spans[-1][1] = max(spans[-1][1], end)
                elif 0 <= off < end:
                    spans.append([off, end])
            self._fetch(*((start, end) for start, end in spans))
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
        """The bytes of member ``name``; a deflated one may not exceed ``declared``."""
        info = self._infos.get(name)
        if info is None:
            raise TorchFileError(self.path, f"missing archive member {name!r}")
        data_off = self._data_offset(name, info)
        view = self._views.get(name)
        if view is not None:
            return view
        span = (data_off, data_off + info.compress_size)
        if info.compress_type != zipfile.ZIP_STORED:
            self._fetch(span)
            view = self._inflate(name, info, data_off, declared=declared)
        else:
            if info.file_size != info.compress_size:
                raise TorchFileError(self.path, f"member {name!r}: stored size mismatch (corrupt)")
            view = np.frombuffer(self._mm, np.uint8, count=info.file_size, offset=data_off)
            storage = name.startswith(self.prefix + "data/")
            if self.defer_crc and storage:
                self.unchecked[name] = (data_off, info.file_size, info.CRC)
            elif self.lazy_crc and storage and self._filemap is not None and info.file_size:
                check = _crc_check(self.path, name, span, info.CRC, self._remote)
                mapped_file.check_before_read(self._filemap, data_off, info.file_size, check)
            else:
                self._fetch(span)
                # its CRC-32, checked once, when first referenced
                _crc_matches(self.path, name, info.CRC, mapped_file.crc32(view, crc=zip_crc32))
        self._views[name] = view
        return view

    def _fetch(self, *spans: tuple[int, int]) -> None:
        """For an archive in an object store: the byte ranges ``spans`` fetched, if not yet."""
        if self._remote is not None:
            self._remote.fetch(list(spans))

    def _data_offset(self, name: str, info: zipfile.ZipInfo) -> int:
        """Where member ``name``'s bytes start, its local header and extent checked."""
        off = info.header_offset
        if off < 0:  # zipfile subtracts what it takes for a prefix: a corrupt directory
            raise TorchFileError(
                self.path, f"member {name!r}: local header at {off}, before the file (corrupt)"
            )
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
        """A deflated member, streamed within its ``declared`` size, :data:`MAX_COMPRESSED_MEMBER`
        and :data:`MAX_INFLATED_TOTAL` (a small deflate stream can expand a thousandfold).
        ``keep=False``: only its CRC-32 is checked."""
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
        """The archive's top folder: the stem of ``torch.save``'s path, so it survives a rename."""
        return self.prefix.rstrip("/")

    def read_member(self, name: str) -> bytes:
        view = self._member_view(name)
        return mapped_file.read_bytes(view, 0, view.size, f"member {name!r}")

    def _persistent_load(self, pid: Any) -> Storage:
        if (
            not isinstance(pid, tuple)
            or len(pid) != 5
            or pid[0] != "storage"
            or not isinstance(pid[1], StorageType)
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
        if raw.size != nbytes:  # torch.save writes each storage's bytes exactly
            raise TorchFileError(
                self.path,
                f"storage {key!r}: expected {nbytes} bytes ({numel} x {dtype}), "
                f"member holds {raw.size}"
                + (" (its storage type edited in data.pkl?)" if raw.size > nbytes else ""),
            )
        return Storage(key, dtype, raw[:nbytes])

    def load(self, extra_classes: Mapping[str, Any] | None = None) -> Any:
        return pickle_format.restricted_loads(
            self.read_member(self.prefix + "data.pkl"),
            where=self.path,
            extra_classes=extra_classes,
            persistent_load=self._persistent_load,
        )

    def verify_crc(self) -> None:
        """Check every member's CRC-32 now, referenced or not."""
        for name, info in self._infos.items():
            if info.compress_type == zipfile.ZIP_STORED or name in self._views:
                self._member_view(name)
            else:
                off = self._data_offset(name, info)
                self._fetch((off, off + info.compress_size))
                self._inflate(name, info, off, keep=False)
        if self._filemap is not None:  # lazy_crc: the checks left for the first read, run now
            mapped_file.check_pending(self._filemap)

    def close(self) -> None:
        """Close the file and drop the caches; arrays returned keep the mapping alive."""
        self._views.clear()
        self._storages.clear()
        self._filemap = None
        self._zip.close()
        self._f.close()


def _refuse_head(path: str, head: bytes, missing: str) -> None:
    """Refuses a file not starting as a zip archive (and one that does, for ``missing``)."""
    if head[:1] == b"\x80":
        raise TorchFileError(
            path,
            "legacy (pre-zip, torch<1.6) serialization is not supported; "
            "re-save it with torch.save(..., _use_new_zipfile_serialization=True)",
        )
    if head and not head.startswith(b"PK"):
        raise TorchFileError(path, f"not a torch zip archive (starts with {head!r})")
    if head and missing:
        raise TorchFileError(path, f"truncated or corrupt zip archive ({missing})")


def _crc_matches(path: str, name: str, recorded: int, found: int) -> None:
    if found != recorded:
        raise TorchFileError(
            path,
            f"member {name!r}: CRC-32 mismatch (the archive records {recorded:08x}, its "
            f"bytes give {found:08x}): the file is corrupt",
        )


def _crc_check(
    path: str, name: str, span: tuple[int, int], recorded: int, remote: RemoteArchive | None
) -> Callable[[mapped_file.FileMap], None]:
    """The CRC-32 check of a stored member's bytes ``span`` (fetched first in an object store)."""

    def check(mm: mapped_file.FileMap) -> None:
        if remote is not None:
            remote.fetch([span])
        view = np.frombuffer(mm, np.uint8, count=span[1] - span[0], offset=span[0])
        _crc_matches(path, name, recorded, mapped_file.crc32(view, crc=zip_crc32))

    return check


def load_torch_file(
    path: os.PathLike | str | tuple[BaseStorage, str],
    extra_classes: Mapping[str, Any] | None = None,
    *,
    verify_crc: bool = False,
) -> Any:
    """Load a ``torch.save`` zip file safely; tensors become read-only memory-mapped numpy arrays.

    Args:
        path: the ``torch.save`` zip file: a checked local path, or (a ``Storage``, its name).
        extra_classes: more allow-listed classes, ``"module.QualName"`` -> a :class:`StandIn`
            subclass, an ``int_enum_standin``, or a side-effect-free callable that checks its
            arguments.
        verify_crc: check every storage's CRC-32 while loading."""
    with contextlib.closing(TorchArchive(*_located(path))) as arch:
        if verify_crc:
            arch.verify_crc()
        return arch.load(extra_classes)


def _located(path: os.PathLike | str | tuple[BaseStorage, str]) -> tuple[BaseStorage, str]:
    """(storage, name) as given, or of a checked local path (a link followed)."""
    if isinstance(path, tuple):
        return path
    folder, name = os.path.split(os.path.realpath(path) if os.path.islink(path) else path)
    return LocalDirectory(folder), name


# --------------------------------------------------------------------------- writing


class _Window(io.RawIOBase):
    """A file seen from ``start`` on, so an archive can sit inside a larger file."""

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


@dataclass(frozen=True)
class TensorSlot:
    """Where tensor ``index`` of ``arrays`` goes in the pickled object."""

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


#: A tensor value read slab by slab in C order (``where``: names it in errors); None: an array.
Slabs = Callable[[Any, str], Iterable[np.ndarray]] | None


def write_torch_save(
    f,
    obj: Any = None,
    array: Any = None,
    name: str = "archive",
    arrays: Sequence[Any] = (),
    slabs: Slabs = None,
) -> int:
    """Appends one ``torch.save`` archive to ``f``, tensors slab by slab; returns its length.

    Args:
        f: a binary file open for writing, at the archive's start.
        obj: the object to pickle when ``array`` is None (plain data and nodes).
        array: a tensor to save on its own.
        name: the archive's top folder (torch uses the file's stem).
        arrays: the tensors ``TensorSlot`` nodes of ``obj`` refer to (``shape``, ``dtype``).
        slabs: reads each of them (:data:`Slabs`)."""
    if array is not None:
        obj, arrays = TensorSlot(0, tuple(array.shape), array.dtype), [array]
    start = f.tell()
    with zipfile.ZipFile(_Window(f, start), "w", zipfile.ZIP_STORED, allowZip64=True) as z:
        z.writestr(_member(f"{name}/data.pkl"), pickle_format.dumps(_with_tensors(obj, name)))
        z.writestr(_member(f"{name}/byteorder"), "little")
        for index, value in enumerate(arrays):
            info = _member(f"{name}/data/{index}")
            nbytes = math.prod(value.shape) * np.dtype(value.dtype).itemsize
            with z.open(info, "w", force_zip64=nbytes >= 0xFFFFFFFF) as member:
                for piece in slabs(value, info.filename) if slabs else [value]:
                    piece = np.ascontiguousarray(piece, piece.dtype.newbyteorder("<"))
                    member.write(piece.reshape(-1).view(np.uint8).data)
                    del piece
        z.writestr(_member(f"{name}/version"), "3\n")
    return f.tell() - start


def _member(name: str) -> zipfile.ZipInfo:
    """A stored member dated 1980-01-01: the same export gives the same bytes."""
    return zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))


def save_file(path: str, obj: Any, arrays: Sequence[Any] = (), slabs: Slabs = None) -> None:
    """``torch.save(obj, path)`` without torch, fsynced; the archive named after the file.

    Args:
        path: the file to write.
        obj: plain data and nodes (``TensorSlot(i, ...)`` for ``arrays[i]``).
        arrays: the tensors ``obj`` refers to.
        slabs: reads each of them (:data:`Slabs`)."""
    stem = os.path.basename(path).removesuffix(".pt")
    with durable.durable_file(path) as f:
        write_torch_save(f, obj, name=stem, arrays=arrays, slabs=slabs)
