"""Comparing two checkpoints tensor by tensor: what differs, by how much, and what is only in one.

Streamed: one tensor of each checkpoint is in memory at a time, so two checkpoints larger than
the host compare fine.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_ucp import format as fmt
from jax_ucp.handler import reader


@dataclasses.dataclass(frozen=True)
class TensorDiff:
    """One tensor present in both checkpoints that is not bit-identical."""

    name: str
    shape: tuple[tuple[int, ...], tuple[int, ...]]  # (a, b)
    dtype: tuple[str, str]
    max_abs: float | None = None  # None when shapes or dtypes differ (no values compared)
    max_rel: float | None = None
    differing: int | None = None  # elements whose bits differ


@dataclasses.dataclass(frozen=True)
class CheckpointDiff:
    """``jax_ucp.diff(a, b)``: everything that differs; empty lists mean identical."""

    tensors: list[TensorDiff]
    values: list[tuple[str, object, object]]  # saved Python values that differ: (name, a, b)
    only_in_a: list[str]
    only_in_b: list[str]
    same: int  # leaves present in both and bit-identical

    @property
    def identical(self) -> bool:
        return not (self.tensors or self.values or self.only_in_a or self.only_in_b)


def diff(a, b, *, progress=None) -> CheckpointDiff:
    """Compares the checkpoints at ``a`` and ``b`` leaf by leaf (bits, so NaN == NaN and
    -0.0 != 0.0); for numeric tensors also the max absolute and relative difference."""
    root_a, root_b = reader.find_checkpoint_dir(a), reader.find_checkpoint_dir(b)
    man_a, man_b = fmt.read_manifest(root_a), fmt.read_manifest(root_b)
    by_a, by_b = man_a.by_key(), man_b.by_key()
    common = [k for k in by_a if k in by_b]
    tensors, values, same = [], [], 0
    for done, key in enumerate(common, 1):
        ea, eb = by_a[key], by_b[key]
        if isinstance(ea, fmt.ValueEntry) or isinstance(eb, fmt.ValueEntry):
            va = ea.value if isinstance(ea, fmt.ValueEntry) else "<array>"
            vb = eb.value if isinstance(eb, fmt.ValueEntry) else "<array>"
            if type(va) is type(vb) and (va == vb or (va != va and vb != vb)):
                same += 1
            else:
                values.append((ea.name, va, vb))
            continue
        result = _compare(root_a, man_a, ea, root_b, man_b, eb)
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


def _compare(root_a, man_a, ea, root_b, man_b, eb) -> TensorDiff | None:
    shapes, dtypes = (ea.shape, eb.shape), (ea.dtype, eb.dtype)
    if ea.shape != eb.shape or ea.dtype != eb.dtype:
        return TensorDiff(ea.name, shapes, dtypes)
    (x,) = reader.read(root_a, man_a, [reader.Request(key=ea.key)])
    (y,) = reader.read(root_b, man_b, [reader.Request(key=eb.key)])
    x, y = np.asarray(x), np.asarray(y)
    bits_x = np.ascontiguousarray(x).view(np.uint8).reshape(x.shape + (-1,))
    bits_y = np.ascontiguousarray(y).view(np.uint8).reshape(y.shape + (-1,))
    differing = int(np.any(bits_x != bits_y, axis=-1).sum()) if x.size else 0
    if not differing:
        return None
    max_abs = max_rel = None
    if x.dtype.kind in "biufc" or "float" in x.dtype.name:
        fx, fy = x.astype(np.float64), y.astype(np.float64)
        delta = np.abs(fx - fy)
        with np.errstate(invalid="ignore", divide="ignore"):
            rel = delta / np.maximum(np.abs(fy), np.finfo(np.float64).tiny)
        max_abs, max_rel = float(np.nanmax(delta)), float(np.nanmax(rel))
    return TensorDiff(ea.name, shapes, dtypes, max_abs, max_rel, differing)
