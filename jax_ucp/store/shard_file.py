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


def can_write(layout: ArrayLayout, data, kvstore: dict) -> bool:
    """Whether ``data`` (one whole shard) can be written here instead of by TensorStore."""
    return (
        kvstore.get("driver") == "file"
        and sys.byteorder == "little"
        and layout.compression is None
        and layout.checksum in (None, "crc32c")
        and isinstance(data, np.ndarray)
        and data.ndim >= 1
        and data.size > 0
        and tuple(data.shape) == tuple(layout.chunk_shape)
        and _encodable_dtype(data.dtype)
        and chunks_are_contiguous(layout.chunk_shape, layout.inner_chunk_shape)
    )


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
    if crc:
        (stored,) = struct.unpack("<I", raw[-4:])
        if crc32c_lib.crc32c(raw[:-4]) != stored:
            raise ShardReadError(f"{path}: crc32c checksum mismatch in the shard index (corrupt)")
        raw = raw[:-4]
    index = np.frombuffer(raw, "<u8").reshape(n_chunks, 2)
    limit = size - index_bytes
    missing = index[:, 0] == _MISSING
    if missing.any():
        i = int(np.argmax(missing))
        raise ShardReadError(
            f"{path}: inner chunk {i} was never written (the shard is incomplete; jax_ucp never "
            f"reads missing data as fill values)"
        )
    if (index[:, 0] + index[:, 1] > limit).any() or (index[:, 1] < (4 if crc else 0)).any():
        raise ShardReadError(f"{path}: shard index points past the data (truncated or corrupt)")
    return index


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
        self, fd: int, index: np.ndarray, i: int, path: str, key: str = ""
    ) -> np.ndarray:
        off, nbytes = (int(x) for x in index[i])
        want = self._chunk_bytes + (4 if self._crc else 0)
        if nbytes != want:
            raise ShardReadError(
                f"{path}: inner chunk {i} holds {nbytes} bytes, expected {want} (corrupt)"
            )
        raw = _pread_exact(fd, nbytes, off, path)
        if self._crc:
            data = memoryview(raw)[:-4]
            (stored,) = struct.unpack("<I", raw[-4:])
            if crc32c_lib.crc32c(data) != stored:
                raise ShardReadError(
                    f"{path}: crc32c checksum mismatch in inner chunk {i} (the data is corrupt)"
                )
            seen = self._seen.get(key)
            if seen is not None:
                seen[2][i] = raw[-4:]
        else:
            data = memoryview(raw)
        return np.frombuffer(data, self.dtype).reshape(self._inner)

    def read_region(self, region: tuple[tuple[int, int], ...]) -> np.ndarray:
        """``region`` ((start, stop) per dimension) as a new array, read in this thread."""
        out = np.empty(tuple(b - a for a, b in region), self.dtype)
        tasks = self._tasks(region)
        for task in tasks:
            self._read_part(*task, region, out)
        self.verify_digests({shard_key(pos) for pos, _ in tasks})
        return out

    def _tasks(self, region) -> list[tuple[tuple[int, ...], list]]:
        """(shard position, inner-chunk positions) batches covering ``region``: the units read
        in parallel (a batch is at most ~``_BATCH_BYTES``, so one big shard is not one thread)."""
        if any(b <= a for a, b in region):
            return []
        outer = self.layout.chunk_shape
        per_batch = max(1, _BATCH_BYTES // max(1, self._chunk_bytes))
        tasks = []
        shard_ranges = [range(a // c, (b - 1) // c + 1) for (a, b), c in zip(region, outer)]
        for pos in itertools.product(*shard_ranges):
            base = [p * c for p, c in zip(pos, outer)]
            lo = [max(a, b0) - b0 for (a, _), b0 in zip(region, base)]  # shard-local region
            hi = [min(b, b0 + c) - b0 for (_, b), b0, c in zip(region, base, outer)]
            ranges = [range(lo_ // c, (h - 1) // c + 1) for lo_, h, c in zip(lo, hi, self._inner)]
            chunks = list(itertools.product(*ranges))
            for k in range(0, len(chunks), per_batch):
                tasks.append((pos, chunks[k : k + per_batch]))
        return tasks

    def _read_part(self, pos, chunks, region, out: np.ndarray) -> None:
        """Reads the inner chunks ``chunks`` of shard ``pos`` into their part of ``out``."""
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
                chunk = self._read_chunk(fd, index, i, path, key)
                start = [b0 + p * c for b0, p, c in zip(base, cpos, self._inner)]  # global
                src = tuple(
                    slice(max(a, s) - s, min(b, s + c) - s)
                    for (a, b), s, c in zip(region, start, self._inner)
                )
                dst = tuple(
                    slice(max(a, s) - a, min(b, s + c) - a)
                    for (a, b), s, c in zip(region, start, self._inner)
                )
                out[dst] = chunk[src]
        finally:
            os.close(fd)


_BATCH_BYTES = 16 << 20


class RegionRead:
    """The pending read of one region: its parts run on the read pool, in parallel."""

    def __init__(self, reader: ShardReader, region: tuple[tuple[int, int], ...]):
        self.out = np.empty(tuple(b - a for a, b in region), reader.dtype)
        self._reader = reader
        pool = read_pool()
        tasks = reader._tasks(region)
        self._keys = sorted({shard_key(pos) for pos, _ in tasks})
        self._parts = [
            pool.submit(reader._read_part, pos, chunks, region, self.out) for pos, chunks in tasks
        ]

    def result(self) -> np.ndarray:
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
        return RegionRead(self.reader, self.region)


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
