"""Durability: fsync of files and directories, syncfs of a whole tree, and the write threads.

A checkpoint is committed by renaming its directory into place, so everything under it must be
on disk first; writers either fsync as they go (``sync=True``) or defer to one ``make_durable``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import os

from jax_ucp._src import format as fmt
from jax_ucp._src.store import host_memory
from jax_ucp._src.writer import file_digest


@functools.cache
def write_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for shard writes: crc32c and os.writev/fsync release the GIL, and fsync-bound
    writes need several in flight (4 did as well as 8 or 16 on 2 cores)."""
    threads = max(4, os.cpu_count() or 2)
    return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="ucp-write")


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a directory's fsync makes its new entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def durable_file(path: str):
    """``open(path, "wb")`` whose content is on disk once the block ends (flush, then fsync):
    the one way jax_ucp writes a file that must survive a crash right after. Under a
    ``file_digest.recording`` of its directory the file is digested as it is written."""
    with open(path, "wb") as f:
        recorder = file_digest.recorder_for(path)
        if recorder is None:
            yield f
        else:
            digesting = file_digest.DigestingFile(f, path)
            yield digesting
            digests, relative = recorder
            digests[relative] = digesting.finish()
        f.flush()
        os.fsync(f.fileno())


def write_file(path: str, data: str | bytes) -> None:
    """``data`` (a str as UTF-8) as the whole content of ``path``, on disk on return
    (``durable_file``)."""
    with durable_file(path) as f:
        f.write(data.encode() if isinstance(data, str) else data)


def fsync_tree_to(root: str, relative: str) -> None:
    """fsync every directory from ``root/relative`` up to ``root`` (each gained an entry)."""
    names = [n for n in relative.split("/") if n]
    for depth in range(len(names), -1, -1):
        fsync_path(os.path.join(root, *names[:depth]))


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
