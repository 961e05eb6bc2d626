"""Chunk layout: outer shard = the save-time per-device shard, inner chunks bounded in bytes.

One outer shard per device shard means each shard file has exactly one writer and is written
whole (no read-modify-write, no two processes touching one file).  Inner chunks bound what a
reader has to fetch: a restore onto another mesh reads only the inner chunks that intersect
its slice, so a replicated 1 GiB embedding is not one unit every reader reads whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Chosen by measurement (benchmarks/bench_chunk_bound.py): on this machine restores onto other
# meshes are flat between 1 and 8 MiB and slow down below 256 KiB (per-chunk overhead) and above
# 16 MiB (read amplification for misaligned slices).
DEFAULT_INNER_CHUNK_BYTES = 4 << 20


def outer_chunk_shape(shard_shape: Sequence[int]) -> tuple[int, ...]:
    """zarr needs positive chunk extents; a zero-size dimension still gets extent 1."""
    return tuple(max(1, int(d)) for d in shard_shape)


def inner_chunk_shape(
    shard_shape: Sequence[int], itemsize: int, max_bytes: int = DEFAULT_INNER_CHUNK_BYTES
) -> tuple[int, ...]:
    """The largest C-order-friendly chunk that divides ``shard_shape`` and fits in ``max_bytes``.

    Trailing dimensions are kept whole as long as possible (contiguous rows read fastest); the
    first dimension that does not fit is cut to its largest divisor that fits (or, for extents
    without a usable divisor, the smallest one above the bound), and every dimension before it to 1.  Divisors, because zarr v3 sharding needs inner chunks that tile the shard.

    Args:
        shard_shape: the shard's shape
        itemsize: bytes per element
        max_bytes: the most bytes an inner chunk may hold
    """
    shard = outer_chunk_shape(shard_shape)
    if not shard:
        return ()
    budget = max(1, max_bytes // max(1, itemsize))  # elements
    chunk = list(shard)
    inner = 1
    for axis in range(len(shard) - 1, -1, -1):
        if inner * shard[axis] <= budget:
            inner *= shard[axis]
            continue
        fit = max(1, budget // inner)
        small = [d for d in range(1, math.isqrt(shard[axis]) + 1) if shard[axis] % d == 0]
        divisors = sorted({*small, *(shard[axis] // d for d in small)}, reverse=True)
        best = next(d for d in divisors if d <= fit)
        if best * 16 < fit:
            # Badly divisible extent (e.g. a prime): millions of tiny chunks would cost more than a
            # chunk somewhat over budget, so take the smallest divisor above the bound instead.
            best = min(d for d in divisors if d >= fit)
        chunk[: axis + 1] = [1] * axis + [best]
        break
    return tuple(chunk)
