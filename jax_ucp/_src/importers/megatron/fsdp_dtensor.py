"""megatron-core's ``fsdp_dtensor`` checkpoints (Megatron-LM ``--ckpt-format fsdp_dtensor`` with
``--use-megatron-fsdp``): plain torch DCP, no ``common.pt`` or ``metadata.json``, written by
Megatron-LM's ``generate_state_dict`` + ``preprocess_fsdp_dtensor_state_dict``
(megatron/training/checkpointing.py) and ``torch.distributed.checkpoint.save``:

* ``model.<wrappers>.<param>``: each parameter at its global shape in row chunks, one per DP rank
  of uneven size (Megatron-FSDP's DTensors, chunk offsets from megatron-core's
  ``preprocess_state_dict_for_uneven_dtensor``). Megatron-FSDP swaps its optimizer's (main)
  parameters into the module before ``state_dict``, so these are the masters: ``params/``;
* ``optimizer.state.<wrappers>.<param>.{exp_avg,exp_avg_sq,step}`` (the distributed optimizer's
  ``sharded_param_state_fsdp_dtensor``, torch Adam's per-parameter state) and objects
  ``optimizer.param_to_group_meta.<param>.<field>`` (lr, betas, ..., ``step`` for optimizers
  that keep it there);
* objects ``args``, ``iteration``, ``checkpoint_version`` (and RNG / scheduler state).

Output names drop the wrappers (``module.``, ``model.``): ``decoder.layers.0.mlp.linear_fc1.weight``
(per layer, as the legacy format's); with ``--swiglu`` Megatron-LM saves fc1 as its two halves
``linear_fc1.weight_w`` / ``_v``, imported under those names.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from jax_ucp._src.importers.megatron import dcp, legacy
from jax_ucp._src.importers.megatron.common import (
    WEIGHTS_ONLY_HINT,
    MegatronImportError,
    OptimizerFound,
)
from jax_ucp._src.importers.plan import VALUES, agreed_step

_STATE = "optimizer.state."
_GROUP_META = "optimizer.param_to_group_meta."
_WRAPPERS = re.compile(r"(?:(?:module|model)\.)*")
MOMENTS = ("exp_avg", "exp_avg_sq")


def is_fsdp_dtensor(checkpoint: dcp.DcpCheckpoint) -> bool:
    """Whether ``checkpoint`` is megatron-core's fsdp_dtensor layout: its optimizer's
    per-parameter group record, or (model only) a ``model.`` tree and no ``common.pt``'s state."""
    names = [*checkpoint.tensors, *checkpoint.objects]
    if any(n.startswith(_GROUP_META) for n in names):
        return True
    return "args" in checkpoint.objects and any(n.startswith("model.") for n in checkpoint.tensors)


def read_fsdp_dtensor(
    checkpoint: dcp.DcpCheckpoint, weights_only: bool
) -> tuple[dict[str, Any], dict[str, str], OptimizerFound]:
    """What torch_dist's planning reads of an fsdp_dtensor checkpoint its own way: the run
    state as ``common.pt`` holds it (:func:`_run_state`), each model tensor's output name
    (wrappers dropped), and the optimizer state by parameter (none with ``weights_only``: its
    tensors in ``skipped``)."""
    where = checkpoint.index
    chunks = [n for n in checkpoint.tensors if re.match(r"model[0-9]+\.", n)]
    if chunks:  # Megatron-LM's virtual pipeline chunks: model0, model1, ...
        raise MegatronImportError(
            f"{where}: tensor {chunks[0]!r}: virtual pipeline chunks of an "
            f"fsdp_dtensor checkpoint are not supported"
        )
    model = {
        n: _WRAPPERS.sub("", n[len("model.") :], count=1)
        for n in checkpoint.tensors
        if n.startswith("model.")
    }
    skipped = {
        n: "not a model or optimizer tensor (RNG or other run state)"
        for n in checkpoint.tensors
        if n not in model and not n.startswith("optimizer.")
    }
    # e.g. Megatron-LM's torch_dcp format (torch's optimizer state dict): not this layout
    alien = [
        n for n in checkpoint.tensors if n.startswith("optimizer.") and not n.startswith(_STATE)
    ]
    if alien and not weights_only:
        raise MegatronImportError(
            f"tensor {alien[0]!r} in {where}: not fsdp_dtensor's optimizer layout "
            f"({_STATE}<param>.<state>). {WEIGHTS_ONLY_HINT}"
        )
    by_param = {v: k for k, v in model.items()}
    if len(by_param) != len(model):
        raise MegatronImportError(f"{where}: two model tensors name one parameter {sorted(model)}")
    states, steps = ({}, {}) if weights_only else _states(checkpoint, by_param)
    for n in checkpoint.tensors:
        if n.startswith("optimizer.") and (weights_only or n in steps):
            skipped[n] = (
                "weights_only: optimizer state (layout 'fsdp_dtensor')"
                if weights_only
                else "the Adam step of one parameter: all equal, imported once as opt_state/count"
            )
    read = {"pattern": "optimizer.state.<param>.step", VALUES: [".metadata: optimizer.state"]}
    step = (_count(checkpoint, steps, by_param), read) if states else None
    return _run_state(checkpoint), model, OptimizerFound(states, skipped=skipped, step=step)


def _object(checkpoint: dcp.DcpCheckpoint, name: str) -> Any:
    return checkpoint.read_object(name, legacy.LEGACY_CLASSES)


def _run_state(checkpoint: dcp.DcpCheckpoint) -> dict[str, Any]:
    """The run state as ``common.pt`` holds it (what torch_dist's planning and
    ``optimizer_record`` read): ``iteration``, ``args``, the scheduler's
    (``opt_param_scheduler.<field>`` objects) and each distinct param group, from the
    per-parameter ``optimizer.param_to_group_meta.<param>.<field>`` objects."""
    metas: dict[str, dict[str, Any]] = {}
    scheduler: dict[str, Any] = {}
    state: dict[str, Any] = {"iteration": None}
    for n in checkpoint.objects:
        if n in ("iteration", "args"):
            state[n] = _object(checkpoint, n)
        elif n.startswith(_GROUP_META):
            param, _, field = n[len(_GROUP_META) :].rpartition(".")
            metas.setdefault(param, {})[field] = _object(checkpoint, n)
        elif n.startswith("opt_param_scheduler."):
            scheduler[n[len("opt_param_scheduler.") :]] = _object(checkpoint, n)
    groups = {repr(sorted(m.items(), key=str)): m for m in metas.values()}
    if scheduler:
        state["opt_param_scheduler"] = scheduler
    if groups:
        state["optimizer"] = {"optimizer": {"param_groups": list(groups.values())}}
    return state


def _states(
    checkpoint: dcp.DcpCheckpoint, by_param: dict[str, str]
) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """``{model tensor: {"param": itself, "exp_avg": ..., "exp_avg_sq": ...}}`` and the per-
    parameter ``step`` tensors ``{tensor: model tensor}``; none when no optimizer was saved."""
    where = checkpoint.index
    found: dict[str, dict[str, str]] = {}
    steps: dict[str, str] = {}
    for n in (n for n in checkpoint.tensors if n.startswith(_STATE)):
        param, _, state = _WRAPPERS.sub("", n[len(_STATE) :], count=1).rpartition(".")
        if param not in by_param or state not in (*MOMENTS, "step"):
            raise MegatronImportError(
                f"tensor {n!r} in {where}: "
                + (
                    f"optimizer state of {param!r}, not a model tensor"
                    if param not in by_param
                    else f"unknown optimizer state {state!r} (Adam's {MOMENTS} and step are read)"
                )
                + f". {WEIGHTS_ONLY_HINT}"
            )
        if state == "step":
            steps[n] = by_param[param]
            continue
        if checkpoint.tensors[n].shape != checkpoint.tensors[by_param[param]].shape:
            raise MegatronImportError(
                f"tensor {n!r} in {where}: shape {list(checkpoint.tensors[n].shape)}, its "
                f"parameter's is {list(checkpoint.tensors[by_param[param]].shape)}"
            )
        found.setdefault(by_param[param], {"param": by_param[param]})[state] = n
    if not found:
        return {}, steps
    for name in by_param.values():
        missing = [s for s in MOMENTS if s not in found.get(name, {})]
        if missing:
            raise MegatronImportError(
                f"tensor {name!r}: optimizer state {missing} missing in {where}. {WEIGHTS_ONLY_HINT}"
            )
    return found, steps


def _count(checkpoint: dcp.DcpCheckpoint, steps: dict[str, str], by_param: dict) -> int:
    """Adam's step: every parameter's ``step`` tensor (torch's Adam), else its group record's
    ``step`` (optimizers that keep it in the param group); all must agree."""
    where = checkpoint.index
    found: dict[float, str] = {}
    sources = steps or {
        n: n for n in checkpoint.objects if n.startswith(_GROUP_META) and n.endswith(".step")
    }
    for n in sources:
        value = checkpoint.read(n) if n in checkpoint.tensors else _object(checkpoint, n)
        value = np.asarray(value)
        if value.shape != () or value.dtype.kind not in "iuf":
            raise MegatronImportError(f"{n!r} in {where}: {value!r} is not an Adam step count")
        found.setdefault(float(value), f"in {n!r}")
    if not found:
        raise MegatronImportError(
            f"{where}: optimizer moments but no Adam step (no optimizer.state.<param>.step, no "
            f"{_GROUP_META}<param>.step). {WEIGHTS_ONLY_HINT}"
        )
    if len(sources) < len(by_param):
        raise MegatronImportError(
            f"{where}: an Adam step for {len(sources)} of {len(by_param)} parameters"
        )
    return agreed_step(found, where, recorded_by="parameters", error=MegatronImportError)
