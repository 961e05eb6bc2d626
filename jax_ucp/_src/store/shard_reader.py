"""Reads regions of zarr v3 arrays whose shards have ``shard_file``'s layout (its docstring says
why), and checks each shard file's digest against the manifest; anything else is read by
TensorStore."""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import math
import os
import struct
import threading
from collections.abc import Callable, Mapping

import crc32c as crc32c_lib
import numpy as np

from jax_ucp._src.errors import CheckpointError, SourceError, tensorstore_message
from jax_ucp._src.format import files, mapped_file
from jax_ucp._src.store.shard_file import check_digest, digest_of_trailers, parse_index, shard_key
from jax_ucp._src.store.storage.ranged import size_when_short
from jax_ucp._src.store.zarr3 import ArrayLayout


def read_index(fd: int, path: str, n_chunks: int, crc: bool) -> np.ndarray:
    """The ``[offset, nbytes]`` index (index_location end) of a shard file, validated.

    Args:
        fd: the open shard file
        path: its path, for messages
        n_chunks: inner chunks in the shard
        crc: the index carries a crc32c
    """
    size = os.fstat(fd).st_size
    index_bytes = n_chunks * 16 + (4 if crc else 0)
    if size < index_bytes:
        raise CheckpointError(
            f"{path}: truncated ({size} bytes, the shard index alone needs {index_bytes})"
        )
    raw = _pread_exact(fd, index_bytes, size - index_bytes, path)
    return parse_index(raw, path, n_chunks, crc, size - index_bytes)


def object_digests(shards) -> list:
    """The digests of shard objects ``(kvstore, key, n_chunks, where, data_bytes)`` in an object
    store (a ``tensorstore.KvStore``): each its index, then the crc32c trailer of every inner
    chunk, read as byte ranges. ``data_bytes``: where the index starts when the layout fixes it
    (uncompressed chunks); else it is read as the object's suffix, which some servers (the GCS
    emulator) ignore. Every index read is issued together, then every trailer in one batch, so a
    restore waits two round trips for all of them instead of two per object (one, and one GET
    per object, where the layout is fixed and a shard holds one inner chunk: the trailer before
    the index is read with it). Each result is the
    digest, or the error (``FileNotFoundError``, ``CheckpointError``) for that object."""
    import tensorstore as ts

    out: list = [None] * len(shards)
    index_reads = []
    for kvstore, key, n_chunks, _, data_bytes in shards:
        index_bytes = n_chunks * 16 + 4
        # a fixed layout: the 4 bytes before the index too, the trailer of the chunk ending
        # there (the last one written): one GET fewer per object, none more for one chunk
        lead = 4 if data_bytes is not None and data_bytes >= 4 else 0
        where_index = (
            slice(-index_bytes, None)
            if data_bytes is None
            else slice(data_bytes - lead, data_bytes + index_bytes)
        )
        index_reads.append((kvstore.read(key, byte_range=where_index), lead))
    trailer_reads = {}
    with ts.Batch() as batch:
        for i, (kvstore, key, n_chunks, where, data_bytes) in enumerate(shards):
            try:
                got = index_reads[i][0].result()
                if got.state == "missing":
                    raise FileNotFoundError(where)
                lead = index_reads[i][1]
                index = parse_index(bytes(got.value)[lead:], where, n_chunks, True, None)
            except (ValueError, OSError) as e:
                out[i] = _read_error(e, where)
                continue
            trailer_reads[i] = [
                bytes(got.value)[:4]
                if lead and o + n == data_bytes
                else kvstore.read(key, byte_range=slice(int(o + n - 4), int(o + n)), batch=batch)
                for o, n in index
            ]
    for i, reads in trailer_reads.items():
        where = shards[i][3]
        try:
            got = [r if isinstance(r, bytes) else r.result() for r in reads]
            if any(not isinstance(t, bytes) and t.state != "value" for t in got):
                raise CheckpointError(f"{where}: shard object changed or truncated while read")
            trailers = [t if isinstance(t, bytes) else bytes(t.value) for t in got]
            if any(len(t) != 4 for t in trailers):
                raise CheckpointError(f"{where}: shard object changed or truncated while read")
            out[i] = digest_of_trailers(b"".join(trailers))
        except (ValueError, OSError) as e:
            out[i] = _read_error(e, where)
    return out


def _read_error(e: Exception, where: str) -> Exception:
    if isinstance(e, (FileNotFoundError, CheckpointError)):
        return e
    if isinstance(e, ValueError) and "OUT_OF_RANGE" in str(e):  # past the object's end
        try:
            size = size_when_short(e, where)
        except SourceError as answered:  # another range than asked: named there
            return answered
        held = "" if size is None else f"it holds {size} bytes: "
        return CheckpointError(
            f"{where}: shorter than this checkpoint's save wrote it ({held}cut short, or "
            f"replaced by another object)"
        )
    return CheckpointError(
        f"{where}: cannot read the shard index or trailers ({tensorstore_message(e)})"
    )


def file_digest(path: str, n_chunks: int) -> str:
    """The digest of the shard file ``path`` (any sharding_indexed layout with crc32c codecs)."""
    fd = files.open_regular(path)
    try:
        index = read_index(fd, path, n_chunks, True)
        trailers = (_pread_exact(fd, 4, int(o + n - 4), path) for o, n in index)
        return digest_of_trailers(b"".join(trailers))
    finally:
        os.close(fd)


_BYTES_READ = [0]  # bytes pread by this process's own readers (see ``bytes_read``)


_BYTES_READ_LOCK = threading.Lock()


def bytes_read() -> int:
    """Bytes this process has read from checkpoint files through jax_ucp's own readers
    (``ShardReader``, an import read in place): a metric, like TensorStore's
    ``/tensorstore/kvstore/file/bytes_read``, which does not see these reads."""
    return _BYTES_READ[0]


def count_bytes_read(n: int) -> None:
    """Adds ``n`` bytes read by one of jax_ucp's own readers to ``bytes_read``."""
    with _BYTES_READ_LOCK:
        _BYTES_READ[0] += n


def _pread_exact(fd: int, n: int, offset: int, path: str) -> bytes:
    out = bytearray(n)
    _preadv_exact(fd, [out], offset, path)
    return bytes(out)


def row_blocks(dests, per_block: int) -> list[tuple[int, int]]:
    """Blocks of at most ``per_block`` whole rows covering the union of the destinations' row
    ranges (``region[0]`` of each ``(region, out)``), so each row is read once."""
    merged: list[list[int]] = []
    for a, b in sorted(region[0] for region, _ in dests):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(r, min(r + per_block, b)) for a, b in merged for r in range(a, b, per_block)]


def check_destination(region, out: np.ndarray, shape, dtype) -> tuple[int, ...]:
    """The shape of ``region`` ((start, stop) per dimension of a tensor of ``shape``), once
    ``out`` is checked to be a writable C-contiguous ``dtype`` array of it: what every reader's
    ``read_into`` reads straight into.

    Args:
        region: ``(start, stop)`` per dimension
        out: the array to read into
        shape: the tensor's shape
        dtype: the tensor's dtype
    """
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
    """Fills ``buffers`` with the file's bytes from ``offset`` on, no intermediate copy."""
    total = sum(memoryview(b).nbytes for b in buffers)
    got = mapped_file.preadv_full(fd, buffers, offset)
    count_bytes_read(got)
    if got < total:
        raise CheckpointError(
            f"{path}: truncated (needs bytes up to {offset + total}, file ends at {offset + got})"
        )


_SCRATCH = threading.local()


def scratch(nbytes: int) -> np.ndarray:
    """This thread's reusable read buffer (for bytes copied on, not kept): a chunk, a block of
    rows cut into their regions."""
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
        root: str | None = None,
        objects: tuple | None = None,
        check: Callable[[], object] | None = None,
    ):
        """``digests``: shard key -> digest from the manifest; each shard file read is checked
        against it (None: no identity check, e.g. arrays saved without checksums). ``root``:
        the checkpoint folder every shard file must resolve inside (default ``array_dir``).
        ``objects``: ``(kvstore, prefix)``, an object store's ``tensorstore.KvStore`` and the
        array's names' prefix: shards are objects read by ranged GETs (``array_dir`` then only
        names them in messages; crc32c and ``digests`` required). ``check``: raises if the array
        may not be read (its ``zarr.json`` unlike the manifest), run before any result is returned."""
        self.array_dir, self.layout, self.dtype = array_dir, layout, np.dtype(dtype)
        self.objects, self.check = objects, check
        self.root = array_dir if root is None else root
        self.digests, self.tensor = digests, tensor
        self._verified: set[str] = set()
        self._inside: set[str] = set()  # shard keys found to resolve inside ``array_dir``
        # Per shard: its index and the crc32c trailers of the chunks read so far. A shard's
        # digest is checked once its reads are done, from these trailers (plus a 4-byte pread
        # for each chunk no read needed): whole-shard reads cost no extra I/O.
        self._seen: dict[str, tuple[str, np.ndarray | None, dict[int, bytes]]] = {}
        self.shape = layout.shape
        self._inner = layout.inner_chunk_shape
        self._inner_grid = tuple(s // c for s, c in zip(layout.chunk_shape, self._inner))
        self._n_inner = math.prod(self._inner_grid)
        self._chunk_bytes = math.prod(self._inner) * self.dtype.itemsize
        self._crc = layout.checksum == "crc32c"

    def __getitem__(self, index) -> _Region:
        """The region ``index`` selects (contiguous slices only), read by its ``read()``."""
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

    def read(self) -> RegionRead:
        """The whole array, like ``tensorstore.TensorStore.read()``."""
        return _Region(self, tuple((0, n) for n in self.shape)).read()

    def _checks_digests(self) -> bool:
        return self.digests is not None and self._crc

    def _shard_index(self, fd: int, path: str, key: str) -> np.ndarray:
        index = read_index(fd, path, self._n_inner, self._crc)
        if self._checks_digests() and key not in self._verified:
            if (self.digests or {}).get(key) is None:  # not listed in the manifest: refuse early
                check_digest(path, "", None, self.tensor)
            self._seen.setdefault(key, (path, index, {}))
        return index

    def verify_digests(self, keys) -> None:
        """Checks the digest of each shard in ``keys`` that has been read and not yet checked."""
        if not self._checks_digests():
            return
        keys = [k for k in keys if k not in self._verified and k in self._seen]
        if self.objects is not None:
            self._fetch_rest(keys)
        for key in keys:
            path, index, trailers = self._seen[key]
            missing = [i for i in range(self._n_inner) if i not in trailers]
            if missing and index is not None:
                fd = files.open_regular(path)
                try:
                    for i in missing:
                        off, nbytes = (int(x) for x in index[i])
                        trailers[i] = _pread_exact(fd, 4, off + nbytes - 4, path)
                finally:
                    os.close(fd)
            found = digest_of_trailers(b"".join(trailers[i] for i in range(self._n_inner)))
            check_digest(path, found, (self.digests or {}).get(key), self.tensor)
            self._verified.add(key)

    def _fetch_rest(self, keys) -> None:
        """The trailers and index of shard objects ``keys`` their chunk reads did not fetch, as
        ranged GETs all issued at once (the last chunk's trailer with the index)."""
        kv, prefix = self.objects  # type: ignore  # an object store's reader only
        step, last = self._chunk_bytes + 4, self._n_inner - 1
        pending = []
        for key in keys:
            where, index, trailers = self._seen[key]
            if index is None:
                at = slice(last * step + step - 4, self._end(self._n_inner))
                pending.append((key, None, at, kv.read(prefix + key, byte_range=at)))
            for i in range(self._n_inner):
                if i not in trailers and (i != last or index is not None):
                    at = slice((i + 1) * step - 4, (i + 1) * step)
                    pending.append((key, i, at, kv.read(prefix + key, byte_range=at)))
        for key, i, at, future in pending:
            where, _, trailers = self._seen[key]
            raw = self._object_bytes(future, where, at.stop - at.start)
            if i is None:
                self._check_object_index(key, memoryview(raw)[4:])
                trailers.setdefault(last, bytes(raw[:4]))
            else:
                trailers[i] = bytes(raw)

    def _read_chunk(
        self, fd: int, index: np.ndarray, i: int, path: str, key: str = "", into=None
    ) -> np.ndarray:
        """Inner chunk ``i``, its crc32c checked: read straight into ``into`` (a C-contiguous
        view of the chunk's shape) when given, else into this thread's scratch buffer (valid
        until the thread's next read)."""
        off, nbytes = (int(x) for x in index[i])
        want = self._chunk_bytes + (4 if self._crc else 0)
        if nbytes != want:
            raise CheckpointError(
                f"{path}: inner chunk {i} holds {nbytes} bytes, expected {want} (corrupt)"
            )
        if into is None:
            raw = scratch(self._chunk_bytes)
            chunk = raw.view(self.dtype).reshape(self._inner)
        else:
            chunk, raw = into, into.reshape(-1).view(np.uint8)
        if self._crc:
            trailer = bytearray(4)
            _preadv_exact(fd, [raw, trailer], off, path)
            (stored,) = struct.unpack("<I", trailer)
            if crc32c_lib.crc32c(raw.data) != stored:
                raise CheckpointError(
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
        if self.objects is not None:
            ids = [int(np.ravel_multi_index(c, self._inner_grid)) for c in chunks]
            return self._place(pos, chunks, dests, self._fetch_chunks(key, path, ids))
        try:
            if key not in self._inside:  # a shard file linked out of its array is never read
                rel = os.path.relpath(path, self.root)
                files.inside(self.root, rel, f"tensor {self.tensor!r}: shard file")
                self._inside.add(key)
            fd = files.open_regular(path)
        except FileNotFoundError:
            raise CheckpointError(
                f"{path}: shard file missing (the checkpoint is incomplete)"
            ) from None
        except files.UnsafeFileError as e:
            raise CheckpointError(str(e)) from None
        try:
            index = self._shard_index(fd, path, key)
            self._place(
                pos, chunks, dests, lambda i, into: self._read_chunk(fd, index, i, path, key, into)
            )
        finally:
            os.close(fd)

    def _place(self, pos, chunks, dests, read) -> None:
        """Each inner chunk of ``chunks`` (of shard ``pos``) read by ``read(i, into)`` into
        its parts of every destination: straight into one wholly holding it, when one does."""
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
            chunk = read(i, into)
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

    def _fetch_chunks(self, key: str, where: str, ids: list[int]):
        """An object store's inner chunks ``ids`` of shard ``key``: one ranged GET per run of
        consecutive chunks, trailers included (the index too, when the run ends the shard),
        issued at once; returns ``read(i, into)`` for ``_place``, each chunk's crc32c checked
        and its trailer kept for the shard's digest (``verify_digests``)."""
        kv, prefix = self.objects  # type: ignore  # an object store's reader only
        step = self._chunk_bytes + 4
        if (self.digests or {}).get(key) is None:  # not listed in the manifest: refuse early
            check_digest(where, "", None, self.tensor)
        runs: list[list[int]] = []
        for i in ids:
            if runs and runs[-1][1] == i:
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1])
        data_bytes = self._n_inner * step
        pending = [
            (a, b, kv.read(prefix + key, byte_range=slice(a * step, self._end(b)))) for a, b in runs
        ]
        seen = self._seen.setdefault(key, (where, None, {}))
        held = {}
        for a, b, future in pending:
            raw = memoryview(self._object_bytes(future, where, self._end(b) - a * step))
            if b == self._n_inner:
                self._check_object_index(key, raw[data_bytes - a * step :])
            for i in range(a, b):
                held[i] = raw[(i - a) * step : (i - a + 1) * step]

        def read(i: int, into) -> np.ndarray:
            raw = held.pop(i)
            (stored,) = struct.unpack("<I", raw[-4:])
            if crc32c_lib.crc32c(raw[:-4]) != stored:
                raise CheckpointError(
                    f"{where}: crc32c checksum mismatch in inner chunk {i} (the data is corrupt)"
                )
            seen[2][i] = bytes(raw[-4:])
            chunk = np.frombuffer(raw[:-4], self.dtype).reshape(self._inner)
            if into is None:
                return chunk
            into[...] = chunk
            return into

        return read

    def _end(self, b: int) -> int:
        """Where a ranged GET of an object's chunks up to ``b`` ends: the index included when
        ``b`` is the last chunk (one GET reads a whole shard, index and all)."""
        return b * (self._chunk_bytes + 4) + (self._n_inner * 16 + 4 if b == self._n_inner else 0)

    def _object_bytes(self, future, where: str, want: int) -> bytes:
        try:
            got = future.result()
        except (ValueError, OSError) as e:
            raise _read_error(e, where) from None
        if got.state != "value":
            raise CheckpointError(
                f"Tensor {self.tensor!r}: shard object {where} is missing (the checkpoint is "
                f"incomplete)."
            )
        if len(got.value) != want:
            raise CheckpointError(f"{where}: truncated ({want} bytes asked, {len(got.value)} read)")
        return got.value

    def _check_object_index(self, key: str, raw) -> None:
        """An object's index, read with its last chunks: what its fixed layout says (chunk
        after chunk, each its bytes and crc32c), else the object is not this checkpoint's."""
        where, _, trailers = self._seen[key]
        step = self._chunk_bytes + 4
        index = parse_index(bytes(raw), where, self._n_inner, True, None)
        if (
            not (index[:, 1] == step).all()
            or not (index[:, 0] == np.arange(self._n_inner) * step).all()
        ):
            raise CheckpointError(
                f"{where}: its shard index does not place the chunks one after another as this "
                f"array's layout does (corrupt, or not written by this checkpoint's save)"
            )
        self._seen[key] = (where, index, trailers)


_BATCH_BYTES = 16 << 20


class PendingReads:
    """Reads running on the read pool, in parallel: ``result()`` waits for every one (none may
    still write into an array when it returns), then raises the first error."""

    def __init__(self, parts: list[concurrent.futures.Future]):
        self._parts = parts

    def result(self) -> np.ndarray | None:
        """Waits for every read; raises the first error."""
        errors = []
        for part in self._parts:
            try:
                part.result()
            except Exception as e:  # the first is raised below
                errors.append(e)
        if errors:
            raise errors[0]
        return None


class RegionRead(PendingReads):
    """The pending read of regions into their arrays; ``result()`` then checks the shard
    digests and is ``out`` (the array of a single-region read)."""

    def __init__(self, reader: ShardReader, dests: list, out: np.ndarray | None = None):
        self.out = out
        self._reader = reader
        pool = read_pool()
        tasks = reader._tasks([region for region, _ in dests])
        self._keys = sorted({shard_key(pos) for pos, _ in tasks})
        super().__init__(
            [pool.submit(reader._read_part, pos, chunks, dests) for pos, chunks in tasks]
        )

    def result(self) -> np.ndarray | None:
        """Waits for every part; raises the reader's ``check``'s error, the first part's, a digest's."""
        try:
            super().result()
        finally:  # its error first: what the reads found does not matter if the array is refused
            if self._reader.check is not None:
                self._reader.check()
        self._reader.verify_digests(self._keys)
        return self.out


class _Region:
    def __init__(self, reader: ShardReader, region: tuple[tuple[int, int], ...]):
        self.reader, self.region = reader, region

    def read(self) -> RegionRead:
        out = np.empty(tuple(b - a for a, b in self.region), self.reader.dtype)
        return RegionRead(self.reader, [(self.region, out)], out)


@functools.cache
def read_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for region reads: a cold restore waits on the disk in pread, so it wants more reads
    in flight than cores (TensorStore allows 128 file operations)."""
    threads = max(16, 4 * (os.cpu_count() or 2))
    return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="ucp-read")
