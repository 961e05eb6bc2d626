"""Durability of the files a writer writes, and the write threads.

A checkpoint is committed by renaming its directory into place, so everything under it must be
on disk first; writers either fsync as they go (``sync=True``) or defer to one ``make_durable``
(``store.storage.local``, the medium's syncfs).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os

from jax_ucp._src.store.storage.local import fsync_path
from jax_ucp._src.writer import file_digest


@functools.cache
def write_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for shard writes: crc32c and os.writev/fsync release the GIL, and fsync-bound
    writes need several in flight (4 did as well as 8 or 16 on 2 cores)."""
    threads = max(4, os.cpu_count() or 2)
    return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="ucp-write")


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
