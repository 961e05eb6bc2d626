"""Where a checkpoint is: a UCP checkpoint directory (or object-store prefix), an Orbax step
directory holding one UCP item, a CheckpointManager's committed steps; and reading it whole while
a concurrent forced save swaps it (``consistent_reads``). JAX-free.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterator
from typing import TypeVar, cast

from jax_ucp._src import format as fmt
from jax_ucp._src import store
from jax_ucp._src.errors import CheckpointError, SaveConflictError
from jax_ucp._src.writer import commit

T = TypeVar("T")


def is_ucp(path) -> bool:
    """Whether ``path`` is read as a UCP checkpoint rather than another source (safetensors):
    an object-store URL, a directory holding ucp.json or one with an item directory holding it,
    or nothing there yet (a forced save's swap, or the error ``find_checkpoint_dir`` gives)."""
    path = os.fspath(path)
    if "://" in path or os.path.exists(os.path.join(path, fmt.MANIFEST_FILE)):
        return True
    if os.path.isdir(path):  # an Orbax step directory holding a UCP item
        return any(
            os.path.exists(os.path.join(path, d, fmt.MANIFEST_FILE)) for d in os.listdir(path)
        )
    return not os.path.lexists(path)


def find_checkpoint_dir(path) -> str:
    """``path`` itself when it holds ucp.json, else its single UCP item (an Orbax step dir).

    A forced save killed between its two renames leaves ``path`` missing with both whole
    checkpoints beside it: the newer one (``<path>.ucp-replacing``, committed before the swap
    began) is read, else the older one (``<path>.ucp-replaced``). Reading never renames; the
    next save to ``path`` completes the interrupted swap.
    """
    path = os.fspath(path).rstrip("/") or "/"
    if store.is_url(path):
        return _find_in_object_store(path)
    if os.path.isdir(path) and os.path.exists(os.path.join(path, fmt.MANIFEST_FILE)):
        return path
    if not os.path.lexists(path):
        for survivor in (path + commit.REPLACING, path + commit.REPLACED):
            if os.path.isdir(survivor):
                return find_checkpoint_dir(survivor)
        raise CheckpointError(f"{path}: no such checkpoint directory.")
    if not os.path.isdir(path):
        raise CheckpointError(
            f"{path}: is a file, not a checkpoint directory (expected a directory holding "
            f"{fmt.MANIFEST_FILE}, or an Orbax step directory with one UCP item)."
        )
    items = _ucp_items(path)
    if len(items) == 1 and is_step_dir(path):
        try:  # the step's item, never a link to another checkpoint
            fmt.files.inside(path, items[0], path)
        except fmt.files.UnsafeFileError as e:
            raise CheckpointError(str(e)) from None
        return os.path.join(path, items[0])
    if len(items) == 1:  # any folder holding one checkpoint is not read as that checkpoint
        raise CheckpointError(
            f"{path}: no {fmt.MANIFEST_FILE} here; it is not a checkpoint nor an Orbax step "
            f"directory, but holds one checkpoint: {os.path.join(path, items[0])} (pass that)."
        )
    if not items:
        steps = _ucp_steps(path)
        if steps:
            shown = ", ".join(os.path.basename(s.path) for s in steps[:10][::-1])
            raise CheckpointError(
                f"{path}: a CheckpointManager directory, not a checkpoint: "
                f"{len(steps)} step(s) with a UCP item ({'…, ' if len(steps) > 10 else ''}"
                f"{shown}); pass a step's item, e.g. {steps[0].items[0]} "
                f"(or step=N / step='latest'; mngr.restore(step) in Orbax)."
            )
        raise CheckpointError(
            f"{path}: no {fmt.MANIFEST_FILE} here nor in any item directory below "
            f"it; not a jax_ucp checkpoint (or the manifest was removed)."
        )
    raise CheckpointError(f"{path}: holds several UCP items {items}; pass one of them.")


def is_step_dir(path: str) -> bool:
    """An Orbax step directory: Orbax's step metadata or commit marker in it, or a step number
    (ASCII digits) as its name (CheckpointManager's default step names)."""
    return (
        _STEP_NAME.fullmatch(os.path.basename(path)) is not None
        or os.path.exists(os.path.join(path, "_CHECKPOINT_METADATA"))
        or os.path.exists(os.path.join(path, "commit_success.txt"))
    )


# A step folder's name as Orbax's standard name formats build it: ``[<step_prefix>_]<digits>``,
# ASCII digits only (``str.isdigit`` and Python's ``\d`` also take ``١٢``, ``１３``, ``²``).
_STEP_NAME = re.compile(r"(?:(.+)_)?([0-9]+)")


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
        found = _STEP_NAME.fullmatch(name)
        if found is None:
            return None
        step = int(found.group(2))
        return step if self.name(step) == name else None


@dataclasses.dataclass
class Step:
    """A committed step of a CheckpointManager root.

    ``items``: its UCP item directories; ``problem``: why it cannot be resumed from (a folder
    that is a link, an item Orbax committed with jax_ucp's handler without its ucp.json, ...),
    None when it may be."""

    step: int
    path: str
    items: list[str]
    problem: str | None = None


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
    found: list[tuple[str, re.Match, bool]] = []  # (name, its match, a link)
    notices = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        match = _STEP_NAME.fullmatch(name)
        if match is None or any(m in name for m in _NOT_STEPS):
            if name.rsplit("_", 1)[-1].isdigit() and os.path.isdir(path):
                notices.append(
                    f"{path}: not a step (a step number is written in the ASCII digits 0-9); "
                    f"ignored"
                )
            continue
        if os.path.islink(path):
            found.append((name, match, True))
        elif os.path.isdir(path) and _committed(path):
            found.append((name, match, False))
    step_format = step_format or _format_of(root, found)
    steps = []
    for name, _, link in found:
        path = os.path.join(root, name)
        step = step_format.step_of(name)
        if step is None:
            notices.append(
                f"{path}: not a step of this run (its steps are named like "
                f"{step_format.name(1234)!r}); ignored"
            )
        elif link:
            steps.append(
                Step(
                    step,
                    path,
                    [],
                    f"{path} is a link (to {os.readlink(path)}); a "
                    f"step folder of the run is never a link",
                )
            )
        else:
            try:
                listed = _step_of_ucp(step, path)
            except FileNotFoundError:  # deleted since listed (a manager's retention)
                continue
            if listed is not None:
                steps.append(listed)
    return RunSteps(sorted(steps, key=lambda s: s.step, reverse=True), notices)


# Names beside the steps of a save in progress or of a forced save's swap: never a step.
_NOT_STEPS = (commit.ORBAX_TMP_MARK, commit.TMP_MARK, commit.REPLACING, commit.REPLACED)


def _format_of(root: str, found: list[tuple[str, re.Match, bool]]) -> StepFormat:
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


def _ucp_steps(root: str) -> list[Step]:
    """``run_steps(root).steps`` holding a UCP item, for a message ([] if none can be listed)."""
    try:
        return [s for s in run_steps(root).steps if s.items]
    except CheckpointError:
        return []


def _step_of_ucp(step: int, path: str) -> Step | None:
    """The committed step folder ``path`` as a ``Step`` (None: it holds no jax_ucp item)."""
    items, problem = [], None
    for d in sorted(os.listdir(path)):
        if not os.path.exists(os.path.join(path, d, fmt.MANIFEST_FILE)):
            continue
        try:  # the step's own item, never a link out of it
            fmt.files.inside(path, d, path)
        except fmt.files.UnsafeFileError as e:
            problem = problem or str(e)
        items.append(os.path.join(path, d))
    ours = [
        name
        for name, handler in _item_handlers(path).items()
        if isinstance(handler, str) and handler.startswith("jax_ucp.")
    ]
    lost = [n for n in ours if os.path.join(path, n) not in items]
    if lost:
        problem = problem or (
            f"{path}: Orbax committed item {lost[0]!r} with jax_ucp's handler, but "
            f"{os.path.join(path, lost[0], fmt.MANIFEST_FILE)} is missing"
        )
    if not items and not lost and _item_handlers(path):
        return None  # a step of other handlers' items only
    if not items and not lost:
        problem = f"{path}: committed, but no item of it holds a {fmt.MANIFEST_FILE}"
    return Step(step, path, items, problem)


def _committed(step_dir: str) -> bool:
    if os.path.exists(os.path.join(step_dir, "commit_success.txt")):
        return True
    try:
        meta = fmt.files.read_regular(os.path.join(step_dir, "_CHECKPOINT_METADATA"), 1 << 20)
        return json.loads(meta).get("commit_timestamp_nsecs") is not None
    except (OSError, ValueError, AttributeError, fmt.UCPError):
        return False


def _item_handlers(step_dir: str) -> dict:
    """The ``item_handlers`` of the step's ``_CHECKPOINT_METADATA`` (item name -> handler class
    name); {} when none can be read."""
    try:
        meta = json.loads(
            fmt.files.read_regular(os.path.join(step_dir, "_CHECKPOINT_METADATA"), 1 << 20)
        )
    except (OSError, ValueError, fmt.UCPError):
        return {}
    handlers = meta.get("item_handlers") if isinstance(meta, dict) else None
    return handlers if isinstance(handlers, dict) else {}


def check_readable(path: str) -> None:
    """Whether the checkpoint at ``path`` can be read before reading it: its manifest parses
    and every shard file it lists is there (the digests are checked as the restore reads)."""
    manifest = store.read_manifest(path)
    for entry in manifest.tensors:
        for key in entry.shard_digests or {}:
            if not os.path.isfile(os.path.join(path, entry.dir, key)):
                raise CheckpointError(
                    f"{path}: tensor {entry.name!r}: shard file {entry.dir}/{key} is missing."
                )


def _ucp_items(path: str) -> list[str]:
    """The item directories of ``path`` holding a ucp.json, sorted."""
    return sorted(
        d for d in os.listdir(path) if os.path.exists(os.path.join(path, d, fmt.MANIFEST_FILE))
    )


def _find_in_object_store(url: str) -> str:
    """``url`` when it holds ucp.json, else its single UCP item (an Orbax-style step prefix).
    A prefix without ucp.json is no checkpoint: a save that never completed."""
    location = store.location
    if location.exists(url, fmt.MANIFEST_FILE):
        return url
    items = sorted(
        {
            name.split("/")[0]
            for name in location.list_names(url)
            if name.count("/") == 1 and name.endswith("/" + fmt.MANIFEST_FILE)
        }
    )
    if len(items) == 1:
        return location.join(url, items[0])
    if not items:
        raise CheckpointError(
            f"{url}: no {fmt.MANIFEST_FILE} here nor in any item below it; not a jax_ucp "
            f"checkpoint (or its save did not complete: an object-store checkpoint exists once "
            f"its {fmt.MANIFEST_FILE} is written)."
        )
    raise CheckpointError(f"{url}: holds several UCP items {items}; pass one of them.")


def read_consistently(path, read: Callable[[str], T], *, redo: bool = True) -> T:
    """``read(root)`` of the checkpoint at ``path`` (``find_checkpoint_dir``), or of the one a
    concurrent forced save swapped in while it ran (see ``consistent_reads``).

    Args:
      path: the checkpoint directory, or an Orbax step directory holding one UCP item.
      read: reads the checkpoint directory it is given.
      redo: a successful ``read`` during which the directory changed is run again (False for a
        read with effects, as an export: a success is whole, every shard checked against the
        manifest's digest).
    """
    result = cast(T, None)
    for attempt in consistent_reads(path, redo=redo):
        with attempt:
            result = read(attempt.find())
    return result


def consistent_reads(path, *, redo: bool = True) -> Iterator[Attempt]:
    """The attempts at reading the checkpoint at ``path`` whole while a concurrent forced save
    may swap it, as ``for attempt in consistent_reads(p): with attempt: r = read(attempt.find())``
    (the loop ends after the read that counts; the caller keeps control, no callback).

    A forced save commits a new directory beside ``path`` and swaps it in by two renames
    (``writer.commit``); a reader may meanwhile see ``path`` missing, read a manifest from one
    directory and shards from the next (``CheckpointError``: not the shard the manifest lists),
    or its directory vanish. Each of those is told from damage by what changed around the read:
    the directory read (device and inode, and its manifest's inode, mtime and size: ext4 gives a
    freed inode to the next directory at once, the new manifest tells them apart; ``_identity``)
    or the swap's names beside ``path`` (``.ucp-replacing``,
    ``.ucp-replaced``). An error with nothing changed is the checkpoint's own; one with a change
    is retried, and after ``_SWAP_RETRIES`` such retries ``SaveConflictError`` ("being
    replaced, retry") is raised, never a corrupt-checkpoint error.

    Args:
      path: the checkpoint directory, or an Orbax step directory holding one UCP item.
      redo: see ``read_consistently``.
    """
    path = os.fspath(path).rstrip("/") or "/"
    error: BaseException | None = None
    for _ in range(_SWAP_RETRIES + 1):
        attempt = Attempt(path, redo)
        yield attempt
        if attempt.done:
            return
        error = attempt.error or error
    raise SaveConflictError(
        f"{path}: the checkpoint was being replaced by a concurrent save while it was read "
        f"({_SWAP_RETRIES + 1} attempts); nothing is wrong with it: read it again once the save "
        f"finishes."
    ) from error  # what the read met while the directory changed under it


class Attempt:
    """One read of ``consistent_reads``: entered, it notes the swap's names beside ``path``;
    ``find()`` gives the checkpoint directory; left, it tells an error or a success during
    which the directory changed (retried: the exception is swallowed) from the checkpoint's own
    error (raised) and a read that counts (``done``)."""

    def __init__(self, path: str, redo: bool):
        self.path, self.redo = path, redo
        self.root: str | None = None
        self.stamp = None
        self.done = False
        self.error: BaseException | None = None

    def __enter__(self) -> Attempt:
        self.around = _swap_state(self.path)
        return self

    def find(self) -> str:
        """The checkpoint directory this attempt reads (``find_checkpoint_dir``)."""
        self.root = find_checkpoint_dir(self.path)
        self.stamp = _identity(self.root)
        return self.root

    def __exit__(self, kind, error, traceback) -> bool:
        if error is None:
            self.done = not self.redo or self.stamp is None or not self._moved()
            return False
        if not isinstance(error, fmt.UCPError):
            return False
        if _swap_state(self.path) == self.around and not self._moved():
            return False  # the checkpoint's own, nothing changed meanwhile
        self.error = error
        return True

    def _moved(self) -> bool:
        """The directory found is gone or another one since ``find()``."""
        return self.root is not None and (self.stamp is None or _identity(self.root) != self.stamp)


_SWAP_RETRIES = 3


def _identity(root: str):
    """What tells one directory at ``root`` from the next, keyed on what a save changes: the
    directory (device, inode: ext4 gives a freed inode to the next directory made at once) and
    its manifest (inode, mtime, size: written anew by every save). Not the ctime, which a
    ``chmod`` of an idle checkpoint changes too."""
    if store.is_url(root):
        return "url"  # an object-store checkpoint is never replaced (no rename there)
    try:
        st = os.stat(root)
    except OSError:
        return None
    try:
        m = os.stat(os.path.join(root, fmt.MANIFEST_FILE))
        manifest = (m.st_ino, m.st_mtime_ns, m.st_size)
    except OSError:
        manifest = None
    return (st.st_dev, st.st_ino, manifest)


def _swap_state(path: str) -> tuple:
    """``path`` and the names a forced replacement of it uses beside it."""
    return tuple(_identity(p) for p in (path, path + commit.REPLACING, path + commit.REPLACED))
