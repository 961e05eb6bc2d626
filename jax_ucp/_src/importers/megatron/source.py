"""Which Megatron format a directory holds (torch_dist or legacy), and where its files are."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from jax_ucp._src.errors import SourceError
from jax_ucp._src.importers import runs
from jax_ucp._src.importers.megatron import legacy


@dataclass(frozen=True)
class MegatronSource:
    """Where a Megatron checkpoint is and which of its two formats it is."""

    format: str  # "torch_dist" | "legacy"
    ckpt_dir: Path  # the directory holding .metadata (torch_dist) or the mp_rank_* dirs (legacy)
    iteration: int | None


def detect_megatron(src: os.PathLike | str) -> MegatronSource | None:
    """torch_dist or legacy, from a checkpoint root (with the tracker file) or an iter directory."""
    path = Path(src)
    if not path.is_dir():
        return None
    # lexists, not is_file: a .metadata or tracker that is a FIFO, a device or too large is
    # this format's file gone wrong, reported as such by the reader, not "not a checkpoint"
    if os.path.lexists(path / ".metadata"):
        match = re.fullmatch(r"iter_([0-9]+)", path.name)
        return MegatronSource("torch_dist", path, int(match.group(1)) if match else None)
    try:
        iteration_dir, iteration = legacy.resolve_iteration_dir(path)
    except SourceError:
        if os.path.lexists(path / legacy.TRACKER_FILE):
            raise
        return None
    if os.path.lexists(iteration_dir / ".metadata"):
        return MegatronSource("torch_dist", iteration_dir, iteration)
    if any(d.name.startswith("mp_rank_") for d in iteration_dir.iterdir() if d.is_dir()):
        return MegatronSource("legacy", iteration_dir, iteration)
    return None


def megatron_run(root: os.PathLike | str) -> runs.TrainerRun | None:
    """A Megatron save root: its ``iter_NNNNNNN`` folders. Megatron writes
    ``latest_checkpointed_iteration.txt`` once every rank has saved an iteration, so a newer
    one did not complete; a folder with neither torch_dist's ``.metadata`` (written last) nor
    legacy ``mp_rank_*`` folders neither."""
    root = os.fspath(root)
    found = runs.numbered_steps(root, r"iter_([0-9]+)")
    tracked = None
    if found and os.path.lexists(os.path.join(root, legacy.TRACKER_FILE)):
        _, iteration = legacy.resolve_iteration_dir(Path(root))
        tracked = (legacy.TRACKER_FILE, iteration)

    def complete(path: str) -> str | None:
        if os.path.lexists(os.path.join(path, ".metadata")) or any(
            d.startswith("mp_rank_") for d in os.listdir(path)
        ):
            return None
        return (
            f"{path}: neither torch_dist's .metadata (written last) nor mp_rank_* folders: its "
            f"save did not complete"
        )

    return runs.trainer_run(root, "a Megatron save root", found, complete, tracked)
