"""A checkpoint in a local (or shared) file system directory: written into a temporary sibling,
made durable (one syncfs), renamed into place; a forced replacement swaps two renames; a lock
file beside it keeps a second saver out. The only module that renames checkpoint directories.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import logging
import os
import shutil
import socket
import time
from typing import Any

from jax_ucp._src import format as fmt
from jax_ucp._src.errors import SaveConflictError
from jax_ucp._src.format.mapped_file import FileMap, map_file
from jax_ucp._src.multihost import liveness
from jax_ucp._src.store import host_memory
from jax_ucp._src.store.storage.base import ORBAX_TMP_MARK, Claim, Storage, Transaction
from jax_ucp._src.store.storage.ranged import LocalFile, RandomAccess

# Every destructive file operation and every commit is logged here (as Orbax's atomicity module
# logs its renames): ``logging.getLogger("jax_ucp")`` shows what a save, import or export removed.
log = logging.getLogger(__name__)

# Orbax's step metadata file: written by writer.commit, read by restoring.steps (here, so that a
# restore does not import the writer)
ORBAX_STEP_METADATA = "_CHECKPOINT_METADATA"
TMP_MARK = ".ucp-tmp-"
REPLACING = ".ucp-replacing"
REPLACED = ".ucp-replaced"
LOCK_SUFFIX = ".ucp-lock"


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a directory's fsync makes its new entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_filesystem(path: str) -> None:
    """syncfs(2) on the file system holding ``path``: waits for every dirty page and the journal.

    Falls back to sync(2) where libc has no syncfs (non-Linux).
    """
    syncfs = host_memory.libc_function("syncfs")
    if syncfs is None:
        os.sync()
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        if syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs: {os.strerror(err)}", path)
    finally:
        os.close(fd)


def make_tree_durable(root: str) -> None:
    """Everything written under ``root`` so far on disk (one syncfs), and ``root``'s entries."""
    sync_filesystem(root)
    arrays = os.path.join(root, fmt.ARRAYS_DIR)
    if os.path.isdir(arrays):
        fsync_path(arrays)
    fsync_path(root)


def make_durable(root: str) -> None:
    """Everything under ``root`` on disk before it is committed.

    Writers that deferred durability (``sync=False``: no fsync per file, write-back started early)
    are covered by one syncfs; then ``ucp.json`` (when ``root`` is a checkpoint, not an export or
    a manager step) and the directories that name new entries are fsynced explicitly (cheap after
    syncfs; what a per-file fsync writer still needs).
    """
    make_tree_durable(root)
    manifest = os.path.join(root, fmt.MANIFEST_FILE)
    if os.path.isfile(manifest):
        fsync_path(manifest)


def temporary_path(path: str) -> str:
    """A sibling of ``path`` (same file system, so the final rename is atomic).

    Named after its writer (host, pid) so a later import can recognise a killed one's leftovers.
    """
    return f"{path}{TMP_MARK}{socket.gethostname()}.{os.getpid()}.{time.time_ns()}"


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
        if owner == host and pid_num != os.getpid() and not liveness.pid_alive(pid_num):
            discard(os.path.join(parent, d), f"left by process {pid_num}, which is gone")
            removed.append(d)
    return removed


def remove_failed_save_leftovers(dest: str) -> None:
    """Temporary directories of a save of ``dest`` that failed in this process (ours and Orbax's)."""
    parent, name = os.path.split(os.path.abspath(dest))
    if not os.path.isdir(parent):
        return
    for d in os.listdir(parent):
        if d.startswith(name + ORBAX_TMP_MARK) or d.startswith(name + TMP_MARK):
            discard(os.path.join(parent, d), "temporary directory of a failed save")


def discard(path: str, why: str) -> None:
    """Removes a temporary directory jax_ucp itself made (never a user's), logging it; errors are
    ignored, as for any clean-up (the next save removes what is left)."""
    log.info("removing %s (%s)", path, why)
    shutil.rmtree(path, ignore_errors=True)


def commit(tmp: str, path: str) -> None:
    """Moves the finished directory ``tmp`` to ``path``, replacing a committed one if present."""
    make_durable(tmp)
    if os.path.exists(path):
        os.rename(tmp, path + REPLACING)  # committed: from here on it survives a kill
        replace_committed(path + REPLACING, path)
    else:
        os.rename(tmp, path)
        log.info("committed %s", path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


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
    fsync_path(os.path.dirname(os.path.abspath(path)))
    log.info("committed %s, replacing the checkpoint that was there", path)
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
                log.warning("completing an interrupted replacement: %s -> %s", survivor, path)
                os.rename(survivor, path)
                fsync_path(os.path.dirname(os.path.abspath(path)))
                break
    for leftover in (newer, older):
        if os.path.lexists(leftover) and os.path.lexists(path):
            _remove(leftover)


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


def directory_identity(path: str):
    """What a save changes at ``path`` (None: nothing there): the directory (device, inode) and
    its manifest (inode, mtime, size: ext4 gives a freed inode to the next directory at once);
    not the ctime, which a ``chmod`` of an idle checkpoint changes too."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    try:
        m = os.stat(os.path.join(path, fmt.MANIFEST_FILE))
        manifest = (m.st_ino, m.st_mtime_ns, m.st_size)
    except OSError:
        manifest = None
    return (st.st_dev, st.st_ino, manifest)


def _remove(path: str) -> None:
    """A directory tree, or a plain file / link that a forced write replaced."""
    if os.path.lexists(path):
        log.info("removing %s", path)
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


class LocalDirectory(Storage):
    """A checkpoint directory: committed by rename, made durable by syncfs, locked by a file."""

    local = True

    def absolute(self) -> str:
        return os.path.abspath(self.root)

    def join(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def kvstore(self, *subpath: str) -> dict:
        """A ``file`` kvstore of the resolved absolute path: TensorStore refuses ``..``, ``.``
        and ``//`` components (``../ck`` was its raw "Invalid file path"), and resolving links
        first reads what the kernel would open through them (``link/../x`` is not ``x``)."""
        rel = "/".join(p.strip("/") for p in subpath if p)
        return {"driver": "file", "path": os.path.join(self.resolved, rel)}

    @functools.cached_property
    def resolved(self) -> str:
        """``root`` absolute, every link and ``..`` resolved (once: the one spelling of it that
        TensorStore, the shard reader and every containment check are given)."""
        return os.path.realpath(self.root)

    def inside(self, name: str, what: str = "") -> str:
        """The path of ``name`` under ``resolved`` that every read here takes, refused unless
        inside the checkpoint (``format.files.inside_checkpoint``: a root reached through links
        is checked as its real path; only a name below it leaving it, not a cache snapshot's
        blob, is refused)."""
        return fmt.files.inside_checkpoint(self.resolved, name, what or self.join(name))

    def ranged(self, name: str) -> tuple[dict, str]:
        """TensorStore reads the file natively: only a regular file inside the checkpoint."""
        path = self.inside(name)
        if os.path.lexists(path):  # a FIFO would hold TensorStore's read forever
            fmt.files.check_regular(path)
        return {"driver": "file", "path": os.path.dirname(path) + "/"}, os.path.basename(path)

    def read(self, name: str, limit: int) -> bytes | None:
        """A regular file only (a FIFO, a device or a larger file refused before any read:
        ``UnsafeFileError`` from ``format.files.read_regular``)."""
        try:
            return fmt.files.read_regular(self.inside(name), limit)
        except FileNotFoundError:
            return None

    def reader(self, name: str, what: str = "") -> RandomAccess:
        """``pread`` of the file."""
        return LocalFile(self.inside(name, what))

    def mapped(self, name: str, *, sealed: bool = False) -> tuple[FileMap | None, Any]:
        """The file itself, mapped (None: empty)."""
        return map_file(self.inside(name)), None

    def folder(self, name: str, *, link: bool = True) -> LocalDirectory:
        """Refused unless ``name`` resolves to a folder strictly inside ``root`` (``link=False``:
        and is no symlink)."""
        real = self.inside(name, self.root)
        if os.path.realpath(real) == self.resolved:
            raise fmt.files.UnsafeFileError(
                f"{self.join(name)}: names {self.root} itself, not a folder inside it"
            )
        if not link and os.path.islink(self.join(name)):
            raise fmt.files.UnsafeFileError(
                f"{self.join(name)}: a symlink, not a folder of its own"
            )
        return LocalDirectory(self.join(name))

    def parent(self) -> LocalDirectory:
        return LocalDirectory(os.path.dirname(self.absolute()))

    def exists(self, name: str) -> bool:
        return os.path.exists(self.inside(name))

    def write(self, name: str, data: bytes) -> None:
        with open(self.join(name), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def names(self, prefix: str = "") -> list[str]:
        return sorted(n for n in os.listdir(self.root) if n.startswith(prefix))

    def delete(self, names: list[str]) -> None:
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.join(name))

    def make_durable(self) -> None:
        make_tree_durable(self.root)

    def read_manifest(self) -> fmt.Manifest:
        return fmt.read_manifest_file(self.root)

    def identity(self):
        return directory_identity(self.root)

    def swap_state(self) -> tuple:
        path = self.root.rstrip("/") or "/"
        return tuple(directory_identity(p) for p in (path, path + REPLACING, path + REPLACED))

    def lock(self):
        return save_lock(self.absolute())

    def refuse_early(self, claim: Claim) -> None:
        """Nothing: the primary checks under the lock, and every process learns its outcome."""

    @contextlib.contextmanager
    def transaction(self, claim: Claim, *, kind: str, staged: bool, inner: str | None):
        """A temporary sibling (``staged``), made durable and renamed into place; an
        interrupted swap is finished first, a killed writer's temporaries removed. On any
        error what the writer wrote is removed (logged) and ``root`` is as it was."""
        dest = self.absolute()
        with self.lock():
            recover_interrupted_swap(dest)
            replacing = claim.directory(dest)
            remove_stale_temporaries(dest)
            if staged:
                tx = Transaction(dest, temporary_path(dest), replacing, inner=inner, finish=_finish)
                os.makedirs(tx.path)
            else:
                path = dest + REPLACING if replacing else dest
                tx = Transaction(dest, path, replacing, False, finish=_finish)
            try:
                yield tx
                tx.commit()
            except BaseException:
                if staged and os.path.lexists(tx.path):
                    discard(tx.path, f"temporary directory of a failed {kind}")
                elif not tx.committed:  # the lock is ours: no other live save owns these
                    remove_failed_save_leftovers(tx.path)
                raise

    def remove_abandoned(self) -> list[str]:
        """An interrupted swap finished, temporary directories whose writer (on this host) is
        gone removed; nothing while another save of ``root`` holds its lock."""
        dest = self.absolute().rstrip("/")
        if not os.path.isdir(os.path.dirname(dest)):
            return []
        try:
            with save_lock(dest):
                recover_interrupted_swap(dest)
                return remove_stale_temporaries(dest)
        except SaveConflictError:
            return []


def _finish(tx: Transaction) -> None:
    """The rename that commits ``tx`` (or the swap, when its writer committed beside ``dest``)."""
    if tx.staged:
        content = os.path.join(tx.path, tx.inner) if tx.inner else tx.path
        commit(content, tx.dest)
        if tx.inner:
            discard(tx.path, "staging directory, its content now in place")
    elif tx.replacing:  # committed beside the old one by its writer: swap it in
        replace_committed(tx.path, tx.dest)
