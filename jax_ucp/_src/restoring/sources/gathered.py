"""A spec's view whose columns are rows of rank-2 source tensors (a transpose: torch ``[out, in]``
-> flax ``[in, out]``; and q/k/v merged, gate|up concatenated, of such columns), read region by
region without TensorStore: ``gather_map`` finds such a view on probes, ``Gathered`` reads it
from its sources' rows (each run of consecutive source rows read once, in blocks, transposed into
every region in tiles: a whole-array strided bf16 transpose copy runs ~15x slower). JAX-free.
"""

from __future__ import annotations

import numpy as np
import tensorstore as ts

from jax_ucp._src.store import shard_reader

GATHER_OPS = {"transpose", "merge_qkv", "concat"}
TILE = 64  # source rows transposed at once (stays in cache)
_BITS = 24  # row and column fields of a probe's codes


def gather_map(plan, shapes: list, dtypes: list):
    """``(which, rows)`` when ``plan``'s view is columns each taken whole from a row of a rank-2
    source (``transpose`` first, then ``merge_qkv`` / ``concat`` of such columns): column ``j``
    is row ``rows[j]`` of source ``which[j]`` (``shapes`` / ``dtypes``: its sources'). Found on
    probes whose values encode (source, row, column), checked on three rows of the view (each
    must hold column ``i`` of the same source rows); None for any other view."""
    ops = tuple(plan.ops)
    if (
        not ops
        or ops[0] != "transpose"
        or not set(ops) <= GATHER_OPS
        or any(len(sh) != 2 or max(sh) >= 1 << _BITS for sh in shapes)
        or len({sh[1] for sh in shapes}) != 1
        or any(d != np.dtype(plan.dtype) for d in dtypes)
        or len(plan.shape) != 2
        or plan.shape[0] != shapes[0][1]
    ):
        return None

    def probe(sid, shape):
        def fill(domain, array, params):
            del params
            rows, cols = np.indices(array.shape)
            rows += domain[0].inclusive_min
            cols += domain[1].inclusive_min
            array[...] = (sid << (2 * _BITS)) | (rows << _BITS) | cols

        return ts.virtual_chunked(
            fill,
            dtype=ts.int64,
            domain=ts.IndexDomain(shape=list(shape)),
            chunk_layout=ts.ChunkLayout(read_chunk_shape=[shape[0], 1]),
        )

    sources = [tuple(s) for s in plan.sources]
    view = plan.build({k: probe(i, sh) for i, (k, sh) in enumerate(zip(sources, shapes))})
    if tuple(view.shape) != tuple(plan.shape):
        return None
    first = np.asarray(view[0, :].read().result())
    if np.any(first & ((1 << _BITS) - 1)):
        return None
    n_in = plan.shape[0]
    for i in sorted({1, n_in - 1} - {0} if n_in > 1 else set()):
        if not np.array_equal(np.asarray(view[i, :].read().result()), first + i):
            return None
    return first >> (2 * _BITS), (first >> _BITS) & ((1 << _BITS) - 1)


class Gathered:
    """A 2-d array whose column ``j`` is row ``rows[j]`` of source ``which[j]``, each source
    read by rows (``read(a, b)``, at most ``per_block`` rows at once; ``sources``: ``(read,
    per_block)``): a ``sharding.RegionReader``."""

    def __init__(self, sources: list, which, rows, shape, dtype):
        self.sources = list(sources)
        self.which, self.rows = np.asarray(which, np.int64), np.asarray(rows, np.int64)
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
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
            read, per_block = self.sources[src]
            for a in range(first, hi, per_block):  # result columns [a, b): rows from there
                b = min(a + per_block, hi)
                wanted = [d for d in dests if d[0][1][0] < b and a < d[0][1][1]]
                if wanted:
                    tasks.append((_read_block, read, a, b, row + (a - first), wanted))
        pool = shard_reader.read_pool()
        return shard_reader.PendingReads([pool.submit(*task) for task in tasks])


def _read_block(read, a: int, b: int, row: int, dests) -> None:
    """Result columns ``[a, b)`` = source rows ``[row, row + b - a)``."""
    block = read(row, row + b - a)
    for (rows, cols), out in dests:  # out[i, j] = block[j, rows[0] + i]
        lo, hi = max(a, cols[0]), min(b, cols[1])
        part = block[lo - a : hi - a, rows[0] : rows[1]]
        for r in range(0, hi - lo, TILE):
            piece = part[r : r + TILE]
            out[:, lo - cols[0] + r : lo - cols[0] + r + len(piece)] = piece.T
