"""Committing a checkpoint directory: temporary sibling, durable, then renamed into place.

JAX saves go through Orbax's Checkpointer, which does the same (``<name>.orbax-checkpoint-tmp-*``
+ rename).  Host-only imports commit with these primitives instead, so a conversion needs neither
JAX nor Orbax (importing them costs a conversion about a second).
Everything here is also what forced replacement uses (never delete the old checkpoint first).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import time

from jax_ucp import format as fmt
from jax_ucp.format import UCPError
from jax_ucp.writer import durable

ORBAX_TMP_MARK = ".orbax-checkpoint-tmp"
TMP_MARK = ".ucp-tmp-"
REPLACING = ".ucp-replacing"
REPLACED = ".ucp-replaced"
LOCK_SUFFIX = ".ucp-lock"
ORBAX_STEP_METADATA = "_CHECKPOINT_METADATA"


def temporary_path(path: str) -> str:
    """A sibling of ``path`` (same file system, so the final rename is atomic).

    Named after its writer (host, pid) so a later import can recognise a killed one's leftovers.
    """
    return f"{path}{TMP_MARK}{socket.gethostname()}.{os.getpid()}.{time.time_ns()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(path: str) -> list[str]:
    """Deletes temporary directories of ``path`` left by killed writers on this host.

    Only directories whose writer process no longer exists; a concurrent live writer's is kept.
    """
    parent, name = os.path.split(os.path.abspath(path))
    removed = []
    if not os.path.isdir(parent):
        return removed
    host = socket.gethostname()
    for d in os.listdir(parent):
        if not d.startswith(name + TMP_MARK):
            continue
        try:
            owner, pid, _ = d[len(name + TMP_MARK) :].rsplit(".", 2)
            pid_num = int(pid)
        except ValueError:
            continue
        if owner == host and pid_num != os.getpid() and not _pid_alive(pid_num):
            shutil.rmtree(os.path.join(parent, d), ignore_errors=True)
            removed.append(d)
    return removed


def remove_failed_save_leftovers(dest: str) -> None:
    """Temporary directories of a save of ``dest`` that failed in this process (ours and Orbax's)."""
    parent, name = os.path.split(os.path.abspath(dest))
    if not os.path.isdir(parent):
        return
    for d in os.listdir(parent):
        if d.startswith(name + ORBAX_TMP_MARK) or d.startswith(name + TMP_MARK):
            shutil.rmtree(os.path.join(parent, d), ignore_errors=True)


def commit(tmp: str, path: str) -> None:
    """Moves the finished directory ``tmp`` to ``path``, replacing a committed one if present."""
    durable.make_durable(tmp)
    if os.path.exists(path):
        os.rename(tmp, path + REPLACING)  # committed: from here on it survives a kill
        replace_committed(path + REPLACING, path)
    else:
        os.rename(tmp, path)
    durable.fsync_path(os.path.dirname(os.path.abspath(path)))


def replace_committed(new: str, path: str) -> None:
    """Swaps the committed directory ``new`` (``path + .ucp-replacing``) in for ``path``.

    Two renames: at every instant either the old or the new checkpoint is whole at ``path``, or
    both sit beside it (``.ucp-replaced`` and ``.ucp-replacing``) and ``recover_interrupted_swap``
    (or a reader) knows which is newer; the old one is deleted only after the new one is in place.
    """
    old = path + REPLACED
    _remove(old)
    os.rename(path, old)
    os.rename(new, path)
    durable.fsync_path(os.path.dirname(os.path.abspath(path)))
    _remove(old)


def recover_interrupted_swap(path: str) -> None:
    """Finishes (or undoes) a forced replacement of ``path`` that was killed midway.

    ``path`` missing: the newer whole checkpoint (``.ucp-replacing``) takes its place, else the
    older (``.ucp-replaced``). ``path`` present: leftovers beside it are removed (a replacement
    whose save never returned is not kept). Call with the save lock held.
    """
    newer, older = path + REPLACING, path + REPLACED
    if not os.path.lexists(path):
        for survivor in (newer, older):
            if os.path.isdir(survivor):
                os.rename(survivor, path)
                durable.fsync_path(os.path.dirname(os.path.abspath(path)))
                break
    for leftover in (newer, older):
        if os.path.lexists(leftover) and os.path.lexists(path):
            _remove(leftover)


class SaveConflictError(UCPError, OSError):
    """Another save to the same path is in progress, or the path is not ours to replace."""


@contextlib.contextmanager
def save_lock(path: str):
    """An exclusive lock on saving to ``path`` (``flock`` on ``.<name>.ucp-lock`` beside it).

    Two writers of one path would share temporary names and delete each other's files; with the
    lock the second gets a clear error at once instead. The holder removes the lock file before
    releasing it; a writer that locked a file which was removed meanwhile tries again.
    """
    parent, name = os.path.split(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    lock_path = os.path.join(parent, f".{name}{LOCK_SUFFIX}")
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SaveConflictError(
                f"{path}: another save to this path is in progress (lock {lock_path} is held); "
                f"nothing was written."
            ) from None
        try:
            same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the previous holder removed that file: lock the current one
    try:
        yield
    finally:
        try:
            os.remove(lock_path)
        finally:
            os.close(fd)  # releases the lock


def check_replaceable(path: str) -> None:
    """``force`` replaces a jax_ucp checkpoint or an Orbax step directory, nothing else.

    A user's folder that happens to sit at ``path`` is never deleted by mistake.
    """
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        raise SaveConflictError(
            f"{path}: exists and is not a checkpoint directory (a file or link); refusing to "
            f"replace it even with force=True. Remove it yourself or choose another path."
        )
    if is_checkpoint_dir(path):
        return
    raise SaveConflictError(
        f"{path}: exists and is not a jax_ucp checkpoint or an Orbax step (no {fmt.MANIFEST_FILE}, "
        f"no {ORBAX_STEP_METADATA}); refusing to replace it even with force=True."
    )


def is_checkpoint_dir(path: str) -> bool:
    """A standalone UCP checkpoint, or an Orbax step directory (its metadata or UCP items)."""
    if os.path.isfile(os.path.join(path, fmt.MANIFEST_FILE)):
        return True
    if os.path.isfile(os.path.join(path, ORBAX_STEP_METADATA)):
        return True
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(os.path.isfile(os.path.join(path, n, fmt.MANIFEST_FILE)) for n in names)


def _remove(path: str) -> None:
    """A directory tree, or a plain file / link that a forced write replaced."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
