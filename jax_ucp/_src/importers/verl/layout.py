"""Where a verl FSDP checkpoint's files are, from any of its three entry points.

verl's trainer saves ``<run>/global_step_N/actor/`` through its ``FSDPCheckpointManager``
(``model|optim|extra_state_world_size_W_rank_R.pt`` per rank, ``fsdp_config.json``,
``huggingface/``), ``global_step_N/data.pt`` (the data loader's position), optionally
``global_step_N/critic/`` (the same layout), and ``<run>/latest_checkpointed_iteration.txt``
naming N. The tracker has Megatron-LM's file name; the ``global_step_N/actor/`` rank files tell
the two apart. verl's Megatron backend (``MegatronCheckpointManager``) writes the same tree with
``actor/dist_ckpt/`` (megatron-core's torch_dist folder) in place of the rank files.
"""

from __future__ import annotations

import dataclasses
import os
import re

from jax_ucp._src.errors import SourceError
from jax_ucp._src.format import files
from jax_ucp._src.importers import runs

__all__ = [
    "TRACKER",
    "Located",
    "RankFiles",
    "is_megatron_dir",
    "is_model_dir",
    "locate",
    "named_like_verl",
    "rank_files",
    "step_dirs",
]

TRACKER = runs.TRACKER_FILE
MODEL_DIRS = ("actor", "critic")
DIST_CKPT = "dist_ckpt"  # the Megatron backend's megatron-core torch_dist folder
# ASCII digits and the whole name (``$`` would also take a name ending in a newline)
_STEP_DIR = re.compile(r"global_step_([0-9]+)")
RANK_FILE = re.compile(r"(model|optim|extra_state)_world_size_([0-9]+)_rank_([0-9]+)\.pt")


def is_megatron_dir(path: str) -> bool:
    """A folder verl's Megatron checkpoint manager wrote: ``dist_ckpt/`` with megatron-core's
    ``.metadata`` and its ``common.pt`` or ``metadata.json``."""
    ckpt = os.path.join(path, DIST_CKPT)
    return os.path.isfile(os.path.join(ckpt, ".metadata")) and any(
        os.path.isfile(os.path.join(ckpt, n)) for n in ("common.pt", "metadata.json")
    )


def is_model_dir(path: str) -> bool:
    """A folder verl's FSDP checkpoint manager wrote (it holds ``model_world_size_W_rank_R.pt``)
    or its Megatron one (:func:`is_megatron_dir`)."""
    if is_megatron_dir(path):
        return True
    try:
        return os.path.isdir(path) and any(
            (m := RANK_FILE.fullmatch(n)) and m.group(1) == "model" for n in os.listdir(path)
        )
    except OSError:
        return False


def step_dirs(root: str) -> list[str]:
    """The ``global_step_N`` folders of a verl run holding a saved actor, by step."""
    holds = lambda path: is_model_dir(os.path.join(path, MODEL_DIRS[0]))
    return list(runs.numbered_steps(root, _STEP_DIR.pattern, holds).values())


def named_like_verl(names: list[str]) -> bool:
    """Whether ``names`` (a remote prefix's) hold a verl step or model folder, by names alone."""
    parts = {part for name in names for part in name.split("/")}
    return any(_STEP_DIR.fullmatch(p) or p in (*MODEL_DIRS, DIST_CKPT) for p in parts)


@dataclasses.dataclass(frozen=True)
class Located:
    """A verl checkpoint's folders: ``model_dir`` (``actor/`` or ``critic/``) always,
    ``step_dir`` (``global_step_N``) and ``root`` (the run) when the path shows them, ``step``
    from the folder's name, ``tracker_step`` from the tracker when there is one."""

    model_dir: str
    step_dir: str | None
    root: str | None
    step: int | None
    tracker_step: int | None


def _read_tracker(root: str) -> int | None:
    """The step the run's tracker names (None without one)."""
    path = os.path.join(root, TRACKER)
    step = runs.read_tracker(path, what="verl's step number") if os.path.isfile(path) else None
    if step == "release":
        raise SourceError(f"{path}: expected verl's step number, found 'release'")
    return step if isinstance(step, int) else None


def locate(src: str) -> Located:
    """The folders of the verl checkpoint at ``src``: a run root (its tracker names the step),
    a ``global_step_N/`` or its ``actor/`` (``critic/``) folder. A tracker naming a step whose
    folder is missing is refused, naming what is there."""
    src = os.path.abspath(src)
    model_dir = src if is_model_dir(src) else os.path.join(src, MODEL_DIRS[0])
    step_dir = os.path.dirname(model_dir)
    m = _STEP_DIR.fullmatch(os.path.basename(step_dir))
    if model_dir == src and not m:
        return Located(src, None, None, None, None)
    if m and is_model_dir(model_dir):
        root = os.path.dirname(step_dir)
        _model_dir_inside(step_dir, model_dir)
        return Located(model_dir, step_dir, root, int(m.group(1)), _read_tracker(root))
    steps = step_dirs(src)
    if not steps:
        raise SourceError(
            f"{src}: not a verl checkpoint (no model_world_size_W_rank_R.pt or {DIST_CKPT}/, "
            f"no global_step_N/actor/)"
        )
    tracker = _read_tracker(src)
    if tracker is None:
        raise SourceError(
            f"{src}: a verl run with {len(steps)} checkpoints ({', '.join(steps)}) and no "
            f"{TRACKER}; convert one of them (e.g. {os.path.join(src, steps[-1])})"
        )
    name = f"global_step_{tracker}"
    if name not in steps:
        raise SourceError(
            f"{os.path.join(src, TRACKER)} names step {tracker} but {os.path.join(src, name)}"
            f"/actor/ does not exist (found {', '.join(steps)}); convert one of those folders"
        )
    step_dir = files.inside(src, name, os.path.join(src, TRACKER))
    model_dir = os.path.join(step_dir, MODEL_DIRS[0])
    _model_dir_inside(step_dir, model_dir)
    return Located(model_dir, step_dir, src, tracker, tracker)


def _model_dir_inside(step_dir: str, model_dir: str) -> None:
    """``global_step_N/actor`` is a folder of that step, never a link to another step's or
    run's actor (its rank files would be read as this step's)."""
    if model_dir != step_dir:
        files.inside(step_dir, os.path.basename(model_dir), f"{step_dir}: verl's model folder")


@dataclasses.dataclass(frozen=True)
class RankFiles:
    """The rank files of a model folder: ``kind -> [file name by rank]`` for the one world
    size they were saved with."""

    world_size: int
    by_kind: dict[str, list[str]]


def rank_files(model_dir: str) -> RankFiles:
    """Every ``<kind>_world_size_W_rank_R.pt`` of ``model_dir``, checked: one world size, every
    rank 0..W-1 of each kind present (the model always, the optimizer and extra state when
    saved); anything else is refused naming the missing files, and so are two names for one
    rank (``rank_1.pt``, ``rank_01.pt``)."""
    found: dict[str, dict[int, str]] = {}
    sizes: dict[int, str] = {}
    named = files.numbered_names(
        [
            ((m.group(1), int(m.group(2)), int(m.group(3))), name)
            for name in os.listdir(model_dir)
            if (m := RANK_FILE.fullmatch(name))
        ],
        model_dir,
        "(kind, world size, rank)",
    )
    for (kind, world, rank), name in named.items():
        sizes.setdefault(world, name)
        found.setdefault(kind, {})[rank] = name
    if len(sizes) != 1:
        raise SourceError(
            f"{model_dir}: rank files of {len(sizes)} world sizes: "
            + ", ".join(f"{w} ({n})" for w, n in sorted(sizes.items()))
            + "; each save is of one world size: remove the stale files"
        )
    (world,) = sizes
    by_kind: dict[str, list[str]] = {}
    for kind, ranks in found.items():
        missing = [r for r in range(world) if r not in ranks]
        extra = sorted(r for r in ranks if r >= world)
        if missing or extra:
            what = ", ".join(f"{kind}_world_size_{world}_rank_{r}.pt" for r in missing)
            raise SourceError(
                f"{model_dir}: {'missing ' + what if missing else ''}"
                f"{'; ' if missing and extra else ''}"
                f"{'ranks ' + str(extra) + ' beyond world size ' + str(world) if extra else ''}"
                f" (a save of {world} ranks holds {kind}_world_size_{world}_rank_0..{world - 1}.pt)"
            )
        by_kind[kind] = [ranks[r] for r in range(world)]
    return RankFiles(world, by_kind)


def verl_run(root: str) -> runs.TrainerRun | None:
    """A verl run root: its ``global_step_N`` folders. verl writes its tracker once a step is
    saved, so a newer step did not complete; one without its actor's model rank files
    neither."""
    found = runs.numbered_steps(root, r"global_step_([0-9]+)")
    tracked = (TRACKER, _read_tracker(root)) if found else None

    def complete(path: str) -> str | None:
        if is_model_dir(os.path.join(path, MODEL_DIRS[0])):
            return None
        return (
            f"{path}: no {MODEL_DIRS[0]}/model_world_size_W_rank_R.pt or {DIST_CKPT}/: its save "
            "did not complete"
        )

    return runs.trainer_run(root, "a verl run", found, complete, tracked)
