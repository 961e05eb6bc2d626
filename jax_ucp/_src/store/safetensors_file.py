"""Regions of the tensors of a Hugging Face safetensors file, read in place (no copy on disk).

A safetensors tensor is one C-ordered byte range of its file (``format.safetensors`` checks the
header), so a region is read with ``preadv``: a block of whole rows (leading extents 1, one cut
dimension, then whole trailing ones) straight into the caller's array, any other region as blocks
of whole rows of bounded size read once into a scratch buffer and cut from there for every region
that needs them (row-parallel weights split on their last dimension). ``SafetensorsTensor`` has
``read_into`` like ``shard_reader.ShardReader``, so ``sharding.PendingArray`` reads each device's
slice into its own aligned buffer that ``jax.device_put`` adopts; ``view()`` is a TensorStore view
(``virtual_chunked`` over row blocks) for the UCP language's lazy transforms.
"""

from __future__ import annotations

import contextlib
import math
import os

import numpy as np
import tensorstore as ts

from jax_ucp._src.errors import CheckpointError, SourceError
from jax_ucp._src.format import files, safetensors
from jax_ucp._src.store import shard_reader

BLOCK_BYTES = 8 << 20  # bytes of whole rows read at once (one task; a cut block: its scratch)
VIEW_CHUNK_BYTES = 4 << 20  # rows per chunk of a TensorStore view


class OpenFile:
    """One safetensors file opened for reading: its checked header and a descriptor kept open
    (closed with the object), so the file read is the file whose header was checked."""

    def __init__(self, parsed: safetensors.SafetensorsFile):
        self.path = parsed.path
        self.parsed = parsed
        self.fd = files.open_regular(parsed.path)
        st = os.fstat(self.fd)
        if st.st_size != parsed.data_start + parsed.data_size:
            os.close(self.fd)
            raise SourceError(
                f"{self.path}: changed while being opened ({st.st_size} bytes, the header was "
                f"read from {parsed.data_start + parsed.data_size})."
            )

    def tensor(self, name: str) -> SafetensorsTensor:
        """The tensor ``name`` of this file (its header entry, checked when parsed)."""
        dtype, shape, begin, _ = self.parsed.header[name]
        return SafetensorsTensor(self, name, dtype, shape, self.parsed.data_start + begin)

    def close(self) -> None:
        """Closes the descriptor (again: nothing)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        # AttributeError, TypeError: at interpreter shutdown ``os`` is gone
        with contextlib.suppress(AttributeError, TypeError, OSError):
            self.close()


class SafetensorsTensor:
    """One tensor of an open safetensors file: regions read like ``ShardReader.read_into``."""

    def __init__(self, file: OpenFile, name: str, dtype: np.dtype, shape, offset: int):
        self.file, self.name = file, name
        self.dtype, self.shape, self.offset = np.dtype(dtype), tuple(shape), offset
        inner = math.prod(self.shape[1:]) if self.shape else 1
        self.row_bytes = inner * self.dtype.itemsize  # bytes of one index of dim 0
        self.block_rows = max(1, BLOCK_BYTES // max(1, self.row_bytes))  # rows per read task

    def _rows_into(self, out: np.ndarray, row: int) -> None:
        """Whole rows ``row, row + len(out)`` straight into ``out`` (C-contiguous)."""
        position = self.offset + row * self.row_bytes
        got = files.preadv_full(self.file.fd, [out.reshape(-1).view(np.uint8).data], position)
        shard_reader.count_bytes_read(got)
        if got < out.nbytes:
            raise CheckpointError(
                f"{self.file.path}: tensor {self.name!r} truncated (needs bytes up to "
                f"{position + out.nbytes}, the file ends at {position + got})."
            )

    def _rows(self, a: int, b: int) -> np.ndarray:
        """Rows ``[a, b)`` in this thread's scratch buffer (valid until its next read)."""
        block = shard_reader.scratch((b - a) * self.row_bytes).view(self.dtype)
        block = block.reshape((b - a,) + self.shape[1:])
        self._rows_into(block, a)
        return block

    def read_into(self, dests) -> shard_reader.PendingReads:
        """Reads each region into its array: ``dests`` is a list of (region, out), region
        ``((start, stop), ...)`` per dimension and out a writable C-contiguous array of the
        tensor's dtype and the region's shape. Rows several regions need are read once."""
        tasks = []
        cut = []
        for region, out in dests:
            shape = shard_reader.check_destination(region, out, self.shape, self.dtype)
            if 0 in shape:
                continue
            if not self.shape:
                tasks.append((self._rows_into, out.reshape(1), 0))
            elif all(r == (0, n) for r, n in zip(region[1:], self.shape[1:])):
                for r in range(0, shape[0], self.block_rows):  # consecutive bytes: into ``out``
                    tasks.append((self._rows_into, out[r : r + self.block_rows], region[0][0] + r))
            else:
                cut.append((region, out))
        tasks.extend(self._cut_tasks(cut))
        pool = shard_reader.read_pool()
        return shard_reader.PendingReads([pool.submit(*task) for task in tasks])

    def _cut_tasks(self, dests) -> list:
        """Blocks of whole rows covering every region not a row range, each block read once."""
        if not dests:
            return []
        per_block = self.block_rows
        blocks = shard_reader.row_blocks(dests, per_block)
        return [(self._read_block, a, b, dests) for a, b in blocks]

    def _read_block(self, a: int, b: int, dests) -> None:
        block = self._rows(a, b)
        for region, out in dests:
            lo, hi = max(a, region[0][0]), min(b, region[0][1])
            if lo >= hi:
                continue
            src = (slice(lo - a, hi - a),) + tuple(slice(s, e) for s, e in region[1:])
            out[lo - region[0][0] : hi - region[0][0]] = block[src]

    def view(self) -> ts.TensorStore:
        """A lazy TensorStore view of the whole tensor (read in chunks of whole rows, each
        ``preadv``'d straight into TensorStore's chunk buffer): the source of spec views."""
        if not self.shape:
            return ts.array(self.read_all())
        rows = max(1, min(self.shape[0], VIEW_CHUNK_BYTES // max(1, self.row_bytes)))

        def read(domain, array, params):
            del params
            (a, _), *rest = [(d.inclusive_min, d.exclusive_max) for d in domain]
            if (
                any(r != (0, n) for r, n in zip(rest, self.shape[1:]))
                or not array.flags.c_contiguous
            ):
                full = tuple((d.inclusive_min, d.exclusive_max) for d in domain)
                tmp = np.empty(tuple(e - s for s, e in full), self.dtype)
                self.read_into([(full, tmp)]).result()
                array[...] = tmp
                return
            self._rows_into(array, a)

        return ts.virtual_chunked(
            read,
            dtype=ts.dtype(self.dtype.name),
            domain=ts.IndexDomain(shape=list(self.shape)),
            chunk_layout=ts.ChunkLayout(read_chunk_shape=[rows, *self.shape[1:]]),
            context=_VIEW_CONTEXT,
        )

    def read_all(self) -> np.ndarray:
        """The whole tensor as a new array."""
        out = np.empty(self.shape, self.dtype)
        self.read_into([(tuple((0, n) for n in self.shape), out)]).result()
        return out


class Gathered:
    """A 2-d array whose column ``j`` is row ``rows[j]`` of the 2-d source ``sources[which[j]]``
    (a transpose: torch ``[out, in]`` -> flax ``[in, out]``; and concatenations or reorderings of
    such columns: q/k/v merged, gate|up), read region by region like ``SafetensorsTensor``: each
    run of consecutive source rows is read once, in blocks, and transposed into every region's
    array in tiles of ``TILE`` rows (a whole-array strided bf16 transpose copy runs ~15x
    slower here)."""

    def __init__(self, sources: list[SafetensorsTensor], which, rows):
        self.sources = list(sources)
        self.which = np.asarray(which, np.int64)
        self.rows = np.asarray(rows, np.int64)
        inner = {t.shape[1:] for t in self.sources}
        dtypes = {t.dtype for t in self.sources}
        if len(inner) != 1 or len(dtypes) != 1 or any(len(t.shape) != 2 for t in self.sources):
            raise ValueError("Gathered: sources must be 2-d with one row length and dtype")
        self.dtype = dtypes.pop()
        self.shape = (inner.pop()[0], len(self.rows))
        # runs of columns reading consecutive rows of one source: (first column, source, row, n)
        breaks = np.flatnonzero((np.diff(self.which) != 0) | (np.diff(self.rows) != 1)) + 1
        starts = np.concatenate([[0], breaks]).astype(np.int64)
        ends = np.concatenate([breaks, [len(self.rows)]]).astype(np.int64)
        self._runs = [
            (int(a), int(self.which[a]), int(self.rows[a]), int(b - a))
            for a, b in zip(starts, ends)
            if b > a
        ]

    def read_into(self, dests) -> shard_reader.PendingReads:
        """Reads each ``(region, out)`` of ``dests`` into ``out``, like ``ShardReader.read_into``."""
        for region, out in dests:
            shard_reader.check_destination(region, out, self.shape, self.dtype)
        dests = [(region, out) for region, out in dests if 0 not in out.shape]
        tasks = []
        for first, src, row, n in self._runs:
            hi = first + n
            if not any(c0 < hi and first < c1 for (_, (c0, c1)), _ in dests):
                continue
            t = self.sources[src]
            for a in range(first, hi, t.block_rows):  # result columns [a, b): rows from there
                b = min(a + t.block_rows, hi)
                wanted = [d for d in dests if d[0][1][0] < b and a < d[0][1][1]]
                if wanted:
                    tasks.append((self._read_block, t, a, b, row + (a - first), wanted))
        pool = shard_reader.read_pool()
        return shard_reader.PendingReads([pool.submit(*task) for task in tasks])

    @staticmethod
    def _read_block(t: SafetensorsTensor, a: int, b: int, row: int, dests) -> None:
        """Result columns ``[a, b)`` = source rows ``[row, row + b - a)`` of ``t``."""
        block = t._rows(row, row + b - a)
        for (rows, cols), out in dests:  # out[i, j] = block[a + j - a, rows[0] + i]
            lo, hi = max(a, cols[0]), min(b, cols[1])
            part = block[lo - a : hi - a, rows[0] : rows[1]]
            for r in range(0, hi - lo, TILE):
                piece = part[r : r + TILE]
                out[:, lo - cols[0] + r : lo - cols[0] + r + len(piece)] = piece.T


TILE = 64  # source rows transposed at once (stays in cache)


_VIEW_CONTEXT = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
