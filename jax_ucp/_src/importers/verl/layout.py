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

import contextlib
import dataclasses
import re

from jax_ucp._src.errors import RequestError, SourceError
from jax_ucp._src.format import files
from jax_ucp._src.importers import runs
from jax_ucp._src.store.storage import Storage

__all__ = [
    "TRACKER",
    "Located",
    "RankFiles",
    "entries",
    "holds_actor",
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


def entries(folder: Storage) -> list[str]:
    """The entries of ``folder`` (a remote prefix's nested objects by their first part); [] when
    it is no folder."""
    try:
        return sorted({name.split("/", 1)[0] for name in folder.names()})
    except OSError:
        return []


def named_like_verl(names: list[str]) -> bool:
    """Whether a folder's entries ``names`` hold a verl file or folder, by names alone: none,
    nothing of verl's is below it (detection lists no folder further)."""
    dirs = (*MODEL_DIRS, DIST_CKPT)
    return any(RANK_FILE.fullmatch(n) or _STEP_DIR.fullmatch(n) or n in dirs for n in names)


def is_megatron_dir(folder: Storage) -> bool:
    """A folder verl's Megatron checkpoint manager wrote: ``dist_ckpt/`` with megatron-core's
    ``.metadata`` and its ``common.pt`` or ``metadata.json``."""
    if DIST_CKPT not in entries(folder):
        return False
    names = entries(folder.folder(DIST_CKPT))
    return ".metadata" in names and not {"common.pt", "metadata.json"}.isdisjoint(names)


def is_model_dir(folder: Storage) -> bool:
    """A folder verl's FSDP checkpoint manager wrote (it holds ``model_world_size_W_rank_R.pt``)
    or its Megatron one (:func:`is_megatron_dir`)."""
    names = entries(folder)
    model = any((m := RANK_FILE.fullmatch(n)) and m.group(1) == "model" for n in names)
    return model or is_megatron_dir(folder)


def holds_actor(folder: Storage) -> bool:
    """Whether ``folder`` holds a saved actor (``actor/``, a model folder)."""
    return MODEL_DIRS[0] in entries(folder) and is_model_dir(folder.folder(MODEL_DIRS[0]))


def step_dirs(root: Storage) -> list[str]:
    """The ``global_step_N`` folders of a verl run holding a saved actor, by step."""
    found = [
        (int(m.group(1)), n)
        for n in entries(root)
        if (m := _STEP_DIR.fullmatch(n)) and holds_actor(root.folder(n))
    ]
    return list(files.numbered_names(found, root.root, "step").values())


@dataclasses.dataclass(frozen=True)
class Located:
    """A verl checkpoint's folders: ``model_dir`` (``actor/`` or ``critic/``) always,
    ``step_dir`` (``global_step_N``) and ``root`` (the run) when the path shows them (a remote
    prefix above the one given is never read), ``step`` from the folder's name,
    ``tracker_step`` from the tracker when there is one."""

    model_dir: Storage
    step_dir: Storage | None
    root: Storage | None
    step: int | None
    tracker_step: int | None


def _read_tracker(root: Storage) -> int | None:
    """The step the run's tracker names (None without one)."""
    if TRACKER not in entries(root):
        return None
    path = root.join(TRACKER)
    try:
        raw = root.read(TRACKER, 4096)
    except (files.UnsafeFileError, RequestError) as e:  # a link out, a larger one
        raise SourceError(str(e)) from None
    if raw is None:  # listed, yet no file: a link to nothing, never read as no tracker
        raise SourceError(f"{path}: listed, but no file there (a link to nothing?)")
    step = runs.tracker_step(raw, path, what="verl's step number")
    if step == "release":
        raise SourceError(f"{path}: expected verl's step number, found 'release'")
    return step if isinstance(step, int) else None


def _name(folder: Storage) -> str:
    return folder.root.rstrip("/").rpartition("/")[2]


def locate(storage: Storage) -> Located:
    """The folders of the verl checkpoint at ``storage``: a run root (its tracker names the
    step), a ``global_step_N/`` or its ``actor/`` (``critic/``) folder. A tracker naming a step
    whose folder is missing is refused, naming what is there."""
    src = type(storage)(storage.absolute())  # named as a save records it
    model_dir = src if is_model_dir(src) else src.folder(MODEL_DIRS[0])
    step_dir = src.parent() if model_dir is src else src
    m = _STEP_DIR.fullmatch(_name(step_dir)) if step_dir is not None else None
    if model_dir is src and not m:
        return Located(src, None, None, None, None)
    if m and step_dir is not None and is_model_dir(model_dir):
        root = step_dir.parent()
        step_dir.folder(_name(model_dir))  # a folder of that step, never a link out of it
        tracked = None if root is None else _read_tracker(root)
        return Located(model_dir, step_dir, root, int(m.group(1)), tracked)
    steps = step_dirs(src)
    if not steps:
        raise SourceError(
            f"{src.root}: not a verl checkpoint (no model_world_size_W_rank_R.pt or "
            f"{DIST_CKPT}/, no global_step_N/actor/)"
        )
    tracker = _read_tracker(src)
    if tracker is None:
        raise SourceError(
            f"{src.root}: a verl run with {len(steps)} checkpoints ({', '.join(steps)}) and no "
            f"{TRACKER}; convert one of them (e.g. {src.join(steps[-1])})"
        )
    name = f"global_step_{tracker}"
    if name not in steps:
        raise SourceError(
            f"{src.join(TRACKER)} names step {tracker} but {src.join(name)}/actor/ does not "
            f"exist (found {', '.join(steps)}); convert one of those folders"
        )
    step_dir = src.folder(name)
    return Located(step_dir.folder(MODEL_DIRS[0]), step_dir, src, tracker, tracker)


@dataclasses.dataclass(frozen=True)
class RankFiles:
    """The rank files of a model folder: ``kind -> [file name by rank]`` for the one world
    size they were saved with."""

    world_size: int
    by_kind: dict[str, list[str]]


def rank_files(model_dir: Storage) -> RankFiles:
    """Every ``<kind>_world_size_W_rank_R.pt`` of ``model_dir``, checked: one world size, every
    rank 0..W-1 of each kind present (the model always, the optimizer and extra state when
    saved); anything else is refused naming the missing files, and so are two names for one
    rank (``rank_1.pt``, ``rank_01.pt``)."""
    found: dict[str, dict[int, str]] = {}
    sizes: dict[int, str] = {}
    named = files.numbered_names(
        [
            ((m.group(1), int(m.group(2)), int(m.group(3))), name)
            for name in entries(model_dir)
            if (m := RANK_FILE.fullmatch(name))
        ],
        model_dir.root,
        "(kind, world size, rank)",
    )
    for (kind, world, rank), name in named.items():
        sizes.setdefault(world, name)
        found.setdefault(kind, {})[rank] = name
    if len(sizes) != 1:
        raise SourceError(
            f"{model_dir.root}: rank files of {len(sizes)} world sizes: "
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
                f"{model_dir.root}: {'missing ' + what if missing else ''}"
                f"{'; ' if missing and extra else ''}"
                f"{'ranks ' + str(extra) + ' beyond world size ' + str(world) if extra else ''}"
                f" (a save of {world} ranks holds {kind}_world_size_{world}_rank_0..{world - 1}.pt)"
            )
        by_kind[kind] = [ranks[r] for r in range(world)]
    return RankFiles(world, by_kind)


def verl_run(root: Storage) -> runs.TrainerRun | None:
    """A verl run root: its ``global_step_N`` folders. verl writes its tracker once a step is
    saved, so a newer step did not complete; one without its actor's model rank files
    neither."""
    found = runs.step_folders(root, r"global_step_([0-9]+)")
    tracked = (TRACKER, _read_tracker(root)) if found else None

    def complete(step: Storage) -> str | None:
        with contextlib.suppress(OSError):  # an actor folder linking out of the step: none
            if is_model_dir(step.folder(MODEL_DIRS[0])):
                return None
        return (
            f"{step.root}: no {MODEL_DIRS[0]}/model_world_size_W_rank_R.pt or {DIST_CKPT}/: its "
            "save did not complete"
        )

    return runs.trainer_run(root, "a verl run", found, complete, tracked)
