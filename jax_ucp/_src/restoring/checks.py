"""Comparing two checkpoints leaf by leaf: what differs, by how much, and what is only in one.

Streamed: one tensor of each checkpoint is in memory at a time (read through the checked read
path of ``restore``: crc32c of every chunk, digest of every shard file), and the difference is
computed over blocks of it, so two checkpoints much larger than the host compare fine.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_ucp._src import format as fmt
from jax_ucp._src import store
from jax_ucp._src.restoring import locate, model
from jax_ucp._src.restoring.sources import ucp_source

# Elements compared at once (float64 temporaries of this many elements, a few of them).
BLOCK = 1 << 20


@dataclasses.dataclass(frozen=True)
class TensorDiff:
    """One tensor present in both checkpoints that is not bit-identical.

    Attributes:
        name: the tensor's key, ``/``-joined.
        shape: ``(shape in a, shape in b)``.
        dtype: ``(dtype in a, dtype in b)``.
        differing: how many elements differ bit for bit (``None`` when the shapes or dtypes
            differ: no values are compared then).
        size: elements in the tensor (``None`` when the shapes or dtypes differ).
        max_abs: the largest ``|a - b|`` over the differing elements (``nan`` when an element
            is NaN in one checkpoint only; ``None`` for non-numeric dtypes or when not
            compared).
        max_rel: the largest ``|a - b| / max(|a|, |b|)`` (symmetric, between 0 and 2).
    """

    name: str
    shape: tuple[tuple[int, ...], tuple[int, ...]]
    dtype: tuple[str, str]
    differing: int | None = None
    size: int | None = None
    max_abs: float | None = None
    max_rel: float | None = None

    @property
    def compared(self) -> bool:
        """Shapes and dtypes match, so values were compared."""
        return self.differing is not None


@dataclasses.dataclass(frozen=True)
class ValueDiff:
    """A saved Python value (or a value in one checkpoint and an array in the other) that
    differs; an array is described as ``"array <shape> <dtype>"``."""

    name: str
    a: Any
    b: Any


@dataclasses.dataclass(frozen=True)
class CheckpointDiff:
    """``jax_ucp.diff(a, b)``: everything that differs; empty lists mean identical.

    Attributes:
        tensors: the tensors in both that differ (values, shape or dtype).
        values: the saved Python values in both that differ.
        only_in_a: names of the leaves only ``a`` has.
        only_in_b: names of the leaves only ``b`` has.
        same: how many leaves are in both and bit-identical.
    """

    tensors: list[TensorDiff]
    values: list[ValueDiff]
    only_in_a: list[str]
    only_in_b: list[str]
    same: int

    @property
    def identical(self) -> bool:
        """Same leaves, same shapes, dtypes and bits."""
        return not (self.tensors or self.values or self.only_in_a or self.only_in_b)


def diff(
    a: str | os.PathLike,
    b: str | os.PathLike,
    *,
    progress: Callable[[str, int, int], None] | None = None,
) -> CheckpointDiff:
    """Compares the checkpoints at ``a`` and ``b`` leaf by leaf.

    Equality is bitwise (a NaN equals the same NaN, ``-0.0`` differs from ``0.0``); for
    numeric tensors that differ, the max absolute and relative difference are computed too.
    Leaves are matched by key path. One tensor of each checkpoint is held at a time.

    Args:
        a: a checkpoint directory (holding ``ucp.json``) or an Orbax step directory with one
            UCP item.
        b: the same, compared against ``a``.
        progress: called as ``progress(name, done, total)`` after each leaf present in both.

    Returns:
        A ``CheckpointDiff``.

    Raises:
        CheckpointError: a checkpoint is missing, unreadable or corrupt (names the tensor and
            the file).
    """
    root_a, root_b = (locate.find_checkpoint(store.storage_for(p)) for p in (a, b))
    man_a, man_b = root_a.read_manifest(), root_b.read_manifest()
    by_a, by_b = man_a.by_key(), man_b.by_key()
    common = [k for k in by_a if k in by_b]
    tensors, values, same = [], [], 0
    for done, key in enumerate(common, 1):
        ea, eb = by_a[key], by_b[key]
        if isinstance(ea, fmt.ValueEntry) or isinstance(eb, fmt.ValueEntry):
            if _same_value(ea, eb):
                same += 1
            else:
                values.append(ValueDiff(ea.name, _as_value(ea), _as_value(eb)))
        else:
            result = compare_tensor(root_a, man_a, ea, root_b, man_b, eb)
            if result is None:
                same += 1
            else:
                tensors.append(result)
        if progress is not None:
            progress(ea.name, done, len(common))
    return CheckpointDiff(
        tensors=tensors,
        values=values,
        only_in_a=[by_a[k].name for k in by_a if k not in by_b],
        only_in_b=[by_b[k].name for k in by_b if k not in by_a],
        same=same,
    )


def _as_value(entry) -> Any:
    if isinstance(entry, fmt.ValueEntry):
        return entry.value
    return f"array {'x'.join(map(str, entry.shape)) or '()'} {entry.dtype}"


def _same_value(ea, eb) -> bool:
    if not (isinstance(ea, fmt.ValueEntry) and isinstance(eb, fmt.ValueEntry)):
        return False
    va, vb = ea.value, eb.value
    if type(va) is not type(vb):
        return False
    if isinstance(va, float):  # bitwise, like tensors: NaN == NaN, -0.0 != 0.0
        return va.hex() == vb.hex()
    return va == vb


def _read(root, manifest, entry) -> np.ndarray:
    (x,) = ucp_source.read(root, manifest, [model.Request(key=entry.key)])
    return np.ascontiguousarray(x).reshape(-1)


def compare_tensor(root_a, man_a, ea, root_b, man_b, eb) -> TensorDiff | None:
    """How tensor ``ea`` of checkpoint ``root_a`` differs from ``eb`` of ``root_b`` (None: equal
    bit for bit), read and compared ``BLOCK`` elements at a time so one tensor of each is held.

    Args:
        root_a: the first checkpoint (its folder or ``Storage``).
        man_a: its manifest.
        ea: its tensor entry.
        root_b: the second checkpoint's folder.
        man_b: its manifest.
        eb: its tensor entry.
    """
    shapes, dtypes = (ea.shape, eb.shape), (ea.dtype, eb.dtype)
    if ea.shape != eb.shape or ea.dtype != eb.dtype:
        return TensorDiff(ea.name, shapes, dtypes)
    x = _read(root_a, man_a, ea)
    y = _read(root_b, man_b, eb)
    numeric = x.dtype.kind in "biufc" or "float" in x.dtype.name  # ml_dtypes: bfloat16, float8
    differing, max_abs, max_rel = 0, 0.0, 0.0
    for start in range(0, x.size, BLOCK):
        bx, by = x[start : start + BLOCK], y[start : start + BLOCK]
        ne = np.any(
            bx.view(np.uint8).reshape(bx.size, -1) != by.view(np.uint8).reshape(by.size, -1),
            axis=1,
        )
        n = int(ne.sum())
        if not n:
            continue
        differing += n
        if numeric:
            block_abs, block_rel = _deltas(bx[ne], by[ne])
            max_abs, max_rel = _nanmax(max_abs, block_abs), _nanmax(max_rel, block_rel)
    del x, y
    if not differing:
        return None
    if not numeric:
        max_abs = max_rel = None
    return TensorDiff(ea.name, shapes, dtypes, differing, math.prod(ea.shape), max_abs, max_rel)


def _deltas(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Max |x - y| and max |x - y| / max(|x|, |y|) over elements known to differ in bits."""
    wide = np.complex128 if x.dtype.kind == "c" else np.float64
    fx, fy = x.astype(wide), y.astype(wide)
    with np.errstate(invalid="ignore", over="ignore"):
        delta = np.abs(fx - fy)
        both_nan = np.isnan(fx) & np.isnan(fy)  # another NaN payload: not a numeric difference
        delta[both_nan] = 0.0
        scale = np.maximum(np.abs(fx), np.abs(fy))
        rel = np.divide(delta, scale, out=np.zeros_like(delta), where=scale > 0)
        rel[np.isinf(delta)] = np.inf
        rel[np.isnan(delta)] = np.nan
    return float(np.max(delta)), float(np.max(rel))


def _nanmax(a: float, b: float) -> float:
    """Max that keeps a NaN (an element NaN in one checkpoint only) once seen."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)
