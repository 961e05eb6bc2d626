"""A torch trainer's run root: the folder its saves go to, one checkpoint folder per step (a
Trainer's ``checkpoint-N``, torchtitan's ``step-N``, DeepSpeed's tags, Megatron's ``iter_N``,
verl's ``global_step_N``). Each importer that knows such a root says how its steps are listed
(``Importer.run``) and what a step's files show of its save having completed; a resume takes
the newest complete one, and says why each newer one was passed over."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable

from jax_ucp._src.format import files


@dataclasses.dataclass(frozen=True)
class RunStep:
    """One checkpoint of a run root: its ``step``, its folder ``path``, and ``problem``: why
    its files show a save that did not complete (None: complete as far as they show)."""

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


def numbered_steps(root: str, pattern: str) -> dict[int, str]:
    """step -> folder name of the folders of ``root`` named ``pattern`` (a regular expression
    of the whole name whose one group is the step, ASCII digits); a link is never a step.
    Two folders of one step (``iter_5``, ``iter_05``) are refused naming both."""
    try:
        names = os.listdir(root)
    except OSError:
        return {}
    found = [
        (int(m.group(1)), n)
        for n in names
        if (m := re.fullmatch(pattern, n, re.ASCII))
        and os.path.isdir(os.path.join(root, n))
        and not os.path.islink(os.path.join(root, n))
    ]
    return files.numbered_names(found, root, "step")


def trainer_run(
    root: str,
    what: str,
    found: dict[int, str],
    complete: Callable[[str], str | None],
    tracker: tuple[str, int | None] | None = None,
) -> TrainerRun | None:
    """The run at ``root`` from its step folders ``found`` (step -> name), None when there are
    none. A step is incomplete when ``complete(path)`` says why, or when the run keeps a
    tracker (``(file name, the step it names)``: DeepSpeed's ``latest``, Megatron's and verl's
    ``latest_checkpointed_iteration.txt``, written once every rank has saved) naming an older
    step: the save of a newer one never finished."""
    if not found:
        return None
    steps = []
    for step in sorted(found, reverse=True):
        path = os.path.join(root, found[step])
        problem = None
        if tracker is not None and tracker[1] is not None and step > tracker[1]:
            problem = (
                f"{path}: newer than step {tracker[1]}, which {tracker[0]} names: the tracker "
                f"is written once every rank has saved, so this save did not complete"
            )
        steps.append(RunStep(step, path, problem or complete(path)))
    return TrainerRun(root, what, tuple(steps))
