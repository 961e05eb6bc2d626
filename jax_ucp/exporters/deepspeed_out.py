"""DeepSpeed's universal checkpoint, written without torch or DeepSpeed.

The layout DeepSpeed's ``ds_to_universal`` writes and ``"checkpoint": {"load_universal": true}``
loads at any data-parallel size::

    DST/latest_universal                         -> "global_step<N>_universal"
    DST/global_step<N>_universal/mp_rank_00_model_states.pt
    DST/global_step<N>_universal/zero/optimizer_state.pt
    DST/global_step<N>_universal/zero/<param>/fp32.pt        {"param": fp32 tensor, "cat_dim": 0}
    DST/global_step<N>_universal/zero/<param>/exp_avg.pt     (the same, Adam's first moment)
    DST/global_step<N>_universal/zero/<param>/exp_avg_sq.pt  (second moment)
    DST/global_step<N>_universal/zero/<param>/step.pt        a 0-d float32 tensor

DeepSpeed's loader reads the weights from ``zero/`` (fp32 masters, then cast to the engine's
precision), takes ``ds_version`` and the param groups from ``optimizer_state.pt`` (written with no
hyperparameters, so the loading engine keeps its own lr, betas, clipping and loss scaling) and
the step counters from ``mp_rank_00_model_states.pt``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

import numpy as np

from jax_ucp.errors import ExportError
from jax_ucp.exporters import torch_out
from jax_ucp.exporters.source import Deferred
from jax_ucp.format import files
from jax_ucp.writer import durable

#: The DeepSpeed version whose universal format this writes (and what ``ds_version`` says).
DS_VERSION = "0.19.8"
STATES = ("fp32", "exp_avg", "exp_avg_sq")


@dataclasses.dataclass(frozen=True)
class UniversalParam:
    """One parameter: its DeepSpeed name and shape (every state is fp32 of this shape)."""

    name: str
    shape: tuple[int, ...]


def tag_for(step: int) -> str:
    """The folder name ``ds_to_universal`` gives the step (``global_step<N>_universal``)."""
    return f"global_step{step}_universal"


def check_name(name: str) -> None:
    """A parameter name becomes a folder name under ``zero/``: no separators, no dot names."""
    if not name or "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
        raise ExportError(f"parameter {name!r} cannot be a folder name under zero/")


def write_universal(
    root: str,
    params: list[UniversalParam],
    states: Iterable[tuple[str, str, np.ndarray | Deferred]],
    *,
    step: int,
    model_weights: Iterable[tuple[str, np.ndarray | Deferred]] | None = None,
    param_groups: int = 1,
) -> list[str]:
    """Writes the universal checkpoint under ``root``; ``states`` yields (param, state, fp32
    array) for every param and every state of :data:`STATES`. Returns the files written.

    Args:
        root: the tag folder to write (``<tag>_universal``).
        params: every parameter, its DeepSpeed name and shape.
        states: (param, state, fp32 array) for every param and state.
        step: the optimizer step recorded in each ``step.pt``.
        model_weights: (name, array) of the model-precision weights, or None.
        param_groups: param groups of the loading engine's optimizer.
    """
    tag = tag_for(step)
    tag_dir = os.path.join(root, tag)
    zero = os.path.join(tag_dir, "zero")
    os.makedirs(zero)
    for p in params:
        check_name(p.name)
        files.inside(zero, p.name, f"{zero}: parameter folder")
        os.makedirs(os.path.join(zero, p.name))
    written = _write_states(zero, {p.name: p.shape for p in params}, states, step)
    if len(written) != 4 * len(params):
        raise ExportError(
            f"DeepSpeed universal needs fp32, exp_avg and exp_avg_sq of every parameter; "
            f"got {len(written)} files for {len(params)} parameters"
        )
    optimizer_state = {
        "ds_version": DS_VERSION,
        "param_groups": [{"params": []} for _ in range(param_groups)],
    }
    path = os.path.join(zero, "optimizer_state.pt")
    torch_out.save_file(path, optimizer_state)
    written.append(path)
    module, arrays = {}, []
    for name, weight in model_weights or ():
        module[name] = torch_out.TensorSlot(len(arrays), tuple(weight.shape), weight.dtype)
        arrays.append(weight)
    path = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    torch_out.save_file(path, _model_states(params, module, step), arrays)
    written.append(path)
    durable.write_file(os.path.join(root, "latest_universal"), tag)
    written.append(os.path.join(root, "latest_universal"))
    return [os.path.relpath(p, root) for p in written]


def _write_states(
    zero: str,
    shapes: dict[str, tuple[int, ...]],
    states: Iterable[tuple[str, str, np.ndarray | Deferred]],
    step: int,
) -> list[str]:
    """``zero/<param>/<state>.pt`` for every state yielded, each checked fp32 of the parameter's
    shape, and ``step.pt`` after a parameter's last state. Returns the paths written."""
    written = []
    step_tensor = np.asarray(float(step), np.float32)
    for name, state, array in states:
        if state not in STATES or name not in shapes:
            raise ExportError(f"unexpected state {state!r} of {name!r} for DeepSpeed universal")
        if tuple(array.shape) != shapes[name] or array.dtype != np.float32:
            raise ExportError(
                f"parameter {name!r} {state}: {array.shape} {array.dtype}, DeepSpeed universal "
                f"wants fp32 {shapes[name]}"
            )
        path = os.path.join(zero, name, f"{state}.pt")
        slot = torch_out.TensorSlot(0, tuple(array.shape), array.dtype)
        torch_out.save_file(path, {"param": slot, "cat_dim": 0}, [array])
        written.append(path)
        if state == STATES[-1]:
            step_path = os.path.join(zero, name, "step.pt")
            slot = torch_out.TensorSlot(0, (), step_tensor.dtype)
            torch_out.save_file(step_path, slot, [step_tensor])
            written.append(step_path)
    return written


def _model_states(params: list[UniversalParam], module: dict, step: int) -> dict:
    """``mp_rank_00_model_states.pt``'s pickle: one rank, no parallelism, the step counters and
    ``module`` (name -> tensor slot) as an OrderedDict."""
    return {
        "module": torch_out.Call(
            torch_out.Global("collections", "OrderedDict"), ([[k, v] for k, v in module.items()],)
        ),
        "buffer_names": [],
        "optimizer": None,
        "param_shapes": [
            torch_out.Call(
                torch_out.Global("collections", "OrderedDict"),
                ([[p.name, torch_out.torch_size(p.shape)] for p in params],),
            )
        ],
        "frozen_param_shapes": {},
        "shared_params": {},
        "frozen_param_fragments": {},
        "lr_scheduler": None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": 0,
        "global_steps": int(step),
        "global_samples": 0,
        "dp_world_size": 1,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": {},
        "ds_version": DS_VERSION,
        "universal_checkpoint_info": {"universal_checkpoint_version": 0.2},
    }
