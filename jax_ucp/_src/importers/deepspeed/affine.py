"""DeepSpeed's affine maps: where every element of a tensor-parallel parameter lives.

DeepSpeed AutoTP (``tensor_parallel.autotp_size``) records, in ``universal_checkpoint_info``,
``affine_map = {"version": 1, "params": {pattern: map}}``. A map (``deepspeed/checkpoint/
affine.py``, ``ParamAffineMap.to_dict``) is::

    {"logical_shape": [...], "ranks": {tp_rank: {"shard_shape": [...], "pieces": [
        {"shape": [...], "source": [offset, strides], "dest": [offset, strides],
         "locations": [tp ranks holding it], "scale": s (optional; shard == full * s)}]}}}

``source`` addresses the whole parameter, ``dest`` the rank's shard, both as
``torch.as_strided`` arguments on flat buffers. ``ds_to_universal`` prefers a matching map to
the category patterns; so does this reader, with numpy and with every piece checked first: the
maps come from a file, and an unchecked offset or stride would read or write outside the
arrays. A piece held by several ranks must be bit-identical on each. Optimizer moments through
a scaled piece are refused, as DeepSpeed does (the optimizer's lr / eps would stay unscaled).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from jax_ucp._src.errors import LanguageError, SourceError
from jax_ucp._src.format import mapped_file
from jax_ucp._src.importers.deepspeed.files import MAX_DIM
from jax_ucp._src.language.patterns import compile_pattern

#: The affine map encoding this reader understands (DeepSpeed 0.19's AFFINE_MAP_FORMAT_VERSION).
FORMAT_VERSION = 1
#: How a piece's scale applies to each state (DeepSpeed's SCALE_POWER_BY_STATE).
SCALE_POWER = {"fp32": 1, "exp_avg": -1, "exp_avg_sq": -2}


@dataclass(frozen=True)
class Piece:
    """One strided piece of an affine map: its shape, where it comes from and goes to."""

    shape: tuple[int, ...]
    source: tuple[int, tuple[int, ...]]
    dest: tuple[int, tuple[int, ...]]
    locations: frozenset[int]
    scale: float


@dataclass(frozen=True)
class AffineMap:
    """DeepSpeed AutoTP's record of how one parameter's pieces tile its tensor-parallel shards."""

    pattern: str
    logical_shape: tuple[int, ...]
    shard_shapes: dict[int, tuple[int, ...]]
    pieces: dict[int, list[Piece]]


def _ints(value: Any, what: str, where: str, *, length: int | None = None) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_DIM for v in value
    ):
        raise SourceError(f"{where}: {what} is {value!r:.200}; expected non-negative ints")
    if length is not None and len(value) != length:
        raise SourceError(f"{where}: {what} has {len(value)} entries, expected {length}")
    return tuple(int(v) for v in value)


def _extent(shape: tuple[int, ...], offset: int, strides: tuple[int, ...]) -> int:
    """One past the last flat index a strided view touches (0 for an empty view)."""
    if any(d == 0 for d in shape):
        return 0
    return offset + sum((d - 1) * s for d, s in zip(shape, strides)) + 1


def _no_self_overlap(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """No two indices of the view address one element: with the dimensions of size > 1 sorted
    by stride, each stride is at least the span of the ones inside it."""
    span = 1
    for d, s in sorted((pair for pair in zip(shape, strides) if pair[0] > 1), key=lambda p: p[1]):
        if s < span:
            return False
        span = s * d
    return True


def _piece(entry: Any, where: str, tp: int) -> Piece:
    if not isinstance(entry, Mapping):
        raise SourceError(f"{where}: a piece is {type(entry).__name__}, not a dict")
    try:
        shape = _ints(entry["shape"], "shape", where)
        (src_off, src_str), (dst_off, dst_str) = entry["source"], entry["dest"]
        locations = entry["locations"]
    except (KeyError, TypeError, ValueError) as e:
        raise SourceError(
            f"{where}: a piece needs shape, source, dest and locations ({e!r:.100})"
        ) from None
    source, dest = [
        (
            _ints([offset], f"{what} offset", where)[0],
            _ints(strides, f"{what} strides", where, length=len(shape)),
        )
        for what, offset, strides in (("source", src_off, src_str), ("dest", dst_off, dst_str))
    ]
    for what, (_, strides) in (("source", source), ("dest", dest)):
        if not _no_self_overlap(shape, strides):
            raise SourceError(
                f"{where}: {what} strides {list(strides)} of a piece of shape {list(shape)} "
                "address some element twice"
            )
    ranks = _ints(locations, "locations", where)
    if not ranks or any(r >= tp for r in ranks):
        raise SourceError(f"{where}: locations {list(ranks)} outside TP ranks 0..{tp - 1}")
    scale = entry.get("scale", 1.0)
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not math.isfinite(scale)
        or scale == 0
    ):
        raise SourceError(f"{where}: scale {scale!r:.50} is not a finite non-zero number")
    return Piece(shape, source, dest, frozenset(ranks), float(scale))


def parse_affine_maps(info: Mapping, where: str, tp: int) -> list[AffineMap]:
    """The checked affine maps of ``universal_checkpoint_info`` (empty when it has none).

    Args:
        info: ``universal_checkpoint_info``.
        where: the file holding it, for errors.
        tp: the tensor-parallel degree of the run.
    """
    section = info.get("affine_map")
    if not section:
        return []
    if not isinstance(section, Mapping) or not isinstance(section.get("params"), Mapping):
        raise SourceError(f"{where}: affine_map is not a dict with 'params'")
    version = section.get("version", FORMAT_VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or version > FORMAT_VERSION:
        raise SourceError(
            f"{where}: affine_map version {version!r:.50}; this reader knows up to "
            f"{FORMAT_VERSION} (DeepSpeed 0.19) and would misread newer fields"
        )
    return [_affine_map(pattern, entry, where, tp) for pattern, entry in section["params"].items()]


def _affine_map(pattern: Any, entry: Any, where: str, tp: int) -> AffineMap:
    """One pattern's map: the pattern compiles, every TP rank has its shard, each shard checked."""
    at = f"{where}: affine_map[{pattern!r:.100}]"
    try:
        compile_pattern(str(pattern), f"{at}: ")
    except LanguageError as e:
        raise SourceError(str(e)) from None
    if not isinstance(entry, Mapping) or not isinstance(entry.get("ranks"), Mapping):
        raise SourceError(f"{at}: expected a dict with logical_shape and ranks")
    logical = _ints(entry.get("logical_shape"), "logical_shape", at)
    ranks = _map_ranks(entry["ranks"], at, tp)
    shard_shapes, pieces = {}, {}
    full = math.prod(logical)
    for rank, value in sorted(ranks.items()):
        shard_shapes[rank], pieces[rank] = _rank_shard(value, f"{at} rank {rank}", rank, full, tp)
    return AffineMap(str(pattern), logical, shard_shapes, pieces)


def _map_ranks(entries: Mapping, at: str, tp: int) -> dict[int, Mapping]:
    """The map's per-rank entries by integer TP rank: exactly the ranks 0..tp-1."""
    ranks = {}
    for rank, value in entries.items():
        try:
            rank = int(rank)
        except (TypeError, ValueError):
            raise SourceError(f"{at}: rank {rank!r:.50} is not an integer") from None
        if not 0 <= rank < tp or not isinstance(value, Mapping):
            raise SourceError(f"{at}: rank {rank} outside TP ranks 0..{tp - 1}")
        ranks[rank] = value
    if sorted(ranks) != list(range(tp)):
        raise SourceError(f"{at}: pieces for TP ranks {sorted(ranks)}; the checkpoint has tp={tp}")
    return ranks


def _rank_shard(
    value: Mapping, at: str, rank: int, full: int, tp: int
) -> tuple[tuple[int, ...], list[Piece]]:
    """One rank's shard shape and pieces: each piece held by this rank, inside the parameter
    (``full`` elements) and the shard, and the pieces together as large as the shard."""
    shard = _ints(value.get("shard_shape"), "shard_shape", at)
    held = value.get("pieces")
    if not isinstance(held, (list, tuple)):
        raise SourceError(f"{at}: pieces is not a list")
    rank_pieces = [_piece(p, at, tp) for p in held]
    for p in rank_pieces:
        if rank not in p.locations:
            raise SourceError(
                f"{at}: a piece held by ranks {sorted(p.locations)} is listed on rank {rank}"
            )
        if _extent(p.shape, *p.source) > full or _extent(p.shape, *p.dest) > math.prod(shard):
            raise SourceError(
                f"{at}: piece {list(p.shape)} at source {p.source[0]} / dest "
                f"{p.dest[0]} reaches outside the parameter ({full} elements) or the "
                f"shard ({math.prod(shard)})"
            )
    if sum(math.prod(p.shape) for p in rank_pieces) != math.prod(shard):
        raise SourceError(
            f"{at}: pieces hold "
            f"{sum(math.prod(p.shape) for p in rank_pieces)} elements, the shard "
            f"{list(shard)} has {math.prod(shard)}"
        )
    return shard, rank_pieces


def map_for(maps: list[AffineMap], name: str) -> AffineMap | None:
    """The map whose pattern ``re.match``-es ``name`` (anchored at the start, as DeepSpeed);
    two matching maps are an error, as in ``ds_to_universal``."""
    found = [m for m in maps if compile_pattern(m.pattern, "affine_map: ").match(name)]
    if len(found) > 1:
        raise SourceError(
            f"{name}: matched by several affine_map patterns {[m.pattern for m in found]}"
        )
    return found[0] if found else None


def rebuild(amap: AffineMap, shards: list[np.ndarray], state: str, name: str) -> np.ndarray:
    """The whole parameter from each TP rank's shard (``shards[tp_rank]``): every element
    written once; a replicated piece checked bit-identical across its ranks.

    Args:
        amap: the parameter's checked affine map.
        shards: each TP rank's shard, by rank.
        state: the optimizer state being rebuilt, for errors.
        name: the parameter, for errors.
    """
    power = SCALE_POWER.get(state, 1)
    scaled = [p for ps in amap.pieces.values() for p in ps if p.scale != 1.0]
    if power != 1 and scaled:
        raise SourceError(
            f"{name}: {state} through a scaled affine-map piece (scale {scaled[0].scale}); the "
            "optimizer's lr and eps would stay in the unscaled coordinates (DeepSpeed refuses "
            "it too). To import the weights alone: convert(..., importing=ImportOptions(weights_only=True))"
        )
    for rank, shard in enumerate(shards):
        if shard.size != math.prod(amap.shard_shapes[rank]):
            raise SourceError(
                f"{name}: TP rank {rank} holds {shard.size} elements, affine_map "
                f"{amap.pattern!r} describes a shard of {list(amap.shard_shapes[rank])}"
            )
    dtype = shards[0].dtype
    full = np.empty(math.prod(amap.logical_shape), dtype)
    covered = np.zeros(full.size, np.uint8)
    item = full.itemsize
    for rank, shard in enumerate(shards):
        flat = mapped_file.read_out(
            np.ascontiguousarray(shard) if mapped_file.mapped_at(shard) is None else shard,
            f"{name}: TP rank {rank}",
        ).reshape(-1)
        if flat.dtype != dtype:
            raise SourceError(f"{name}: TP rank {rank} is {flat.dtype}, rank 0 {dtype}")
        for p in amap.pieces[rank]:
            if not math.prod(p.shape):
                continue
            src = as_strided(
                flat[p.dest[0] :], p.shape, [s * item for s in p.dest[1]], writeable=False
            )
            if p.scale != 1.0:
                src = (src / np.asarray(p.scale, dtype)).astype(dtype)
            off, strides = p.source
            target = as_strided(full[off:], p.shape, [s * item for s in strides])
            seen = as_strided(covered[off:], p.shape, strides)
            if not seen.any():
                target[...] = src
                seen[...] = 1
            elif seen.all() and len(p.locations) > 1:
                if target.tobytes() != src.tobytes():  # bit for bit
                    raise SourceError(
                        f"{name}: TP ranks {sorted(p.locations)} hold different {state} values "
                        f"for the replicated block at offset {off} (affine_map {amap.pattern!r})"
                    )
            else:
                raise SourceError(
                    f"{name}: affine_map {amap.pattern!r}: a piece of TP rank {rank} at offset "
                    f"{off} overlaps elements another piece already wrote"
                )
    if not covered.all():
        first = int(np.argmin(covered))
        raise SourceError(
            f"{name}: affine_map {amap.pattern!r} leaves {int(full.size - covered.sum())} "
            f"element(s) of {list(amap.logical_shape)} uncovered, the first at offset {first}"
        )
    return full.reshape(amap.logical_shape)
