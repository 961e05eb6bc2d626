"""A torch Distributed Checkpoint (``torch.distributed.checkpoint``) both ways, without torch, for
the plain DCP importer and megatron-core's ``torch_dist``. On disk: ``.metadata`` (a pickle of
``Metadata``: shape, dtype and chunks per tensor, and chunk -> (file, byte offset, length)) and
``__R_N.distcp`` files whose byte ranges are each a ``torch.save`` archive or a tensor's raw
bytes, maybe passed through torch's stream transforms (:mod:`dcp_transforms`). Checkpoints are
untrusted: ``.metadata`` is unpickled with inert stand-ins (:mod:`pickle_format`), every chunk is
checked to tile its tensor exactly before it is read."""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import functools
import itertools
import math
import os
import posixpath
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from jax_ucp._src import writer
from jax_ucp._src.errors import RequestError, SourceError
from jax_ucp._src.format import files, mapped_file
from jax_ucp._src.store.storage import Storage, ranged
from jax_ucp._src.torchfiles import allow_list, dcp_transforms, torch_zip
from jax_ucp._src.torchfiles.dtypes import torch_dtype
from jax_ucp._src.torchfiles.pickle_format import (
    Call,
    Global,
    New,
    Pairs,
    dumps,
    restricted_loads,
    torch_size,
)
from jax_ucp._src.writer import durable

# ----------------------------------------------------------------- stand-ins for .metadata


class _MetadataIndex(allow_list.StandIn):
    """Keys of ``Metadata.storage_data``: must hash, so it cannot be a plain allow_list.StandIn."""

    qualname = "torch.distributed.checkpoint.metadata.MetadataIndex"

    def _key(self):
        # checked before hashing: shared nested tuples hash in exponential time
        d = self.__dict__
        fqn, off, index = d.get("fqn"), d.get("offset"), d.get("index")
        if (
            not isinstance(fqn, str)
            or not (
                off is None or (isinstance(off, (tuple, list)) and all(type(v) is int for v in off))
            )
            or not (index is None or type(index) is int)
        ):
            raise ValueError(f"bad MetadataIndex {allow_list.short_repr(d)}")
        return (fqn, tuple(off) if off is not None else None, index)

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(self._key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _MetadataIndex) and other._key() == self._key()


def path_standin(*parts: Any) -> str:
    """A pickled ``pathlib`` path as the string it names (strings only; the disk is not touched)."""
    if not all(isinstance(p, str) for p in parts) or sum(len(p) for p in parts) > 1 << 16:
        raise ValueError(f"bad path parts {allow_list.short_repr(parts)}")
    return posixpath.join(*parts) if parts else "."


_META = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
METADATA_FILE = ".metadata"
DATA_FILE = "__0_0.distcp"  # the one file write_dcp writes


def _standins() -> dict[str, Any]:
    m = _META + "."
    p = "torch.distributed.checkpoint.planner."
    d: dict[str, Any] = {
        m + n: allow_list.standin_class(m + n)
        for n in (
            "Metadata",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "TensorProperties",
            "StorageMeta",
        )
    }
    d[m + "MetadataIndex"] = _MetadataIndex
    d[m + "_MEM_FORMAT_ENCODING"] = allow_list.int_enum_standin(m + "_MEM_FORMAT_ENCODING")
    # torch's FileSystemWriter, and OLMo-core's RemoteFileSystemWriter (the same fields)
    for owner in (_FILESYSTEM, "olmo_core.distributed.checkpoint.filesystem"):
        name = f"{owner}._StorageInfo"
        d[name] = allow_list.standin_class(name)
    # megatron-core keeps its save plans in Metadata (for cached re-saves): parsed, never used
    for n in ("SavePlan", "WriteItem", "TensorWriteData", "LoadPlan", "ReadItem"):
        d[p + n] = allow_list.standin_class(p + n)
    d[p + "WriteItemType"] = allow_list.int_enum_standin(p + "WriteItemType")
    d[p + "LoadItemType"] = allow_list.int_enum_standin(p + "LoadItemType")
    d["torch.serialization._get_layout"] = allow_list.get_layout
    d["torch.layout"] = allow_list.get_layout
    # StorageMeta.checkpoint_id: the path torch.distributed.checkpoint.save was given
    for n in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
        d["pathlib." + n] = path_standin
    return d


#: Classes a DCP ``.metadata`` pickle may reference, mapped to inert stand-ins.
DCP_CLASSES: dict[str, Any] = _standins()

#: Largest ``.metadata`` read (it lists every chunk of every tensor: megabytes for big models).
MAX_METADATA_BYTES = 1 << 30

#: Most bytes a decoded chunk's archive may hold beyond its elements' (torch writes ~1.5 KiB).
ARCHIVE_OVERHEAD = 1 << 20

#: Most bytes a compressed pickled object (a ``BytesStorageMetadata`` entry) may decode to.
MAX_OBJECT_BYTES = 256 << 20


# ----------------------------------------------------------------- typed view of the metadata


class ObjectPath(str):
    """A DCP folder (or a file of it) in an object store or a Hub repo: its URL, for messages;
    read by ranged GETs only, as object ``key`` of ``storage`` (the one medium the read chose:
    a Hub repo's commit listed once)."""

    storage: Storage
    key: str

    def __new__(cls, url: str, where: Storage, key: str = "") -> ObjectPath:
        self = super().__new__(cls, url.rstrip("/"))
        self.storage, self.key = where, key.strip("/")
        return self

    def __reduce__(self):  # copied (and pickled, where its storage is) with its storage
        return ObjectPath, (str(self), self.storage, self.key)

    def __truediv__(self, name: str) -> ObjectPath:
        key = f"{self.key}/{name}" if self.key else name
        return ObjectPath(f"{self}/{name}", self.storage, key)

    @property
    def name(self) -> str:
        return self.rpartition("/")[2]


def folder(path: os.PathLike | str | Storage) -> Path | ObjectPath:
    """``path`` as the reader holds it: a local folder, or a ``Storage`` as an
    :class:`ObjectPath` (ranges)."""
    if isinstance(path, ObjectPath):
        return path
    if isinstance(path, Storage):
        return ObjectPath(path.root, path)
    return Path(path)


@dataclass(frozen=True)
class DcpChunk:
    """One saved piece of a tensor: where it sits in the tensor and in which file's bytes."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative path of the .distcp file
    byte_offset: int
    byte_length: int
    transforms: tuple[str, ...] = ()


@dataclass(frozen=True)
class DcpTensor:
    """A tensor of a DCP checkpoint: global shape, dtype and the chunks that tile it."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[DcpChunk, ...]

    @property
    def files(self) -> list[str]:
        return sorted({c.file for c in self.chunks})


@dataclass(frozen=True)
class DcpObject:
    """A ``BytesStorageMetadata`` entry (megatron ShardedObject: rng state, ``_extra_state``)."""

    name: str
    file: str
    byte_offset: int
    byte_length: int
    transforms: tuple[str, ...] = ()


@dataclass
class DcpCheckpoint:
    """A parsed, checked ``.metadata``: tensors, pickled objects and the torch version."""

    path: Path | ObjectPath
    tensors: dict[str, DcpTensor]
    objects: dict[str, DcpObject]
    version: str | None = None
    #: "dcp": ``.distcp`` files; "hf_safetensors": rank-local safetensors (:mod:`dcp_safetensors`)
    layout: str = "dcp"
    #: what the reader could not check and the import records (``source.notes``)
    notes: tuple[str, ...] = ()
    #: each entry's top-level key in the state dict saved, as ``.metadata``'s ``planner_data``
    #: records it (``{"model": {"a.b": t}}``: ``model.a.b`` -> ``model``); {} where it is silent
    tops: dict[str, str] = field(default_factory=dict)
    _covered: set[str] = field(default_factory=set, init=False, repr=False, compare=False)
    _real: dict[str, str] = field(default_factory=dict, init=False, repr=False, compare=False)
    #: objects (an :class:`ObjectPath`'s) found to hold at least this many bytes: probed once
    _long: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def file_path(self, name: str) -> str:
        """The real path of storage file ``name``, refused unless it lies inside the folder."""
        if isinstance(self.path, ObjectPath):
            return self.path / name  # a plain name (checked in _storage_ref): no link to follow
        real = self._real.get(name)
        if real is None:
            try:
                real = files.inside(self.path, name, f"{self.path / METADATA_FILE}: storage file")
            except files.UnsafeFileError as e:
                raise SourceError(str(e)) from None
            self._real[name] = real
        return real

    @property
    def index(self) -> str:
        """What records the chunks, for errors: ``.metadata``, or the safetensors files."""
        if self.layout == "dcp":
            return str(self.path / METADATA_FILE)
        return f"{self.path} (DCP_SHARDING_INFO of its .safetensors files)"

    def check_tensor(self, name: str) -> None:
        """:func:`check_coverage` of tensor ``name``, once per checkpoint."""
        if name not in self._covered:
            check_coverage(self.tensors[name], self.index)
            self._covered.add(name)

    def read(self, name: str, rows: int | None = None) -> np.ndarray:
        """The tensor's array from its chunks; ``rows`` keeps the first rows (vocab padding)."""
        t = self.tensors[name]
        if rows is not None and (not t.shape or not 0 <= rows <= t.shape[0]):
            raise SourceError(
                f"tensor {name!r} in {self.path}: cannot keep {rows} rows of shape {list(t.shape)}"
            )
        return self._assemble(t, 0, t.shape[0] if rows is None and t.shape else rows)

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of the tensor, from the chunks that overlap them only."""
        t = self.tensors[name]
        if not t.shape or not 0 <= start <= stop <= t.shape[0]:
            raise SourceError(
                f"tensor {name!r} in {self.path}: no rows {start}:{stop} in shape {list(t.shape)}"
            )
        return self._assemble(t, start, stop)

    def _assemble(self, t: DcpTensor, start: int, stop: int | None) -> np.ndarray:
        """Rows ``start:stop`` of ``t`` (``stop`` None: a 0-d tensor) put together in place, or
        read by the reader :func:`tensors_read_by` installed."""
        if (reader := _READER.get()) is not None:
            return reader(str(self.path), t.name, start, stop)
        shape = t.shape if stop is None else (stop - start, *t.shape[1:])
        # its own mapping: glibc keeps freed blocks under 32 MiB in the heap (+120 MiB measured)
        out = writer.unpooled_empty(shape, t.dtype)
        region = [] if stop is None else [(start, stop), *((0, n) for n in t.shape[1:])]
        jobs = self.region_jobs(t.name, [(tuple(region), out)])
        if len(jobs) > 1 and out.nbytes >= PARALLEL_BYTES:
            # preadv and the CRC release the GIL: the chunks (one per rank) are read at once
            for f in [_pool(os.getpid()).submit(job) for job in jobs]:
                f.result()
        else:
            for job in jobs:
                job()
        return out

    def region_jobs(self, name: str, dests: Sequence[tuple[tuple, np.ndarray]]) -> list:
        """One job (a callable, any thread) per chunk overlapping the regions of ``dests``
        (``((start, stop) per dim, C-contiguous out)``), that reads the chunk's part of every
        region straight into it: a row of a layer stack can be a GiB, so no row is put
        together first. A chunk is read in slabs of at most ``READ_PIECE`` bytes (into a
        region when it lies whole in one, else into a scratch buffer cut into each), only
        those its regions cover, on every medium (``_chunk_into``)."""
        t = self.tensors[name]
        self.check_tensor(name)
        self.check_files([t])
        jobs = []
        for c in t.chunks:
            box = _union_overlap(c, [region for region, _ in dests])
            if box is not None:
                jobs.append(functools.partial(self._chunk_into, t, c, box, dests))
        return jobs

    def _chunk_into(self, t: DcpTensor, c: DcpChunk, box, dests) -> None:
        """Chunk ``c``'s part ``box`` (chunk-local) into every destination overlapping it: the
        slabs it covers read alone (into a destination a slab lies whole in, else cut from the
        bytes read), from the file's reader (pread, or ranged GETs of an object); an archive's
        data member found from the archive's first and last bytes, its CRC-32 computed slab by
        slab when ``box`` is all of the chunk (a part of it is not checkable). An archive laid
        out otherwise, a transformed chunk (its codec), a 0-d or a small one (:data:`SMALL`), and
        one needed whole from a file read by requests (its ends' two saved) is read whole and cut."""
        where, reader = self._where(t, c), self._reader(c.file)
        n, need = (math.prod(d) * t.dtype.itemsize for d in (c.sizes, [b - a for a, b in box]))
        small = c.byte_length <= max(SMALL, 2 * EDGE + need if need < n else 0)  # fewer bytes
        small = small or (need == n and reader.requests)  # fewer requests
        at, crc, whole = c.byte_offset, None, bool(c.transforms) or not c.sizes or small
        if not whole:
            raw = _file_range(reader, c.byte_offset, c.byte_length, where, edges=EDGE)
            if mapped_file.read_bytes(raw, 0, 4, where) == b"PK\x03\x04":
                member = self._member(t, c, raw, where)
                whole = member is None
                if member is not None:  # a part's CRC-32 is not checkable
                    at += member[0]
                    crc = member[1] if need == n else None
            else:
                whole = raw.size != n
                if self.layout == "dcp":
                    _refuse_safetensors_format(raw, self.path, c.file, c.byte_offset)
        if whole:
            arr = self.read_chunk(t, c)
            for part, view in _overlaps(c.offsets, [(0, n) for n in c.sizes], dests):
                mapped_file.copy_into(view, arr[tuple(slice(a, b) for a, b in part)], where)
            return
        pieces, cuts = [], []
        for off, slab in _slabs(c.sizes, box, t.dtype.itemsize):
            parts = _overlaps(c.offsets, slab, dests)
            shape = tuple(b - a for a, b in slab)
            into = None
            if len(parts) == 1 and parts[0][0] == slab and parts[0][1].flags.c_contiguous:
                into, parts = parts[0][1].reshape(-1).view(np.uint8).data, []  # no copy
            pieces.append((at + off, math.prod(shape) * t.dtype.itemsize, into))
            cuts.append((shape, slab, parts))
        found = [None if crc is None else 0]

        def done(i: int, data: memoryview) -> None:
            if found[0] is not None:
                found[0] = torch_zip.zip_crc32(data, found[0])
            shape, slab, parts = cuts[i]
            buf = np.frombuffer(data, t.dtype).reshape(shape)  # (a view: nothing copied)
            for part, view in parts:
                view[...] = buf[tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(part, slab))]

        _read(reader, pieces, done, where)
        _check_crc(found[0], crc, where)

    def _member(self, t: DcpTensor, c: DcpChunk, raw: np.ndarray, where: str):
        """``(offset, zip CRC-32)`` of the member of archive ``raw`` (its ends, zeros between)
        holding chunk ``c``'s bytes; None when laid out otherwise (read whole, it says how)."""
        try:
            arr, unchecked = _load_embedded(raw, f"{where}@{c.byte_offset}", where, True)
            _check_chunk(arr, t, c, where)
        except SourceError:
            return None
        m = _data_member(arr, raw, unchecked)  # every byte but its data read, or all of them
        ends = m is not None and m[0] <= EDGE and m[0] + arr.nbytes >= raw.size - EDGE
        return m if ends or raw.size <= 2 * EDGE else None

    def _where(self, t: DcpTensor, c: DcpChunk) -> str:
        return f"tensor {t.name!r} chunk at offsets {list(c.offsets)} in {self.path / c.file}"

    def _reader(self, name: str) -> ranged.RandomAccess:
        """Storage file ``name`` read at any offset, locally inside the folder only."""
        if isinstance(self.path, ObjectPath):
            obj = self.path / name
            return obj.storage.reader(obj.key)
        return ranged.LocalFile(self.file_path(name))

    def _entry_bytes(
        self, e: DcpChunk | DcpObject, budget: int, where: str
    ) -> tuple[str, np.ndarray]:
        """(its file, the bytes of chunk or object ``e``), torch's stream transforms (its
        ZStandard extension) undone within ``budget`` bytes."""
        dcp_transforms.check_descriptors(e.transforms, where)
        reader = self._reader(e.file)
        fpath, raw = reader.shown, _file_range(reader, e.byte_offset, e.byte_length, where)
        if e.transforms:
            data = mapped_file.read_bytes(raw, 0, raw.size, where)
            raw = np.frombuffer(dcp_transforms.undo(data, e.transforms, budget, where), np.uint8)
        return fpath, raw

    def read_chunk(self, t: DcpTensor, c: DcpChunk) -> np.ndarray:
        """Chunk ``c`` of ``t`` read whole: its array (a view of the bytes read)."""
        where, n = self._where(t, c), math.prod(c.sizes) * t.dtype.itemsize
        fpath, raw = self._entry_bytes(c, n + ARCHIVE_OVERHEAD, where)
        if mapped_file.read_bytes(raw, 0, 4, where) == b"PK\x03\x04":
            arr, _ = _load_embedded(raw, f"{fpath}@{c.byte_offset}", where)
        else:  # torch's raw (non-torch.save) serialization: the bytes of a contiguous tensor
            if self.layout == "dcp":
                _refuse_safetensors_format(raw, self.path, c.file, c.byte_offset)
            if raw.size != n:
                raise SourceError(
                    f"{where}: {raw.size} raw bytes, expected {n} ({list(c.sizes)} x {t.dtype})"
                )
            arr = raw.view(t.dtype.newbyteorder("<")).reshape(c.sizes)
        _check_chunk(arr, t, c, where)
        return arr

    def read_object(self, name: str, extra_classes=None) -> Any:
        """Unpickle a ShardedObject payload (restricted; unknown classes are refused)."""
        o = self.objects[name]
        where = f"object {name!r} in {self.path / o.file}"
        fpath, raw = self._entry_bytes(o, MAX_OBJECT_BYTES, where)
        obj, _ = _load_embedded(raw, f"{fpath}@{o.byte_offset}", where, extra_classes=extra_classes)
        return obj

    def check_files(self, tensors: Iterable[DcpTensor] | None = None) -> None:
        """Every file the chunks (of ``tensors``) reference exists and is long enough."""
        sizes: dict[str, int] = {}
        objects = self.objects.values() if tensors is None else ()
        tensors = self.tensors.values() if tensors is None else tensors
        entries = [
            (name, file, offset + length)
            for name, file, offset, length, _ in _storage_entries(tensors, objects)
        ]
        ends: dict[str, int] = {}  # an object's size is asked once: is it at least this long
        for _, file, end in entries:
            ends[file] = max(end, ends.get(file, 0))
        for name, file, end in entries:
            if file not in sizes and isinstance(self.path, ObjectPath):
                if self._long.get(file, -1) < ends[file]:
                    obj = self.path / file  # at least ends[file] bytes, else its size
                    self._long[file] = ranged.object_size(obj.storage, obj.key, ends[file])
                sizes[file] = self._long[file]
            if file not in sizes:
                p = Path(self.file_path(file))
                if os.path.lexists(p):
                    try:
                        files.check_regular(str(p))
                    except (files.UnsafeFileError, FileNotFoundError) as e:
                        what = e if isinstance(e, files.UnsafeFileError) else f"{p}: dangling link"
                        raise SourceError(f"tensor {name!r}: shard {what}") from None
                sizes[file] = p.stat().st_size if p.is_file() else -1
            if sizes[file] < 0:
                raise SourceError(
                    f"tensor {name!r}: shard file {self.path / file} is missing "
                    f"(referenced by {self.path / METADATA_FILE})"
                )
            if sizes[file] < end:
                raise SourceError(
                    f"tensor {name!r}: shard file {self.path / file} has {sizes[file]} bytes, "
                    f"metadata needs {end} (truncated)"
                )


#: (checkpoint folder, tensor name, start, stop) -> rows ``start:stop`` (stop None: a 0-d tensor)
RowReader = Callable[[str, str, int, "int | None"], np.ndarray]
_READER: contextvars.ContextVar[RowReader | None] = contextvars.ContextVar(
    "dcp_reader", default=None
)


@contextlib.contextmanager
def tensors_read_by(reader: RowReader) -> Iterator[None]:
    """Within it (this thread or task), every tensor a :class:`DcpCheckpoint` reads comes from
    ``reader`` instead of its files: ``verify --against`` has torch's own ``dcp.load`` read what
    an import builds of a DCP source (megatron-core's flat optimizer buckets)."""
    token = _READER.set(reader)
    try:
        yield
    finally:
        _READER.reset(token)


#: Most corner coordinates :func:`check_coverage` sorts for one tensor: 256 MiB of int64.
MAX_COVERAGE_CORNERS = 1 << 25


def check_coverage(t: DcpTensor, where: Path | str) -> None:
    """Every element of ``t`` comes from exactly one chunk, each inside the shape with enough bytes,
    in Python ints (no int64 wrap); O(n log n)."""
    nd = len(t.shape)
    total = 0
    for c in t.chunks:
        place = f"chunk at offsets {list(c.offsets)} sizes {list(c.sizes)} in {c.file}"
        if len(c.offsets) != nd or len(c.sizes) != nd:
            raise SourceError(
                f"tensor {t.name!r} in {where}: {place}: rank {len(c.sizes)}, the tensor's is {nd}"
            )
        if any(o < 0 or s < 0 or o + s > g for o, s, g in zip(c.offsets, c.sizes, t.shape)):
            raise SourceError(
                f"tensor {t.name!r} in {where}: {place} exceeds the global shape {list(t.shape)}"
            )
        count = math.prod(c.sizes)
        if count * t.dtype.itemsize > c.byte_length and not c.transforms:  # compressed: fewer
            raise SourceError(
                f"tensor {t.name!r} in {where}: {place}: declares {count * t.dtype.itemsize} "
                f"bytes ({t.dtype}), its storage entry holds only {c.byte_length}"
            )
        total += count
    want = math.prod(t.shape)
    incomplete = (
        f"tensor {t.name!r} in {where}: incomplete shard coverage: chunks hold {total} of "
        f"{want} elements of shape {list(t.shape)} (files {t.files})"
    )
    if total < want:
        raise SourceError(incomplete)
    witness = _tiling_witness(t, where)
    if witness is not None:
        element, holders = witness
        if not holders:
            raise SourceError(f"{incomplete}; element {element} is in no chunk")
        a, b = holders[:2]
        raise SourceError(
            f"tensor {t.name!r}: overlapping shards: {list(a.offsets)}+{list(a.sizes)} in "
            f"{a.file} and {list(b.offsets)}+{list(b.sizes)} in {b.file} both hold element "
            f"{element} ({where})"
        )
    check_disjoint({t.name: t}, {}, where)  # no two chunks share a byte


def _tiling_witness(t: DcpTensor, where: Path | str) -> tuple[list[int], list[DcpChunk]] | None:
    """None when the chunks tile ``t.shape`` exactly, else an element in no chunk or in several, and
    the chunks holding it.

    Exact: with ``g`` = sum of the chunks' indicators - the tensor's, the mixed difference ``D g``
    is the signed sum of all boxes' corners (found by sorting), ``g == 0`` iff ``D g == 0``, and at
    the lexicographically smallest ``p`` with ``D g != 0``, ``g(p) = D g(p)``: > 0 in two chunks, <
    0 in none. Dimensions every chunk spans whole factor out."""
    chunks = [c for c in t.chunks if all(c.sizes)]
    shape = np.array(t.shape, np.int64)
    nd = len(t.shape)
    lo = np.array([c.offsets for c in chunks], np.int64).reshape(len(chunks), nd)
    hi = lo + np.array([c.sizes for c in chunks], np.int64).reshape(len(chunks), nd)
    split = np.flatnonzero(~np.all((lo == 0) & (hi == shape), axis=0))
    d = len(split)
    rows = (len(chunks) + 1) << d
    if rows * (d + 1) > MAX_COVERAGE_CORNERS:
        raise SourceError(
            f"tensor {t.name!r} in {where}: {len(chunks)} chunks split along {d} dimensions: "
            f"too many to check that they tile the tensor ({rows} corners, at most "
            f"{MAX_COVERAGE_CORNERS // (d + 1)})"
        )
    sign = np.ones(len(chunks) + 1, np.int64)
    sign[-1] = -1 if all(t.shape) else 0  # the tensor's own box (none when it is empty)
    starts = np.vstack([lo[:, split], np.zeros((1, d), np.int64)])
    ends = np.vstack([hi[:, split], shape[split][None, :]])
    points, weights = [], []
    for corner in range(1 << d):
        at_end = np.array([(corner >> k) & 1 for k in range(d)], bool)
        points.append(np.where(at_end, ends, starts))
        weights.append(sign * (-1) ** int(at_end.sum()))
    point = np.concatenate(points)
    weight = np.concatenate(weights)
    if d:
        order = np.lexsort(point.T[::-1])  # lexicographic: the first dimension first
        point, weight = point[order], weight[order]
    first = np.concatenate([[0], np.flatnonzero(np.any(point[1:] != point[:-1], axis=1)) + 1])
    residual = np.flatnonzero(np.add.reduceat(weight, first)) if len(point) else []
    if not len(residual):
        return None
    where_split = point[first[residual[0]]]
    element = np.zeros(nd, np.int64)
    element[split] = where_split
    inside = np.all((lo <= element) & (element < hi), axis=1)
    return element.tolist(), [chunks[i] for i in np.flatnonzero(inside)]


def _overlap(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]):
    """The intersection of boxes ``a`` and ``b`` (``(start, stop)`` per dim), or None."""
    box = [(max(x, y), min(u, v)) for (x, u), (y, v) in zip(a, b)]
    return None if any(lo >= hi for lo, hi in box) else box


def _union_overlap(c: DcpChunk, regions: Sequence[tuple]) -> list[tuple[int, int]] | None:
    """The chunk-local bounding box of ``regions``' overlaps with chunk ``c`` (None: none)."""
    own = [(o, o + s) for o, s in zip(c.offsets, c.sizes)]
    found = [box for region in regions if (box := _overlap(own, region)) is not None]
    if not found or not c.sizes:
        return None if c.sizes or not regions else []
    return [
        (min(b[d][0] for b in found) - o, max(b[d][1] for b in found) - o)
        for d, o in enumerate(c.offsets)
    ]


def _slabs(sizes: Sequence[int], box: Sequence[tuple[int, int]], itemsize: int):
    """``(byte offset, chunk-local box)`` of contiguous slabs of a C-ordered chunk of ``sizes``
    covering ``box``, each at most ``READ_PIECE`` bytes (or one element's row): whole along
    the dimensions after the first one a ``READ_PIECE`` holds a step of."""
    step = [itemsize * math.prod(sizes[d + 1 :]) for d in range(len(sizes))]
    k = next(d for d in range(len(sizes)) if step[d] <= READ_PIECE)
    rows = max(1, READ_PIECE // step[k])
    tail = [(0, n) for n in sizes[k + 1 :]]
    for prefix in itertools.product(*(range(a, b) for a, b in box[:k])):
        base = sum(i * s for i, s in zip(prefix, step))
        for lo in range(box[k][0], box[k][1], rows):
            hi = min(lo + rows, box[k][1])
            yield base + lo * step[k], [*((i, i + 1) for i in prefix), (lo, hi), *tail]


def _overlaps(offsets: Sequence[int], part: Sequence[tuple[int, int]], dests) -> list:
    """``(chunk-local box, the destination's view of it)`` for every destination overlapping
    ``part`` (chunk-local) of a chunk at ``offsets``."""
    own = [(o + a, o + b) for o, (a, b) in zip(offsets, part)]
    out = []
    for region, arr in dests:
        box = _overlap(own, region) if own else []
        if box is None:
            continue
        view = arr[(*(slice(a - r, b - r) for (a, b), (r, _) in zip(box, region)), ...)]
        out.append(([(a - o, b - o) for (a, b), o in zip(box, offsets)], view))
    return out


def _file_range(
    reader: ranged.RandomAccess, offset: int, length: int, where: str, edges: int = 0
) -> np.ndarray:
    """A read-only uint8 array of the file's bytes ``[offset, offset + length)``; ``edges``:
    only its first and last ``edges`` bytes read, zeros between (untouched pages)."""
    out = np.zeros(length, np.uint8)
    spans = [(0, edges), (length - edges, length)] if 0 < 2 * edges < length else [(0, length)]
    _read(reader, [(offset + a, b - a, out[a:b].data) for a, b in spans], None, where)
    out.flags.writeable = False
    return out


def _read(reader: ranged.RandomAccess, pieces: list, done, where: str) -> None:
    """``reader.read_into``, its errors naming ``where``."""
    try:
        reader.read_into(pieces, done or (lambda i, data: None))
    except (ranged.RangeError, files.UnsafeFileError) as e:
        raise SourceError(f"{where}: {e}") from None


def _check_chunk(arr: Any, t: DcpTensor, c: DcpChunk, where: str) -> None:
    if not isinstance(arr, np.ndarray):
        raise SourceError(f"{where}: chunk holds a {type(arr).__name__}, expected a tensor")
    if arr.dtype != t.dtype:
        raise SourceError(
            f"{where}: dtype disagreement: metadata says {t.dtype}, bytes hold {arr.dtype}"
        )
    if tuple(arr.shape) != tuple(c.sizes):
        raise SourceError(
            f"{where}: shape disagreement: metadata says {list(c.sizes)}, "
            f"bytes hold {list(arr.shape)}"
        )


#: Tensors at least this large have their chunks read by :func:`_pool`'s threads at once.
PARALLEL_BYTES = 4 << 20


@functools.cache
def _pool(pid: int) -> concurrent.futures.ThreadPoolExecutor:
    """The reading threads of process ``pid`` (a forked child needs its own pool)."""
    return concurrent.futures.ThreadPoolExecutor(max(2, min(4, os.cpu_count() or 1)), "dcp-read")


def _address(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]


#: Most bytes read and CRC-checked at once (they stay in the CPU cache).
READ_PIECE = 4 << 20
#: Bytes of a chunk's archive read at each end to find its data member (torch writes ~1.5 KiB).
EDGE = 4 << 10
#: A chunk up to this long, or its ends and the rows read longer, is read whole (fewer bytes).
SMALL = 64 << 10


def _check_crc(found: int | None, crc: int | None, where: str) -> None:
    if crc is not None and found != crc:
        raise SourceError(
            f"{where}: CRC-32 mismatch (the chunk's archive records {crc:08x}, its bytes give "
            f"{found or 0:08x}): the file is corrupt"
        )


def _data_member(arr: np.ndarray, raw: np.ndarray, unchecked: dict) -> tuple[int, int] | None:
    """``(offset in raw, zip CRC-32)`` of the one archive member holding exactly ``arr``'s bytes
    (a chunk's ``torch.save`` archive, ``arr`` a view of ``raw``), else None."""
    members = list(unchecked.values())
    if len(members) == 1 and arr.flags.c_contiguous:
        start, size, crc = members[0]
        if size == arr.nbytes and _address(arr) - _address(raw) == start:
            return start, crc
    return None


def _load_embedded(
    view: np.ndarray, archive: str, where: str, defer_crc: bool = False, extra_classes=None
) -> tuple[Any, dict[str, tuple[int, int, int]]]:
    """A chunk or object's ``torch.save`` archive: what it holds, and the CRCs left to check."""
    try:
        embedded = torch_zip.TorchArchive.from_buffer(view, archive, defer_crc=defer_crc)
        with contextlib.closing(embedded) as arch:
            return arch.load(extra_classes), arch.unchecked
    except allow_list.TorchFileError as e:
        raise SourceError(f"{where}: {e}") from None


# ----------------------------------------------------------------- opening


def refuse_fsdp_dtensor(names: list, where: str) -> None:
    """Megatron-FSDP's fsdp_dtensor keys its optimizer state by parameter name: read as plain DCP it
    would give wrongly named weights, so it is refused here."""
    meta = next(
        (n for n in names if isinstance(n, str) and n.startswith("optimizer.param_to_group_meta.")),
        None,
    )
    if meta is not None:
        raise SourceError(
            f"{where}: a megatron-core fsdp_dtensor checkpoint (Megatron-FSDP, --ckpt-format "
            f"fsdp_dtensor; key {meta!r}): read it as a Megatron checkpoint (format='megatron'), "
            f"not as plain torch DCP, whose names its per-parameter optimizer state would not fit"
        )


def _is_count(value: Any) -> bool:
    """A non-negative int that fits torch's int64 (a bool or a float is not one)."""
    return type(value) is int and 0 <= value < 2**63


def _dtype_of(props: Any, name: str, where: Path | str) -> np.dtype:
    state = getattr(props, "state", None)
    dt = getattr(props, "dtype", None)
    if dt is None and isinstance(state, tuple) and state:
        dt = state[0]  # TensorProperties pickles as (dtype, layout, requires_grad, mem_format, pin)
    if not isinstance(dt, np.dtype):
        raise SourceError(f"tensor {name!r} in {where}: unsupported dtype {dt!r}")
    return dt


def _storage_ref(
    by_fqn: dict[str, dict[Any, Any]], mfile: Path | str, name: str, off, what: str
) -> tuple[str, int, int, tuple[str, ...]]:
    """The checked (file, offset, length, transforms) of one chunk or object of ``name``."""
    info = by_fqn.get(name, {}).get(off)
    if info is None:
        raise SourceError(
            f"tensor {name!r}: {what} at offsets {off} has no storage entry in {mfile}"
        )
    rp, bo, bl = (getattr(info, field, None) for field in ("relative_path", "offset", "length"))
    trs = getattr(info, "transform_descriptors", None) or ()
    if (
        not isinstance(rp, str)
        or not _is_count(bo)
        or not _is_count(bl)
        or "/" in rp
        or "\0" in rp
        or rp.startswith(".")
        or not isinstance(trs, (list, tuple))
        or not all(isinstance(tr, str) for tr in trs)
    ):
        raise SourceError(
            f"tensor {name!r} in {mfile}: {what} storage entry (file {allow_list.short_repr(rp)}, offset "
            f"{allow_list.short_repr(bo)}, length {allow_list.short_repr(bl)}, transforms {allow_list.short_repr(trs)}): expected a file name "
            f"in the checkpoint directory, non-negative integer offset and length, strings"
        )
    return rp, cast(int, bo), cast(int, bl), tuple(trs)  # checked by _is_count above


def _dims(
    mfile: Path | str, name: str, what: str, value: Any, rank: int | None = None
) -> tuple[int, ...]:
    """A shape / offsets / sizes field: non-negative ints (torch's int64), ``rank`` of them."""
    if not isinstance(value, (tuple, list)) or not all(_is_count(v) for v in value):
        raise SourceError(
            f"tensor {name!r} in {mfile}: {what} {allow_list.short_repr(value)}: expected "
            f"non-negative integers below 2**63"
        )
    if rank is not None and len(value) != rank:
        raise SourceError(
            f"tensor {name!r} in {mfile}: {what} {list(value)} has rank {len(value)}, the "
            f"tensor rank {rank}"
        )
    return tuple(value)


def _load_metadata(root: Path | ObjectPath, extra_classes: dict[str, Any] | None):
    """``.metadata`` restrictedly unpickled: (path, pickle, its two checked dicts)."""
    mfile = root / METADATA_FILE
    try:
        if isinstance(mfile, ObjectPath):
            raw = mfile.storage.read(mfile.key, MAX_METADATA_BYTES)
            if raw is None:
                raise SourceError(f"{root}: no .metadata object (not a torch DCP checkpoint)")
        elif not os.path.lexists(mfile):
            raise SourceError(f"{root}: no .metadata file (not a torch DCP checkpoint)")
        else:
            files.in_own_folder(mfile)  # never another checkpoint's .metadata through a link
            raw = files.read_regular(str(mfile), MAX_METADATA_BYTES)
        extra = {**DCP_CLASSES, **(extra_classes or {})}
        md = restricted_loads(raw, where=str(mfile), extra_classes=extra)
    except (RequestError, allow_list.TorchFileError, files.UnsafeFileError) as e:
        raise SourceError(str(e)) from None
    sdm = getattr(md, "state_dict_metadata", None)
    storage = getattr(md, "storage_data", None)
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        raise SourceError(f"{mfile}: not a torch.distributed.checkpoint Metadata pickle")
    return mfile, md, sdm, storage


def _storage_by_fqn(storage: dict[Any, Any], mfile: Path | str) -> dict[str, dict[Any, Any]]:
    """``storage_data`` regrouped as name -> chunk offsets -> storage info."""
    by_fqn: dict[str, dict[Any, Any]] = {}
    for idx, info in storage.items():
        if not isinstance(idx, _MetadataIndex):
            raise SourceError(f"{mfile}: storage_data key {idx!r} is not a MetadataIndex")
        fqn, off, _ = idx._key()
        by_fqn.setdefault(fqn, {})[off] = info
    return by_fqn


def _tensor_entry(
    name: str, m: Any, mfile: Path | str, by_fqn: dict[str, dict[Any, Any]]
) -> DcpTensor:
    """One ``TensorStorageMetadata``: its shape, dtype and chunks, each with its storage entry."""
    shape = _dims(mfile, name, "size", getattr(m, "size", None))
    dt = _dtype_of(getattr(m, "properties", None), name, mfile)
    listed = getattr(m, "chunks", None)
    if not isinstance(listed, (list, tuple)):
        raise SourceError(
            f"tensor {name!r} in {mfile}: chunks {allow_list.short_repr(listed)}: expected a list"
        )
    chunks = []
    for index, c in enumerate(listed):
        offs = _dims(mfile, name, f"chunk {index} offsets", getattr(c, "offsets", None), len(shape))
        sizes = _dims(mfile, name, f"chunk {index} sizes", getattr(c, "sizes", None), len(shape))
        rp, bo, bl, trs = _storage_ref(by_fqn, mfile, name, offs, f"chunk {index}")
        # an unknown stream transform refused as the checkpoint is opened, before any read
        dcp_transforms.check_descriptors(trs, f"tensor {name!r} chunk {index} in {mfile}")
        chunks.append(DcpChunk(offs, sizes, rp, bo, bl, trs))
    return DcpTensor(name, shape, dt, tuple(chunks))


def open_dcp(
    path: os.PathLike | str | Storage,
    extra_classes: dict[str, Any] | None = None,
    fsdp_dtensor: bool = False,
) -> DcpCheckpoint:
    """Parse ``.metadata`` into checked entries (``extra_classes``: more stand-ins)."""
    root = folder(path)
    mfile, md, sdm, storage = _load_metadata(root, extra_classes)
    if not fsdp_dtensor:
        refuse_fsdp_dtensor(list(sdm), str(mfile))
    by_fqn = _storage_by_fqn(storage, mfile)
    tensors: dict[str, DcpTensor] = {}
    objects: dict[str, DcpObject] = {}
    for name, m in sdm.items():
        if not isinstance(name, str):
            raise SourceError(f"{mfile}: entry name {allow_list.short_repr(name)} is not a string")
        kind = type(m).__name__
        if kind == "TensorStorageMetadata":
            tensors[name] = _tensor_entry(name, m, mfile, by_fqn)
        elif kind == "BytesStorageMetadata":
            rp, bo, bl, trs = _storage_ref(by_fqn, mfile, name, None, "object")
            dcp_transforms.check_descriptors(trs, f"object {name!r} in {mfile}")
            objects[name] = DcpObject(name, rp, bo, bl, trs)
        else:
            raise SourceError(f"{mfile}: entry {name!r} has unknown metadata type {kind}")
    paths = getattr(md, "planner_data", None)
    tops = {
        n: p[0]
        for n, p in (paths.items() if isinstance(paths, dict) else ())
        if isinstance(n, str) and isinstance(p, tuple) and p and isinstance(p[0], str)
    }
    ck = DcpCheckpoint(root, tensors, objects, getattr(md, "version", None), tops=tops)
    try:
        check_disjoint(tensors, objects, mfile)
    except SourceError:
        _diagnose_overlap(ck)  # torch's safetensors serialization: say what it is
        raise
    return ck


def _diagnose_overlap(ck: DcpCheckpoint) -> None:
    """Refuse by name a ``dcp.save`` with ``serialization_format=SAFETENSORS``."""
    seen: set[tuple[str, int]] = set()
    for t in ck.tensors.values():
        for c in t.chunks:
            if (c.file, c.byte_offset) in seen or c.transforms:
                continue
            seen.add((c.file, c.byte_offset))
            try:
                head = _file_range(ck._reader(c.file), c.byte_offset, min(c.byte_length, 16), "")
            except SourceError:  # a missing or short file: the overlap is the error
                continue
            _refuse_safetensors_format(head, ck.path, c.file, c.byte_offset)


#: The most header bytes a safetensors file may declare (the ``safetensors`` crate's limit).
_MAX_SAFETENSORS_HEADER = 100 << 20


def _refuse_safetensors_format(
    raw: np.ndarray, root: Path | ObjectPath, file: str, offset: int
) -> None:
    """Refuse an entry whose bytes start a safetensors file:
    ``FileSystemWriter(serialization_format=SAFETENSORS)`` records every tensor at its start, so
    nothing is located (torch's ``dcp.load`` fails too)."""
    head = mapped_file.read_bytes(raw, 0, min(raw.size, 10), f"{root / file}@{offset}")
    length = int.from_bytes(head[:8], "little") if len(head) == 10 else 0
    if not 2 <= length <= _MAX_SAFETENSORS_HEADER or head[8:] != b'{"':
        return
    raise SourceError(
        f"{root}: a torch DCP checkpoint saved with serialization_format=SAFETENSORS "
        f"(FileSystemWriter): its storage file {file} holds a safetensors file from byte "
        f"{offset}, where .metadata puts every tensor, so .metadata does not locate any "
        f"tensor's bytes. torch's own dcp.load cannot read this folder either (its "
        f"FileSystemReader torch.loads each entry and fails). Not supported: save with the "
        f"default serialization, or with HuggingFaceStorageWriter (whose safetensors files "
        f"record their offsets and are read)."
    )


def _storage_entries(
    tensors: Iterable[DcpTensor], objects: Iterable[DcpObject]
) -> Iterator[tuple[str, str, int, int, DcpChunk | None]]:
    """(name, file, byte offset, byte length, chunk or None) of every chunk of ``tensors``, then
    of every entry of ``objects``."""
    for t in tensors:
        for c in t.chunks:
            yield t.name, c.file, c.byte_offset, c.byte_length, c
    for o in objects:
        yield o.name, o.file, o.byte_offset, o.byte_length, None


def check_disjoint(
    tensors: dict[str, DcpTensor], objects: dict[str, DcpObject], where: Path | str
) -> None:
    """No two storage entries share a byte of a file (a tensor would import another's values),
    but for a tied weight (``DcpItem.same_as``): a whole one-chunk tensor whose entry, shape and
    dtype are another's. Sorted per file by start: an overlap with any later entry is one with
    the next. Args: tensors: every tensor's chunks. objects: every pickled object's entry.
    where: the ``.metadata`` file, for errors."""
    file_ids: dict[str, int] = {}  # files in the order met: the order of the sort
    whole: dict[tuple, str] = {}  # a one-chunk tensor's entry, shape, dtype -> its first name
    kept = [
        t
        for t in tensors.values()
        if len(t.chunks) != 1
        or t.chunks[0].sizes != t.shape
        or whole.setdefault((t.chunks[0], t.shape, t.dtype.str), t.name) == t.name
    ]
    entries = sorted(  # (file id, start, end, file, tensor or object name, chunk or None)
        (
            (file_ids.setdefault(file, len(file_ids)), offset, offset + length, file, name, chunk)
            for name, file, offset, length, chunk in _storage_entries(kept, objects.values())
            if length
        ),
        key=lambda e: e[:2],
    )
    hit = next(
        ((a, b) for a, b in itertools.pairwise(entries) if a[0] == b[0] and b[1] < a[2]), None
    )
    if hit is None:
        return
    (_, _, end_a, file, name_a, chunk_a), (_, first, end_b, _, name_b, chunk_b) = hit
    last = min(end_a, end_b)
    if name_a == name_b and chunk_a is not None and chunk_b is not None:
        raise SourceError(
            f"tensor {name_b!r} in {where}: two chunks share bytes [{first}, "
            f"{min(last, first + 1)}...) of {file}; each chunk has its own bytes"
        )
    shown = [
        f"object {name!r}"
        if chunk is None
        else f"tensor {name!r} (chunk at offsets {list(chunk.offsets)})"
        for name, chunk in ((name_a, chunk_a), (name_b, chunk_b))
    ]
    raise SourceError(
        f"{where}: {shown[0]} and {shown[1]} share bytes [{first}, {last}) of storage file "
        f"{file}; each entry has its own bytes"
    )


# ----------------------------------------------------------------- writing


def _meta(cls: str, **state: Any) -> New:
    """A ``torch.distributed.checkpoint.metadata`` dataclass as torch pickles it."""
    return New(Global(_META, cls), state)


def _properties(torch_name: str) -> New:
    return New(
        Global(_META, "TensorProperties"),
        (
            Global("torch", torch_name),
            Call(Global("torch.serialization", "_get_layout"), ("torch.strided",)),
            False,
            Call(Global(_META, "_MEM_FORMAT_ENCODING"), (0,)),
            False,
        ),
    )


@dataclass(frozen=True)
class DcpItem:
    """One entry of a DCP state dict: a tensor (``shape``/``dtype``) or a Python value;
    ``same_as``: an earlier tensor's fqn whose bytes this one is (a tied weight: one storage
    entry, no array of its own), which is how a reader knows the tie."""

    fqn: str
    path: tuple[str | int, ...]  # the nested state-dict keys (DCP's planner_data)
    shape: tuple[int, ...] | None = None
    dtype: np.dtype | None = None
    value: Any = None
    same_as: str | None = None


def write_dcp(
    directory: str,
    items: Sequence[DcpItem],
    arrays: Iterable[Any],
    save_id: str,
    slabs: torch_zip.Slabs = None,
):
    """A single-file DCP checkpoint of ``items``, readable by ``torch.distributed.checkpoint.load``
    at any world size. Args: directory: the DCP folder (exists, empty). items: every entry:
    tensors and pickled objects, in order. arrays: the tensors' values, in the order of the
    tensor items. save_id: the ``storage_meta.save_id`` recorded in ``.metadata``. slabs: reads
    each value (:data:`~jax_ucp._src.torchfiles.torch_zip.Slabs`)."""
    storage_data: list = []
    metadata: dict = {}
    tensors = iter(arrays)
    stored: dict[str, tuple[int, int]] = {}  # fqn -> its (offset, length)
    with durable.durable_file(os.path.join(directory, DATA_FILE)) as f:
        for item in items:
            offset = f.tell()
            if item.shape is None:
                length = torch_zip.write_torch_save(f, obj=item.value)
                where: dict = {"index": None, "offset": None}
                metadata[item.fqn] = _meta("BytesStorageMetadata")
            else:
                if item.same_as is not None:
                    offset, length = stored[item.same_as]
                    torch_name, _ = torch_dtype(item.fqn, np.dtype(item.dtype))
                else:
                    array = next(tensors)
                    if tuple(array.shape) != item.shape or array.dtype != item.dtype:
                        raise RequestError(
                            f"tensor {item.fqn!r}: read {array.shape} {array.dtype}, planned "
                            f"{item.shape} {item.dtype}"
                        )
                    torch_name, _ = torch_dtype(item.fqn, array.dtype)  # == item.dtype, checked
                    length = torch_zip.write_torch_save(f, array=array, slabs=slabs)
                zeros, size = torch_size([0] * len(item.shape)), torch_size(item.shape)
                where = {"index": 0, "offset": zeros}
                chunk = _meta("ChunkStorageMetadata", offsets=zeros, sizes=size)
                properties = _properties(torch_name)
                metadata[item.fqn] = _meta(
                    "TensorStorageMetadata", properties=properties, size=size, chunks=[chunk]
                )
                stored[item.fqn] = (offset, length)
            info = New(
                Global(_FILESYSTEM, "_StorageInfo"),
                {"relative_path": DATA_FILE, "offset": offset, "length": length},
            )
            storage_data.append((_meta("MetadataIndex", fqn=item.fqn, **where), info))
    meta = _meta(
        "Metadata",
        state_dict_metadata=metadata,
        planner_data={item.fqn: item.path for item in items},
        storage_data=Pairs(tuple(storage_data)),
        storage_meta=_meta(
            "StorageMeta", checkpoint_id=None, save_id=save_id, load_id=None, modules=[]
        ),
        version="1.0.0",
    )
    durable.write_file(os.path.join(directory, METADATA_FILE), dumps(meta))
