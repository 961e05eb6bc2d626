"""The run roots of torch trainers whose checkpoints are torch DCP or torch_checkpointing
folders: torchtitan's ``checkpoint/step-N`` and OLMo-core's save folder ``stepN``. Torch DCP
writes ``.metadata`` once every rank's files are written, so a step folder without it is a save
that did not complete (:mod:`jax_ucp._src.importers.runs`)."""

from __future__ import annotations

from jax_ucp._src.format import files
from jax_ucp._src.importers import runs
from jax_ucp._src.importers.torch import dcp, olmo_core, torch_checkpointing
from jax_ucp._src.store.storage import Storage


def torchtitan_run(root: Storage) -> runs.TrainerRun | None:
    """torchtitan's checkpoint folder: its ``step-N`` folders, torch DCP (torchtitan up to 0.2)
    or torch_checkpointing (0.3)."""

    def complete(step: Storage) -> str | None:
        if dcp.is_torch_dcp(step) or torch_checkpointing.is_torch_checkpointing(step):
            return None
        return (
            f"{step.root}: no torch DCP .metadata (written once every rank's files are) nor "
            f"torch_checkpointing metadata.pkl: its save did not complete"
        )

    found = runs.step_folders(root, rf"step-({files.DIGITS})")
    return runs.trainer_run(root, "torchtitan's checkpoint folder", found, complete)


def olmo_core_run(root: Storage) -> runs.TrainerRun | None:
    """OLMo-core's save folder: its ``stepN`` folders (``model_and_optim/`` torch DCP)."""

    def complete(step: Storage) -> str | None:
        if olmo_core.is_step_folder(step):
            return None
        return (
            f"{step.root}: no {olmo_core.MODEL_DIR}/.metadata (torch DCP writes it once every rank's "
            f"files are): its save did not complete"
        )

    found = runs.step_folders(root, rf"step({files.DIGITS})")
    return runs.trainer_run(root, "an OLMo-core save folder", found, complete)
