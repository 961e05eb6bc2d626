"""megatron-core's distributed-optimizer layouts saved per model-parallel rank: ``dp_reshardable``
(flat buckets as tensors), ``dp_zero_gather_scatter`` (one pickled buffer per rank) and a MoE
ChainedOptimizer's members (dense, then experts)."""

from __future__ import annotations

import itertools
import re
from typing import Any

from jax_ucp._src.errors import SourceError
from jax_ucp._src.importers.megatron import dcp, legacy, rank_states
from jax_ucp._src.importers.megatron.common import (
    STATE_TREES,
    SUPPORTED_LAYOUTS,
    WEIGHTS_ONLY_HINT,
    MegatronImportError,
    ddp_bucket_size,
    is_optimizer_name,
)
from jax_ucp._src.importers.megatron.module_order import STACKED_EXPERT, in_module_order
from jax_ucp._src.importers.megatron.rank_states import GATHERED, RankStates
from jax_ucp._src.torchfiles import allow_list

_BUCKET_KEY = re.compile(
    r"(?:chained_[0-9]+\.)?optimizer\.distributed\.dp_group_idx_([0-9]+)\.gbuf_idx_([0-9]+)\.dtype_(.+)"
    r"\.bucket_idx_([0-9]+)\.(param|exp_avg|exp_avg_sq)"
)


_EXPERT = re.compile(r"decoder\.layers\.mlp\.experts\.")


def bucket_states(
    checkpoint: dcp.DcpCheckpoint,
    model_names: list[str],
    settings: dict,
    prefix: str = "",
    experts: bool = False,
    pp: int | None = None,
    grouped: bool = False,
) -> RankStates:
    """megatron-core 0.16's ``dp_reshardable`` (Megatron-LM's default): one flat tensor per
    rank, grad buffer, bucket and state, each bucket's length its recorded unpadded size; a
    bucket closes exactly there (``rank_states.bucket_layout``), so the DDP ``bucket_size``
    (not saved) is not needed and every bucket size is checked. ``prefix``, ``experts``: a
    ChainedOptimizer member's (:class:`RankStates`)."""
    where = checkpoint.index
    ranks: dict[int, dict[int, dict[str, str]]] = {}  # {rank: {bucket: {state: tensor}}}
    dtypes: dict[int, set[str]] = {}
    for name in checkpoint.tensors:
        if not is_optimizer_name(name) or (prefix and not name.startswith(prefix)):
            continue
        m = _BUCKET_KEY.fullmatch(name)
        if m is None or m.group(2) != "0" or (not prefix and name.startswith("chained_")):
            which = "expert" if experts else "dense"
            raise MegatronImportError(
                f"{where}: dp_reshardable optimizer tensor {name!r} is not in grad buffer 0 "
                f"of the {which} parameters (several parameter dtypes are not supported). "
                f"{WEIGHTS_ONLY_HINT}"
            )
        rank, bucket = int(m.group(1)), int(m.group(4))
        ranks.setdefault(rank, {}).setdefault(bucket, {})[m.group(5)] = name
        dtypes.setdefault(rank, set()).add(m.group(3))
    if not ranks or sorted(ranks) != list(range(len(ranks))):
        raise MegatronImportError(
            f"{where}: dp_reshardable state for model-parallel ranks {sorted(ranks)}, "
            f"expected 0..N-1. {WEIGHTS_ONLY_HINT}"
        )
    buffers: dict[int, list[dict[str, str]]] = {}
    for rank, per_bucket in sorted(ranks.items()):
        if len(dtypes[rank]) != 1 or sorted(per_bucket) != list(range(len(per_bucket))):
            raise MegatronImportError(
                f"{where}: dp_reshardable state of model-parallel rank {rank}: buckets "
                f"{sorted(per_bucket)}, dtypes {sorted(dtypes[rank])}; expected buckets "
                f"0..N-1 of one dtype. {WEIGHTS_ONLY_HINT}"
            )
        for bucket, states in per_bucket.items():
            if set(states) != set(STATE_TREES):
                raise MegatronImportError(
                    f"{where}: dp_reshardable bucket {bucket} of model-parallel rank {rank} "
                    f"has states {sorted(states)}, expected {list(STATE_TREES)}"
                )
            shapes = {checkpoint.tensors[n].shape for n in states.values()}
            if len(shapes) != 1 or len(next(iter(shapes))) != 1:
                raise MegatronImportError(
                    f"{where}: dp_reshardable bucket {bucket} of model-parallel rank {rank}: "
                    f"shapes {sorted(shapes)}, expected one flat vector per state"
                )
        buffers[rank] = [per_bucket[b] for b in range(len(per_bucket))]
    found = RankStates(
        checkpoint, model_names, settings, len(ranks), pp, prefix, experts, grouped=grouped
    )
    found.buffers = buffers
    for rank in buffers:
        params, shared = found.rank_params(rank)
        numels = [checkpoint.tensors[b["param"]].shape[0] for b in buffers[rank]]
        recorded = _recorded_numels(found, rank)
        if recorded is not None and recorded != numels:
            raise MegatronImportError(
                f"{where}: model-parallel rank {rank}: bucket tensors of {numels} elements, "
                f"but megatron-core recorded {recorded} unpadded"
            )
        found.layout[rank] = rank_states.bucket_layout(
            params, shared, numels, f"{where} (model-parallel rank {rank})"
        )
    return found


def _recorded_numels(found: RankStates, rank: int) -> list[int] | None:
    """``per_bucket_numel_unpadded``: [[{(param dtype, grad dtype): [numel per bucket]}]]."""
    value = found.object(rank, "per_bucket_numel_unpadded")
    if value is None:
        return None
    try:
        ((per_dtype,),) = value
        (numels,) = per_dtype.values()
        return [int(n) for n in numels]
    except (TypeError, ValueError, AttributeError):
        raise MegatronImportError(
            f"{found.where}: per_bucket_numel_unpadded of model-parallel rank {rank} is "
            f"{allow_list.short_repr(value)}, expected [[{{dtypes: [numel per bucket]}}]]"
        ) from None


def gathered_states(
    checkpoint: dcp.DcpCheckpoint, model_names: list[str], settings: dict, grouped: bool = False
) -> RankStates:
    """megatron-core 0.13's ``dp_zero_gather_scatter``: per model-parallel rank one pickled
    ``param_state`` object (written by DP rank 0), the same dict as a legacy
    ``distrib_optim.pt`` (the buckets' unpadded parts concatenated), laid out as for that file
    (``rank_states.distrib_optim_layout``, the DDP bucket size from the saved args)."""
    where = checkpoint.index
    pattern = r"optimizer\.distributed\.dp_group_idx_([0-9]+)\.param_state/.*"
    named = {int(m.group(1)): n for n in checkpoint.objects if (m := re.fullmatch(pattern, n))}
    if not named or sorted(named) != list(range(len(named))):
        raise MegatronImportError(
            f"{where}: dp_zero_gather_scatter param_state objects for model-parallel ranks "
            f"{sorted(named)}, expected 0..N-1. {WEIGHTS_ONLY_HINT}"
        )
    found = RankStates(
        checkpoint, model_names, settings, len(named), grouped=grouped, sharding=GATHERED
    )
    bucket_size = ddp_bucket_size(settings)
    for rank, name in named.items():
        saved = checkpoint.read_object(name, legacy.LEGACY_CLASSES)
        label = f"{where} (object {name!r})"
        try:
            if isinstance(saved, list) and len(saved) == 1:  # one model chunk
                (saved,) = saved
            state = rank_states.distrib_optim_state(saved, label)
        except SourceError as e:
            raise MegatronImportError(f"{e}. {WEIGHTS_ONLY_HINT}") from None
        params, shared = found.rank_params(rank)
        size, whose = bucket_size if rank < found.grid.tp else None, f"model-parallel rank {rank}"
        layout = rank_states.distrib_optim_layout(params, shared, size, state, whose)
        found.buffers[rank] = [dict.fromkeys(STATE_TREES, name)]
        found.held[rank] = state
        found.layout[rank] = {k: (0, a, b) for k, (a, b) in layout.items()}
    return found


def chained_layouts(checkpoint: dcp.DcpCheckpoint, common: Any) -> list[str | None] | None:
    """The per-optimizer sharding types of a megatron-core ChainedOptimizer save (``common.pt``'s
    ``optimizer`` keyed by optimizer index, or ``chained_N.`` keys), else None."""
    optimizer = common.get("optimizer") if isinstance(common, dict) else None
    if isinstance(optimizer, dict) and optimizer and all(type(k) is int for k in optimizer):
        parts = [optimizer[k] for k in sorted(optimizer)]
    elif isinstance(optimizer, list) and optimizer:
        parts = optimizer
    else:
        names = itertools.chain(checkpoint.tensors, checkpoint.objects)
        prefixes = {
            n.partition(".")[0] for n in names if re.match(r"chained_[0-9]+\.optimizer\.", n)
        }
        if not prefixes:
            return None
        parts = [None] * len(prefixes)
    return [
        part.get("param_state_sharding_type") if isinstance(part, dict) else None for part in parts
    ]


def chained_states(
    checkpoint: dcp.DcpCheckpoint, model_names: list[str], settings: dict, chained: list[str | None]
) -> list[RankStates] | None:
    """A MoE run's ChainedOptimizer (megatron-core puts expert parameters in their own grad
    buffer and optimizer, after the dense one): each member's ``dp_reshardable`` state (dense:
    ``chained_0``; experts: ``chained_1``, placed by expert-parallel rank), or None
    when every member is ``fully_reshardable`` (model-space tensors, read like a single
    optimizer's). Anything else is refused naming the layouts.

    Args:
        checkpoint: the torch_dist checkpoint.
        model_names: the model tensors, in save order.
        settings: the run's model settings.
        chained: each member's sharding type, from ``chained_layouts``.
    """
    where = checkpoint.index
    experts = [n for n in model_names if _EXPERT.match(n)]
    dense = [n for n in model_names if n not in experts]
    if set(chained) == {"fully_reshardable"}:
        return None
    odd = [n for n in experts if not STACKED_EXPERT.fullmatch(n)]
    if set(chained) != {"dp_reshardable"} or len(chained) != 2 or not experts or odd:
        raise MegatronImportError(
            f"{where}: the optimizer state is megatron-core's ChainedOptimizer "
            f"({len(chained)} optimizers, layouts {chained}, expert tensors {odd or experts}); "
            f"supported: two members (dense, then SequentialMLP or GroupedMLP experts) both "
            f"'dp_reshardable' or both 'fully_reshardable' ({SUPPORTED_LAYOUTS}). "
            f"{WEIGHTS_ONLY_HINT}"
        )
    first = in_module_order(bucket_states, checkpoint, dense, settings, prefix="chained_0.")
    second = in_module_order(
        bucket_states,
        checkpoint,
        experts,
        settings,
        prefix="chained_1.",
        experts=True,
        pp=first.grid.pp,
    )
    return [first, second]
