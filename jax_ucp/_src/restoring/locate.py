"""Where a checkpoint is: a UCP checkpoint directory (or object-store prefix), an Orbax step
directory holding one UCP item, a CheckpointManager's committed steps; and reading it whole while
a concurrent forced save swaps it (``consistent_reads``). JAX-free.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TypeVar, cast

from jax_ucp._src import format as fmt
from jax_ucp._src import store
from jax_ucp._src.errors import CheckpointError, RequestError, SaveConflictError
from jax_ucp._src.restoring import steps
from jax_ucp._src.store.storage import Storage, local

T = TypeVar("T")


def is_ucp(storage: Storage, manifest: bool, explicit: bool = False) -> bool:
    """Whether ``storage`` is read as a UCP checkpoint rather than a source ``convert`` reads:
    ``manifest`` (the open stage asked "a manifest here?" once), a local Orbax step directory
    holding a UCP item, a CheckpointManager root (``find_checkpoint`` says which step to pass),
    or nothing there (a forced save's swap, or the error ``find_checkpoint`` gives).
    ``explicit``: importing= or format= was given, an error for a local checkpoint there."""
    path = storage.local_path()
    if path is None:  # a step's items or a manager root's: ``<item>/ucp.json``, one level more
        return manifest or any(
            n.endswith("/" + fmt.MANIFEST_FILE) and 1 <= n.count("/") <= 2 for n in storage.names()
        )
    found = manifest or (
        bool(steps.ucp_items(path)) if os.path.isdir(path) else not os.path.lexists(path)
    )
    if found and explicit and os.path.exists(path):
        raise RequestError(
            f"{path}: a jax_ucp checkpoint; importing= and format= apply to the sources "
            f"convert reads (torch, DeepSpeed, Megatron, ...), not to a UCP checkpoint."
        )
    return found or (os.path.isdir(path) and bool(steps.with_ucp_items(path)))


def find_checkpoint(storage: Storage, manifest: bool | None = None) -> Storage:
    """``storage`` itself when it holds ucp.json (``manifest``: the open stage's answer, not
    asked again; None: asked here), else its single UCP item (an Orbax step dir).

    A forced save killed between its two renames leaves ``path`` missing with both whole
    checkpoints beside it: the newer one (``<path>.ucp-replacing``, committed before the swap
    began) is read, else the older one (``<path>.ucp-replaced``). Reading never renames; the
    next save to ``path`` completes the interrupted swap.
    """
    path = storage.root.rstrip("/") or "/"
    storage = storage if storage.root == path else storage.at(path)
    if manifest or (manifest is None and storage.exists(fmt.MANIFEST_FILE)):
        return storage
    if storage.local_path() is None:  # an object-store prefix: no swap, no links
        return _find_in_object_store(storage)
    if not os.path.lexists(path):
        for survivor in (path + local.REPLACING, path + local.REPLACED):
            if os.path.isdir(survivor):
                return find_checkpoint(storage.at(survivor))
        raise CheckpointError(f"{path}: no such checkpoint directory.")
    if not os.path.isdir(path):
        raise CheckpointError(
            f"{path}: is a file, not a checkpoint directory (expected a directory holding "
            f"{fmt.MANIFEST_FILE}, or an Orbax step directory with one UCP item)."
        )
    items = steps.ucp_items(path)
    if len(items) == 1 and is_step_dir(path):
        try:  # the step's item, never a link to another checkpoint
            fmt.files.inside(path, items[0], path)
        except fmt.files.UnsafeFileError as e:
            raise CheckpointError(str(e)) from None
        return storage.at(os.path.join(path, items[0]))
    if len(items) == 1:  # any folder holding one checkpoint is not read as that checkpoint
        raise CheckpointError(
            f"{path}: no {fmt.MANIFEST_FILE} here; it is not a checkpoint nor an Orbax step "
            f"directory, but holds one checkpoint: {os.path.join(path, items[0])} (pass that)."
        )
    if not items:
        listed = steps.with_ucp_items(path)
        if listed:
            shown = ", ".join(os.path.basename(s.path) for s in listed[:10][::-1])
            raise CheckpointError(
                f"{path}: a CheckpointManager directory, not a checkpoint: "
                f"{len(listed)} step(s) with a UCP item ({'…, ' if len(listed) > 10 else ''}"
                f"{shown}); pass a step's item, e.g. {listed[0].items[0]} "
                f"(or step=N / step='latest'; mngr.restore(step) in Orbax)."
            )
        _refuse_incomplete_dcp(path, os.listdir(path))
        raise CheckpointError(
            f"{path}: no {fmt.MANIFEST_FILE} here nor in any item directory below "
            f"it; not a jax_ucp checkpoint (or the manifest was removed)."
        )
    raise CheckpointError(f"{path}: holds several UCP items {items}; pass one of them.")


def _refuse_incomplete_dcp(path: str, names: list[str]) -> None:
    """A folder (or object-store prefix) of torch DCP rank files without ``.metadata`` (which
    rank 0 writes last, once every rank's files are written) is a DCP save still running or
    killed: named as that, not as a folder that is no checkpoint."""
    ranks = sorted(n for n in names if n.endswith(".distcp") and "/" not in n)
    if ranks and ".metadata" not in names:
        shown = ", ".join(ranks[:3]) + (", ..." if len(ranks) > 3 else "")
        raise CheckpointError(
            f"{path}: an incomplete torch DCP checkpoint: {len(ranks)} rank file(s) ({shown}) "
            f"but no .metadata, which torch.distributed.checkpoint writes last; its save is "
            f"still running or was killed. Wait for it to finish, or pass a complete one."
        )


def is_step_dir(path: str) -> bool:
    """An Orbax step directory: Orbax's step metadata or commit marker in it, or a step number
    (ASCII digits) as its name (CheckpointManager's default step names)."""
    name = os.path.basename(path)
    return (
        (name.isascii() and name.isdigit())
        or os.path.exists(os.path.join(path, "_CHECKPOINT_METADATA"))
        or os.path.exists(os.path.join(path, "commit_success.txt"))
    )


def check_step_item(path: str | Storage, manifest: fmt.Manifest | None = None) -> None:
    """The item at ``path``, restored as a step of its run, is that step's: the step folder
    and item it was written as (``source.orbax_item``, recorded by the Orbax handler) are the
    ones it is found under, or that step folder is no longer in the run (a folder renamed or
    moved: its name is the user's). An item of another step of the same run, swapped or copied
    in, is refused: it would restore that step's values as this one's. Standalone checkpoints
    record none and move freely.

    Args:
      path: the item directory, ``<root>/<step folder>/<item>`` (or its storage; local: an
        object store's prefixes are not compared).
      manifest: its manifest (None: read here; no manifest there, e.g. a torch source read in
        place through Orbax's args: nothing to check).
    """
    storage = store.storage_for(path)
    folder = storage.local_path()
    if folder is None:
        return
    if manifest is None:
        if not os.path.isfile(os.path.join(folder, fmt.MANIFEST_FILE)):
            return
        manifest = storage.read_manifest()
    recorded = (manifest.source or {}).get(fmt.ORBAX_ITEM)
    if recorded is None:
        return
    real = os.path.normpath(os.path.abspath(folder))
    found = "/".join(real.split(os.sep)[-2:])
    if recorded == found:
        return
    step = recorded.split("/")[0] if isinstance(recorded, str) else ""
    plain = step not in ("", ".", "..") and os.sep not in step and "\0" not in step
    if plain and not os.path.isdir(os.path.join(os.path.dirname(os.path.dirname(real)), step)):
        return  # renamed or moved out of its step: nothing else of the run claims it
    shown = repr(recorded)[:200]
    raise CheckpointError(
        f"{folder}: saved as {shown} of its run (source.{fmt.ORBAX_ITEM}), found as {found!r}: "
        f"another step's item, swapped or copied in; never restored as this step. To restore "
        f"what it holds on purpose (a rollback copied forward), name the item folder itself: "
        f"jax_ucp.restore({os.fspath(folder)!r}) restores it as the checkpoint it is, or move it "
        f"out of the run"
    )


def check_readable(path: str) -> None:
    """Whether the step item at ``path`` can be read before reading it: its manifest parses,
    it is this step's (:func:`check_step_item`) and every shard file it lists is there (the
    digests are checked as the restore reads)."""
    manifest = store.read_manifest(path)
    check_step_item(path, manifest)
    for entry in manifest.tensors:
        for key in entry.shard_digests or {}:
            if not os.path.isfile(os.path.join(path, entry.dir, key)):
                raise CheckpointError(
                    f"{path}: tensor {entry.name!r}: shard file {entry.dir}/{key} is missing."
                )


def _find_in_object_store(prefix: Storage) -> Storage:
    """The single UCP item of ``prefix``, which holds no ucp.json (an Orbax-style step prefix).
    A prefix without ucp.json is no checkpoint: a save that never completed."""
    url = prefix.root
    items = sorted(
        {
            name.split("/")[0]
            for name in prefix.names()
            if name.count("/") == 1 and name.endswith("/" + fmt.MANIFEST_FILE)
        }
    )
    if len(items) == 1:
        return prefix.folder(items[0])
    if not items:
        _refuse_incomplete_dcp(url, list(prefix.names()))
        raise CheckpointError(
            f"{url}: no {fmt.MANIFEST_FILE} here nor in any item below it; not a jax_ucp "
            f"checkpoint (or its save did not complete: an object-store checkpoint exists once "
            f"its {fmt.MANIFEST_FILE} is written)."
        )
    raise CheckpointError(f"{url}: holds several UCP items {items}; pass one of them.")


def read_consistently(path, read: Callable[[Storage], T], *, redo=True, manifest=None) -> T:
    """``read(root)`` of the checkpoint at ``path`` (``find_checkpoint``), or of the one a
    concurrent forced save swapped in while it ran (see ``consistent_reads``).

    Args:
      path: the checkpoint directory, or an Orbax step directory holding one UCP item.
      read: reads the checkpoint it is given (its ``Storage``).
      redo: a successful ``read`` during which the directory changed is run again (False for a
        read with effects, as an export: a success is whole, every shard checked against the
        manifest's digest).
      manifest: the open stage's True to "a manifest at ``path``?" (None: asked by the read).
    """
    result = cast(T, None)
    for attempt in consistent_reads(store.storage_for(path), redo=redo, manifest=manifest):
        with attempt:
            result = read(attempt.find())
    return result


def consistent_reads(storage: Storage, *, redo=True, manifest=None) -> Iterator[Attempt]:
    """The attempts at reading the checkpoint at ``path`` whole while a concurrent forced save
    may swap it, as ``for attempt in consistent_reads(p): with attempt: r = read(attempt.find())``
    (the loop ends after the read that counts; the caller keeps control, no callback).

    A forced save commits a new directory beside ``path`` and swaps it in by two renames
    (``writer.commit``); a reader may meanwhile see ``path`` missing, read a manifest from one
    directory and shards from the next (``CheckpointError``: not the shard the manifest lists),
    or its directory vanish. Each of those is told from damage by what changed around the read:
    the directory read (device and inode, and its manifest's inode, mtime and size: ext4 gives a
    freed inode to the next directory at once, the new manifest tells them apart) or the swap's
    names beside ``path`` (``.ucp-replacing``, ``.ucp-replaced``; ``Storage.swap_state``). An
    error with nothing changed is the checkpoint's own; one with a change is retried, and after
    ``_SWAP_RETRIES`` such retries ``SaveConflictError`` ("being replaced, retry") is raised,
    never a corrupt-checkpoint error.

    Args:
      storage: the checkpoint directory, or an Orbax step directory holding one UCP item.
      redo: see ``read_consistently``.
      manifest: see ``read_consistently`` (for the first attempt alone: a retry asks again).
    """
    path = storage.root.rstrip("/") or "/"
    error: BaseException | None = None
    for _ in range(_SWAP_RETRIES + 1):
        attempt = Attempt(storage, redo, manifest)
        manifest = None
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

    def __init__(self, storage: Storage, redo: bool, manifest: bool | None = None):
        self.storage, self.redo, self.manifest = storage, redo, manifest
        self.root: Storage | None = None
        self.stamp, self.done = None, False
        self.error: BaseException | None = None

    def __enter__(self) -> Attempt:
        self.around = self.storage.swap_state()
        return self

    def find(self) -> Storage:
        """The checkpoint this attempt reads (``find_checkpoint``)."""
        self.root = find_checkpoint(self.storage, self.manifest)
        self.stamp = self.root.identity()
        step = os.path.dirname(self.root.root)  # an Orbax step's folder, its metadata in it
        self.step = step if os.path.isfile(os.path.join(step, local.ORBAX_STEP_METADATA)) else None
        return self.root

    def __exit__(self, kind, error, traceback) -> bool:
        if error is None:
            self.done = not self.redo or self.stamp is None or not self._moved()
            return False
        if not isinstance(error, fmt.UCPError):
            return False
        if self._removed():  # a retention's delete, not damage: said so (issue 56)
            what = f"step {os.path.basename(self.step)}" if self.step else "the checkpoint"
            raise CheckpointError(
                f"{self.storage.root}: {what} was removed while it was read (retention of "
                f"another process?)"
            ) from error
        if self.storage.swap_state() == self.around and not self._moved():
            return False  # the checkpoint's own, nothing changed meanwhile
        self.error = error
        return True

    def _removed(self) -> bool:
        """The checkpoint found is being deleted since ``find()`` (no forced save's swap beside
        it): its ucp.json gone, or its step folder's metadata, which Orbax deletes first."""
        if self.root is None or any(self.storage.swap_state()[1:]):
            return False
        meta = self.step and os.path.join(self.step, local.ORBAX_STEP_METADATA)
        return (meta and not os.path.isfile(meta)) or not self.root.exists(fmt.MANIFEST_FILE)

    def _moved(self) -> bool:
        """The directory found is gone or another one since ``find()``."""
        return self.root is not None and (self.stamp is None or self.root.identity() != self.stamp)


_SWAP_RETRIES = 3
