"""Reading exactly the slices a process's devices need from any TensorStore (the language's lazy
views included), and assembling a global ``jax.Array``."""

from __future__ import annotations

import functools
import math
import mmap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard, cast, runtime_checkable

import ml_dtypes
import numpy as np
import tensorstore as ts

from jax_ucp._src.format.dtypes import is_floating

if TYPE_CHECKING:
    import jax


class Waitable(Protocol):
    """Reads in flight: ``result()`` waits for every one and raises the first error."""

    def result(self) -> Any: ...


@runtime_checkable
class RegionReader(Protocol):
    """A tensor read region by region into arrays the caller allocates."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def read_into(self, dests: list[tuple[tuple[tuple[int, int], ...], np.ndarray]]) -> Waitable:
        """Reads each ``(region, out)`` (``(start, stop)`` per dimension) into ``out``."""
        ...


def _reads_regions(source) -> TypeGuard[RegionReader]:
    """``isinstance(source, RegionReader)`` by its members (typing's check: ~2 ms a tensor)."""
    return all(hasattr(source, m) for m in ("read_into", "shape", "dtype"))


class PendingArray:
    """Reads issued for one tensor; ``result()`` waits for them and builds the array."""

    def __init__(
        self,
        source: RegionReader | ts.TensorStore,
        shape: tuple[int, ...],
        dtype: np.dtype,
        sharding: jax.sharding.Sharding | None,
    ):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.sharding = sharding
        self._source = source
        self._reads: dict[tuple, ts.Future | Waitable] = {}
        self._device_index: list[tuple[Any, tuple]] = []  # (jax device, slice key)
        self._slices: dict[tuple, tuple] = {}
        self._box = None
        # each slice read into its own aligned buffer, which ``jax.device_put`` adopts without a
        # copy on CPU; devices holding the same slice share it
        self._reader = source if _reads_regions(source) and self.shape else None
        self._outs: dict[tuple, np.ndarray] = {}
        # Values that a narrowing cast turned into inf/NaN (see ``convert``), once read.
        self.overflowed = 0
        if sharding is None:
            self._slices[()] = ()
            self.read_bytes = _nbytes(self.shape, source)
        else:
            self.read_bytes = self._slice(sharding, source)
        stored = _stored_dtype(source)
        #: bytes of this process's slices in the result's dtype (what a CPU result keeps)
        self.result_bytes = self.read_bytes // stored.itemsize * self.dtype.itemsize
        #: host memory ``start`` + ``result`` allocate at most (reads, converted copies)
        self.host_bytes = self.read_bytes + (self.result_bytes if stored != self.dtype else 0)
        self.on_host = on_host(sharding)  # sizes known once: the engine reads them, no call

    def _slice(self, sharding: jax.sharding.Sharding, source) -> int:
        """This process's distinct slices (each device's, or one box they tile); their bytes."""
        for device, index in sharding.addressable_devices_indices_map(self.shape).items():
            assert index is not None  # an addressable device always holds an index
            key = tuple(s.indices(n) for s, n in zip(index, self.shape))  # (start, stop, step)s
            self._slices.setdefault(key, index)  # devices holding the same slice share one read
            self._device_index.append((device, key))
        if self._reader is None:
            self._box = _tiled_box(list(self._slices), self.shape)
        if self._box is not None:  # the slices tile one box: read it once, cut it on the host
            self._slices = {(): tuple(slice(a, b) for a, b in self._box)}
        return sum(
            _nbytes(tuple(len(range(*s.indices(n))) for s, n in zip(index, self.shape)), source)
            for index in self._slices.values()
        )

    def start(self) -> None:
        """Issues the reads (separate from construction so a caller can budget them)."""
        if self._reader is not None:
            stored = np.dtype(self._reader.dtype)
            dests = []
            for key in self._slices:
                region = (
                    tuple((a, b) for a, b, _ in key) if key else tuple((0, n) for n in self.shape)
                )
                self._outs[key] = aligned_empty(tuple(b - a for a, b in region), stored)
                dests.append((region, self._outs[key]))
            self._reads[()] = self._reader.read_into(dests)
            return
        view = cast(ts.TensorStore, self._source)  # or a 0-d ShardReader, sliced alike
        for key, index in self._slices.items():
            self._reads[key] = view[index].read() if index else view[()].read()

    def _host(self, key) -> np.ndarray:
        if self._reader is not None:
            data = self._outs[key]
        else:
            data = np.asarray(self._reads[key].result())
        if data.dtype == self.dtype:
            return data
        converted, overflowed = convert(data, self.dtype)  # the caller checked the cast is wanted
        self.overflowed += overflowed
        return converted

    def result(self):
        """The ``jax.Array`` (or host array without a sharding), once every read is done."""
        if not self._reads:
            self.start()
        if self._reader is not None:
            self._reads[()].result()  # every slice read (errors raised here)
        if self.sharding is None:
            return self._host(())
        if self._box is not None:  # never with a reader
            whole = self._host(())
            host = {
                key: whole[
                    tuple(slice(a - lo, b - lo) for (a, b, _), (lo, _) in zip(key, self._box))
                ]
                for _, key in self._device_index
            }
        else:
            host = {key: self._host(key) for key in self._slices}
        import jax  # a result on a sharding: JAX is loaded (host-only reads never import it)

        singles = [
            jax.device_put(host[key], device, may_alias=True) for device, key in self._device_index
        ]
        return jax.make_array_from_single_device_arrays(self.shape, self.sharding, singles)

    def release(self) -> None:
        """Drops the reads and their host buffers once the result is taken, freeing them now."""
        self._reads.clear()
        self._outs.clear()


_ALIGNMENT = 64  # XLA:CPU adopts a host buffer as a device buffer, uncopied, if this aligned
_OWN_MAPPING_AT = 4 << 20  # numpy advises huge pages from here up (its HUGEPAGE_THRESHOLD)


def convert(data: np.ndarray, dtype) -> tuple[np.ndarray, int]:
    """``data`` as ``dtype`` in a new 64-byte-aligned array, and how many values the cast overflowed
    (finite beyond the target's range, or an inf into a dtype without inf). Only casts into a float
    of smaller range are counted, block by block while in cache; every other cast is a plain copy.
    """
    dtype = np.dtype(dtype)
    out = aligned_empty(data.shape, dtype)
    check = _overflow_check(np.dtype(data.dtype), dtype)
    if check is None:
        np.copyto(out, data, casting="unsafe")
        return out, 0
    source = np.ascontiguousarray(data).reshape(-1)
    target = out.reshape(-1)
    overflowed = 0
    with np.errstate(over="ignore", invalid="ignore"):  # counted and named by the caller
        for start in range(0, source.size, _CAST_BLOCK):
            block = source[start : start + _CAST_BLOCK]
            cast = target[start : start + _CAST_BLOCK]
            np.copyto(cast, block, casting="unsafe")
            lost = ~np.isfinite(cast)
            if lost.any():
                overflowed += int(np.count_nonzero(lost & check(block)))
    return out, overflowed


_CAST_BLOCK = 1 << 16  # elements converted and checked at once


@functools.cache
def _overflow_check(source: np.dtype, target: np.dtype):
    """None when casting ``source`` into ``target`` cannot overflow, else a check per block."""
    if not is_floating(target):
        return None
    info = np.finfo(target) if target.kind == "c" else ml_dtypes.finfo(target)
    has_inf = bool(np.isinf(np.array(np.inf).astype(target)))
    if source.kind in "biu":
        wider = float(np.iinfo(source).max if source.kind != "b" else 1) > float(info.max)
        return (lambda block: np.ones(block.shape, bool)) if wider else None
    if not is_floating(source):
        return None
    source_info = np.finfo(source) if source.kind == "c" else ml_dtypes.finfo(source)
    if float(source_info.max) > float(info.max):
        return np.isfinite if has_inf else (lambda block: ~np.isnan(block))
    if not has_inf and bool(np.isinf(np.array(np.inf).astype(source))):
        return lambda block: ~np.isnan(block)  # only infinities can turn into NaN
    return None


def aligned_empty(shape: Sequence[int], dtype) -> np.ndarray:
    """An uninitialised C-ordered array whose data starts at a multiple of 64 bytes. From
    ``_OWN_MAPPING_AT`` bytes up it is a mapping of its own, without numpy's
    ``madvise(MADV_HUGEPAGE)``, which lets each page fault compact memory first: 1.05 s against 1.80
    s on a cold 0.54 GB restore (docs/BENCHMARKS.md)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes >= _OWN_MAPPING_AT and hasattr(mmap, "MAP_ANONYMOUS"):
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return np.frombuffer(mapping, np.uint8).view(dtype).reshape(tuple(shape))  # page-aligned
    raw = np.empty(nbytes + _ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % _ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(tuple(shape))


def _tiled_box(keys: list[tuple], shape: Sequence[int]) -> tuple[tuple[int, int], ...] | None:
    """The bounding box of distinct slices that tile it exactly, else None."""
    if len(keys) < 2 or any(step != 1 for key in keys for _, _, step in key):
        return None
    box = tuple(
        (min(key[d][0] for key in keys), max(key[d][1] for key in keys)) for d in range(len(shape))
    )
    boxes = [tuple((a, b) for a, b, _ in key) for key in keys]
    return box if tile(boxes, math.prod(b - a for a, b in box)) else None


def tile(boxes: Sequence[tuple[tuple[int, int], ...]], volume: int) -> bool:
    """Whether ``boxes`` cover ``volume`` elements exactly: volumes add up, no two overlap."""
    if sum(math.prod(b - a for a, b in box) for box in boxes) != volume:
        return False
    return not any(
        all(a1 < b2 and a2 < b1 for (a1, b1), (a2, b2) in zip(first, second))
        for i, first in enumerate(boxes)
        for second in boxes[i + 1 :]
    )


def on_host(sharding: jax.sharding.Sharding | None) -> bool:
    """A result on ``sharding`` lives in host memory: numpy (None), or jax.Arrays on CPU."""
    return sharding is None or all(d.platform == "cpu" for d in sharding.device_set)


def _stored_dtype(source) -> np.dtype:
    return np.dtype(getattr(source.dtype, "numpy_dtype", source.dtype))


def _nbytes(shape, source) -> int:
    return math.prod(shape) * _stored_dtype(source).itemsize
