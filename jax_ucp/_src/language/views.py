"""Lazy, exact TensorStore views, the primitives of every restore-side transform: index transforms
and virtual concat/stack, never a read; every view has a zero origin."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import tensorstore as ts

from jax_ucp._src.errors import LanguageError
from jax_ucp._src.format import mapped_file

#: Bytes per chunk of a view of a memory-mapped array (each chunk one ``pread``).
MAPPED_CHUNK_BYTES = 4 << 20


def as_view(x) -> ts.TensorStore:
    """A zero-origin TensorStore view of ``x``; a mapped file is read by ``pread`` (no SIGBUS)."""
    if isinstance(x, ts.TensorStore):
        return zero_origin(x)
    x = np.asarray(x)
    if x.ndim and x.size and mapped_file.mapped_at(x) is not None:
        return _pread_view(x)
    return ts.array(x)


def _pread_view(x: np.ndarray) -> ts.TensorStore:
    row_bytes = max(1, x.nbytes // x.shape[0])
    rows = max(1, min(x.shape[0], MAPPED_CHUNK_BYTES // row_bytes))

    def read(domain: ts.IndexDomain, array: np.ndarray, _params) -> None:
        array[...] = mapped_file.read_out(x[domain.index_exp])

    return ts.virtual_chunked(
        read,
        dtype=ts.dtype(x.dtype.name),
        shape=x.shape,
        chunk_layout=ts.ChunkLayout(read_chunk_shape=[rows, *x.shape[1:]]),
    )


def zero_origin(tensor: ts.TensorStore) -> ts.TensorStore:
    """The same view translated so every dimension starts at 0 (TensorStore keeps slice origins)."""
    if tensor.rank == 0 or all(o == 0 for o in tensor.domain.origin):
        return tensor
    return tensor[ts.d[:].translate_to[0]]


def checked_axis(shape: Sequence[int], axis: int, what: str = "axis") -> int:
    """``axis`` of a tensor of ``shape``, made non-negative; out of range: a LanguageError
    (``what`` names the axis)."""
    r = len(shape)
    a = axis + r if axis < 0 else axis
    if not 0 <= a < r:
        raise LanguageError(
            f"{what} {axis} out of range for a rank-{r} tensor of shape {tuple(shape)}"
        )
    return a


def _view_axis(tensor, axis: int) -> tuple[ts.TensorStore, int, int]:
    """``tensor`` as a view, ``axis`` checked and made non-negative, and its size."""
    tensor = as_view(tensor)
    a = checked_axis(tensor.shape, axis)
    return tensor, a, tensor.shape[a]


def transpose(tensor: ts.TensorStore, perm: Sequence[int] | None = None) -> ts.TensorStore:
    """numpy.transpose semantics; ``perm=None`` reverses the axes (torch [out,in] -> flax [in,out])."""
    tensor = as_view(tensor)
    if tensor.rank < 2 and perm is None:
        return tensor
    if perm is None:
        perm = list(range(tensor.rank))[::-1]
    perm = [checked_axis(tensor.shape, p) for p in perm]
    if sorted(perm) != list(range(tensor.rank)):
        raise LanguageError(
            f"transpose: {list(perm)} is not a permutation of the {tensor.rank} axes"
        )
    return zero_origin(tensor.transpose(perm))


def rope_interleaved_to_half(
    tensor: ts.TensorStore, axis: int, head_dim: int, *, inverse: bool = False
) -> ts.TensorStore:
    """q/k head rows from RoPE's interleaved pairs to rotate-half order, lazily.

    Args:
        tensor: a tensor or a lazy view (``tensorstore.TensorStore``; numpy arrays are wrapped)
        axis: the axis of the heads' rows (whole heads of ``head_dim``)
        head_dim: rows per head (even)
        inverse: rotate-half order back to interleaved pairs"""
    tensor, a, n = _view_axis(tensor, axis)
    if head_dim <= 0 or head_dim % 2 or n % head_dim:
        raise LanguageError(
            f"rope_half: axis {a} of size {n} is not whole heads of an even head_dim {head_dim}"
        )
    within = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    within = np.argsort(within) if inverse else within
    order = (np.arange(0, n, head_dim)[:, None] + within[None, :]).reshape(-1)
    return zero_origin(tensor[ts.d[a].oindex[order]])


def take(tensor: ts.TensorStore, axis: int, index: int) -> ts.TensorStore:
    """Select one index along ``axis``, dropping that axis.

    Args:
        tensor: a tensor or a lazy view (``tensorstore.TensorStore``; numpy arrays are wrapped)
        axis: the axis to select on (negative counts from the end)
        index: the index kept (negative counts from the end)"""
    tensor, a, n = _view_axis(tensor, axis)
    if not -n <= index < n:
        raise LanguageError(f"index {index} out of range for axis {a} of size {n}")
    return zero_origin(tensor[ts.d[a][index % n]])


def slice_axis(tensor: ts.TensorStore, axis: int, start: int, stop: int) -> ts.TensorStore:
    """The indices ``[start, stop)`` of ``axis``, the axis kept.

    Args:
        tensor: a tensor or a lazy view (``tensorstore.TensorStore``; numpy arrays are wrapped)
        axis: the axis to cut
        start: first index kept
        stop: one past the last index kept"""
    tensor, a, n = _view_axis(tensor, axis)
    if not 0 <= start <= stop <= n:
        raise LanguageError(f"slice [{start}, {stop}) out of range for axis {a} of size {n}")
    return zero_origin(tensor[ts.d[a][start:stop]])


def concat(parts: Sequence, axis: int = 0) -> ts.TensorStore:
    """One lazy view of ``parts`` joined along ``axis`` (same dtype, other dimensions equal)."""
    parts = [as_view(p) for p in parts]
    if not parts:
        raise LanguageError("concat of no tensors")
    if len(parts) == 1:
        return parts[0]
    a = checked_axis(parts[0].shape, axis)
    ref = list(parts[0].shape)
    for i, p in enumerate(parts):
        s = list(p.shape)
        if len(s) != len(ref) or s[:a] + s[a + 1 :] != ref[:a] + ref[a + 1 :]:
            raise LanguageError(
                f"concat along axis {a}: part {i} has shape {tuple(s)}, "
                f"incompatible with part 0's {tuple(ref)}"
            )
        if p.dtype != parts[0].dtype:
            raise LanguageError(
                f"concat: part {i} has dtype {p.dtype}, part 0 has {parts[0].dtype}"
            )
    return zero_origin(ts.concat(parts, axis=a))


def stack(parts: Sequence, axis: int = 0) -> ts.TensorStore:
    """One lazy view of equal-shaped ``parts`` stacked along a new ``axis``."""
    parts = [as_view(p) for p in parts]
    if not parts:
        raise LanguageError("stack of no tensors")
    ref = tuple(parts[0].shape)
    for i, p in enumerate(parts):
        if tuple(p.shape) != ref:
            raise LanguageError(f"stack: part {i} has shape {tuple(p.shape)}, part 0 has {ref}")
        if p.dtype != parts[0].dtype:
            raise LanguageError(f"stack: part {i} has dtype {p.dtype}, part 0 has {parts[0].dtype}")
    r = parts[0].rank + 1
    a = axis + r if axis < 0 else axis
    if not 0 <= a < r:
        raise LanguageError(f"stack axis {axis} out of range for rank {r - 1} parts")
    return zero_origin(ts.stack(parts, axis=a))


def split_sizes(tensor: ts.TensorStore, axis: int, sizes: Sequence[int]) -> list[ts.TensorStore]:
    """Split ``axis`` into consecutive pieces of the given sizes (which must add up).

    Args:
        tensor: a tensor or a lazy view (``tensorstore.TensorStore``; numpy arrays are wrapped)
        axis: the axis to split
        sizes: the pieces' extents, in order, adding up to the axis"""
    tensor, a, _ = _view_axis(tensor, axis)
    if sum(sizes) != tensor.shape[a] or any(s < 0 for s in sizes):
        raise LanguageError(
            f"split of axis {a} (size {tensor.shape[a]}) into sizes {list(sizes)}: "
            f"they add up to {sum(sizes)}"
        )
    ends = itertools.accumulate(sizes)
    return [slice_axis(tensor, a, end - s, end) for s, end in zip(sizes, ends)]


def split_even(tensor: ts.TensorStore, axis: int, n: int) -> list[ts.TensorStore]:
    """Split ``axis`` into ``n`` consecutive pieces of equal size.

    Args:
        tensor: a tensor or a lazy view (``tensorstore.TensorStore``; numpy arrays are wrapped)
        axis: the axis to split
        n: how many equal pieces"""
    tensor, a, _ = _view_axis(tensor, axis)
    if n <= 0 or tensor.shape[a] % n:
        raise LanguageError(
            f"axis {a} of size {tensor.shape[a]} does not split into {n} equal parts"
        )
    return split_sizes(tensor, a, [tensor.shape[a] // n] * n)


def split_dim(tensor: ts.TensorStore, axis: int, sizes: Sequence[int]) -> ts.TensorStore:
    """Reshape one axis of size a*b into two axes (a, b); one of them may be -1.

    Args:
        tensor: a tensor or a lazy view (``tensorstore.TensorStore``; numpy arrays are wrapped)
        axis: the axis of size ``a*b`` to split
        sizes: ``(a, b)``; one may be -1 (inferred)"""
    tensor, ax, n = _view_axis(tensor, axis)
    a, b = int(sizes[0]), int(sizes[1])
    if a == -1 and b > 0 and n % b == 0:
        a = n // b
    if b == -1 and a > 0 and n % a == 0:
        b = n // a
    if a <= 0 or b <= 0 or a * b != n:
        raise LanguageError(f"cannot split axis {ax} of size {n} into {list(sizes)}")
    return stack([slice_axis(tensor, ax, i * b, (i + 1) * b) for i in range(a)], axis=ax)


def merge_dims(tensor: ts.TensorStore, axis: int) -> ts.TensorStore:
    """Reshape axes (axis, axis+1) of sizes (a, b) into one axis of size a*b (row-major)."""
    tensor, ax, _ = _view_axis(tensor, axis)
    if ax + 1 >= tensor.rank:
        raise LanguageError(
            f"merge_dims: axis {ax} has no following axis (shape {tuple(tensor.shape)})"
        )
    return concat([take(tensor, ax, i) for i in range(tensor.shape[ax])], axis=ax)


def group_stages(tensor: ts.TensorStore, stages: int, axis: int = 0) -> ts.TensorStore:
    """[L, ...] -> [stages, L/stages, ...] (pipeline grouping).

    Args:
        tensor: a tensor or a lazy view (``tensorstore.TensorStore``; numpy arrays are wrapped)
        stages: pipeline stages (must divide the layers)
        axis: the layer axis"""
    tensor, a, n = _view_axis(tensor, axis)
    if stages <= 0 or n % stages:
        raise LanguageError(
            f"cannot group {n} layers into {stages} pipeline stages: "
            f"{n} is not divisible by {stages}"
        )
    return split_dim(tensor, a, (stages, n // stages))


def regroup_stages(tensor: ts.TensorStore, stages: int, axis: int = 0) -> ts.TensorStore:
    """[S, L/S, ...] -> [stages, L/stages, ...]; an error if L does not divide by ``stages``.

    Args:
        tensor: a tensor or a lazy view (``tensorstore.TensorStore``; numpy arrays are wrapped)
        stages: the new number of pipeline stages
        axis: the saved stage axis (the layer axis follows it)"""
    tensor, a, _ = _view_axis(tensor, axis)
    if tensor.rank < a + 2:
        raise LanguageError(
            f"regroup_stages needs a [stages, layers_per_stage, ...] tensor, got "
            f"shape {tuple(tensor.shape)}"
        )
    n = tensor.shape[a] * tensor.shape[a + 1]
    if stages <= 0 or n % stages:
        raise LanguageError(
            f"cannot regroup {n} layers (saved as {tensor.shape[a]} stages x "
            f"{tensor.shape[a + 1]}) into {stages} pipeline stages: {n} is not divisible "
            f"by {stages}"
        )
    if stages == tensor.shape[a]:
        return tensor
    return group_stages(merge_dims(tensor, a), stages, a)


def pad_axis(tensor: ts.TensorStore, axis: int, size: int) -> ts.TensorStore:
    """Zero-pad ``axis`` at its end to ``size`` (the padding is a small in-memory array).

    Args:
        tensor: a tensor or a lazy view (``tensorstore.TensorStore``; numpy arrays are wrapped)
        axis: the axis to pad at its end
        size: the padded extent (at least the current one)"""
    tensor, a, n = _view_axis(tensor, axis)
    if size < n:
        raise LanguageError(f"pad: axis {a} has size {n} > requested {size}")
    if size == n:
        return tensor
    shape = list(tensor.shape)
    shape[a] = size - n
    z = ts.array(np.zeros(shape, dtype=tensor.dtype.numpy_dtype))
    return concat([tensor, z], axis=a)


# --- fused QKV in Megatron's per-query-group interleaved order -------------------------------


def qkv_sizes(num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
    """(rows per group for q, k, v): (heads_per_group*head_dim, head_dim, head_dim).

    Args:
        num_heads: query heads
        num_kv_heads: key/value heads (query groups; divides ``num_heads``)
        head_dim: rows per head"""
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise LanguageError(
            f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
        )
    return (num_heads // num_kv_heads * head_dim, head_dim, head_dim)


def split_qkv(
    tensor: ts.TensorStore,
    axis: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    interleaved: bool = True,
) -> list[ts.TensorStore]:
    """Fused QKV -> [q, k, v] along ``axis``.

    Args:
        tensor: the fused QKV, a lazy view (``tensorstore.TensorStore``; numpy arrays are wrapped)
        axis: the fused axis
        num_heads: query heads
        num_kv_heads: key/value heads (query groups)
        head_dim: rows per head
        interleaved: Megatron's order, per query group g ``[q heads of g, k_g, v_g]`` (True), or
            a plain ``[Q; K; V]`` (False)"""
    tensor, a, _ = _view_axis(tensor, axis)
    qg, kg, vg = qkv_sizes(num_heads, num_kv_heads, head_dim)
    g = num_kv_heads
    total = g * (qg + kg + vg)
    if tensor.shape[a] != total:
        raise LanguageError(
            f"fused QKV axis {a} has size {tensor.shape[a]}, expected {total} "
            f"(num_heads={num_heads}, num_kv_heads={num_kv_heads}, head_dim={head_dim})"
        )
    if not interleaved:
        return split_sizes(tensor, a, [g * qg, g * kg, g * vg])
    groups = split_even(tensor, a, g)
    per = [split_sizes(x, a, [qg, kg, vg]) for x in groups]
    return [concat([p[j] for p in per], axis=a) for j in range(3)]


def merge_qkv(
    q, k, v, axis: int, num_heads: int, num_kv_heads: int, head_dim: int, interleaved: bool = True
) -> ts.TensorStore:
    """The inverse of ``split_qkv``: q, k and v fused along ``axis``.

    Args:
        q: the query rows (``num_heads * head_dim`` on ``axis``)
        k: the key rows (``num_kv_heads * head_dim``)
        v: the value rows (``num_kv_heads * head_dim``)
        axis: the axis to fuse along
        num_heads: query heads
        num_kv_heads: key/value heads (query groups)
        head_dim: rows per head
        interleaved: Megatron's per-group order (True) or a plain ``[Q; K; V]`` (False)"""
    q, k, v = as_view(q), as_view(k), as_view(v)
    a = checked_axis(q.shape, axis)
    qg, kg, vg = qkv_sizes(num_heads, num_kv_heads, head_dim)
    g = num_kv_heads
    for name, x, want in (("q", q, g * qg), ("k", k, g * kg), ("v", v, g * vg)):
        if x.shape[a] != want:
            raise LanguageError(
                f"merge_qkv: {name} has size {x.shape[a]} on axis {a}, expected {want} "
                f"(num_heads={num_heads}, num_kv_heads={num_kv_heads}, head_dim={head_dim})"
            )
    if not interleaved:
        return concat([q, k, v], axis=a)
    qs, ks, vs = split_even(q, a, g), split_even(k, a, g), split_even(v, a, g)
    return concat([x for i in range(g) for x in (qs[i], ks[i], vs[i])], axis=a)
