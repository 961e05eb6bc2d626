"""The verl importer's entry: its options, ``detect`` and ``plan`` (the model's tensors from
:mod:`.rank_tensors`, the optimizer's from :mod:`.optimizer`, the files beside from
:mod:`.side_files`, planned as a torch optimizer's state by
:func:`~jax_ucp._src.importers.torch_state.plan_state`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from jax_ucp._src.errors import SourceError
from jax_ucp._src.importers.plan import SKIPPED, Detection, ImportOptions, ImportPlan, refuse_spec
from jax_ucp._src.importers.torch_state import TorchState, plan_state, tied_parameters
from jax_ucp._src.importers.verl import layout, optimizer, rank_tensors, side_files
from jax_ucp._src.store.storage import Storage

__all__ = ["VerlOptions", "detect", "megatron_backend", "plan"]


@dataclasses.dataclass(frozen=True)
class VerlOptions(ImportOptions):
    """``ImportOptions``: a verl checkpoint takes no options of its own."""


def detect(storage: Storage) -> Detection:
    """Whether ``storage`` is a verl run root, ``global_step_N/`` or its ``actor/`` folder, from
    file names alone."""
    named = layout.named_like_verl(layout.entries(storage))  # else no folder of it is listed
    if named and layout.is_megatron_dir(storage):
        return Detection(True, f"a verl Megatron-backend model folder ({layout.DIST_CKPT}/)")
    if named and layout.is_model_dir(storage):
        return Detection(True, "verl FSDP rank files (model_world_size_W_rank_R.pt)")
    if named and layout.holds_actor(storage):
        return Detection(True, "a verl global_step_N/ folder (actor/ rank files)")
    if named and (steps := layout.step_dirs(storage)):
        return Detection(True, f"a verl run ({', '.join(steps[-3:])})")
    return Detection(
        False,
        "no verl `model_world_size_W_rank_R.pt` or `dist_ckpt/`, `global_step_N/actor/` or run "
        "root with them",
    )


def megatron_backend(
    storage: Storage, tensor_names: Callable[[Storage], Iterable[str]]
) -> tuple[str, Storage, dict[str, Any]] | None:
    """(``"megatron"``, megatron-core's ``dist_ckpt/`` folder, the verl record its import
    keeps) when ``storage`` locates a step of verl's Megatron backend, which megatron's importer
    reads (``Importer.hands_over``); None for an FSDP one. Bridge mode's ``dist_ckpt/`` (the
    optimizer's state alone: of ``tensor_names(folder)``, megatron's reading of its
    ``.metadata``, none outside ``optimizer.``) is refused by name."""
    where = layout.locate(storage)
    if not layout.is_megatron_dir(where.model_dir):
        return None
    ckpt = where.model_dir.folder(layout.DIST_CKPT)  # never a link out of the model folder
    if all(name.startswith("optimizer.") for name in tensor_names(ckpt)):
        hf = where.model_dir.join("huggingface")
        raise SourceError(
            f"{ckpt.root}: no model weights, only the optimizer's state: verl's Megatron backend in "
            f"bridge mode (use_dist_checkpointing=False) saves the weights as safetensors in "
            f"{hf}; convert that folder (the optimizer state in {layout.DIST_CKPT}/ is not read)"
        )
    record: dict[str, Any] = {"backend": "megatron", "path": where.model_dir.root}
    record.update(global_step=where.step, tracker_step=where.tracker_step)
    record["model_config"] = side_files.hf_config(where.model_dir)
    return "megatron", ckpt, {"verl": {k: v for k, v in record.items() if v is not None}}


def plan(storage: Storage, options: ImportOptions) -> ImportPlan:
    """The import of the verl checkpoint at ``storage`` (a run root, ``global_step_N/`` or its
    ``actor/``). Every check that needs no tensor bytes runs before this returns."""
    refuse_spec(options.spec, "a verl import keeps the model's parameter names", SourceError)
    where = layout.locate(storage)
    model_dir, folder = where.model_dir, where.model_dir.root
    ranks = layout.rank_files(model_dir)
    world = ranks.world_size
    if "model" not in ranks.by_kind:
        raise SourceError(f"{folder}: no model_world_size_{world}_rank_R.pt")
    recorded = {
        "fsdp_version": side_files.fsdp_config(model_dir, world),
        "global_step": where.step,
        "tracker_step": where.tracker_step,
    }
    source: dict[str, Any] = {"framework": "verl", "path": folder, "world_size": world}
    source.update((k, v) for k, v in recorded.items() if v is not None)
    found: list[str] = []  # every source tensor (or file read as a unit)

    models = [rank_tensors.load(model_dir, name) for name in ranks.by_kind["model"]]
    params = rank_tensors.parameters(folder, ranks.by_kind["model"], models, world, found)
    refs = {name: rank_tensors.tensor_ref(name, *value) for name, value in params.items()}
    tied = tied_parameters(refs, {})
    config = side_files.hf_config(model_dir)
    if config is not None:
        source["trainer"] = {"model_config": config}

    states, groups, optimizer_sources = optimizer.optimizer_state(
        model_dir, ranks, options, params, tied, source, found
    )
    side_files.extra_state(model_dir, ranks.by_kind.get("extra_state", []), source, found)
    side_files.units_beside(where, source, found)
    skipped = source.pop(SKIPPED, {})
    state = TorchState(refs, states, groups, skipped, folder, found, optimizer_sources)
    planned = plan_state(state, source, options)
    step = next((int(per["step"].read()) for per in states.values() if "step" in per), None)
    side_files.scheduler_against_optimizer(folder, planned.source, step)
    return planned
