"""Which Megatron format a directory holds (torch_dist or legacy), and where its files are."""

from __future__ import annotations

import re
from dataclasses import dataclass

from jax_ucp._src.errors import SourceError
from jax_ucp._src.importers import runs
from jax_ucp._src.importers.megatron import legacy
from jax_ucp._src.importers.megatron.common import listed, subfolder
from jax_ucp._src.store.storage import Storage


@dataclass(frozen=True)
class MegatronSource:
    """Where a Megatron checkpoint is and which of its two formats it is."""

    format: str  # "torch_dist" | "legacy"
    #: the folder holding .metadata (torch_dist) or the mp_rank_* folders (legacy)
    folder: Storage
    iteration: int | None


def detect_megatron(src: Storage) -> MegatronSource | None:
    """torch_dist or legacy, from a checkpoint root (with the tracker file) or an iter folder."""
    names = listed(src)
    if names is None:
        return None
    # listed, not a regular file: a .metadata or tracker that is a FIFO, a device or too large
    # is this format's file gone wrong, reported as such by the reader, not "not a checkpoint"
    if ".metadata" in names:
        match = re.fullmatch(r"iter_([0-9]+)", legacy.name_of(src))
        return MegatronSource("torch_dist", src, int(match.group(1)) if match else None)
    try:
        iteration_dir, iteration = legacy.resolve_iteration_dir(src, names)
    except SourceError:
        if legacy.TRACKER_FILE in names:
            raise
        return None
    inner = names if iteration_dir is src else listed(iteration_dir) or []
    if ".metadata" in inner:
        return MegatronSource("torch_dist", iteration_dir, iteration)
    ranks = (n for n in inner if n.startswith("mp_rank_"))
    if any(listed(subfolder(iteration_dir, n)) is not None for n in ranks):
        return MegatronSource("legacy", iteration_dir, iteration)
    return None


def megatron_run(root: Storage) -> runs.TrainerRun | None:
    """A Megatron save root (``Importer.run``): its ``iter_NNNNNNN`` folders. Megatron writes
    ``latest_checkpointed_iteration.txt`` once every rank has saved an iteration, so a newer one
    did not complete; a folder with neither torch_dist's ``.metadata`` (written last) nor
    legacy ``mp_rank_*`` folders neither."""
    found = runs.step_folders(root, r"iter_([0-9]+)")
    names = listed(root) or [] if found else []
    tracked = None
    if legacy.TRACKER_FILE in names:
        tracked = (legacy.TRACKER_FILE, legacy.resolve_iteration_dir(root, names)[1])

    def complete(step: Storage) -> str | None:
        inner = listed(step) or []
        if ".metadata" in inner or any(d.startswith("mp_rank_") for d in inner):
            return None
        return (
            f"{step.root}: neither torch_dist's .metadata (written last) nor mp_rank_* folders: "
            f"its save did not complete"
        )

    return runs.trainer_run(root, "a Megatron save root", found, complete, tracked)
