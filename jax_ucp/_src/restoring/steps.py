"""The steps of an Orbax CheckpointManager root, by the manager's own step names: the one
step-name rule of every resume path (``restoring.resume``, ``locate``, the CLI). JAX-free."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable

from jax_ucp._src import format as fmt
from jax_ucp._src.errors import CheckpointError
from jax_ucp._src.store.storage import Storage, base, local
from jax_ucp._src.store.storage.local import ORBAX_STEP_METADATA

# A step folder's name as Orbax's standard name formats build it: ``[<step_prefix>_]<digits>``,
# ASCII digits only (``str.isdigit`` and Python's ``\d`` also take ``١٢``, ``１３``, ``²``).
STEP_NAME = re.compile(r"(?:(.+)_)?([0-9]+)")


@dataclasses.dataclass(frozen=True)
class StepFormat:
    """A CheckpointManager's step names: its ``step_prefix`` and ``step_format_fixed_length``
    (Orbax's ``standard_name_format``), or its own ``build_name`` (another ``NameFormat``)."""

    prefix: str | None = None
    fixed_length: int | None = None
    build: Callable[[int], str] | None = None

    def name(self, step: int) -> str:
        """The folder name of ``step`` (Orbax's ``build_name``)."""
        if self.build is not None:
            return self.build(step)
        digits = f"{step:0{self.fixed_length}d}" if self.fixed_length else str(step)
        return digits if self.prefix is None else f"{self.prefix}_{digits}"

    def step_of(self, name: str) -> int | None:
        """The step a folder name stands for, None when it names none: exactly the name
        ``name(step)`` builds (``0012`` is no step without a fixed length, ``12`` none with 4)."""
        found = STEP_NAME.fullmatch(name)
        if found is None:
            return None
        step = int(found.group(2))
        return step if self.name(step) == name else None


@dataclasses.dataclass
class Step:
    """A committed step of a CheckpointManager root.

    ``items``: its UCP item directories; ``problem``: why it cannot be resumed from (a folder
    that is a link, an item Orbax committed with jax_ucp's handler without its ucp.json, ...),
    None when it may be. ``imported``: a torch trainer's checkpoint folder (``trainer_steps``),
    its one item the folder itself, read through its import."""

    step: int
    path: str
    items: list[str]
    problem: str | None = None
    imported: bool = False


@dataclasses.dataclass
class RunSteps:
    """``run_steps``: the committed steps, newest first, and ``notices``: the folders that look
    like steps but are none of this run (each a sentence naming the folder)."""

    steps: list[Step]
    notices: list[str]


def run_steps(root: str, step_format: StepFormat | None = None) -> RunSteps:
    """The committed steps of the CheckpointManager root ``root``, newest first: the one
    step-name rule of every resume path (``latest_step``, ``restore(step=)``, the CLI).

    A step is a folder named as ``step_format`` names steps (the manager's own: ASCII digits,
    its prefix and fixed length), or when it is None as every committed step folder of ``root``
    is named (two formats there, as ``0012`` beside ``12``, is an error: which one the manager
    lists depends on its options). A step still being written (Orbax's
    ``<step>.orbax-checkpoint-tmp...``, or no commit recorded: no ``commit_success.txt`` and no
    ``commit_timestamp_nsecs`` in ``_CHECKPOINT_METADATA``) is never listed, nor a step holding
    only other handlers' items. A step folder that is a link, or a committed step whose jax_ucp
    item lacks its ucp.json, is listed with its ``problem``.

    Args:
      root: the CheckpointManager's directory.
      step_format: its step names (None: taken from the committed step folders).
    """
    if not os.path.isdir(root):
        raise CheckpointError(f"{root}: no such CheckpointManager directory.")
    found: list[tuple[str, re.Match, str | None]] = []  # (name, its match, why it is refused)
    notices = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        match = STEP_NAME.fullmatch(name)
        if match is None or any(m in name for m in _NOT_STEPS):
            tail = name.rsplit("_", 1)[-1]
            if tail.isdigit() and not tail.isascii() and os.path.isdir(path):
                notices.append(
                    f"{path}: not a step (a step number is written in the ASCII digits 0-9); "
                    f"ignored"
                )
            continue
        if os.path.islink(path):  # a step refused, never followed (not even to ask if done)
            why = f"{path} is a link; a step folder of the run is never a link (never followed)"
            found.append((name, match, why))
        elif os.path.islink(os.path.join(path, ORBAX_STEP_METADATA)):
            why = (
                f"{os.path.join(path, ORBAX_STEP_METADATA)} is a link; a step's own "
                f"metadata is never a link (never followed)"
            )
            found.append((name, match, why))
        elif os.path.isdir(path) and _committed(path):
            found.append((name, match, None))
    step_format = step_format or _format_of(root, found)
    steps = []
    for name, _, refused in found:
        path = os.path.join(root, name)
        step = step_format.step_of(name)
        if step is None:
            notices.append(
                f"{path}: not a step of this run (its steps are named like "
                f"{step_format.name(1234)!r}); ignored"
            )
        elif refused is not None:
            steps.append(Step(step, path, [], refused))
        else:
            try:
                listed = _step_of_ucp(step, path)
            except FileNotFoundError:  # deleted since listed (a manager's retention)
                continue
            if listed is not None:
                steps.append(listed)
    return RunSteps(sorted(steps, key=lambda s: s.step, reverse=True), notices)


def trainer_steps(root: Storage) -> RunSteps | None:
    """The steps of ``root`` as a torch trainer's run root (a Trainer's ``output_dir``,
    torchtitan's ``checkpoint/``, a DeepSpeed ``save_dir``, a Megatron or verl save root: what
    the importers list, ``registry.trainer_run``; a remote one listed once), newest first, each
    step's ``problem`` why its save did not complete; None when ``root`` is no such root."""
    from jax_ucp._src.importers import registry  # the edge restoring -> importers

    with base.listed_once():
        run = registry.trainer_run(root)
    if run is None:
        return None
    listed = [Step(s.step, s.path, [s.path], s.problem, imported=True) for s in run.steps]
    return RunSteps(listed, [])


# Names beside the steps of a save in progress or of a forced save's swap: never a step.
_NOT_STEPS = (local.ORBAX_TMP_MARK, local.TMP_MARK, local.REPLACING, local.REPLACED)


def _format_of(root: str, found: list[tuple[str, re.Match, str | None]]) -> StepFormat:
    """The step names of ``root``'s committed step folders: one prefix, and a fixed length when
    a zero-padded name shows it; a folder named otherwise beside them is an error naming both
    (which one the manager lists depends on its options, unknown here)."""
    prefixes = sorted({m.group(1) or "" for _, m, _ in found})
    if len(prefixes) > 1:
        shown = ", ".join(sorted(name for name, _, _ in found)[:6])
        raise CheckpointError(
            f"{root}: step folders named in {len(prefixes)} ways ({shown}): which ones the "
            f"CheckpointManager lists depends on its step_prefix; remove the strays, or resume "
            f"through the manager: mngr.restore(jax_ucp.latest_step(mngr), ...)"
        )
    prefix = prefixes[0] if prefixes and prefixes[0] else None
    padded = sorted(
        {len(m.group(2)) for _, m, _ in found if m.group(2)[:1] == "0" and len(m.group(2)) > 1}
    )
    fixed = padded[0] if len(padded) == 1 else None
    step_format = StepFormat(prefix, fixed)
    odd = sorted(name for name, _, _ in found if step_format.step_of(name) is None)
    if len(padded) > 1 or odd:
        named = sorted({name for name, m, _ in found if m.group(2)[:1] == "0"})[:4]
        raise CheckpointError(
            f"{root}: step folders named in two formats ({', '.join(named)} zero-padded; "
            f"{', '.join(odd[:4]) or 'others'} not): which ones the CheckpointManager lists "
            f"depends on its step_format_fixed_length; remove the strays, or resume through "
            f"the manager: mngr.restore(jax_ucp.latest_step(mngr), ...)"
        )
    return step_format


def with_ucp_items(root: str) -> list[Step]:
    """``run_steps(root).steps`` holding a UCP item, for a message ([] if none can be listed)."""
    try:
        return [s for s in run_steps(root).steps if s.items]
    except CheckpointError:
        return []


def ucp_items(path: str) -> list[str]:
    """The item directories of ``path`` holding a ucp.json, sorted."""
    return sorted(
        d for d in os.listdir(path) if os.path.exists(os.path.join(path, d, fmt.MANIFEST_FILE))
    )


def _step_of_ucp(step: int, path: str) -> Step | None:
    """The committed step folder ``path`` as a ``Step`` (None: it holds no jax_ucp item)."""
    items, problem = [], None
    for d in ucp_items(path):
        try:  # the step's own item, never a link out of it
            fmt.files.inside(path, d, path)
        except fmt.files.UnsafeFileError as e:
            problem = problem or str(e)
        items.append(os.path.join(path, d))
    handlers = _step_metadata(path).get("item_handlers")  # item name -> handler class name
    handlers = handlers if isinstance(handlers, dict) else {}
    ours = [n for n, h in handlers.items() if isinstance(h, str) and h.startswith("jax_ucp.")]
    lost = [n for n in ours if os.path.join(path, n) not in items]
    if lost:
        problem = problem or (
            f"{path}: Orbax committed item {lost[0]!r} with jax_ucp's handler, but "
            f"{os.path.join(path, lost[0], fmt.MANIFEST_FILE)} is missing"
        )
    if not items and not lost and handlers:
        return None  # a step of other handlers' items only
    if not items and not lost:
        problem = f"{path}: committed, but no item of it holds a {fmt.MANIFEST_FILE}"
    return Step(step, path, items, problem)


def _committed(step_dir: str) -> bool:
    if os.path.exists(os.path.join(step_dir, "commit_success.txt")):
        return True
    return _step_metadata(step_dir).get("commit_timestamp_nsecs") is not None


def _step_metadata(step_dir: str) -> dict:
    """The step's ``_CHECKPOINT_METADATA``, {} when it cannot be read as a JSON object."""
    try:
        meta = fmt.files.strict_loads(
            fmt.files.read_regular(os.path.join(step_dir, ORBAX_STEP_METADATA), 1 << 20)
        )
    except (OSError, ValueError, RecursionError, fmt.UCPError):
        return {}
    return meta if isinstance(meta, dict) else {}
