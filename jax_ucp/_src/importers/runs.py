"""A torch trainer's run root: the folder its saves go to, one checkpoint folder per step (a
Trainer's ``checkpoint-N``, torchtitan's ``step-N``, DeepSpeed's tags, Megatron's ``iter_N``,
verl's ``global_step_N``). Each importer that knows such a root says how its steps are listed
(``Importer.run``) and what a step's files show of its save having completed; a resume takes
the newest complete one, and says why each newer one was passed over."""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from collections.abc import Callable
from typing import Any

from jax_ucp._src.errors import SourceError
from jax_ucp._src.format import files
from jax_ucp._src.store.storage import Storage

#: Megatron-LM's tracker file (verl writes it too): the latest iteration number, or "release".
TRACKER_FILE = "latest_checkpointed_iteration.txt"


@dataclasses.dataclass(frozen=True)
class RunStep:
    """One checkpoint of a run root: its ``step``, its folder's ``path`` (a URL when the root
    is remote), and ``problem``: why its files show a save that did not complete (None:
    complete as far as they show)."""

    step: int
    path: str
    problem: str | None = None


@dataclasses.dataclass(frozen=True)
class TrainerRun:
    """A run root (``root``) of a torch trainer: ``what`` it is (for messages) and its
    ``steps``, newest first."""

    root: str
    what: str
    steps: tuple[RunStep, ...]


def numbered_steps(
    root, pattern: str, holds: Callable[[str], bool], what: str = "step"
) -> dict[int, str]:
    """number -> name of the entries of the folder ``root`` named ``pattern`` whose path
    ``holds``, by number; {} when ``root`` cannot be listed.

    Args:
        root: the folder.
        pattern: a regular expression of the whole name, its one group the number (ASCII
            digits: :data:`files.DIGITS`).
        holds: whether a matching entry's path is one.
        what: what the number is (``"epoch"``), for the error.

    Two entries of one number (``iter_5``, ``iter_05``) are refused naming both.
    """
    try:
        names = os.listdir(root)
    except OSError:
        return {}
    found = [
        (int(m.group(1)), n)
        for n in names
        if (m := re.fullmatch(pattern, n, re.ASCII)) and holds(os.path.join(root, n))
    ]
    return files.numbered_names(found, os.fspath(root), what)


def step_folders(root: Storage, pattern: str) -> dict[int, str]:
    """number -> name of the folders of ``root`` (never a link) named ``pattern`` (as
    :func:`numbered_steps`), listed through the medium: a remote prefix's by its one listing."""
    try:
        names = {name.split("/", 1)[0] for name in root.names()}
    except OSError:
        return {}
    found = [
        (int(m.group(1)), n)
        for n in sorted(names)
        if (m := re.fullmatch(pattern, n, re.ASCII)) and _is_folder(root, n)
    ]
    return files.numbered_names(found, root.root, "step")


def _is_folder(root: Storage, name: str) -> bool:
    """Whether ``name`` of ``root`` is a folder: listed, not a file nor a link (a remote
    prefix's entry is one when objects are below it)."""
    try:
        root.folder(name, link=False).names()
    except OSError:  # UnsafeFileError too: a link
        return False
    return True


def tracker_step(
    raw: bytes, tracker, error: type[SourceError] = SourceError, what: str = "an iteration number"
) -> int | str:
    """The iteration the bytes ``raw`` of the tracker file ``tracker`` (:data:`TRACKER_FILE`)
    name: a number of at most 18 ASCII digits (``int()`` takes "١٢", " 5" and "5_0" too), or
    ``"release"``. Anything else is ``error``, naming the file and saying ``what`` was
    expected."""
    text = raw.decode("utf-8", "replace").strip()
    step = files.name_number(text)
    if text != "release" and (step is None or len(text) > 18):
        raise error(
            f"{tracker}: expected {what} of at most 18 ASCII digits (or 'release'), found "
            f"{text[:40]!r}{'...' if len(text) > 40 else ''}"
        )
    return text if step is None else step


def trainer_run(
    root: Storage,
    what: str,
    found: dict[int, str],
    complete: Callable[[Storage], str | None],
    tracker: tuple[str, int | None] | None = None,
) -> TrainerRun | None:
    """The run at ``root`` from its step folders ``found`` (step -> name), None when there are
    none. A step is incomplete when ``complete(its folder)`` says why, or when the run keeps a
    tracker (``(file name, the step it names)``: DeepSpeed's ``latest``, Megatron's and verl's
    ``latest_checkpointed_iteration.txt``, written once every rank has saved) naming an older
    step: the save of a newer one never finished."""
    if not found:
        return None
    steps = []
    for step in sorted(found, reverse=True):
        folder = root.folder(found[step])
        problem = None
        if tracker is not None and tracker[1] is not None and step > tracker[1]:
            problem = (
                f"{folder.root}: newer than step {tracker[1]}, which {tracker[0]} names: the "
                f"tracker is written once every rank has saved, so this save did not complete"
            )
        steps.append(RunStep(step, folder.root, problem or complete(folder)))
    return TrainerRun(root.root, what, tuple(steps))


def say_renamed(folder: str, pattern: str, step: Any, says: str) -> None:
    """A step folder (``pattern``: its name, the step's digits its group 1) whose files record
    another step, renamed or copied: the files' step holds, and a warning names both;
    ``says`` the files' side of it and what is continued."""
    m = re.fullmatch(pattern, os.path.basename(os.path.normpath(folder)))
    named = files.name_number(m[1]) if m else None
    if named is not None and type(step) is int and named != step:
        warnings.warn(f"{folder}: the {says.format(named=named, step=step)}", UserWarning, 3)
