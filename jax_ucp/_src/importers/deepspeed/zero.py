"""One model-parallel rank's ZeRO 1/2/3 partitions, reassembled one parameter at a time.

Layouts (DeepSpeed 0.19, checked against ``ds_to_universal`` and ``zero_to_fp32``):

* stage 1/2: DP rank r's ``optimizer_state_dict`` holds, per param group g, a flat fp32 partition
  ``single_partition_of_fp32_groups[g]`` and flat ``base_optimizer_state.state[g]`` {step,
  exp_avg, exp_avg_sq}; ``param_slice_mappings[g][name] = fragment_address(numel, start)`` says
  which slice of rank r's partition holds which part of the parameter (a parameter can straddle
  ranks; group ends are padded, ``group_paddings``). Concatenating the fragments in rank order
  gives the flattened parameter.
* stage 3: DP rank r holds ``fp32_flat_groups`` (one flat tensor per sub-group; virtually
  concatenated) and ``optimizer_state_dict.state[i]`` per sub-group. Each parameter of
  ``param_shapes`` (in order) takes ``ceil(numel / W)`` elements of every rank's flat vector;
  rank r holds elements ``[r*p, (r+1)*p)`` of the flattened parameter, the tail padded.

A plain ZeRO checkpoint is one such rank; a Megatron-DeepSpeed TP/PP checkpoint is a grid of them
(:mod:`deepspeed.megatron`). Everything stays memory-mapped until a parameter is yielded.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jax_ucp._src import writer
from jax_ucp._src.errors import SourceError
from jax_ucp._src.facts import ABSENT, Facts
from jax_ucp._src.format import mapped_file
from jax_ucp._src.importers.deepspeed.files import (
    ZERO3_MODEL_FILE,
    OptimizerStates,
    dtype_of_run,
    file_name,
    frozen_shapes_of,
    is_bf16_optimizer,
    listed,
    load_model_states,
    param_shapes_of,
    rank0_optimizer_states,
    require,
    source_record,
    sourced_item,
)
from jax_ucp._src.importers.plan import (
    ADAM_TREES,
    TENSORS,
    VALUES,
    ImportOptions,
    agreed_step,
    count_item,
    host_item,
    jsonable,
    skip,
    tensor_names,
)
from jax_ucp._src.store.storage import Storage
from jax_ucp._src.torchfiles.allow_list import StandIn

#: The optimizer states of a parameter, in output order, with where each goes in the output tree.
STATE_TREES: tuple[tuple[str, tuple[str, ...]], ...] = (("fp32", ("params",)), *ADAM_TREES.items())


#: Stage 3's model states file of one (DP rank, model-parallel rank).
ZERO3_MODEL_NAME = "zero_pp_rank_{}_mp_rank_{:02d}_model_states.pt"


@dataclass(frozen=True)
class Piece:
    """A contiguous part of a flattened parameter in one DP rank's flat state vector."""

    dp_rank: int
    start: int  # in the rank's (virtual) flat vector
    numel: int


@dataclass(frozen=True)
class ParameterFragments:
    """Where a parameter lives: its param group and its pieces in DP-rank order."""

    group: int
    pieces: list[Piece]


@dataclass
class DeepSpeedCheckpoint:
    """One model-parallel rank's ZeRO files, validated up front (the whole checkpoint when there
    is no tensor/pipeline parallelism)."""

    tag_dir: Storage
    stage: int
    world_size: int
    model_dtype: np.dtype
    param_shapes: list[dict[str, tuple[int, ...]]]  # per param group (stage 3: as stored)
    model_file: str
    optim_files: list[str]
    model_states: Mapping
    optim_states: list[dict]  # per DP rank: the 'optimizer_state_dict'
    module: Mapping[str, np.ndarray] = field(default_factory=dict)
    shared_params: Mapping[str, str] = field(default_factory=dict)
    fragment_plan: dict[str, ParameterFragments] = field(default_factory=dict)
    # requires_grad=False parameters: name -> shape, and where their weights are (stage 1/2:
    # whole in the model states file; stage 3: one partition per DP rank's model states file)
    frozen: dict[str, tuple[int, ...]] = field(default_factory=dict)
    frozen_files: list[str] = field(default_factory=list)
    mp_rank: int = 0  # the model-parallel rank these files are of (stage-3 file names)
    optim_configs: list = field(default_factory=list)  # per DP rank: its file's ds_config
    # DeepSpeed MoE (stage 1/2): the output name of a name in DP rank r's param_slice_mappings
    # of group g (local expert index -> global), and per group the DP-rank distance between
    # consecutive ranks of its partition (expert groups are partitioned over the
    # expert-data-parallel ranks, ``ep_size`` apart)
    rename: Callable[[int, int, str], str] | None = None
    rank_stride: dict[int, int] = field(default_factory=dict)
    # where a ``module`` entry was read from when not ``<model file>:module.<name>`` (experts)
    module_tensors: dict[str, str] = field(default_factory=dict)

    @functools.cached_property  # asked per parameter and state: built once, not O(N) each time
    def names(self) -> list[str]:
        return [name for group in self.param_shapes for name in group]

    @functools.cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: shape for group in self.param_shapes for name, shape in group.items()}

    @property
    def model_files(self) -> list[str]:
        """The rank's model states files: one, or stage 3's one per DP rank."""
        if self.stage != 3:
            return [self.model_file]
        return [
            self.tag_dir.join(ZERO3_MODEL_NAME.format(r, self.mp_rank))
            for r in range(self.world_size)
        ]

    def module_tensor(self, name: str) -> str:
        """The source tensor (``<file>:<key>``) of ``module`` entry ``name``."""
        default = f"{file_name(self.model_file)}:module.{name}"
        return self.module_tensors.get(name, default)


# --------------------------------------------------------------------------- opening


def open_zero_checkpoint(tag_dir: Storage) -> DeepSpeedCheckpoint:
    """The ZeRO files of a tag folder without tensor/pipeline parallelism (MP rank 0 only)."""
    optimizer = rank0_optimizer_states(tag_dir, "ZeRO", (1, 2, 3))
    model_file = model_states_file(tag_dir, optimizer)
    model_states = load_model_states(tag_dir, file_name(model_file))
    if model_states.get("mp_world_size", 1) not in (None, 1):
        raise SourceError(
            f"{model_file}: mp_world_size is {model_states['mp_world_size']} but the folder holds "
            f"the files of model-parallel rank 0 only (missing mp_rank_01_* files?)"
        )
    return open_zero_rank(tag_dir, model_file, model_states, optimizer)


def model_states_file(tag_dir: Storage, optimizer: OptimizerStates, mp_rank: int = 0) -> str:
    """The model states file of the stage (of model-parallel rank ``mp_rank``); stage 3 also
    needs one file per DP rank.

    Args:
        tag_dir: the tag folder.
        optimizer: the checked optimizer files (their stage).
        mp_rank: the model-parallel rank.
    """
    if optimizer.stage in (1, 2):
        return tag_dir.join(f"mp_rank_{mp_rank:02d}_model_states.pt")
    if optimizer.stage != 3:
        raise SourceError(f"{optimizer.files[0]}: unsupported zero_stage {optimizer.stage}")
    names = listed(tag_dir) or []
    for dp_rank in range(optimizer.world_size):  # each read as a regular file (TorchArchive)
        if (name := ZERO3_MODEL_NAME.format(dp_rank, mp_rank)) not in names:
            raise SourceError(
                f"{tag_dir.join(name)}: missing stage-3 model states file for DP rank {dp_rank}"
            )
    matches = map(ZERO3_MODEL_FILE.match, names)
    found = sum(1 for m in matches if m and int(m.group(2)) == mp_rank)
    if found != optimizer.world_size:
        raise SourceError(
            f"{tag_dir.root}: world size metadata says {optimizer.world_size} DP ranks but found "
            f"{found} stage-3 model states files"
            + (f" of model-parallel rank {mp_rank}" if mp_rank else "")
        )
    return tag_dir.join(ZERO3_MODEL_NAME.format(0, mp_rank))


def open_zero_rank(
    tag_dir: Storage,
    model_file: str,
    model_states: Mapping,
    optimizer: OptimizerStates,
    mp_rank: int = 0,
    *,
    param_shapes: list[dict[str, tuple[int, ...]]] | None = None,
    module: Mapping | None = None,
    **layout: Any,
) -> DeepSpeedCheckpoint:
    """One model-parallel rank from its model states and checked optimizer files; checks that
    the optimizer partitions hold exactly every parameter of ``param_shapes``.

    Args:
        tag_dir: the tag folder.
        model_file: the rank's model states file.
        model_states: its loaded content.
        optimizer: the rank's checked optimizer files.
        mp_rank: the model-parallel rank.
        param_shapes: each group's parameter shapes (None: the model states' ``param_shapes``).
        module: the model weights (None: the model states' ``module``).
        layout: further ``DeepSpeedCheckpoint`` fields (MoE: ``rename``, ``rank_stride``,
            ``module_tensors``).
    """
    recorded = model_states.get("dp_world_size")
    if recorded is not None and int(recorded) != optimizer.world_size:
        raise SourceError(
            f"{model_file}: dp_world_size is {recorded} but the optimizer files say "
            f"{optimizer.world_size} (partition_count in {optimizer.files[0]})"
        )
    if param_shapes is None:
        param_shapes = param_shapes_of(model_states, model_file)
    if module is None:
        module = model_states.get("module") or {}
    # DeepSpeed's shared_params: tied name (not stored) -> the stored parameter's name
    shared = model_states.get("shared_params") or {}
    if not isinstance(shared, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in shared.items()
    ):
        raise SourceError(f"{model_file}: shared_params is not a dict of names")
    checkpoint = DeepSpeedCheckpoint(
        tag_dir=tag_dir,
        stage=optimizer.stage,
        world_size=optimizer.world_size,
        model_dtype=dtype_of_run(model_states.get("ds_config") or {}, module),
        param_shapes=param_shapes,
        model_file=model_file,
        optim_files=optimizer.files,
        model_states=model_states,
        optim_states=optimizer.states,
        optim_configs=optimizer.configs,
        module=module,
        shared_params=dict(shared),
        mp_rank=mp_rank,
        **layout,
    )
    checkpoint.fragment_plan = plan_fragments(checkpoint)
    checkpoint.frozen = frozen_shapes_of(model_states, model_file, checkpoint.names)
    if checkpoint.frozen:
        checkpoint.frozen_files = checkpoint.model_files
    return checkpoint


# --------------------------------------------------------------------------- fragment maps


class FlatVector:
    """Several flat arrays of one rank seen as one vector (stage-3 sub-groups)."""

    def __init__(self, arrays: Sequence[np.ndarray], what: str):
        self.arrays = [np.asarray(a).reshape(-1) for a in arrays]
        self.offsets = np.cumsum([0] + [a.size for a in self.arrays]).tolist()
        self.what = what

    @property
    def size(self) -> int:
        return self.offsets[-1]

    def take(self, start: int, count: int) -> list[np.ndarray]:
        """Views of elements ``[start, start + count)``, one per array they span."""
        if start + count > self.size:
            raise SourceError(
                f"{self.what}: needs elements [{start}, {start + count}) but holds {self.size}"
            )
        out = []
        for array, offset in zip(self.arrays, self.offsets):
            low, high = max(start, offset), min(start + count, offset + array.size)
            if low < high:
                out.append(array[low - offset : high - offset])
        return out


def plan_fragments(checkpoint: DeepSpeedCheckpoint) -> dict[str, ParameterFragments]:
    """Where every parameter's pieces are, checked against the partitions' sizes before any
    tensor byte is read."""
    if checkpoint.stage in (1, 2):
        _check_stage12_partitions(checkpoint)
        plan = _plan_stage12(checkpoint)
        _check_stage12_contiguity(checkpoint, plan)
    else:
        plan = _plan_stage3(checkpoint)
    shapes = checkpoint.shapes
    for name, fragments in plan.items():
        held = sum(piece.numel for piece in fragments.pieces)
        if held != math.prod(shapes[name]):
            raise SourceError(
                f"{checkpoint.tag_dir.root}: parameter {name!r} shape {shapes[name]} has "
                f"{math.prod(shapes[name])} elements but the optimizer files hold {held} "
                f"(ranks {[piece.dp_rank for piece in fragments.pieces]})"
            )
    return plan


def _plan_stage12(checkpoint: DeepSpeedCheckpoint) -> dict[str, ParameterFragments]:
    """From every rank's ``param_slice_mappings``: name -> (group, pieces in rank order).

    Every fragment is checked before any tensor byte is read: a positive element count from a
    non-negative start, inside its rank's partition, and no two parameters on the same
    elements. The sum per parameter is checked against its shape by the caller. Without these,
    a mapping onto another parameter's range (or a negative start, which numpy reads from the
    end) imports wrong values whenever the model weights are not there to compare against."""
    plan = {
        name: ParameterFragments(group, [])
        for group, shapes in enumerate(checkpoint.param_shapes)
        for name in shapes
    }
    for dp_rank, optimizer_state in enumerate(checkpoint.optim_states):
        path = checkpoint.optim_files[dp_rank]
        slice_mappings = require(optimizer_state, "param_slice_mappings", path)
        if len(slice_mappings) != len(checkpoint.param_shapes):
            raise SourceError(
                f"{path}: {len(slice_mappings)} param groups in param_slice_mappings, "
                f"{checkpoint.model_file} has {len(checkpoint.param_shapes)}"
            )
        for group, mapping in enumerate(slice_mappings):
            for name, address in mapping.items():
                if checkpoint.rename is not None:
                    name = checkpoint.rename(dp_rank, group, name)
                fragments = plan.get(name)
                if fragments is None:
                    raise SourceError(
                        f"{path}: parameter {name!r} in param_slice_mappings is not in "
                        f"param_shapes of {checkpoint.model_file}"
                    )
                if fragments.group != group:
                    raise SourceError(
                        f"{path}: parameter {name!r} in group {group}, expected {fragments.group}"
                    )
                if not isinstance(address, StandIn) or not all(
                    hasattr(address, attribute) for attribute in ("numel", "start")
                ):
                    raise SourceError(f"{path}: bad fragment_address for {name!r}: {address!r}")
                # a StandIn: its attributes come from the pickle (getattr for pyright)
                start, count = getattr(address, "start"), getattr(address, "numel")  # noqa: B009
                size = optimizer_state["single_partition_of_fp32_groups"][group].size
                ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (start, count))
                if not (ints and start >= 0 and count > 0):
                    raise SourceError(
                        f"{path}: parameter {name!r}: fragment_address start={start!r} "
                        f"numel={count!r}; expected a start >= 0 and numel > 0"
                    )
                if start + count > size:
                    raise SourceError(
                        f"{path}: parameter {name!r}: fragment [{start}, {start + count}) reaches "
                        f"past the end of group {group}'s partition of {size} elements"
                    )
                fragments.pieces.append(Piece(dp_rank, int(start), int(count)))
        _check_no_overlap(plan, dp_rank, path)
    return plan


def _check_no_overlap(plan: Mapping[str, ParameterFragments], dp_rank: int, path: str) -> None:
    """No element of DP rank ``dp_rank``'s partitions belongs to two parameters."""
    spans = sorted(
        (fragments.group, piece.start, piece.start + piece.numel, name)
        for name, fragments in plan.items()
        for piece in fragments.pieces
        if piece.dp_rank == dp_rank
    )
    for (group, start, end, name), (next_group, next_start, next_end, other) in itertools.pairwise(
        spans
    ):
        if group == next_group and next_start < end:
            raise SourceError(
                f"{path}: parameters {name!r} (elements [{start}, {end})) and {other!r} "
                f"([{next_start}, {next_end})) overlap in group {group}'s partition; each "
                "element belongs to one parameter"
            )


def _plan_stage3(checkpoint: DeepSpeedCheckpoint) -> dict[str, ParameterFragments]:
    """Stage 3 records no map: each parameter of the stored ``param_shapes`` takes
    ``ceil(numel / W)`` of every rank, in order; every rank's flat fp32 vector is exactly as long
    as its share. A group of ``rank_stride`` s (AutoEP's experts) is partitioned over W / s
    ranks ``e, e + s, ...`` for each e < s, each a parameter of its own (``rename(e, ...)``)."""
    plan: dict[str, ParameterFragments] = {}
    offset = 0
    world, rename = checkpoint.world_size, checkpoint.rename or (lambda _, __, name: name)
    stored = checkpoint.param_shapes
    if checkpoint.rename is not None:  # param_shapes holds the output names
        stored = param_shapes_of(checkpoint.model_states, checkpoint.model_file)
    for group, shapes in enumerate(stored):
        stride = checkpoint.rank_stride.get(group, 1)
        for name, shape in shapes.items():
            count = math.prod(shape)
            part = math.ceil(count * stride / world)
            for first in range(stride):
                ranks = range(first, world, stride)
                takes = ((r, min(part, count - i * part)) for i, r in enumerate(ranks))
                pieces = [Piece(r, offset, take) for r, take in takes if take > 0]
                plan[rename(first, group, name)] = ParameterFragments(group, pieces)
            offset += part
    for dp_rank, optimizer_state in enumerate(checkpoint.optim_states):
        path = checkpoint.optim_files[dp_rank]
        fp32 = FlatVector(
            require(optimizer_state, "fp32_flat_groups", path), f"{path} fp32_flat_groups"
        )
        if fp32.size != offset:
            raise SourceError(
                f"{path}: fp32_flat_groups hold {fp32.size} elements; param_shapes in "
                f"{checkpoint.model_file} with {world} DP ranks need {offset}"
            )
    return plan


def _check_stage12_partitions(checkpoint: DeepSpeedCheckpoint) -> None:
    """Every group has an fp32 partition, and moments at least as long."""
    groups = len(checkpoint.param_shapes)
    for dp_rank, optimizer_state in enumerate(checkpoint.optim_states):
        path = checkpoint.optim_files[dp_rank]
        fp32 = require(optimizer_state, "single_partition_of_fp32_groups", path)
        inner = require(require(optimizer_state, "base_optimizer_state", path), "state", path)
        if not isinstance(fp32, (list, tuple)) or not all(
            isinstance(part, np.ndarray) for part in fp32
        ):
            raise SourceError(f"{path}: single_partition_of_fp32_groups is not a list of tensors")
        if len(fp32) != groups:
            raise SourceError(f"{path}: {len(fp32)} fp32 partitions for {groups} groups")
        for group in range(len(fp32)):
            group_state = require(inner, group, f"{path} state")
            for state_name in ("exp_avg", "exp_avg_sq"):
                moment = require(group_state, state_name, f"{path} state[{group}]")
                if not isinstance(moment, np.ndarray):
                    raise SourceError(
                        f"{path}: group {group} {state_name} is a {type(moment).__name__}, "
                        "expected a tensor"
                    )
                if moment.size < fp32[group].size:
                    raise SourceError(
                        f"{path}: group {group} {state_name} has {moment.size} elements, "
                        f"fp32 partition has {fp32[group].size}"
                    )


def _check_stage12_contiguity(
    checkpoint: DeepSpeedCheckpoint, plan: Mapping[str, ParameterFragments]
) -> None:
    """A parameter split across ranks continues on the next rank: its piece on a rank ends at
    that rank's partition end, and the next piece starts at 0 on the next rank. Rank files in
    the wrong order break this for every parameter that straddles two partitions."""
    for name, fragments in plan.items():
        pieces = fragments.pieces
        stride = checkpoint.rank_stride.get(fragments.group, 1)
        for before, after in itertools.pairwise(pieces):
            partition = checkpoint.optim_states[before.dp_rank]["single_partition_of_fp32_groups"]
            end = partition[fragments.group].size
            if (
                after.dp_rank != before.dp_rank + stride
                or before.start + before.numel != end
                or after.start != 0
            ):
                raise SourceError(
                    f"{checkpoint.optim_files[after.dp_rank]}: parameter {name!r} does not "
                    f"continue where {file_name(checkpoint.optim_files[before.dp_rank])} "
                    f"leaves it (piece [{before.start}, {before.start + before.numel}) of a "
                    f"{end}-element partition, then one at {after.start} on DP rank "
                    f"{after.dp_rank}): rank files out of order, renamed or from different saves"
                )


def check_against_module(checkpoint: DeepSpeedCheckpoint, name: str, fp32: np.ndarray) -> None:
    """The fp32 master assembled from the rank files must round to the model weight DeepSpeed
    saved beside it (stage 1/2 keep the whole module; DeepSpeed copies master -> model after
    every step). Checked at both ends of every rank's piece: swapped or stale partitions
    disagree there.

    Args:
        checkpoint: the opened ZeRO checkpoint (one model-parallel rank).
        name: the parameter.
        fp32: its assembled fp32 master.
    """
    stored = checkpoint.module.get(name)
    if not (isinstance(stored, np.ndarray) and stored.shape == fp32.shape and stored.size):
        return
    pieces = checkpoint.fragment_plan[name].pieces
    at = np.cumsum([0] + [piece.numel for piece in pieces])
    index = np.unique(np.concatenate([at[:-1], at[1:] - 1]).astype(np.int64))
    want = mapped_file.take(stored, index, f"reading {name!r}")
    found = mapped_file.take(fp32, index, f"reading {name!r}").astype(stored.dtype)
    same = (want.view(np.uint8) == found.view(np.uint8)).reshape(len(index), -1).all(axis=1)
    if not same.all():
        bad = int(np.argmin(same))
        raise SourceError(
            f"parameter {name!r}: the fp32 master in "
            f"{[file_name(checkpoint.optim_files[p.dp_rank]) for p in pieces]} "
            f"gives {found[bad]!r} at flat index {int(index[bad])}, the model weight in "
            f"{checkpoint.module_tensors.get(name, checkpoint.model_file)} is "
            f"{want[bad]!r}: rank files renamed, swapped or from different saves"
        )


# --------------------------------------------------------------------------- reading


def _layout(checkpoint: DeepSpeedCheckpoint) -> tuple[str, str]:
    """Where a rank's ``optimizer_state_dict`` keeps the flat fp32 masters and the torch
    optimizer's own state dict (stage 1/2: per param group; stage 3: per sub-group)."""
    if checkpoint.stage in (1, 2):
        return "single_partition_of_fp32_groups", "base_optimizer_state"
    return "fp32_flat_groups", "optimizer_state_dict"


def _state_arrays(
    checkpoint: DeepSpeedCheckpoint, dp_rank: int, state_name: str
) -> list[tuple[str, np.ndarray]]:
    """DP rank ``dp_rank``'s flat arrays of one optimizer state, each with its dotted path in
    the rank file: one per param group (stage 1/2), or per sub-group (stage 3)."""
    state, path = checkpoint.optim_states[dp_rank], checkpoint.optim_files[dp_rank]
    fp32_key, inner_key = _layout(checkpoint)
    if state_name == "fp32":
        return [(f"optimizer_state_dict.{fp32_key}.{i}", a) for i, a in enumerate(state[fp32_key])]
    inner = require(require(state, inner_key, path), "state", f"{path} {inner_key}")
    keys = range(len(checkpoint.param_shapes)) if checkpoint.stage in (1, 2) else sorted(inner)
    return [
        (
            f"optimizer_state_dict.{inner_key}.state.{k}.{state_name}",
            np.asarray(require(inner[k], state_name, f"{path} state[{k}]")).reshape(-1),
        )
        for k in keys
    ]


def gather_parameter(
    checkpoint: DeepSpeedCheckpoint, name: str, state_name: str, vectors: dict
) -> np.ndarray:
    """One optimizer state of parameter ``name``, in its shape (a view of the memory map when it
    sits on one rank). ``vectors`` caches each DP rank's flat vectors by (DP rank, state name).

    Args:
        checkpoint: the opened ZeRO checkpoint (one model-parallel rank).
        name: the parameter.
        state_name: "fp32", "exp_avg" or "exp_avg_sq".
        vectors: the cache of the flat vectors.
    """
    parts, shape = _parts(checkpoint, name, state_name, vectors), checkpoint.shapes[name]
    return (
        parts[0].reshape(shape) if len(parts) == 1 else joined_parts(parts, shape, parts[0].dtype)
    )


def _parts(checkpoint: DeepSpeedCheckpoint, name: str, state_name: str, vectors: dict) -> list:
    """The views of the rank files (memory maps) that hold ``name``'s ``state_name``, in order."""
    fragments = checkpoint.fragment_plan[name]
    parts: list[np.ndarray] = []
    for piece in fragments.pieces:
        key = (piece.dp_rank, state_name)
        if key not in vectors:  # stage 1/2: one array per param group; 3: one virtual vector
            arrays = [array for _, array in _state_arrays(checkpoint, piece.dp_rank, state_name)]
            what = "fp32_flat_groups" if state_name == "fp32" else state_name
            what = f"{checkpoint.optim_files[piece.dp_rank]} {what}"
            vectors[key] = arrays if checkpoint.stage in (1, 2) else FlatVector(arrays, what)
        vector = vectors[key]
        if isinstance(vector, FlatVector):
            parts.extend(vector.take(piece.start, piece.numel))
            continue
        # inside: _plan_stage12 bounds it by the fp32 partition, no moment is shorter
        parts.append(vector[fragments.group][piece.start : piece.start + piece.numel])
    return parts


def joined_parts(parts: list, shape, dtype) -> np.ndarray:
    """``parts`` end to end (cast to ``dtype``) in their own mapping, unmapped once the writer
    drops it (``writer.unpooled_empty``).

    Args:
        parts: the flat pieces, in order.
        shape: the joined tensor's shape.
        dtype: its dtype.
    """
    out = writer.unpooled_empty((sum(p.size for p in parts),), dtype)
    at = 0
    for part in parts:
        mapped_file.copy_into(out[at : at + part.size], part.reshape(-1))
        at += part.size
    return out.reshape(shape)


def flat_rows(parts: list, shape, dtype) -> Callable[[int, int], np.ndarray]:
    """``rows(lo, hi)``: rows ``lo:hi`` of ``parts`` joined end to end into ``shape`` (cast to
    ``dtype``), copied from the pieces that hold them alone: a direct restore's process reads
    its rows, not every rank's partition of the parameter.

    Args:
        parts: the flat pieces, in order.
        shape: the joined tensor's shape.
        dtype: its dtype.
    """
    inner = math.prod(shape[1:])

    def rows(lo: int, hi: int) -> np.ndarray:
        out = np.empty((hi - lo) * inner, dtype)
        start, stop, at = lo * inner, hi * inner, 0
        for part in parts:
            a, b = max(start, at), min(stop, at + part.size)
            if a < b:
                piece = part.reshape(-1)[a - at : b - at]
                mapped_file.copy_into(out[a - start : b - start], piece)
            at += part.size
        return out.reshape((hi - lo, *shape[1:]))

    return rows


def _state_item(
    checkpoint: DeepSpeedCheckpoint, name: str, state_name: str, vectors: dict
) -> np.ndarray | writer.Deferred:
    """A view of the rank file when the state sits on one rank, else a ``writer.Deferred``
    joining its pieces once the writer has room for it (ZeRO-3 splits every parameter over
    the ranks: joined in the generator, each was held beside the writer's window); the fp32
    master checked against the stored module weight either way."""
    parts = _parts(checkpoint, name, state_name, vectors)
    shape = tuple(checkpoint.shapes[name])

    def make() -> np.ndarray:
        value = gather_parameter(checkpoint, name, state_name, vectors)
        if state_name == "fp32" and checkpoint.stage in (1, 2):
            check_against_module(checkpoint, name, value)
        return value

    if len(parts) == 1:
        return make()
    if checkpoint.stage in (1, 2) or not shape:  # the master checked whole
        return writer.Deferred(shape, parts[0].dtype, make)
    rows = flat_rows(parts, shape, parts[0].dtype)
    return writer.Deferred(shape, parts[0].dtype, make, rows=rows, ranged=True)


def _steps(checkpoint: DeepSpeedCheckpoint) -> Iterator[tuple[str, str, Any]]:
    """Every rank's per-group ``step``: its source name (``<rank file>:<path>``), where it is
    (for messages) and its value (older torch kept Adam's step as a Python number)."""
    _, inner = _layout(checkpoint)
    for path, state in zip(checkpoint.optim_files, checkpoint.optim_states):
        file = file_name(path)
        for group, group_state in state[inner]["state"].items():
            if "step" in group_state:
                name = f"{file}:optimizer_state_dict.{inner}.state.{group}.step"
                yield name, f"in {file} group {group}", group_state["step"]


def optimizer_step(*checkpoints: DeepSpeedCheckpoint) -> int:
    """The step every rank and param group (of every model-parallel rank given) agrees on
    (``opt_state.count``)."""
    seen: dict[float, str] = {}
    for checkpoint in checkpoints:
        for _, place, step in _steps(checkpoint):
            seen.setdefault(float(mapped_file.read_out(np.asarray(step))), place)
    return agreed_step(
        seen,
        checkpoints[0].tag_dir.root,
        recorded_by="ranks or parameter groups",
        error=SourceError,
    )


def step_sources(*checkpoints: DeepSpeedCheckpoint) -> dict[str, list[str]]:
    """What ``opt_state.count`` is built from, as provenance: the ``step`` tensors, and the steps
    pickled as Python numbers (values, not tensors, but sources all the same)."""
    steps = [(name, isinstance(v, np.ndarray)) for c in checkpoints for name, _, v in _steps(c)]
    out = {TENSORS: [name for name, is_tensor in steps if is_tensor]}
    if values := [name for name, is_tensor in steps if not is_tensor]:
        out[VALUES] = values
    return out


# --------------------------------------------------------------------------- streaming


def iter_zero_items(
    checkpoint: DeepSpeedCheckpoint, options: ImportOptions
) -> Iterator[writer.HostItem]:
    """params / mu / nu / model_params one parameter at a time (this process's share), then
    ``opt_state.count``; ``options.weights_only``: params and model_params alone."""
    weights_only, share = options.weights_only, options.share
    vectors: dict[tuple[int, str], Any] = {}
    files = [file_name(f) for f in checkpoint.optim_files]
    for name in share.pick(checkpoint.names):
        pieces = checkpoint.fragment_plan[name].pieces
        provenance = {
            "files": sorted({files[piece.dp_rank] for piece in pieces}),
            "zero_stage": checkpoint.stage,
            "pattern": f"zero{checkpoint.stage}-flat",
            "dp_ranks": [piece.dp_rank for piece in pieces],
        }
        for state_name, tree in STATE_TREES[:1] if weights_only else STATE_TREES:
            value = _state_item(checkpoint, name, state_name, vectors)
            sources = piece_tensors(checkpoint, name, state_name)
            yield host_item((*tree, name), value, dict(provenance, tensors=sources))
            del value
        if checkpoint.model_dtype != np.dtype(np.float32):
            fp32 = _parts(checkpoint, name, "fp32", vectors)
            yield _model_copy_item(checkpoint, name, fp32, piece_tensors(checkpoint, name, "fp32"))
    yield from frozen_items(checkpoint, share.pick(checkpoint.frozen))
    if weights_only or not share.primary:
        return
    yield step_item(optimizer_step(checkpoint), checkpoint)


def step_item(step: int, *checkpoints: DeepSpeedCheckpoint) -> writer.HostItem:
    """``opt_state.count``: the ``step`` the ranks' optimizer files agree on, named by them."""
    files = [file_name(f) for c in checkpoints for f in c.optim_files]
    provenance = {"files": files, "pattern": "step", **step_sources(*checkpoints)}
    return count_item(step, provenance)


def piece_tensors(checkpoint: DeepSpeedCheckpoint, name: str, state_name: str) -> list[str]:
    """The source tensors (``<rank file>:<path>``) one optimizer state of ``name`` is read from.

    Args:
        checkpoint: the opened ZeRO checkpoint (one model-parallel rank).
        name: the parameter.
        state_name: "fp32", "exp_avg" or "exp_avg_sq".
    """
    fragments = checkpoint.fragment_plan[name]
    out = []
    for piece in fragments.pieces:
        file = file_name(checkpoint.optim_files[piece.dp_rank])
        named = _state_arrays(checkpoint, piece.dp_rank, state_name)
        if checkpoint.stage in (1, 2):
            out.append(f"{file}:{named[fragments.group][0]}")
            continue
        at = np.cumsum([0] + [array.size for _, array in named]).tolist()
        for (key, _), low, high in zip(named, at, at[1:]):
            if max(low, piece.start) < min(high, piece.start + piece.numel):
                out.append(f"{file}:{key}")
    return out


def zero_tensors(
    checkpoint: DeepSpeedCheckpoint,
    source: dict,
    *,
    weights_only: bool,
    imported_module: set[str] | None = None,
) -> list[str]:
    """Every tensor of the rank's files, as ``<file>:<dotted path>``; those the import does not
    take listed in ``source["skipped"]`` with the reason.

    Args:
        checkpoint: the opened ZeRO checkpoint.
        source: the manifest's source record, whose ``skipped`` is filled.
        weights_only: whether the optimizer state is skipped.
        imported_module: the ``module`` weights imported as ``model_params`` (default: those a
            plain ZeRO import takes).
    """
    found: list[str] = []
    for path, state in zip(checkpoint.optim_files, checkpoint.optim_states):
        file = file_name(path)
        found += [f"{file}:{n}" for n in tensor_names(state, "optimizer_state_dict")]
    module_found = []
    for path in checkpoint.model_files:
        states = _model_states(checkpoint, path)
        names = [f"{file_name(path)}:{n}" for n in tensor_names(states)]
        found += names
        module_found += [n for n in names if n.split(":", 1)[1].startswith("module.")]
    if weights_only:
        moments = [n for n in found if n.rsplit(".", 1)[-1] in ("exp_avg", "exp_avg_sq")]
        skip(source, moments, "weights_only: Adam moment")
        skip(source, step_sources(checkpoint)[TENSORS], "weights_only: optimizer step")
    model_file = file_name(checkpoint.model_file)
    if imported_module is None:  # the stored weights a bf16/fp16 ZeRO 1/2 run imports
        cast = checkpoint.stage in (1, 2) and checkpoint.model_dtype != np.dtype(np.float32)
        imported_module = {
            checkpoint.module_tensor(name)
            for name in checkpoint.names
            if cast
            and isinstance(stored := checkpoint.module.get(name), np.ndarray)
            and stored.size
        }
    for name in module_found:
        if name in imported_module:
            continue
        key = name.split(":", 1)[1][len("module.") :]
        stored = checkpoint.module.get(key) if name.startswith(model_file + ":") else None
        if key in checkpoint.shapes and checkpoint.stage == 3:
            why = "ZeRO-3 placeholder of the model weight; params/ is read from the partitions"
        elif key in checkpoint.shapes:
            why = (
                "the model weight in the run's precision (fp32): the same values as its fp32 "
                "master partitions, imported as params/"
            )
        elif key in checkpoint.frozen:
            why = "frozen parameter: imported from frozen_param_fragments"
        elif key in checkpoint.shared_params:
            why = f"tied to {checkpoint.shared_params[key]!r} (DeepSpeed shared_params)"
        elif isinstance(stored, np.ndarray) and not stored.size:
            why = "0-element placeholder"
        else:  # e.g. DeepSpeed 0.19 ZeRO-1/2 fp32 runs record no frozen_param_shapes
            why = (
                "in module but in neither param_shapes nor frozen_param_shapes (a frozen "
                "parameter or a buffer DeepSpeed does not describe): not imported"
            )
        skip(source, [name], why)
    return found


def _model_states(checkpoint: DeepSpeedCheckpoint, path: str) -> Mapping:
    """The model states file ``path`` of the rank (the one already read, or read now)."""
    if path == checkpoint.model_file:
        return checkpoint.model_states
    return load_model_states(checkpoint.tag_dir, file_name(path))


def _model_copy_item(
    checkpoint: DeepSpeedCheckpoint, name: str, fp32: list[np.ndarray], fp32_tensors: list[str]
) -> writer.HostItem:
    """The model-precision weight: the stored module weight (stage 1/2), else the fp32 master
    (its pieces ``fp32``) cast the way DeepSpeed re-derives it (stage 3 keeps no
    model-precision copy), piece by piece once the writer has room for it."""
    shape = tuple(checkpoint.shapes[name])
    stored = checkpoint.module.get(name) if checkpoint.stage in (1, 2) else None
    if isinstance(stored, np.ndarray) and stored.shape == shape and stored.size:
        if stored.dtype != checkpoint.model_dtype:
            raise SourceError(
                f"{checkpoint.model_file}: {name!r} has dtype {stored.dtype}, run dtype is "
                f"{checkpoint.model_dtype}"
            )
        return sourced_item(
            ("model_params", name), stored, "module", [checkpoint.module_tensor(name)]
        )
    dtype = np.dtype(checkpoint.model_dtype)
    make = functools.partial(joined_parts, fp32, shape, dtype)
    rows = flat_rows(fp32, shape, dtype) if shape else None
    cast = writer.Deferred(shape, dtype, make, rows=rows, ranged=rows is not None)
    return sourced_item(("model_params", name), cast, f"cast(fp32 -> {dtype})", fp32_tensors)


def frozen_items(
    checkpoint: DeepSpeedCheckpoint,
    names: Sequence[str],
    also: Callable[[str, np.ndarray, list[str]], list[str]] | None = None,
) -> Iterator[writer.HostItem]:
    """``params`` items of the frozen parameters ``names``, marked frozen, their weights rebuilt
    from ``frozen_param_fragments`` as DeepSpeed's zero_to_fp32 does: stage 1/2 keep each whole;
    stage 3 keeps a ``ceil(numel / W)`` partition per DP rank, concatenated in rank order and
    cut to ``numel``. In the run's precision (never trained, there is no fp32 master).

    Args:
        checkpoint: the opened ZeRO checkpoint holding the fragments.
        names: the frozen parameters to yield (this process's share).
        also: ``also(name, weight, files)``: more source tensors of the same weight, checked
            equal (None: none).
    """
    fragments = []
    for path in checkpoint.frozen_files:
        found = _model_states(checkpoint, path).get("frozen_param_fragments")
        if not isinstance(found, Mapping):
            raise SourceError(f"{path}: frozen_param_fragments missing")
        fragments.append((path, found))
    frozen_files = sorted({file_name(f) for f in checkpoint.frozen_files})
    for name in names:
        shape = checkpoint.frozen[name]
        count = math.prod(shape)
        parts = []
        for path, found in fragments:
            part = found.get(name)
            if not isinstance(part, np.ndarray):
                raise SourceError(f"{path}: frozen parameter {name!r} has no weights")
            parts.append(part.reshape(-1))
        if checkpoint.stage == 3:
            expected = math.ceil(count / checkpoint.world_size)
            for (path, _), part in zip(fragments, parts):
                if part.size != expected:
                    raise SourceError(
                        f"{path}: frozen parameter {name!r}: a partition of {part.size} "
                        f"elements; {checkpoint.world_size} DP ranks of shape {shape} need "
                        f"{expected}"
                    )
        flat = (
            np.concatenate([mapped_file.read_out(p) for p in parts]) if len(parts) > 1 else parts[0]
        )
        if flat.size < count or (checkpoint.stage != 3 and flat.size != count):
            raise SourceError(
                f"{checkpoint.frozen_files[0]}: frozen parameter {name!r} shape {shape} needs "
                f"{count} elements, the files hold {flat.size}"
            )
        weight = flat[:count].reshape(shape)
        sources = [f"{f}:frozen_param_fragments.{name}" for f in frozen_files]
        if also is not None:
            sources += also(name, weight, frozen_files)
        item = host_item(
            ("params", name),
            weight,
            {"files": frozen_files, "pattern": "frozen", "tensors": sources},
        )
        item.frozen = True
        yield item


#: The DeepSpeed optimizer class of each ZeRO stage (recorded as ``source.ds_optimizer``).
_ZERO_OPTIMIZER = {
    1: "DeepSpeedZeroOptimizer",
    2: "DeepSpeedZeroOptimizer",
    3: "DeepSpeedZeroOptimizer_Stage3",
}


def zero_source_info(checkpoint: DeepSpeedCheckpoint) -> dict:
    """What the manifest records about a ZeRO checkpoint (``ds_optimizer``: the DeepSpeed
    optimizer that wrote it, ``BF16_Optimizer`` or ZeRO's own)."""
    bf16 = is_bf16_optimizer(checkpoint.optim_states[0])
    return source_record(
        checkpoint.tag_dir,
        checkpoint.model_states,
        checkpoint.stage,
        dp_world_size=checkpoint.world_size,
        model_dtype=str(checkpoint.model_dtype),
        # tied weights (GPT-2's lm_head = wte): stored once, under the second name
        shared_params=dict(checkpoint.shared_params),
        frozen_params=sorted(checkpoint.frozen),
        ds_optimizer="BF16_Optimizer" if bf16 else _ZERO_OPTIMIZER.get(checkpoint.stage),
    )


#: DeepSpeed config entries that say how the optimizer stepped (recorded in the manifest)
DS_OPTIMIZER_FIELDS = ("optimizer", "scheduler", "gradient_clipping", "zero_force_ds_cpu_optimizer")


def torch_optimizer_record(checkpoint: DeepSpeedCheckpoint) -> dict | None:
    """The torch optimizer DeepSpeed stepped, as the manifest records a torch one
    (``source.optimizer``): the ``param_groups`` with each group's ``params`` named by
    ``param_shapes`` (DeepSpeed flattens a group into one vector, so its indices name nothing),
    and the DeepSpeed config entries that made and clipped it (``config``: ``optimizer``,
    ``gradient_clipping``: under DeepSpeed the Trainer does not clip). Every copy is compared
    (:func:`run_facts`): one that disagrees is refused. None when the files hold no param
    groups, or not one per ``param_shapes`` group (nothing is guessed)."""
    fields = run_facts(checkpoint)
    if fields is None:
        return None
    groups, config = fields
    named = [
        {**{str(k): jsonable(v) for k, v in g.items() if k != "params"}, "params": list(shapes)}
        for g, shapes in zip(groups, checkpoint.param_shapes)
    ]
    record = {
        "param_groups": named,
        "state": ["exp_avg", "exp_avg_sq", "step"],
        "no_state": sorted(checkpoint.frozen),
        "config": config,
    }
    scheduler = checkpoint.model_states.get("lr_scheduler")
    if isinstance(scheduler, Mapping):  # a client's torch scheduler (the Trainer's), or the one
        # DeepSpeed made from its config (its state: the last_batch_iteration alone)
        keys = {"last_epoch": "last_epoch", "base_lrs": "base_lrs", "_last_lr": "last_lr"}
        keys["last_batch_iteration"] = "last_batch_iteration"
        record["scheduler"] = {v: jsonable(scheduler[k]) for k, v in keys.items() if k in scheduler}
    return record


def run_facts(checkpoint: DeepSpeedCheckpoint) -> tuple[list[Mapping], dict] | None:
    """(DP rank 0's param groups, the config entries of :data:`DS_OPTIMIZER_FIELDS`), each
    compared with every other record of it: the config in the model states file and in each
    rank's optimizer file, each rank's ``clip_grad`` (the clipping its optimizer applied) and
    each rank's param groups. None when the groups are not one per ``param_shapes`` group."""
    inner_key = _layout(checkpoint)[1]
    per_rank = []
    for state in checkpoint.optim_states:
        inner = state.get(inner_key)
        groups = inner.get("param_groups") if isinstance(inner, Mapping) else None
        if not isinstance(groups, list | tuple) or len(groups) != len(checkpoint.param_shapes):
            return None
        if not all(isinstance(g, Mapping) for g in groups):
            return None
        per_rank.append(groups)
    facts = Facts(checkpoint.tag_dir.root)
    model_config = checkpoint.model_states.get("ds_config")
    model_config = model_config if isinstance(model_config, Mapping) else {}
    copies = [(f"{file_name(checkpoint.model_file)} ds_config", model_config)]
    copies += [
        (f"{file_name(path)} ds_config", config)
        for path, config in zip(checkpoint.optim_files, checkpoint.optim_configs)
        if config is not None  # a DeepSpeed that wrote none there
    ]
    for name, config in copies:
        config = config if isinstance(config, Mapping) else {}
        for key in DS_OPTIMIZER_FIELDS:
            # clipping absent: set beside the saved config (accelerate's), clip_grad holds it
            if key != "gradient_clipping" or key in config:
                facts.state(key, f"{name}.{key}", jsonable(config.get(key, ABSENT)))
    for path, state in zip(checkpoint.optim_files, checkpoint.optim_states):
        if "clip_grad" in state:  # ZeRO-1/2's and BF16_Optimizer's (ZeRO-3 keeps none)
            name = f"{file_name(path)} optimizer_state_dict.clip_grad"
            facts.state("gradient_clipping", name, jsonable(state["clip_grad"]))
    for path, groups in zip(checkpoint.optim_files, per_rank):
        for g, group in enumerate(groups):
            for key in sorted({str(k) for gs in per_rank for k in gs[g]} - {"params"}):
                at = f"param_groups[{g}].{key}"
                name = f"{file_name(path)} optimizer_state_dict.{inner_key}.{at}"
                facts.state(at, name, jsonable(group.get(key, ABSENT)))
    agreed = facts.agree_all()
    return per_rank[0], {
        k: v for k, v in agreed.items() if k in DS_OPTIMIZER_FIELDS and v != ABSENT
    }


#: DeepSpeed config entries the Trainer fills from its arguments, refusing to start when one set
#: by hand differs (transformers' ``HfTrainerDeepSpeedConfig.trainer_config_process``)
TRAINER_FILLS = {
    ("gradient_clipping",): ("max_grad_norm",),
    ("optimizer", "params", "lr"): ("learning_rate",),
    ("optimizer", "params", "betas"): ("adam_beta1", "adam_beta2"),
    ("optimizer", "params", "eps"): ("adam_epsilon",),
    ("optimizer", "params", "weight_decay"): ("weight_decay",),
}


def trainer_facts(source: dict, folder: str) -> None:
    """A Trainer's ``training_args.bin`` (``source.trainer``) against the DeepSpeed config it
    filled (``source.optimizer.config``): a value in both that differs is refused, both named."""
    args = (source.get("trainer") or {}).get("training_args")
    config = (source.get("optimizer") or {}).get("config")
    if not isinstance(args, Mapping) or not isinstance(config, Mapping):
        return
    facts = Facts(folder)
    for path, names in TRAINER_FILLS.items():
        node: Any = config
        for key in path:
            node = node.get(key, ABSENT) if isinstance(node, Mapping) else ABSENT
        if node in (ABSENT, "auto") or not all(n in args for n in names):
            continue
        fact = ".".join(path)
        facts.state(fact, f"the DeepSpeed config (ds_config.{fact})", node)
        said = [args[n] for n in names] if len(names) > 1 else args[names[0]]
        facts.state(fact, f"training_args.bin {' and '.join(names)}", said)
    facts.agree_all()
