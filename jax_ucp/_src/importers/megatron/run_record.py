"""What a Megatron checkpoint records of how its optimizer stepped: the saved ``args`` that set
the optimizer, clipping and schedule, the ``OptimizerParamScheduler`` state and the optimizer's
param-group hyper-parameters, kept as the files hold them (``source.megatron_optimizer``) so a
continuation (``continuation.megatron``) can check and translate them without re-reading."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jax_ucp._src.facts import ABSENT, Facts, canonical

__all__ = [
    "MEGATRON_OPTIMIZER",
    "RUN_ARGS",
    "agreed_record",
    "optimizer_record",
    "run_config_args",
    "with_rank_groups",
]

#: the key of ``source`` this record is kept under
MEGATRON_OPTIMIZER = "megatron_optimizer"

#: Megatron-LM run arguments that say how the optimizer, clipping and schedule stepped
RUN_ARGS = (
    "optimizer",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
    "sgd_momentum",
    "weight_decay",
    "start_weight_decay",
    "end_weight_decay",
    "weight_decay_incr_style",
    "decoupled_weight_decay",
    "apply_wd_to_qk_layernorm",
    "clip_grad",
    "lr",
    "min_lr",
    "lr_warmup_init",
    "lr_decay_style",
    "lr_decay_iters",
    "lr_decay_samples",
    "lr_warmup_iters",
    "lr_warmup_samples",
    "lr_warmup_fraction",
    "lr_wsd_decay_style",
    "lr_wsd_decay_iters",
    "lr_wsd_decay_samples",
    "train_iters",
    "train_samples",
    "global_batch_size",
    "micro_batch_size",
    "data_parallel_size",
    "rampup_batch_size",
    "step_batch_size_schedule",
    "decoupled_lr",
    "decoupled_min_lr",
    "iteration",
    "consumed_train_samples",
    "skipped_train_samples",
    "use_checkpoint_opt_param_scheduler",
    "override_opt_param_scheduler",
    "fp16",
    "bf16",
    "optimizer_cpu_offload",
    "use_distributed_optimizer",
    "no_weight_decay_cond_type",
)


def _plain(value: Any, nested: bool = False) -> Any:
    """A scalar (or a short list of scalars) as JSON can hold it; anything else as its type's
    name in angle brackets, so a reader sees the value was there but not what it was (a pickle
    cannot make the record large: no nesting, strings and lists bounded)."""
    if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.size == 1):
        value = np.asarray(value).reshape(()).item()
    numel = getattr(value, "numel", None)
    if callable(numel) and hasattr(value, "item") and numel() == 1:
        value = value.item()  # a one-element tensor (a step saved as a tensor)
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, str):
        return value if len(value) <= 200 else f"<str of {len(value)} characters>"
    if isinstance(value, float):
        return value if np.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)) and len(value) <= 16 and not nested:
        return [_plain(v, nested=True) for v in value]
    return f"<{type(value).__name__}>"


def _groups(optimizer_state: Any) -> list[Any] | None:
    """The hyper-parameters of every saved param group (a ChainedOptimizer's members in order),
    without their parameter lists; None when none is saved."""
    members: list[Any]
    if isinstance(optimizer_state, dict) and "param_groups" in optimizer_state:
        members = [{"optimizer": optimizer_state}]  # FP32Optimizer: torch's own state dict
    elif isinstance(optimizer_state, dict) and "optimizer" in optimizer_state:
        members = [optimizer_state]
    elif isinstance(optimizer_state, dict):  # ChainedOptimizer: {index: member state}
        order = sorted(optimizer_state, key=lambda k: (not isinstance(k, int), str(k).zfill(9)))
        members = [optimizer_state[k] for k in order]
    elif isinstance(optimizer_state, list):
        members = list(optimizer_state)
    else:
        return None
    groups: list[Any] = []
    for member in members:
        inner = member.get("optimizer") if isinstance(member, dict) else None
        saved = inner.get("param_groups") if isinstance(inner, dict) else None
        for group in saved if isinstance(saved, list) else ():
            if isinstance(group, dict):
                groups.append(_mapping({k: v for k, v in group.items() if k != "params"}))
    if len(groups) > _MAX_ITEMS:
        return [f"<{len(groups)} param groups>"]  # refused by its reader as no list of groups
    return groups or None


#: the most keys of one record mapping, and param groups, kept (a run has a few dozen)
_MAX_ITEMS = 256


def _mapping(values: Mapping[Any, Any]) -> dict[str, Any] | str:
    """A saved mapping's scalars (keys as bounded text), or what it was when too large."""
    if len(values) > _MAX_ITEMS:
        return f"<dict of {len(values)} keys>"
    return {str(k)[:100]: _plain(v) for k, v in values.items()}


def optimizer_record(state: Mapping[str, Any], where: str) -> dict | None:
    """``source.megatron_optimizer`` from a checkpoint's top-level state (torch_dist's common
    state, a legacy rank file): only what it holds; None when it holds none of it."""
    args = state.get("args")
    fields = vars(args) if hasattr(args, "__dict__") else {}
    record: dict[str, Any] = {"file": where}
    run_args = {k: _plain(fields[k]) for k in RUN_ARGS if k in fields}
    if run_args:
        record["args"] = run_args
    scheduler = state.get("opt_param_scheduler")
    if isinstance(scheduler, dict):
        record["opt_param_scheduler"] = _mapping(scheduler)
    elif scheduler is not None:
        record["opt_param_scheduler"] = _plain(scheduler)
    groups = _groups(state.get("optimizer"))
    if groups:
        record["param_groups"] = groups
    if "iteration" in state:
        record["iteration"] = _plain(state["iteration"])
    return record if len(record) > 1 else None


#: param-group fields one run gives every group of every rank (weight_decay and lr are scaled
#: by a group's wd_mult / lr_mult, so they are compared where a rank's groups hold one value)
GROUP_SHARED = ("lr", "max_lr", "min_lr", "betas", "eps", "step", "decoupled_weight_decay",
                "amsgrad", "maximize")  # fmt: skip


def agreed_record(files: Sequence[tuple[str, Mapping[str, Any]]], where: str) -> dict | None:
    """:func:`optimizer_record` of the first of ``files`` ((name, state) of every rank file),
    each of its facts compared with every other rank file's (``facts.py``): every rank saves
    the same args, scheduler state, iteration and group hyper-parameters, so one that differs
    (a file edited or copied from another run) is refused, every rank's value named."""
    records = [r for name, state in files if (r := optimizer_record(state, name)) is not None]
    facts = Facts(where)
    for section in ("args", "opt_param_scheduler"):
        keys = {k for r in records if isinstance(r.get(section), dict) for k in r[section]}
        for key in sorted(keys):
            for r in records:
                said = r.get(section)
                value = said.get(key, ABSENT) if isinstance(said, dict) else said
                facts.state(f"{section}.{key}", f"{r['file']} {section}.{key}", value)
    for r in records:
        facts.state("iteration", f"{r['file']} iteration", r.get("iteration", ABSENT))
        groups = [g for g in r.get("param_groups") or () if isinstance(g, dict)]
        for key in GROUP_SHARED:
            values = {repr(canonical(g[key])): g[key] for g in groups if key in g}
            if len(values) == 1:
                record = f"{r['file']} optimizer param_groups[*].{key}"
                facts.state(f"param_groups.{key}", record, next(iter(values.values())))
        for key, by in (("weight_decay", ("wd_mult",)), ("lr", ("lr_mult", "is_decoupled_lr"))):
            for g in groups:  # scaled by the group's multiplier: equal where it is
                if key in g and all(k in g for k in by):
                    which = ", ".join(f"{k} {g[k]!r}" for k in by)
                    record = f"{r['file']} optimizer param_groups[{which}].{key}"
                    facts.state(f"param_groups[{which}].{key}", record, g[key])
    facts.agree_all()
    return records[0] if records else None


def with_rank_groups(
    record: dict | None, members: Sequence[Sequence[tuple[str, Any]]], common: str, where: str
) -> dict | None:
    """``record`` (the common state's; None: it holds none, its file ``common``) with the param
    groups a distributed optimizer saved per model-parallel rank (torch_dist's ``dp_reshardable``
    / ``dp_zero_gather_scatter`` objects; ``members``: a ChainedOptimizer's, each [(object,
    groups)]): every rank's compared with every other's (:func:`agreed_record`), each member's
    first rank's kept as a ChainedOptimizer's common state lists them, the objects named
    (``groups_file``) for the continuation's refusals."""
    ranks = [(name, g) for member in members for name, g in member if isinstance(g, list)]
    if not ranks:
        return record
    named = [(name, {"optimizer": {"param_groups": groups}}) for name, groups in ranks]
    if record is not None and record.get("param_groups"):  # the common state's too
        named.append((record["file"], {"optimizer": {"param_groups": record["param_groups"]}}))
    agreed_record(named, where)
    out: dict[str, Any] = dict(record or {"file": common})
    if not out.get("param_groups"):
        firsts = [member[0][1] for member in members if member and isinstance(member[0][1], list)]
        out["param_groups"] = [g for f in firsts for g in _groups({"param_groups": f}) or ()]
    out["groups_file"] = ranks[0][0]
    return out


def run_config_args(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """Megatron Bridge's ``run_config.yaml``: its ``optimizer`` (megatron-core's
    ``OptimizerConfig``), ``scheduler`` and ``train`` sections hold the run arguments under
    Megatron-LM's names; those of :data:`RUN_ARGS` it holds."""
    found: dict[str, Any] = {}
    for section in ("optimizer", "scheduler", "train"):
        values = run_config.get(section)
        if not isinstance(values, dict):
            continue
        for key in RUN_ARGS:
            if key in values and key not in found:
                found[key] = _plain(values[key])
    return found
