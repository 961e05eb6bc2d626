"""DeepSpeed's universal checkpoint (what ``ds_to_universal`` writes and ``"load_universal": true``
loads at any DP size), written without torch or DeepSpeed::

    DST/latest_universal                         -> "global_step<N>_universal"
    DST/global_step<N>_universal/mp_rank_00_model_states.pt
    DST/global_step<N>_universal/zero/optimizer_state.pt
    DST/global_step<N>_universal/zero/<param>/fp32.pt        {"param": fp32 tensor, "cat_dim": 0}
    DST/global_step<N>_universal/zero/<param>/exp_avg.pt     (the same, Adam's first moment)
    DST/global_step<N>_universal/zero/<param>/exp_avg_sq.pt  (second moment)
    DST/global_step<N>_universal/zero/<param>/step.pt        a 0-d float32 tensor

``optimizer_state.pt`` holds no hyperparameters: the loading engine keeps its own lr, betas,
clipping and loss scaling."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from jax_ucp._src import format as fmt
from jax_ucp._src import store
from jax_ucp._src.errors import RequestError
from jax_ucp._src.exporters import by_spec, source
from jax_ucp._src.exporters.options import DeepSpeedUniversalExport, Exported
from jax_ucp._src.exporters.source import RowSlabs
from jax_ucp._src.format import files
from jax_ucp._src.restoring.model import Request, check_cast
from jax_ucp._src.restoring.sources import ucp_source
from jax_ucp._src.torchfiles import torch_zip
from jax_ucp._src.torchfiles.pickle_format import Call, Global, torch_size
from jax_ucp._src.writer import durable

#: The DeepSpeed version whose universal format this writes (and what ``ds_version`` says).
DS_VERSION = "0.19.8"
STATES = ("fp32", "exp_avg", "exp_avg_sq")


def check_name(name: str) -> None:
    """A parameter name becomes a folder name under ``zero/``: no separators, no dot names."""
    if not name or "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
        raise RequestError(f"parameter {name!r} cannot be a folder name under zero/")


def write_universal(
    root: str,
    params: Sequence[tuple[str, Mapping[str, np.ndarray | RowSlabs]]],
    *,
    step: int,
    model_weights: Iterable[tuple[str, np.ndarray | RowSlabs]] | None = None,
    param_groups: int = 1,
) -> list[str]:
    """Writes the universal checkpoint under ``root``; returns the files written.

    Args:
        root: the tag folder to write (``<tag>_universal``).
        params: every parameter's DeepSpeed name and its fp32 arrays by :data:`STATES`.
        step: the optimizer step recorded in each ``step.pt``.
        model_weights: (name, array) of the model-precision weights, or None.
        param_groups: param groups of the loading engine's optimizer."""
    tag = f"global_step{step}_universal"  # the folder name ds_to_universal gives the step
    tag_dir = os.path.join(root, tag)
    zero = os.path.join(tag_dir, "zero")
    os.makedirs(zero)
    written = []
    step_tensor = np.asarray(float(step), np.float32)
    for name, states in params:
        check_name(name)
        files.inside(zero, name, f"{zero}: parameter folder")
        os.makedirs(os.path.join(zero, name))
        for state in STATES:
            path = os.path.join(zero, name, f"{state}.pt")
            slot = torch_zip.TensorSlot(0, tuple(states[state].shape), np.dtype(np.float32))
            obj = {"param": slot, "cat_dim": 0}
            torch_zip.save_file(path, obj, [states[state]], source.pieces)
            written.append(path)
        written.append(os.path.join(zero, name, "step.pt"))
        slot = torch_zip.TensorSlot(0, (), step_tensor.dtype)
        torch_zip.save_file(written[-1], slot, [step_tensor])
    optimizer_state = {
        "ds_version": DS_VERSION,
        "param_groups": [{"params": []} for _ in range(param_groups)],
    }
    path = os.path.join(zero, "optimizer_state.pt")
    torch_zip.save_file(path, optimizer_state)
    written.append(path)
    module, arrays = {}, []
    for name, weight in model_weights or ():
        module[name] = torch_zip.TensorSlot(len(arrays), tuple(weight.shape), weight.dtype)
        arrays.append(weight)
    path = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    shapes = [(name, tuple(states["fp32"].shape)) for name, states in params]
    torch_zip.save_file(path, _model_states(shapes, module, step), arrays, source.pieces)
    written.append(path)
    durable.write_file(os.path.join(root, "latest_universal"), tag)
    written.append(os.path.join(root, "latest_universal"))
    return [os.path.relpath(p, root) for p in written]


def _model_states(params: list[tuple[str, tuple[int, ...]]], module: dict, step: int) -> dict:
    """``mp_rank_00_model_states.pt``'s pickle: one rank, the step counters and ``module``."""
    return {
        "module": Call(
            Global("collections", "OrderedDict"), ([[k, v] for k, v in module.items()],)
        ),
        "buffer_names": [],
        "optimizer": None,
        "param_shapes": [
            Call(
                Global("collections", "OrderedDict"),
                ([[name, torch_size(shape)] for name, shape in params],),
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


def export(root: str, dst: str, options: DeepSpeedUniversalExport) -> Exported:
    """Params with their Adam moments (by manifest role) and the step, as DeepSpeed universal.

    Args:
        root: the UCP checkpoint directory (a manager step already resolved).
        dst: the directory to create.
        options: this format's options (``engine.export`` checked them)."""
    manifest = store.read_manifest(root)
    # the names DeepSpeed's model has: its named_parameters (transformers 5's experts fused)
    spec = by_spec.load(options.spec, manifest, None, state_dict=options.state_dict_names)
    available = ucp_source.available_tensors(manifest, spec)
    # each tensor's manifest entry (a view's: its first source's), for its role
    by_key = {k: a.sources[0] for k, a in available.items()}
    found, count = source.required_adam_keys(root, by_key, "DeepSpeed universal")
    params, moments, model = found.params, found.moments, found.model
    ds_names = {p: ".".join(rel) for p, rel in params.items()}
    for p in params:
        check_cast(ds_names[p], available[p].dtype, np.dtype(np.float32), "same_kind")
        for m, state in (("mu", "exp_avg"), ("nu", "exp_avg_sq")):
            shape = tuple(available[moments[(p, m)]].shape)
            if shape != tuple(available[p].shape):
                raise RequestError(
                    f"parameter {ds_names[p]!r} {state}: shape {shape}, DeepSpeed universal "
                    f"wants the parameter's {tuple(available[p].shape)}"
                )
    (step,) = ucp_source.read(root, manifest, [Request(count)], available=available)
    reads = source.Source(root, manifest, available, progress=options.progress, total=len(ds_names))

    # each parameter's states, read as they are written (progress counted at the last)
    params_out = [
        (
            name,
            {
                "fp32": reads.tensor(p, np.float32),
                "exp_avg": reads.tensor(moments[(p, "mu")], np.float32),
                "exp_avg_sq": reads.tensor(moments[(p, "nu")], np.float32, name),
            },
        )
        for p, name in ds_names.items()
    ]
    weights = [(name, reads.tensor(model.get(p, p))) for p, name in ds_names.items()]
    shapes = [tuple(available[p].shape) for p in params]
    written = source.write_atomically(
        dst,
        lambda tmp: write_universal(
            tmp,
            params_out,
            step=int(step),
            model_weights=weights,
            param_groups=options.param_groups,
        ),
        options.force,
    )
    return Exported(
        path=dst,
        files=written,
        tensors=3 * len(shapes),
        bytes=3 * sum(4 * math.prod(shape) for shape in shapes),
        skipped=[
            fmt.key_to_str(k)
            for k in by_key
            if k not in params and k != count and k not in set(moments.values())
        ]
        + [fmt.key_to_str(v.key) for v in manifest.values],
    )
