"""Whole zarr v3 shard files written from host memory (byte for byte what TensorStore writes) and
regions of such arrays read back.

Why not TensorStore's own write: its wheel computes crc32c in software, several times
slower than the ``crc32c`` package, which uses the CPU's instruction and releases the GIL.
Our layouts make this simple: a shard is written whole by one writer, uncompressed, and its inner chunks (trailing dimensions whole, one
dimension cut, earlier ones 1; see ``chunking``) are consecutive byte ranges of the C-ordered
shard. So the file is: every chunk's bytes, each followed by its crc32c, then the shard index
(``[offset, nbytes]`` uint64 per chunk, little-endian) and its crc32c (``index_location: end``).
TensorStore still creates every array (``zarr.json``); tests check that the files are identical
to the ones TensorStore writes and that reads equal TensorStore's. Anything else (compression,
lazy TensorStore sources and views, non-file kvstores, sub-byte dtypes) goes through TensorStore.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import os
import struct
import sys
import threading
from collections.abc import Mapping, Sequence

import crc32c as crc32c_lib
import numpy as np

from jax_ucp.format import UCPError, files
from jax_ucp.store.zarr3 import ArrayLayout

# Dtypes whose zarr v3 "bytes" encoding is the little-endian in-memory layout (itemsize >= 1).
# Sub-byte types (int4, float4) are packed differently and are left to TensorStore.
_BYTES_KINDS = "biufc"
_ML_DTYPES_1_2_BYTES = (
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e4m3b11fnuz",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e8m0fnu",
)
_IOV_MAX = 512  # buffers per writev call (Linux allows 1024)


def _encodable_dtype(dtype: np.dtype) -> bool:
    if dtype.name in _ML_DTYPES_1_2_BYTES:
        return True
    return dtype.kind in _BYTES_KINDS and dtype.itemsize >= 1 and dtype.byteorder in ("=", "<", "|")


def chunks_are_contiguous(shard_shape: Sequence[int], inner: Sequence[int]) -> bool:
    """True if each inner chunk is one consecutive byte range of the C-ordered shard, in grid order."""
    cut = max((i for i, (s, c) in enumerate(zip(shard_shape, inner)) if c != s), default=None)
    if cut is None:
        return True
    return all(c == 1 for c in inner[:cut]) and shard_shape[cut] % inner[cut] == 0


def can_encode(layout: ArrayLayout, data) -> bool:
    """Whether ``data`` (one whole shard) is laid out so that ``encode`` gives its file."""
    return (
        sys.byteorder == "little"
        and layout.compression is None
        and layout.checksum in (None, "crc32c")
        and isinstance(data, np.ndarray)
        and data.ndim >= 1
        and data.size > 0
        and tuple(data.shape) == tuple(layout.chunk_shape)
        and _encodable_dtype(data.dtype)
        and chunks_are_contiguous(layout.chunk_shape, layout.inner_chunk_shape)
    )


def can_write(layout: ArrayLayout, data, kvstore: dict) -> bool:
    """Whether ``data`` (one whole shard) can be written here instead of by TensorStore."""
    return kvstore.get("driver") == "file" and can_encode(layout, data)


def shard_key(chunk_position: Sequence[int]) -> str:
    """zarr v3 "default" chunk key encoding ("/"-separated)."""
    return "/".join(["c", *(str(int(i)) for i in chunk_position)])


def encode(data: np.ndarray, layout: ArrayLayout) -> list:
    """The shard file as a list of buffers (views of ``data`` plus the small crc/index pieces)."""
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    chunk_bytes = math.prod(layout.inner_chunk_shape) * data.dtype.itemsize
    n = flat.size // chunk_bytes
    checksum = layout.checksum == "crc32c"
    stored = chunk_bytes + (4 if checksum else 0)
    parts: list = []
    for i in range(n):
        chunk = flat[i * chunk_bytes : (i + 1) * chunk_bytes]
        parts.append(chunk)
        if checksum:
            parts.append(struct.pack("<I", crc32c_lib.crc32c(chunk)))
    index = np.empty((n, 2), "<u8")
    index[:, 0] = np.arange(n, dtype=np.uint64) * stored
    index[:, 1] = stored
    index_bytes = index.tobytes()
    parts.append(index_bytes)
    if checksum:
        parts.append(struct.pack("<I", crc32c_lib.crc32c(index_bytes)))
    return parts


def digest_of_trailers(trailers: bytes) -> str:
    """The shard digest recorded in the manifest: crc32c of the inner chunks' crc32c trailers,
    concatenated in index order (8 hex digits). Readers check it from the file's own trailers,
    so a shard file swapped with another one, or left from an older save, is detected."""
    return f"{crc32c_lib.crc32c(trailers):08x}"


def digest_of_parts(parts: list) -> str:
    """``digest_of_trailers`` of a shard being written (the trailers are every other part)."""
    return digest_of_trailers(b"".join(parts[1:-2:2]))


def digest_of_data(data: np.ndarray, layout: ArrayLayout) -> str:
    """The digest of the shard file TensorStore writes for ``data`` (``can_encode``, crc32c):
    for object stores, where the file is not ours to write or cheap to read back."""
    return digest_of_parts(encode(data, layout))


def write(
    array_dir: str,
    chunk_position: Sequence[int],
    data: np.ndarray,
    layout: ArrayLayout,
    *,
    sync: bool = True,
) -> str | None:
    """Writes the shard at ``chunk_position`` of the array in ``array_dir``; returns its digest
    (``digest_of_trailers``; None without checksums).

    ``sync``: the file's data is on disk on return (fsync); the directories that gained entries
    are the caller's to fsync (``writer.durable``). Otherwise only start the write-back (no
    waiting) and leave durability to the caller's one syncfs before it commits the directory:
    writers then never stall on the disk one file at a time.
    The checkpoint directory is committed by rename afterwards, so a partially written file is
    never visible under the final name.
    """
    key = shard_key(chunk_position)
    path = os.path.join(array_dir, *key.split("/"))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    parts = encode(data, layout)
    digest = digest_of_parts(parts) if layout.checksum == "crc32c" else None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        for i in range(0, len(parts), _IOV_MAX):
            batch = parts[i : i + _IOV_MAX]
            n = os.writev(fd, batch)
            if n != sum(memoryview(p).nbytes for p in batch):  # short write: finish piece by piece
                _write_rest(fd, batch, n)
        if sync:
            os.fsync(fd)
        elif hasattr(os, "posix_fadvise"):
            # Linux: DONTNEED starts write-back of the dirty pages now (and drops them once clean).
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return digest


def _write_rest(fd: int, batch: list, done: int) -> None:
    for p in batch:
        mv = memoryview(p).cast("B")
        if done >= mv.nbytes:
            done -= mv.nbytes
            continue
        mv = mv[done:]
        done = 0
        while mv.nbytes:
            n = os.write(fd, mv)
            if n <= 0:
                raise OSError(f"write returned {n} with {mv.nbytes} bytes left")
            mv = mv[n:]


# --- Reading ------------------------------------------------------------------------------------
# The mirror of ``write``: regions of arrays whose shards have the layout ``write`` produces are
# read with pread + the hardware crc32c (TensorStore verifies crc32c in software, the
# main cost of a restore on 2 cores). ``layout_from_metadata`` admits an array only if its
# zarr.json (as TensorStore parsed it) is exactly that layout; anything else is read by TensorStore.

_MISSING = (1 << 64) - 1


class ShardReadError(UCPError, OSError):
    """A shard file that is missing, truncated, fails its crc32c, or is not the one the manifest
    lists (digest mismatch: swapped, or from another save)."""


def read_index(fd: int, path: str, n_chunks: int, crc: bool) -> np.ndarray:
    """The ``[offset, nbytes]`` index (index_location end) of a shard file, validated."""
    size = os.fstat(fd).st_size
    index_bytes = n_chunks * 16 + (4 if crc else 0)
    if size < index_bytes:
        raise ShardReadError(
            f"{path}: truncated ({size} bytes, the shard index alone needs {index_bytes})"
        )
    raw = _pread_exact(fd, index_bytes, size - index_bytes, path)
    return parse_index(raw, path, n_chunks, crc, size - index_bytes)


def parse_index(raw: bytes, path: str, n_chunks: int, crc: bool, limit: int | None):
    """The shard index from its bytes (crc32c included), validated; ``limit``: where the data
    ends (None: unknown, reads past the end fail later)."""
    if crc:
        (stored,) = struct.unpack("<I", raw[-4:])
        if crc32c_lib.crc32c(raw[:-4]) != stored:
            raise ShardReadError(f"{path}: crc32c checksum mismatch in the shard index (corrupt)")
        raw = raw[:-4]
    index = np.frombuffer(raw, "<u8").reshape(n_chunks, 2)
    missing = index[:, 0] == _MISSING
    if missing.any():
        i = int(np.argmax(missing))
        raise ShardReadError(
            f"{path}: inner chunk {i} was never written (the shard is incomplete; jax_ucp never "
            f"reads missing data as fill values)"
        )
    past = limit is not None and (index[:, 0] + index[:, 1] > limit).any()
    if past or (index[:, 1] < (4 if crc else 0)).any():
        raise ShardReadError(f"{path}: shard index points past the data (truncated or corrupt)")
    return index


def index_offset(inner_chunk_shape, dtype, n_chunks: int, compression: str | None) -> int | None:
    """Where the shard index starts in a shard with crc32c chunks, when the layout fixes it
    (uncompressed, whole-byte dtype: every chunk its bytes + 4); else None."""
    dtype = np.dtype(dtype)
    if compression is not None or not _encodable_dtype(dtype):
        return None
    return n_chunks * (math.prod(inner_chunk_shape) * dtype.itemsize + 4)


def object_digest(kvstore, key: str, n_chunks: int, where: str, data_bytes: int | None) -> str:
    """The digest of the shard object ``key`` in an object store (a ``tensorstore.KvStore``):
    its index, then the crc32c trailer of every inner chunk, read as byte ranges.

    ``data_bytes``: where the index starts when the layout fixes it (uncompressed chunks); else
    the index is read as the object's suffix, which some servers (the GCS emulator) ignore."""
    found = object_digests([(kvstore, key, n_chunks, where, data_bytes)])[0]
    if isinstance(found, BaseException):
        raise found
    return found


def object_digests(shards) -> list:
    """``object_digest`` of many shard objects ``(kvstore, key, n_chunks, where, data_bytes)``
    at once: every index read is issued together, then every trailer in one batch, so a restore
    waits two round trips for all of them instead of two per object. Each result is the digest,
    or the error (``FileNotFoundError``, ``ShardReadError``) for that object."""
    import tensorstore as ts

    out: list = [None] * len(shards)
    index_reads = []
    for kvstore, key, n_chunks, _, data_bytes in shards:
        index_bytes = n_chunks * 16 + 4
        where_index = (
            slice(-index_bytes, None)
            if data_bytes is None
            else slice(data_bytes, data_bytes + index_bytes)
        )
        index_reads.append(kvstore.read(key, byte_range=where_index))
    trailer_reads = {}
    with ts.Batch() as batch:
        for i, (kvstore, key, n_chunks, where, _) in enumerate(shards):
            try:
                got = index_reads[i].result()
                if got.state == "missing":
                    raise FileNotFoundError(where)
                index = parse_index(bytes(got.value), where, n_chunks, True, None)
            except (ValueError, OSError) as e:
                out[i] = _read_error(e, where)
                continue
            trailer_reads[i] = [
                kvstore.read(key, byte_range=slice(int(o + n - 4), int(o + n)), batch=batch)
                for o, n in index
            ]
    for i, reads in trailer_reads.items():
        where = shards[i][3]
        try:
            trailers = [r.result() for r in reads]
            if any(t.state != "value" or len(t.value) != 4 for t in trailers):
                raise ShardReadError(f"{where}: shard object changed or truncated while read")
            out[i] = digest_of_trailers(b"".join(bytes(t.value) for t in trailers))
        except (ValueError, OSError) as e:
            out[i] = _read_error(e, where)
    return out


def _read_error(e: Exception, where: str) -> Exception:
    if isinstance(e, (FileNotFoundError, ShardReadError)):
        return e
    return ShardReadError(f"{where}: cannot read the shard index or trailers ({e})")


def trailers_digest(fd: int, path: str, index: np.ndarray) -> str:
    """``digest_of_trailers`` of a shard file on disk (one 4-byte pread per inner chunk)."""
    trailers = b"".join(_pread_exact(fd, 4, int(o + n - 4), path) for o, n in index)
    return digest_of_trailers(trailers)


def file_digest(path: str, n_chunks: int) -> str:
    """The digest of the shard file ``path`` (any sharding_indexed layout with crc32c codecs)."""
    fd = files.open_regular(path)
    try:
        return trailers_digest(fd, path, read_index(fd, path, n_chunks, True))
    finally:
        os.close(fd)


def check_digest(path: str, found: str, expected: str | None, tensor: str) -> None:
    if expected is None:
        raise ShardReadError(
            f"Tensor {tensor!r}: {path} is not a shard the manifest lists for it (a stray or "
            f"misplaced file)"
        )
    if found != expected:
        raise ShardReadError(
            f"Tensor {tensor!r}: {path} is not the shard file this checkpoint saved there (digest "
            f"{found}, the manifest says {expected}): swapped with another shard, or left from "
            f"another save"
        )


def layout_from_metadata(metadata: dict, dtype: np.dtype) -> ArrayLayout | None:
    """The ``ArrayLayout`` of a zarr v3 array's metadata if ``ShardReader`` can read it, else None."""
    try:
        shape = tuple(int(d) for d in metadata["shape"])
        grid = metadata["chunk_grid"]
        chunk_shape = tuple(int(c) for c in grid["configuration"]["chunk_shape"])
        key_enc = metadata.get("chunk_key_encoding", {"name": "default"})
        (codec,) = metadata["codecs"]
        cfg = codec["configuration"]
        inner_shape = tuple(int(c) for c in cfg["chunk_shape"])
    except (KeyError, TypeError, ValueError):
        return None
    bytes_le = {"name": "bytes", "configuration": {"endian": "little"}}
    codecs, index_codecs = cfg.get("codecs"), cfg.get("index_codecs")
    if codecs and codecs[0] == {"name": "bytes"} and np.dtype(dtype).itemsize == 1:
        codecs = [bytes_le, *codecs[1:]]  # single-byte types carry no endianness
    if codecs == [bytes_le] and index_codecs == [bytes_le]:
        checksum = None
    elif codecs == [bytes_le, {"name": "crc32c"}] and index_codecs == [
        bytes_le,
        {"name": "crc32c"},
    ]:
        checksum = "crc32c"
    else:
        return None
    if (
        grid.get("name") != "regular"
        or codec.get("name") != "sharding_indexed"
        or cfg.get("index_location", "end") != "end"
        or key_enc.get("name") != "default"
        or key_enc.get("configuration", {}).get("separator", "/") != "/"
        or not shape
        or len(chunk_shape) != len(shape)
        or len(inner_shape) != len(shape)
        or 0 in shape
        or any(s % c for s, c in zip(shape, chunk_shape))
        or not _encodable_dtype(np.dtype(dtype))
        or sys.byteorder != "little"
        or any(c % i for c, i in zip(chunk_shape, inner_shape))
    ):
        return None
    return ArrayLayout(
        shape=shape,
        dtype=str(metadata["data_type"]),
        chunk_shape=chunk_shape,
        inner_chunk_shape=inner_shape,
        checksum=checksum,
    )


_BYTES_READ = [0]  # bytes pread by this process's ShardReaders (see ``bytes_read``)
_BYTES_READ_LOCK = threading.Lock()


def bytes_read() -> int:
    """Bytes this process has read from shard files through ``ShardReader`` (a metric, like
    TensorStore's ``/tensorstore/kvstore/file/bytes_read``, which does not see these reads)."""
    return _BYTES_READ[0]


def _pread_exact(fd: int, n: int, offset: int, path: str) -> bytes:
    data = os.pread(fd, n, offset)
    with _BYTES_READ_LOCK:
        _BYTES_READ[0] += n
    while len(data) < n:  # pread may return less; 0 means end of file
        more = os.pread(fd, n - len(data), offset + len(data))
        if not more:
            raise ShardReadError(
                f"{path}: truncated (needs bytes up to {offset + n}, file ends at "
                f"{offset + len(data)})"
            )
        data += more
    return data


def check_destination(region, out: np.ndarray, shape, dtype) -> tuple[int, ...]:
    """The shape of ``region`` ((start, stop) per dimension of a tensor of ``shape``), once
    ``out`` is checked to be a writable C-contiguous ``dtype`` array of it: what every reader's
    ``read_into`` reads straight into."""
    want = tuple(b - a for a, b in region)
    if (
        len(region) != len(shape)
        or tuple(out.shape) != want
        or out.dtype != dtype
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        raise ValueError(
            f"read_into: region {region} needs a writable C-contiguous {dtype} "
            f"array of shape {want}, got {out.dtype} {tuple(out.shape)}"
        )
    return want


def _preadv_exact(fd: int, buffers: list, offset: int, path: str) -> None:
    """Fills ``buffers`` (writable, contiguous bytes) with the file's bytes from ``offset`` on:
    one ``preadv`` straight into them (no intermediate bytes object), repeated for whatever the
    kernel left unfilled."""
    rest = [memoryview(b).cast("B") for b in buffers]
    total = sum(v.nbytes for v in rest)
    position = offset
    while rest:
        got = os.preadv(fd, rest, position)
        if not got:
            raise ShardReadError(
                f"{path}: truncated (needs bytes up to {offset + total}, file ends at {position})"
            )
        position += got
        unfilled = []
        for v in rest:
            if got >= v.nbytes:
                got -= v.nbytes
            else:
                unfilled.append(v[got:])
                got = 0
        rest = unfilled
    with _BYTES_READ_LOCK:
        _BYTES_READ[0] += total


_SCRATCH = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """This thread's reusable read buffer (a chunk that is copied on, not kept)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _SCRATCH.buf = np.empty(nbytes, np.uint8)
    return buf[:nbytes]


def _contiguous_within(box, region) -> bool:
    """Whether ``box`` lies inside ``region`` as one consecutive byte range of a C-ordered array
    holding ``region`` (leading extents 1, then one partial dimension, then whole ones)."""
    if any(s < a or e > b for (s, e), (a, b) in zip(box, region)):
        return False
    extent = [e - s for s, e in box]
    full = [b - a for a, b in region]
    cut = next((d for d, n in enumerate(extent) if n != 1), len(extent))
    return all(extent[d] == full[d] for d in range(cut + 1, len(extent)))


class ShardReader:
    """Regions of one stored array, read like ``tensorstore.TensorStore[index].read()``."""

    def __init__(
        self,
        array_dir: str,
        layout: ArrayLayout,
        dtype: np.dtype,
        *,
        digests: Mapping[str, str] | None = None,
        tensor: str = "",
    ):
        """``digests``: shard key -> digest from the manifest; each shard file read is checked
        against it (None: no identity check, e.g. arrays saved without checksums)."""
        self.array_dir, self.layout, self.dtype = array_dir, layout, np.dtype(dtype)
        self.digests, self.tensor = digests, tensor
        self._verified: set[str] = set()
        # Per shard: its index and the crc32c trailers of the chunks read so far. A shard's
        # digest is checked once its reads are done, from these trailers (plus a 4-byte pread
        # for each chunk no read needed): whole-shard reads cost no extra I/O.
        self._seen: dict[str, tuple[str, np.ndarray, dict[int, bytes]]] = {}
        self.shape = layout.shape
        self._inner = layout.inner_chunk_shape
        self._inner_grid = tuple(s // c for s, c in zip(layout.chunk_shape, self._inner))
        self._n_inner = math.prod(self._inner_grid)
        self._chunk_bytes = math.prod(self._inner) * self.dtype.itemsize
        self._crc = layout.checksum == "crc32c"

    def __getitem__(self, index) -> _Region:
        if not isinstance(index, tuple):
            index = (index,)
        region = []
        for sl, n in zip(index, self.shape):
            start, stop, step = sl.indices(n)
            if step != 1:
                raise ValueError("ShardReader reads contiguous regions only")
            region.append((start, max(start, stop)))
        region += [(0, n) for n in self.shape[len(region) :]]
        return _Region(self, tuple(region))

    def read(self) -> concurrent.futures.Future:
        return _Region(self, tuple((0, n) for n in self.shape)).read()

    def _checks_digests(self) -> bool:
        return self.digests is not None and self._crc

    def _shard_index(self, fd: int, path: str, key: str) -> np.ndarray:
        index = read_index(fd, path, self._n_inner, self._crc)
        if self._checks_digests() and key not in self._verified:
            if self.digests.get(key) is None:  # a file the manifest does not list: refuse early
                check_digest(path, "", None, self.tensor)
            self._seen.setdefault(key, (path, index, {}))
        return index

    def verify_digests(self, keys) -> None:
        """Checks the digest of each shard in ``keys`` that has been read and not yet checked."""
        if not self._checks_digests():
            return
        for key in keys:
            if key in self._verified or key not in self._seen:
                continue
            path, index, trailers = self._seen[key]
            missing = [i for i in range(len(index)) if i not in trailers]
            if missing:
                fd = files.open_regular(path)
                try:
                    for i in missing:
                        off, nbytes = (int(x) for x in index[i])
                        trailers[i] = _pread_exact(fd, 4, off + nbytes - 4, path)
                finally:
                    os.close(fd)
            found = digest_of_trailers(b"".join(trailers[i] for i in range(len(index))))
            check_digest(path, found, self.digests.get(key), self.tensor)
            self._verified.add(key)

    def _read_chunk(
        self, fd: int, index: np.ndarray, i: int, path: str, key: str = "", into=None
    ) -> np.ndarray:
        """Inner chunk ``i``, its crc32c checked: read straight into ``into`` (a C-contiguous
        view of the chunk's shape) when given, else into this thread's scratch buffer (valid
        until the thread's next read)."""
        off, nbytes = (int(x) for x in index[i])
        want = self._chunk_bytes + (4 if self._crc else 0)
        if nbytes != want:
            raise ShardReadError(
                f"{path}: inner chunk {i} holds {nbytes} bytes, expected {want} (corrupt)"
            )
        if into is None:
            raw = _scratch(self._chunk_bytes)
            chunk = raw.view(self.dtype).reshape(self._inner)
        else:
            chunk, raw = into, into.reshape(-1).view(np.uint8)
        if self._crc:
            trailer = bytearray(4)
            _preadv_exact(fd, [raw, trailer], off, path)
            (stored,) = struct.unpack("<I", trailer)
            if crc32c_lib.crc32c(raw) != stored:
                raise ShardReadError(
                    f"{path}: crc32c checksum mismatch in inner chunk {i} (the data is corrupt)"
                )
            seen = self._seen.get(key)
            if seen is not None:
                seen[2][i] = bytes(trailer)
        else:
            _preadv_exact(fd, [raw], off, path)
        return chunk

    def read_into(self, dests) -> RegionRead:
        """Reads each region into its array: ``dests`` is a list of (region, out), region
        ``((start, stop), ...)`` per dimension and out a C-contiguous array of this reader's
        dtype and the region's shape (e.g. one per device, allocated by the caller).

        Every inner chunk is read once however many regions need it; one wholly inside a region,
        as a consecutive range of it, is read straight into that region's array (no copy)."""
        for region, out in dests:
            check_destination(region, out, self.shape, self.dtype)
        return RegionRead(self, list(dests))

    def _tasks(self, regions) -> list[tuple[tuple[int, ...], list]]:
        """(shard position, inner-chunk positions) batches covering every region, each chunk
        once: the units read in parallel (a batch is at most ~``_BATCH_BYTES``, so one big shard
        is not one thread)."""
        outer = self.layout.chunk_shape
        per_batch = max(1, _BATCH_BYTES // max(1, self._chunk_bytes))
        wanted: dict[tuple[int, ...], set] = {}
        for region in regions:
            if any(b <= a for a, b in region):
                continue
            shard_ranges = [range(a // c, (b - 1) // c + 1) for (a, b), c in zip(region, outer)]
            for pos in itertools.product(*shard_ranges):
                base = [p * c for p, c in zip(pos, outer)]
                lo = [max(a, b0) - b0 for (a, _), b0 in zip(region, base)]  # shard-local region
                hi = [min(b, b0 + c) - b0 for (_, b), b0, c in zip(region, base, outer)]
                ranges = [
                    range(lo_ // c, (h - 1) // c + 1) for lo_, h, c in zip(lo, hi, self._inner)
                ]
                wanted.setdefault(pos, set()).update(itertools.product(*ranges))
        tasks = []
        for pos in sorted(wanted):
            chunks = sorted(wanted[pos])  # file order
            for k in range(0, len(chunks), per_batch):
                tasks.append((pos, chunks[k : k + per_batch]))
        return tasks

    def _read_part(self, pos, chunks, dests) -> None:
        """Reads the inner chunks ``chunks`` of shard ``pos`` into their parts of every
        destination (region, out) they overlap."""
        key = shard_key(pos)
        path = os.path.join(self.array_dir, *key.split("/"))
        try:
            fd = files.open_regular(path)
        except FileNotFoundError:
            raise ShardReadError(
                f"{path}: shard file missing (the checkpoint is incomplete)"
            ) from None
        except files.UnsafeFileError as e:
            raise ShardReadError(str(e)) from None
        try:
            index = self._shard_index(fd, path, key)
            base = [p * c for p, c in zip(pos, self.layout.chunk_shape)]
            for cpos in chunks:
                i = int(np.ravel_multi_index(cpos, self._inner_grid))
                start = [b0 + p * c for b0, p, c in zip(base, cpos, self._inner)]  # global
                box = tuple((s, s + c) for s, c in zip(start, self._inner))
                hits = [
                    (region, out)
                    for region, out in dests
                    if all(a < e and s < b for (a, b), (s, e) in zip(region, box))
                ]
                direct = next((d for d in hits if _contiguous_within(box, d[0])), None)
                into = None
                if direct is not None:
                    region, out = direct
                    into = out[tuple(slice(s - a, e - a) for (a, _), (s, e) in zip(region, box))]
                    if not into.flags.c_contiguous:  # never read into a reshaped copy
                        direct = into = None
                chunk = self._read_chunk(fd, index, i, path, key, into=into)
                for region, out in hits:
                    if direct is not None and out is direct[1]:
                        continue
                    src = tuple(
                        slice(max(a, s) - s, min(b, e) - s) for (a, b), (s, e) in zip(region, box)
                    )
                    dst = tuple(
                        slice(max(a, s) - a, min(b, e) - a) for (a, b), (s, e) in zip(region, box)
                    )
                    out[dst] = chunk[src]
        finally:
            os.close(fd)


_BATCH_BYTES = 16 << 20


class RegionRead:
    """The pending read of regions into their arrays: its parts run on the read pool, in
    parallel; ``result()`` is ``out`` (the array of a single-region read) once all are done."""

    def __init__(self, reader: ShardReader, dests: list, out: np.ndarray | None = None):
        self.out = out
        self._reader = reader
        pool = read_pool()
        tasks = reader._tasks([region for region, _ in dests])
        self._keys = sorted({shard_key(pos) for pos, _ in tasks})
        self._parts = [pool.submit(reader._read_part, pos, chunks, dests) for pos, chunks in tasks]

    def result(self) -> np.ndarray | None:
        errors = []
        for part in self._parts:  # wait for every part: none may still write into ``out``
            try:
                part.result()
            except Exception as e:  # noqa: BLE001 - the first is raised below
                errors.append(e)
        if errors:
            raise errors[0]
        self._reader.verify_digests(self._keys)
        return self.out


class _Region:
    def __init__(self, reader: ShardReader, region: tuple[tuple[int, int], ...]):
        self.reader, self.region = reader, region

    def read(self) -> RegionRead:
        out = np.empty(tuple(b - a for a, b in self.region), self.reader.dtype)
        return RegionRead(self.reader, [(self.region, out)], out)


_READ_POOL: list[concurrent.futures.ThreadPoolExecutor] = []


def read_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for region reads: a cold restore waits on the disk in pread, so it wants more reads
    in flight than cores (TensorStore allows 128 file operations)."""
    if not _READ_POOL:
        threads = max(16, 4 * (os.cpu_count() or 2))
        _READ_POOL.append(
            concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="ucp-read")
        )
    return _READ_POOL[0]
