"""Import Megatron-DeepSpeed checkpoints with tensor / pipeline parallelism (ZeRO stage 1/2).

Layout (DeepSpeed 0.19 ``deepspeed/checkpoint``, as ``ds_to_universal`` reads it):

* ``mp_rank_XX_model_states.pt``, XX = pp * tp_degree + tp (pp-major, like
  ``meg_2d_parallel_map.simple_init``): per model-parallel rank ``param_shapes`` (TP-local shapes),
  ``universal_checkpoint_info`` (the merge patterns), ``module`` (the TP-local model weights; ``None``
  with pipeline parallelism), ``mp_world_size`` = tp * pp, ``checkpoint_parallel_dimensions``.
* ``layer_LL-model_TT-model_states.pt`` (pipeline parallel): the model weights of pipeline layer LL
  on TP rank TT, keyed locally (``input_layernorm.weight``); the parameter is ``LL.<key>``, or
  ``tied_modules.<tie>.<key>`` for a tied layer.
* ``[bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt``: ZeRO stage 1/2 partitions of model-parallel
  rank XX's parameters over DP rank D, ``param_slice_mappings`` keyed by the TP-local names.

Each model-parallel rank is read and checked like a plain ZeRO checkpoint
(:func:`zero.open_zero_rank`). Per parameter the importer merges every TP rank's fragment with
the kind :func:`ucp_info.spec_from_ucp_info` gives it and, for a parameter held by several
pipeline stages (tied embeddings), checks the stages agree. Everything stays memory-mapped; one
parameter is materialised at a time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jax_ucp._src import writer
from jax_ucp._src.errors import LanguageError, SourceError
from jax_ucp._src.format import mapped_file
from jax_ucp._src.format.files import numbered_names
from jax_ucp._src.importers import rank_grid
from jax_ucp._src.importers.deepspeed import affine, files, zero
from jax_ucp._src.importers.deepspeed.affine import AffineMap
from jax_ucp._src.importers.deepspeed.files import file_name, listed
from jax_ucp._src.importers.deepspeed.ucp_info import spec_from_ucp_info
from jax_ucp._src.importers.deepspeed.zero import (
    STATE_TREES,
    DeepSpeedCheckpoint,
    piece_tensors,
    zero_tensors,
)
from jax_ucp._src.importers.plan import WHOLE, Share, host_item, skip, tensor_names
from jax_ucp._src.importers.rank_grid import RankGrid
from jax_ucp._src.language import (
    Averaged,
    PipelineTied,
    Replicated,
    SubParams,
    Vocab,
    load_spec,
)
from jax_ucp._src.language.patterns import compile_pattern
from jax_ucp._src.store.storage import Storage

__all__ = [
    "MegatronDeepSpeedCheckpoint",
    "iter_megatron_deepspeed_items",
    "open_megatron_deepspeed_checkpoint",
    "source_info",
]

# name -> {TP rank: (weight, file, source tensor "<file>:<key>")}
ModelWeights = dict[str, dict[int, tuple[np.ndarray, str, str]]]


@dataclass
class MegatronDeepSpeedCheckpoint:
    """Every TP/PP rank of one tag folder, validated up front, with the merge rule of each name."""

    tag_dir: Storage
    stage: int
    grid: RankGrid  # TP x PP, each model-parallel rank's ZeRO state over DP ranks
    model_dtype: np.dtype
    info: Mapping[str, Any]
    spec: Any
    ranks: list[list[DeepSpeedCheckpoint]]  # [pp][tp]: one ZeRO checkpoint per model-parallel rank
    names: list[str]  # output order (stage order, tied once)
    holders: dict[str, list[int]]  # name -> pipeline stages holding it
    module: ModelWeights = field(default_factory=dict)
    model_states: Mapping = field(default_factory=dict)
    matches: dict = field(default_factory=dict)  # name -> the spec's ImportMatch
    # AutoTP: name -> its affine map (preferred to the rule's kind, as ds_to_universal does)
    affine: dict[str, AffineMap] = field(default_factory=dict)
    layer_tensors: dict[str, list[str]] = field(default_factory=dict)  # layer file -> its tensors

    @property
    def every_rank(self) -> list[DeepSpeedCheckpoint]:
        return [rank for row in self.ranks for rank in row]


@dataclass(frozen=True)
class _RankFiles:
    """Where each model-parallel rank's files are (found and checked before any rank is read)."""

    tag_dir: Storage
    grid: RankGrid
    model_files: dict[int, str]  # MP rank -> model states file name
    optimizer_files: dict[int, dict[int, str]]  # MP rank -> {DP rank: path}
    optimizer_prefix: str
    first_model_file: str
    first_model_states: Mapping


# --------------------------------------------------------------------------- opening


def open_megatron_deepspeed_checkpoint(
    tag_dir: Storage, *, spec: Any = None
) -> MegatronDeepSpeedCheckpoint:
    """Finds and validates every TP/PP/DP rank file of one tag folder (tensors stay
    memory-mapped); ``spec``: import rules to use instead of its ``universal_checkpoint_info``."""
    listing = listed(tag_dir) or []
    rank_files = _find_rank_files(tag_dir, listing)
    spec, info = _import_spec(spec, rank_files)
    ranks = [
        [_open_rank(rank_files, pp_rank, tp_rank) for tp_rank in range(rank_files.grid.tp)]
        for pp_rank in range(rank_files.grid.pp)
    ]
    _check_same_parameters_per_stage(ranks)
    holders: dict[str, list[int]] = {}  # in stage order, a tied parameter once
    for pp_rank, row in enumerate(ranks):
        for name in row[0].names:
            holders.setdefault(name, []).append(pp_rank)
    names = list(holders)
    checkpoint = MegatronDeepSpeedCheckpoint(
        tag_dir=tag_dir,
        stage=ranks[0][0].stage,
        grid=dataclasses.replace(rank_files.grid, dp=ranks[0][0].world_size),
        model_dtype=_check_same_partitioning(tag_dir, ranks),
        info=info,
        spec=spec,
        ranks=ranks,
        names=names,
        holders=holders,
        model_states=rank_files.first_model_states,
    )
    checkpoint.module = _model_weights(checkpoint, listing)
    # classify every name up front (strictness errors before anything is written)
    checkpoint.matches = spec.classify(names)
    missing = [name for name in names if name not in checkpoint.matches]
    if missing:
        raise SourceError(f"{tag_dir.root}: no import rule covers {missing[:10]}")
    maps = affine.parse_affine_maps(
        info, f"{rank_files.first_model_file}: universal_checkpoint_info", rank_files.grid.tp
    )
    for name in names:
        amap = affine.map_for(maps, name)
        if amap is None:
            continue
        stage = holders[name][0]
        for tp_rank, rank in enumerate(ranks[stage]):
            local = rank.shapes[name]
            if math.prod(local) != math.prod(amap.shard_shapes[tp_rank]):
                raise SourceError(
                    f"{rank.model_file}: {name!r} has param_shapes {tuple(local)} on TP rank "
                    f"{tp_rank}; affine_map {amap.pattern!r} describes a shard of "
                    f"{list(amap.shard_shapes[tp_rank])}"
                )
        checkpoint.affine[name] = amap
    return checkpoint


def _find_rank_files(tag_dir: Storage, names: list[str]) -> _RankFiles:
    """The TP x PP grid (from rank 0's model states) and every rank's model and optimizer files;
    a missing or surplus rank file is an error. ZeRO-3 (AutoTP with ZeRO stage 3) keeps each
    model-parallel rank's model states in ``zero_pp_rank_D_mp_rank_XX_model_states.pt``, one
    per DP rank: DP rank 0's stands for the rank (the others are checked when it is opened)."""
    zero3 = [
        (int(m.group(2)), f)
        for f in names
        if (m := files.ZERO3_MODEL_FILE.match(f)) and int(m.group(1)) == 0
    ]
    plain = [(int(m[1]), f) for f in names if (m := files.MP_MODEL_FILE.match(f))]
    # mp_rank_00 and mp_rank_0: refused, never one of them taken
    model_files = numbered_names(zero3 or plain, tag_dir.root, "model-parallel rank")
    pattern = ("zero_pp_rank_0_" if zero3 else "") + "mp_rank_{:02d}_model_states.pt"
    first_model_file = tag_dir.join(pattern.format(0))
    first_model_states = files.load_model_states(
        tag_dir, pattern.format(0), of_rank=" of model-parallel rank 0"
    )
    tp, pp = _degrees(names, first_model_states, first_model_file, len(model_files))
    grid = RankGrid(tp, pp)
    mp_world = grid.size
    for mp_rank in range(mp_world):
        if mp_rank not in model_files:
            path = tag_dir.join(pattern.format(mp_rank))
            tp_rank, stage, _ = grid.coords(mp_rank)
            raise SourceError(
                f"{path}: missing model states file of model-parallel rank {mp_rank} "
                f"(pp={stage}, tp={tp_rank}; the checkpoint has tp={tp}, pp={pp})"
            )
    extra = sorted(set(model_files) - set(range(mp_world)))
    if extra:
        raise SourceError(
            f"{tag_dir.root}: model states files for ranks {extra} beyond tp={tp} x pp={pp}: "
            f"{[model_files[mp_rank] for mp_rank in extra]}"
        )
    optimizer_files, prefix = files.optimizer_files_by_rank(tag_dir)
    extra = sorted(set(optimizer_files) - set(range(mp_world)))
    if extra:
        raise SourceError(
            f"{tag_dir.root}: optimizer files for model-parallel ranks {extra} beyond tp={tp} x pp={pp}"
        )
    return _RankFiles(
        tag_dir, grid, model_files, optimizer_files, prefix, first_model_file, first_model_states
    )


def _degrees(
    names: list[str], first_model_states: Mapping, first_model_file: str, model_file_count: int
):
    """(tp, pp): from ``checkpoint_parallel_dimensions``, else from the files present."""
    dims = first_model_states.get("checkpoint_parallel_dimensions")
    if isinstance(dims, Mapping) and dims.get("tp_degree") and dims.get("pp_degree"):
        tp, pp = int(dims["tp_degree"]), int(dims["pp_degree"])
    else:
        layer_tp_ranks = {int(m[2] or 0) for m in map(files.LAYER_FILE.match, names) if m}
        if layer_tp_ranks:
            tp = max(layer_tp_ranks) + 1
            pp = max(1, math.ceil(model_file_count / tp))
        else:
            tp, pp = max(model_file_count, 1), 1
    recorded = first_model_states.get("mp_world_size")
    if recorded is not None and int(recorded) != tp * pp:
        raise SourceError(
            f"{first_model_file}: mp_world_size is {recorded} but the checkpoint has tp={tp} x "
            f"pp={pp} model-parallel ranks"
        )
    return tp, pp


def _import_spec(spec: Any, rank_files: _RankFiles) -> tuple[Any, dict]:
    """The import rules (``spec``, or translated from ``universal_checkpoint_info``) and that
    info; parameters the info marks as not convertible, or affine maps, are refused."""
    where = rank_files.first_model_file
    info = rank_files.first_model_states.get("universal_checkpoint_info")
    if isinstance(spec, (str, os.PathLike)):
        spec = load_spec(os.fspath(spec))
    if spec is None:
        if not isinstance(info, Mapping) and rank_files.grid.tp == 1:
            # pipeline parallelism alone (DeepSpeed's PipelineModule): every parameter is whole
            # on the stage(s) holding it, so no TP merge rule is needed (stages holding the same
            # name, tied layers, are still checked bit-identical)
            return spec_from_ucp_info({}), {}
        if not isinstance(info, Mapping):
            raise SourceError(
                f"{where}: no universal_checkpoint_info: a tensor-parallel checkpoint needs the "
                f"patterns saying how TP fragments merge (Megatron-DeepSpeed writes them); pass "
                f"spec= with import rules instead"
            )
        try:  # patterns from the file: matched with RE2 (bounded time), or refused by name
            spec = spec_from_ucp_info(info, where=f"{where}: universal_checkpoint_info")
        except LanguageError as e:
            raise SourceError(str(e)) from None
    info = dict(info or {})
    unsupported = info.get("autotp_unsupported_parameter_patterns") or {}
    if unsupported:
        raise SourceError(
            f"{where}: universal_checkpoint_info marks parameters as not convertible: "
            + ", ".join(f"{p}: {why}" for p, why in sorted(dict(unsupported).items()))
        )
    return spec, info


def _open_rank(rank_files: _RankFiles, pp_rank: int, tp_rank: int) -> DeepSpeedCheckpoint:
    """One model-parallel rank, read and checked like a plain ZeRO stage 1/2 checkpoint."""
    tag_dir, grid = rank_files.tag_dir, rank_files.grid
    mp_rank = grid.rank(tp_rank, pp_rank)
    model_file = tag_dir.join(rank_files.model_files[mp_rank])
    model_states = (
        rank_files.first_model_states
        if mp_rank == 0
        else files.load_model_states(tag_dir, rank_files.model_files[mp_rank])
    )
    recorded = model_states.get("mp_world_size")
    if recorded is not None and int(recorded) != grid.size:
        raise SourceError(
            f"{model_file}: mp_world_size {recorded}, {rank_files.first_model_file} implies "
            f"{grid.size} (tp={grid.tp} x pp={grid.pp})"
        )
    of_rank = f" of model-parallel rank {mp_rank} (pp={pp_rank}, tp={tp_rank})"
    files_by_dp_rank = rank_files.optimizer_files.get(mp_rank)
    if not files_by_dp_rank:
        name = f"{rank_files.optimizer_prefix}zero_pp_rank_0_mp_rank_{mp_rank:02d}_optim_states.pt"
        raise SourceError(f"{tag_dir.join(name)}: missing optimizer files{of_rank}")
    optimizer = files.read_optimizer_states(tag_dir, files_by_dp_rank, of_rank=of_rank)
    if optimizer.stage not in (1, 2, 3):
        raise SourceError(
            f"{optimizer.files[0]}: zero_stage {optimizer.stage}; Megatron-DeepSpeed TP/PP "
            f"checkpoints are read for ZeRO stage 1, 2 and 3"
        )
    # the stage's own model states file name (and, for stage 3, every DP rank's present)
    expected = zero.model_states_file(tag_dir, optimizer, mp_rank)
    if file_name(expected) != rank_files.model_files[mp_rank]:
        raise SourceError(
            f"{optimizer.files[0]}: zero_stage {optimizer.stage}{of_rank} is saved with "
            f"{file_name(expected)}, but the folder holds {rank_files.model_files[mp_rank]}"
        )
    return zero.open_zero_rank(tag_dir, model_file, model_states, optimizer, mp_rank)


def _check_same_partitioning(tag_dir: Storage, ranks: list[list[DeepSpeedCheckpoint]]) -> np.dtype:
    """Every model-parallel rank was partitioned over the same DP ranks with the same stage, in
    the same model dtype (returned)."""
    reference = ranks[0][0]
    for rank in (rank for row in ranks for rank in row):
        if (rank.world_size, rank.stage) != (reference.world_size, reference.stage):
            raise SourceError(
                f"{rank.optim_files[0]}: zero_stage {rank.stage} / partition_count "
                f"{rank.world_size}, model-parallel rank 0 has {reference.stage} / "
                f"{reference.world_size}"
            )
    dtypes = {rank.model_dtype for row in ranks for rank in row}
    if len(dtypes) != 1:
        raise SourceError(
            f"{tag_dir.root}: model-parallel ranks disagree on the model dtype: "
            f"{sorted(map(str, dtypes))}"
        )
    return dtypes.pop()


def _check_same_parameters_per_stage(ranks: list[list[DeepSpeedCheckpoint]]) -> None:
    """The TP ranks of a pipeline stage hold the same parameters, in the same order."""
    for pp_rank, row in enumerate(ranks):
        reference = row[0]
        for tp_rank, rank in enumerate(row[1:], start=1):
            expected, held = list(reference.shapes), list(rank.shapes)
            if expected != held:
                diff = sorted(set(expected) ^ set(held))[:5] or "a different order"
                raise SourceError(
                    f"{rank.model_file}: TP rank {tp_rank} of stage {pp_rank} holds other "
                    f"parameters than {reference.model_file}: {diff}"
                )


# --------------------------------------------------------------------------- model weights


def _model_weights(checkpoint: MegatronDeepSpeedCheckpoint, names: list[str]) -> ModelWeights:
    """Model-precision weights per name and TP rank: from ``module`` (no PP) or the layer files."""
    weights: ModelWeights = {}
    for row in checkpoint.ranks:
        for tp_rank, rank in enumerate(row):
            if rank.stage == 3:  # ZeRO-3's module holds placeholders: masters are the weights
                continue
            for name, value in (rank.module or {}).items():
                if isinstance(value, np.ndarray):
                    file = file_name(rank.model_file)
                    weights.setdefault(str(name), {}).setdefault(
                        tp_rank, (value, file, f"{file}:module.{name}")
                    )
    layer_files = [
        (int(m.group(1)), int(m.group(2) or 0), f)
        for f in names
        if (m := files.LAYER_FILE.match(f))
    ]
    if layer_files:
        _check_layer_files(checkpoint, layer_files)
        _add_layer_weights(checkpoint, sorted(layer_files), weights)
    return weights


def _check_layer_files(
    checkpoint: MegatronDeepSpeedCheckpoint, layer_files: list[tuple[int, int, str]]
) -> None:
    """Every pipeline layer has one file per TP rank, and no TP rank beyond the grid."""
    tp_ranks_of_layer: dict[int, dict[int, str]] = {}
    for layer, tp_rank, name in layer_files:
        if tp_rank >= checkpoint.grid.tp:
            raise SourceError(
                f"{checkpoint.tag_dir.join(name)}: TP rank {tp_rank} beyond tp={checkpoint.grid.tp}"
            )
        same = tp_ranks_of_layer.setdefault(layer, {})
        if tp_rank in same:  # layer_00-model_states.pt beside layer_00-model_00-model_states.pt
            raise SourceError(
                f"{checkpoint.tag_dir.root}: two files for pipeline layer {layer} on TP rank "
                f"{tp_rank}: {same[tp_rank]} and {name} (two saves mixed in one folder?)"
            )
        same[tp_rank] = name
    for layer, tp_ranks in sorted(tp_ranks_of_layer.items()):
        for tp_rank in range(checkpoint.grid.tp):
            if tp_rank not in tp_ranks:
                name = f"layer_{layer:02d}-model_{tp_rank:02d}-model_states.pt"
                raise SourceError(
                    f"{checkpoint.tag_dir.join(name)}: missing layer file of pipeline "
                    f"layer {layer} for TP rank {tp_rank} (other TP ranks have it)"
                )


def _add_layer_weights(
    checkpoint: MegatronDeepSpeedCheckpoint,
    layer_files: list[tuple[int, int, str]],
    weights: ModelWeights,
) -> None:
    """Layer LL's ``<key>`` is parameter ``LL.<key>``, or the one ``tied_modules.<tie>.<key>``."""
    tied: dict[str, list[str]] = {}
    for name in checkpoint.names:
        if name.startswith("tied_modules."):
            tied.setdefault(name.split(".", 2)[2], []).append(name)
    known = set(checkpoint.names)
    for layer, tp_rank, file in layer_files:
        path = checkpoint.tag_dir.join(file)
        state_dict = files.parsed_file(checkpoint.tag_dir, file)  # and the check's
        if not isinstance(state_dict, Mapping):
            raise SourceError(f"{path}: expected a state dict, found {type(state_dict).__name__}")
        checkpoint.layer_tensors[file] = [f"{file}:{n}" for n in tensor_names(state_dict)]
        for key, value in state_dict.items():
            if not isinstance(value, np.ndarray):
                continue
            name = f"{layer}.{key}"
            if name not in known:
                candidates = tied.get(str(key), [])
                if len(candidates) != 1:
                    continue  # a buffer, or not a trained parameter
                name = candidates[0]
            weights.setdefault(name, {}).setdefault(tp_rank, (value, file, f"{file}:{key}"))


# --------------------------------------------------------------------------- merge kinds


def resolve_sub_params(kind, name: str, info: Mapping, widths: list[int]):
    """``kind`` with the DeepSpeed details the generic translation leaves open, resolved per
    tensor: legacy sub-param metadata giving a *count* of equal sub-params, and v0.4
    ``sub_param_shard_widths`` (uneven).

    Args:
        kind: the kind the generic translation gave.
        name: the tensor.
        info: ``universal_checkpoint_info``.
        widths: each TP fragment's size on the merge dim.
    """
    inner = getattr(kind, "inner", None)
    if inner is not None and not isinstance(kind, SubParams):
        return dataclasses.replace(kind, inner=resolve_sub_params(inner, name, info, widths))
    if not isinstance(kind, SubParams):
        return kind
    entries = info.get("parameter_with_sub_params") or []
    for pattern, entry in ((str(p), e) for e in entries for p in e.get("patterns") or []):
        # re.match semantics (anchored at the start only), on RE2: the pattern is from the file
        if compile_pattern(pattern, "universal_checkpoint_info: ").match(name) is None:
            continue
        sizes = list(entry["shape"])[int(entry["partition_dim"])]
        shard_widths = (info.get("sub_param_shard_widths") or {}).get(pattern)
        if shard_widths is not None:
            return dataclasses.replace(
                kind,
                sizes=tuple(int(sum(w)) for w in shard_widths),
                rank_sizes=tuple(
                    tuple(int(w[tp_rank]) for w in shard_widths) for tp_rank in range(len(widths))
                ),
            )
        if not isinstance(sizes, (list, tuple)):  # legacy: number of equal sub-params
            count, total = int(sizes), sum(widths)
            if count <= 0 or total % count:
                raise SourceError(
                    f"{name}: legacy sub-param count {count} does not divide the merged size {total}"
                )
            return dataclasses.replace(kind, sizes=(total // count,) * count)
        return kind
    return kind


def _tp_kind(checkpoint: MegatronDeepSpeedCheckpoint, name: str, kind) -> tuple[Any, list[int]]:
    """How the TP fragments of ``name`` merge (the stage wrapper removed; no rule: replicated),
    and each fragment's width on the merge dim."""
    tp_kind = kind.inner if isinstance(kind, PipelineTied) else kind
    if tp_kind is None:
        tp_kind = Replicated()
    dim = getattr(_merged_kind(tp_kind), "dim", 0) or 0
    stage = checkpoint.holders[name][0]
    shapes = [
        checkpoint.ranks[stage][tp_rank].shapes[name] for tp_rank in range(checkpoint.grid.tp)
    ]
    widths = [s[dim] if len(s) > abs(dim) else 0 for s in shapes] if shapes[0] else []
    return resolve_sub_params(tp_kind, name, checkpoint.info, widths), widths


def _merged_kind(tp_kind):
    """The kind a TP kind's fragments merge with (a vocabulary's inner kind)."""
    return tp_kind.inner if isinstance(tp_kind, Vocab) and tp_kind.inner is not None else tp_kind


# --------------------------------------------------------------------------- streaming


def iter_megatron_deepspeed_items(
    checkpoint: MegatronDeepSpeedCheckpoint, share: Share = WHOLE
) -> Iterator[writer.HostItem]:
    """params / mu / nu / model_params one parameter at a time (TP merged, vocab stripped, tied
    stages checked), then ``opt_state.count``; ``share``: this process's part."""
    count = zero.optimizer_step(*checkpoint.every_rank)
    for name in share.pick(checkpoint.names):
        yield from _parameter_items(checkpoint, name)
    if not share.primary:
        return
    yield zero.step_item(count, *checkpoint.every_rank)


def megatron_deepspeed_tensors(
    checkpoint: MegatronDeepSpeedCheckpoint, source: dict, *, weights_only: bool
) -> list[str]:
    """Every tensor of every rank's files and layer files (``<file>:<key>``); those not imported
    listed in ``source["skipped"]`` with the reason.

    Args:
        checkpoint: the opened Megatron-DeepSpeed checkpoint.
        source: the manifest's source record, whose ``skipped`` is filled.
        weights_only: whether the optimizer state is skipped.
    """
    imported = {
        entry[2]
        for name in checkpoint.names
        if (stored := checkpoint.module.get(name, {})) and _stored_copy_used(checkpoint, name)
        for entry in stored.values()
    }
    found = []
    for rank in checkpoint.every_rank:
        found += zero_tensors(rank, source, weights_only=weights_only, imported_module=imported)
    layer_tensors = [
        t for file in sorted(checkpoint.layer_tensors) for t in checkpoint.layer_tensors[file]
    ]
    found += layer_tensors
    known = {
        entry[2]: name for name, stored in checkpoint.module.items() for entry in stored.values()
    }
    # the stored model weights (module entries, layer files) that are not imported
    for name in layer_tensors + [n for n in known if n not in layer_tensors]:
        if name in imported or name in (source.get("skipped") or {}):
            continue
        if name not in known:
            why = "not a trained parameter of param_shapes (a buffer or a tied copy)"
        elif _stored_copy_used(checkpoint, known[name]):
            why = "not imported"
        else:
            why = "model-precision copy of an averaged parameter (re-derived from its fp32 master)"
        skip(source, [name], why)
    return found


def _stored_copy_used(checkpoint: MegatronDeepSpeedCheckpoint, name: str) -> bool:
    """Whether ``model_params/<name>`` is the stored copy merged (else the master cast)."""
    if (
        name not in checkpoint.matches
        or checkpoint.model_dtype == np.dtype(np.float32)
        or len(checkpoint.module.get(name, {})) != checkpoint.grid.tp
    ):
        return False
    if name in checkpoint.affine:
        return all(p.scale == 1.0 for ps in checkpoint.affine[name].pieces.values() for p in ps)
    tp_kind, _ = _tp_kind(checkpoint, name, checkpoint.matches[name].kind)
    return not isinstance(_merged_kind(tp_kind), Averaged)


def _parameter_items(
    checkpoint: MegatronDeepSpeedCheckpoint, name: str
) -> Iterator[writer.HostItem]:
    """One parameter's merged fp32 master, moments and model-precision copy."""
    stages = checkpoint.holders[name]
    match = checkpoint.matches[name]
    tp_kind, widths = _tp_kind(checkpoint, name, match.kind)
    provenance = _provenance(checkpoint, name, match, tp_kind, widths)

    def files_of() -> str:
        return "; ".join(
            f"stage {stage} TP rank {tp_rank}: "
            f"{file_name(checkpoint.ranks[stage][tp_rank].model_file)} + "
            f"{[file_name(f) for f in checkpoint.ranks[stage][tp_rank].optim_files]}"
            for stage in stages
            for tp_rank in range(checkpoint.grid.tp)
        )

    if name in checkpoint.affine:
        provenance["kind"] = {"kind": "affine_map", "pattern": checkpoint.affine[name].pattern}
    for state_name, tree in STATE_TREES:
        per_stage = [  # each stage's TP fragments, in their TP-local shapes
            [zero.gather_parameter(rank, name, state_name, {}) for rank in checkpoint.ranks[stage]]
            for stage in stages
        ]
        value = _merged(checkpoint, name, tp_kind, per_stage, state_name, files_of)
        sources = [
            n
            for stage in stages
            for rank in checkpoint.ranks[stage]
            for n in piece_tensors(rank, name, state_name)
        ]
        yield host_item((*tree, name), value, dict(provenance, state=state_name, tensors=sources))
        if state_name == "fp32":
            fp32, fp32_sources = value, sources
        del per_stage
    if checkpoint.model_dtype != np.dtype(np.float32):
        yield _model_copy_item(
            checkpoint, name, tp_kind, fp32, dict(provenance, tensors=fp32_sources)
        )


def _merged(checkpoint, name, tp_kind, per_stage, state_name, files_of) -> np.ndarray:
    """The parameter from each stage's TP fragments (``per_stage``): merged by ``tp_kind``
    (``rank_grid``), or, with an affine map, rebuilt by it on every stage holding it (which
    must agree), then the vocabulary padding stripped as ds_to_universal does after a map."""
    amap = checkpoint.affine.get(name)
    if amap is None:
        return rank_grid.merged(tp_kind, per_stage, name, checkpoint.spec, files_of)
    try:
        values = [affine.rebuild(amap, f, state_name, name) for f in per_stage]
    except SourceError as e:
        raise SourceError(f"{e} [files: {files_of()}]") from None
    for stage, other in zip(checkpoint.holders[name][1:], values[1:]):
        if other.tobytes() != values[0].tobytes():
            raise SourceError(
                f"{name}: pipeline stage {stage} holds another {state_name} than stage "
                f"{checkpoint.holders[name][0]} [files: {files_of()}]"
            )
    value = values[0]
    if isinstance(tp_kind, Vocab):
        size = checkpoint.info.get("original_vocab_size")
        if isinstance(size, int) and not isinstance(size, bool) and 0 < size <= value.shape[0]:
            value = value[:size]
    return value


def _provenance(checkpoint: MegatronDeepSpeedCheckpoint, name, match, tp_kind, widths) -> dict:
    stages = checkpoint.holders[name]
    holding = [rank for stage in stages for rank in checkpoint.ranks[stage]]
    files = {
        file_name(rank.optim_files[piece.dp_rank])
        for rank in holding
        for piece in rank.fragment_plan[name].pieces
    } | {file_name(rank.model_file) for rank in holding}
    provenance = {
        "files": sorted(files),
        "pattern": match.rule.label or match.rule.pattern,
        "kind": tp_kind.to_dict(),
        "tp": checkpoint.grid.tp,
        "pp_stages": stages,
        "zero_stage": checkpoint.stage,
    }
    if isinstance(tp_kind, Vocab):
        provenance["original_vocab_size"] = checkpoint.spec.settings.get("vocab_size")
        provenance["padded_vocab_size"] = sum(widths) if widths else None
    return provenance


def _model_copy_item(
    checkpoint: MegatronDeepSpeedCheckpoint, name: str, tp_kind, fp32, provenance: dict
) -> writer.HostItem:
    """The stored model-precision TP fragments merged like the master; an averaged parameter
    (DeepSpeed re-derives its model copy from the fp32 master) or one with no stored copy is
    the master cast."""
    stored = checkpoint.module.get(name, {})
    if not _stored_copy_used(checkpoint, name):
        return host_item(
            ("model_params", name),
            mapped_file.read_out(fp32, f"{name!r} fp32").astype(checkpoint.model_dtype),
            dict(provenance, pattern=f"cast(fp32 -> {checkpoint.model_dtype})", state="module"),
        )
    stage = checkpoint.holders[name][0]
    tp_ranks = range(checkpoint.grid.tp)
    fragments, paths, sources = (list(e) for e in zip(*(stored[t] for t in tp_ranks)))
    for tp_rank, (fragment, path) in enumerate(zip(fragments, paths)):
        if fragment.dtype != checkpoint.model_dtype:
            raise SourceError(
                f"{path}: {name!r} has dtype {fragment.dtype}, run dtype is {checkpoint.model_dtype}"
            )
        expected = checkpoint.ranks[stage][tp_rank].shapes[name]
        if tuple(fragment.shape) != tuple(expected):
            raise SourceError(
                f"{path}: {name!r} has shape {tuple(fragment.shape)}, param_shapes in "
                f"{file_name(checkpoint.ranks[stage][tp_rank].model_file)} say {tuple(expected)}"
            )
    files = sorted(set(paths))
    value = _merged(checkpoint, name, tp_kind, [fragments], "module", lambda: files)
    return host_item(
        ("model_params", name),
        value,
        dict(provenance, files=files, state="module", tensors=sources),
    )


def source_info(checkpoint: MegatronDeepSpeedCheckpoint) -> dict:
    """What the manifest records about a Megatron-DeepSpeed checkpoint (its info made JSON)."""
    info = json.loads(json.dumps(checkpoint.info, default=lambda o: getattr(o, "__dict__", str(o))))
    return files.source_record(
        checkpoint.tag_dir,
        checkpoint.model_states,
        checkpoint.stage,
        layout="megatron-deepspeed" if checkpoint.info or checkpoint.grid.tp > 1 else "pipeline",
        tp=checkpoint.grid.tp,
        pp=checkpoint.grid.pp,
        dp_world_size=checkpoint.grid.dp,
        model_dtype=str(checkpoint.model_dtype),
        original_vocab_size=checkpoint.info.get("original_vocab_size"),
        padded_vocab_size=checkpoint.info.get("padded_vocab_size"),
        universal_checkpoint_info=info,
    )
