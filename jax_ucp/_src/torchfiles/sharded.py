"""Where a rank's piece of a DTensor or ShardedTensor lies in the whole, from its inert state; only
layouts the file states (1-D mesh, recorded offsets), else an error."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_ucp._src.errors import SourceError
from jax_ucp._src.torchfiles.allow_list import StandIn, WrapperTensor, short_repr

__all__ = ["Piece", "ShardLayoutError", "assemble", "covers", "dtensor_box", "local_pieces"]

DTENSOR = "torch.distributed.tensor.DTensor"
SHARDED_TENSOR = "torch.distributed._shard.sharded_tensor.api.ShardedTensor"


class ShardLayoutError(SourceError):
    """A DTensor / ShardedTensor whose layout this module does not read."""


@dataclasses.dataclass(frozen=True)
class Piece:
    """A rank's block of a tensor: offsets and bytes; ``replicated``: the whole tensor."""

    offsets: tuple[int, ...]
    array: np.ndarray
    replicated: bool = False


def _attr(obj: Any, name: str, what: str) -> Any:
    if not isinstance(obj, StandIn) or name not in vars(obj):
        raise ShardLayoutError(f"{what}: no {name!r} in {short_repr(obj, 120)}")
    return vars(obj)[name]


def local_pieces(tensor: WrapperTensor, mesh_size: int) -> list[Piece]:
    """The blocks of ``tensor`` this rank's file holds, of ``mesh_size`` ranks."""
    if tensor.qualname == DTENSOR:
        return [_dtensor_piece(tensor, mesh_size)]
    if tensor.qualname == SHARDED_TENSOR:
        return _sharded_tensor_pieces(tensor)
    raise ShardLayoutError(f"{tensor.qualname} is not read")


def _dtensor_piece(tensor: WrapperTensor, mesh_size: int) -> Piece:
    state = tensor.state
    if isinstance(state, tuple) and len(state) == 2 and state[0] is None:
        state = state[1]
    if not isinstance(state, dict) or "_local_tensor" not in state or "_spec" not in state:
        raise ShardLayoutError(f"DTensor state {short_repr(state, 120)} has no local tensor/spec")
    local = state["_local_tensor"]
    if not isinstance(local, np.ndarray) or local.dtype != tensor.dtype:
        raise ShardLayoutError(
            f"DTensor local tensor {short_repr(local, 80)} is not {tensor.dtype}"
        )
    spec = state["_spec"]
    placements = _attr(spec, "placements", "DTensorSpec")
    mesh = _attr(spec, "mesh", "DTensorSpec")
    coordinate = _attr(mesh, "_coordinate_on_dim", "DeviceMesh")
    if not isinstance(placements, (tuple, list)) or len(placements) != 1:
        raise ShardLayoutError(
            f"DTensor placed by {short_repr(placements, 160)}: only a 1-D mesh is read"
        )
    if (
        not isinstance(coordinate, (tuple, list))
        or len(coordinate) != 1
        or type(coordinate[0]) is not int
    ):
        raise ShardLayoutError(f"DeviceMesh coordinate {short_repr(coordinate, 80)} is not 1-D")
    (placement,) = placements
    (coord,) = coordinate
    kind = getattr(placement, "qualname", type(placement).__name__)
    if kind.endswith(".Replicate"):
        if local.shape != tensor.shape:
            raise ShardLayoutError(f"replicated DTensor holds {local.shape}, not {tensor.shape}")
        return Piece((0,) * len(tensor.shape), local, replicated=True)
    if not kind.endswith("placement_types.Shard"):
        raise ShardLayoutError(f"DTensor placement {short_repr(placement, 120)} is not read")
    dim = _attr(placement, "dim", "Shard")
    if type(dim) is not int or not 0 <= dim < len(tensor.shape):
        raise ShardLayoutError(f"Shard dim {short_repr(dim, 40)} of a {tensor.shape} tensor")
    if not 0 <= coord < mesh_size:
        raise ShardLayoutError(f"mesh coordinate {coord} outside {mesh_size} ranks")
    offsets, expected = dtensor_box(tensor.shape, (mesh_size,), (coord,), (dim,))
    if tuple(local.shape) != expected:
        raise ShardLayoutError(
            f"Shard({dim}) piece of rank {coord} of {mesh_size}: expected {expected}, "
            f"found {local.shape}"
        )
    return Piece(offsets, local)


def dtensor_box(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    coords: Sequence[int],
    dims: Sequence[int | None],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, shape) of the shard at mesh ``coords`` by DTensor's own chunking rule.

    Args:
        shape: the whole tensor's shape.
        mesh_shape: the device mesh's shape.
        coords: the rank's coordinate on each mesh dimension.
        dims: per mesh dimension, the tensor dim it shards (``Shard(d)``), None to replicate."""
    offset = [0] * len(shape)
    local = list(shape)
    for mesh_dim, d in enumerate(dims):
        if d is None:
            continue
        if not 0 <= d < len(shape) or mesh_shape[mesh_dim] < 1:
            raise ShardLayoutError(
                f"Shard({d}) over a mesh dimension of {mesh_shape[mesh_dim]} ranks: the tensor "
                f"is {list(shape)}, {len(shape)}-D"
            )
        chunk = -(-local[d] // mesh_shape[mesh_dim])
        start = min(int(coords[mesh_dim]) * chunk, local[d])
        offset[d] += start
        local[d] = max(0, min(local[d], start + chunk) - start)
    return tuple(offset), tuple(local)


def _sharded_tensor_pieces(tensor: WrapperTensor) -> list[Piece]:
    state = tensor.state
    if not isinstance(state, tuple) or len(state) < 2 or not isinstance(state[0], list):
        raise ShardLayoutError(f"ShardedTensor state {short_repr(state, 120)} is not read")
    pieces = []
    for shard in state[0]:
        local = _attr(shard, "tensor", "ShardedTensor shard")
        meta = _attr(shard, "metadata", "ShardedTensor shard")
        offsets = _attr(meta, "shard_offsets", "ShardMetadata")
        sizes = _attr(meta, "shard_sizes", "ShardMetadata")
        if not isinstance(local, np.ndarray) or local.dtype != tensor.dtype:
            raise ShardLayoutError(f"shard tensor {short_repr(local, 80)} is not {tensor.dtype}")
        for name, value in (("offsets", offsets), ("sizes", sizes)):
            if (
                not isinstance(value, (list, tuple))
                or len(value) != len(tensor.shape)
                or not all(type(v) is int and v >= 0 for v in value)
            ):
                raise ShardLayoutError(f"shard {name} {short_repr(value, 80)} of {tensor.shape}")
        if tuple(sizes) != tuple(local.shape) or any(
            o + s > n for o, s, n in zip(offsets, sizes, tensor.shape)
        ):
            raise ShardLayoutError(
                f"shard at {tuple(offsets)} of size {tuple(sizes)} holds {local.shape} "
                f"of a {tensor.shape} tensor"
            )
        pieces.append(Piece(tuple(offsets), local))
    return pieces


def covers(shape: Sequence[int], pieces: Sequence[Piece]) -> str | None:
    """None when the non-replicated ``pieces`` tile ``shape`` exactly, else what is wrong."""
    total = math.prod(shape)
    found = sum(p.array.size for p in pieces)
    if found != total:
        return f"the pieces hold {found} elements, the tensor {total}"
    boxes = sorted((p.offsets, p.array.shape) for p in pieces)
    for i, (a_off, a_shape) in enumerate(boxes):
        for b_off, b_shape in boxes[i + 1 :]:
            if (
                all(
                    ao < bo + bs and bo < ao + as_
                    for ao, as_, bo, bs in zip(a_off, a_shape, b_off, b_shape)
                )
                and all(a_shape)
                and all(b_shape)
            ):
                return f"pieces at {a_off} and {b_off} overlap"
    return None


def assemble(
    shape: tuple[int, ...], dtype: np.dtype, pieces: Sequence[Piece], start: int = 0, stop=None
) -> np.ndarray:
    """Rows ``start:stop`` of the whole tensor from its ``pieces`` (checked to tile it).

    Args:
        shape: the whole tensor's shape.
        dtype: its dtype.
        pieces: its blocks (every rank's).
        start: the first row.
        stop: past the last row (None: the end)."""
    for piece in pieces:  # numpy would cast another dtype's values without a word
        if np.dtype(piece.array.dtype).name != np.dtype(dtype).name:
            raise ShardLayoutError(
                f"a piece at {piece.offsets} holds {piece.array.dtype}, the tensor is "
                f"{np.dtype(dtype)}: its storage type disagrees with the other pieces'"
            )
    if not shape:
        return np.array(pieces[0].array, dtype=dtype)
    stop = shape[0] if stop is None else stop
    out = np.empty((stop - start, *shape[1:]), dtype)
    for piece in pieces:
        lo = piece.offsets[0]
        hi = lo + piece.array.shape[0]
        a, b = max(lo, start), min(hi, stop)
        if a >= b:
            continue
        region = (slice(a - start, b - start),) + tuple(
            slice(o, o + n) for o, n in zip(piece.offsets[1:], piece.array.shape[1:])
        )
        out[region] = piece.array[a - lo : b - lo]
    return out
