"""Which step of a CheckpointManager root a resume takes: the one rule behind
``latest_step``, ``restore(root, step="latest" | N)`` and the CLI's ``latest`` / ``--step``.
JAX-free.

The steps are ``steps.run_steps`` (the manager's step names, committed steps only). "latest"
is the newest of them that can be read: without ``fallback`` its manifest parses and every
shard file it lists is there (the data is checked as the restore reads it; damage there is the
error); with ``fallback`` every tensor of it reads back intact (digests and crc32c, as
``verify``), so every process of a job, and ``latest_step`` and ``restore``, take the same
step. A step deleted while it is read (a live manager's ``max_to_keep``) is not damage: the
steps are listed again and the newest committed one taken again.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from typing import Any

from jax_ucp._src import format as fmt
from jax_ucp._src import store
from jax_ucp._src.errors import CheckpointError, ResumeWarning, SaveConflictError, SourceError
from jax_ucp._src.restoring import locate, model, sources, steps
from jax_ucp._src.restoring.sources import ucp_source


@dataclasses.dataclass
class Resume:
    """The step a resume takes: ``step``; ``skipped``: ``(step, why)`` of each newer committed
    step passed over (``fallback``); ``notices``: folders that look like steps but are none
    (``steps.RunSteps.notices``); ``value``: what ``read`` returned for it."""

    step: steps.Step
    skipped: list[tuple[int, str]]
    notices: list[str]
    value: Any = None

    def warn(self, stacklevel: int) -> None:
        """Each notice and each step passed over as a ``ResumeWarning``."""
        for notice in self.notices:
            warnings.warn(notice, ResumeWarning, stacklevel=stacklevel + 1)
        for step, why in self.skipped:
            warnings.warn(
                f"{os.path.dirname(self.step.path)}: step {step} skipped: {why}",
                ResumeWarning,
                stacklevel=stacklevel + 1,
            )


def latest_readable(
    root: str,
    *,
    fallback: bool,
    step_format: steps.StepFormat | None = None,
    read: Callable[[str], Any] | None = None,
) -> Resume:
    """The newest committed step of ``root`` that can be read (see the module), and with
    ``read`` its one UCP item read (``read(item)`` as ``.value``).

    Args:
      root: the CheckpointManager's directory.
      fallback: pass over steps that cannot be read to older ones (each in ``skipped``);
        False: such a newest step is the error, naming it and why.
      step_format: the manager's step names (None: as ``root``'s step folders are named).
      read: reads the chosen step's UCP item (a restore); None: nothing read.
    """
    for _ in range(_RELISTS + 1):
        listed = listed_steps(root, step_format)
        if not listed.steps:
            raise CheckpointError(
                f"{root}: no committed step with a UCP item, nor a torch trainer's checkpoint "
                f"folder (a Trainer's checkpoint-N, torchtitan's step-N, DeepSpeed's tags, "
                f"Megatron's iter_N, verl's global_step_N)."
            )
        shown = ", ".join(str(s.step) for s in listed.steps[:10])
        skipped: list[tuple[int, str]] = []
        for step in listed.steps:
            if step.imported and step.problem:  # a save that did not complete: never resumed
                skipped.append((step.step, step.problem))
                continue
            before = _files(step.path)
            why = step.problem or _unreadable(step, fallback)
            if why is None and read is not None:
                why, value = _read(step, read)
            else:
                value = None
            if why is None:
                return Resume(step, skipped, listed.notices, value)
            if before is None or _files(step.path) != before:
                break  # deleted or rewritten while read (a manager's retention): list again
            if not fallback:
                raise CheckpointError(
                    f"{root}: the latest committed step {step.step} cannot be read: {why} "
                    f"(committed steps: {shown}; step='latest', fallback=True moves on to the "
                    f"next older one)"
                )
            skipped.append((step.step, why))
        else:
            whys = "; ".join(f"step {s}: {why}" for s, why in skipped)
            raise CheckpointError(f"{root}: no committed step can be read: {whys[:2000]}")
    raise SaveConflictError(
        f"{root}: its steps were deleted or rewritten while they were read ({_RELISTS + 1} "
        f"times: a manager saving with max_to_keep?); nothing is wrong with them: resume again."
    )


def step_item(root: str, step: int, step_format: steps.StepFormat | None = None) -> str:
    """The UCP item of committed step ``step`` of ``root`` (``restore(root, step=N)``), or a
    torch trainer's checkpoint folder of that step."""
    committed = listed_steps(root, step_format).steps
    chosen = [s for s in committed if s.step == step]
    if not chosen:
        listed = ", ".join(str(s.step) for s in committed[:10]) or "none"
        raise CheckpointError(
            f"{root}: no committed step {step} with a UCP item (committed: {listed})."
        )
    found = chosen[0]
    if found.problem:
        raise CheckpointError(f"{root}: step {step} cannot be read: {found.problem}")
    if found.imported:
        return found.path
    item = one_item(found)
    try:
        locate.check_step_item(item, store.read_manifest(item))
    except CheckpointError as e:
        raise CheckpointError(f"{root}: step {step} cannot be read: {e}") from None
    return item


def listed_steps(root: str, step_format: steps.StepFormat | None = None) -> steps.RunSteps:
    """The steps a resume chooses from: the CheckpointManager's committed steps with a UCP
    item, else (none) those of a torch trainer's run root (``steps.trainer_steps``, a URL's)."""
    storage = store.storage_for(root)  # a URL holds no manager's steps: a trainer's only
    remote = storage.local_path() is None and step_format is None
    listed = steps.RunSteps([], []) if remote else steps.run_steps(root, step_format)
    if listed.steps or step_format is not None:
        return listed
    trainer = steps.trainer_steps(storage)  # None, or its steps (one at least)
    return listed if trainer is None else steps.RunSteps(trainer.steps, listed.notices)


def one_item(step: steps.Step) -> str:
    if len(step.items) != 1:
        names = [os.path.basename(i) for i in step.items]
        raise CheckpointError(
            f"{step.path}: holds several UCP items {names}; restore one of them by its path "
            f"(in Orbax: mngr.restore(step, args=ocp.args.Composite(...)))."
        )
    return step.items[0]


def _unreadable(step: steps.Step, whole: bool) -> str | None:
    """Why ``step`` cannot be read, None when it can: every item's manifest and shard files
    (``whole``: and every tensor read back intact); a torch trainer's checkpoint with
    ``whole``: its import planned (every file found and checked, no tensor read)."""
    if step.imported:
        return _unplannable(step.path) if whole else None
    try:
        for item in step.items:
            if whole:
                _read_whole(item)
            else:
                locate.check_readable(item)
    except (fmt.UCPError, OSError) as e:
        return str(e)
    return None


def _read(step: steps.Step, read: Callable[[str], Any]) -> tuple[str | None, Any]:
    """``read`` of the step's one UCP item: (None, its value), or (why, None) when the data
    is damaged (``CheckpointError``) or went away (``OSError``); a bad request is raised."""
    item = one_item(step)
    damaged = (
        (CheckpointError, SourceError, OSError) if step.imported else (CheckpointError, OSError)
    )
    try:
        return None, read(item)
    except damaged as e:
        return str(e), None


def _unplannable(path: str) -> str | None:
    """Why the import of the torch checkpoint folder ``path`` cannot be planned (its files
    missing, damaged or unknown), None when it can."""
    from jax_ucp._src.restoring.sources import import_open

    try:  # its importer, detected once and handed on
        found = sources.opening(store.storage_for(path), warn=False)
        if found.importer is None:
            return f"{path}: no importer reads it"
        import_open.manifest_of(found.storage, found.importer)
    except (fmt.UCPError, OSError) as e:
        return str(e)
    return None


def _read_whole(item: str) -> None:
    """Every tensor of the checkpoint ``item`` read as a restore reads it (shard digests,
    crc32c of every inner chunk), one at a time, the data dropped: the first damage raised."""
    manifest = store.read_manifest(item)
    locate.check_step_item(item, manifest)
    for entry in manifest.tensors:
        ucp_source.read(item, manifest, [model.Request(key=entry.key)])


def _files(path: str):
    """The names below ``path`` (what a deletion or a new save changes), None if it is gone;
    a link is not followed (its target names it)."""
    try:
        if os.path.islink(path):
            return os.readlink(path)
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, sorted((d, tuple(sorted(f))) for d, _, f in os.walk(path)))


# How many times the steps are listed again when the one read was deleted meanwhile.
_RELISTS = 8
