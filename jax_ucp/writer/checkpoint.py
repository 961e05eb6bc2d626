"""A standalone checkpoint written from a stream of host tensors, committed atomically.

An importer yields ``HostItem``s; each is written as it comes, with a bounded number of bytes in
flight (``shards.PipelinedWriter``), so peak memory is a few tensors, not the checkpoint. The
checkpoint is written into a temporary sibling directory and renamed into place (``commit``)
without importing JAX or Orbax — a conversion is a host-only job and their import was ~1 s of
it. If the generator raises, the destination is untouched. (A CheckpointManager step is written
by ``handler.manager_step`` on top of the same stream writer.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
from collections.abc import Iterable, Mapping

from jax_ucp.writer import commit
from jax_ucp.writer.stream import HostItem, write_stream


def write_host_checkpoint(
    dest,
    items: Iterable[HostItem],
    *,
    force: bool = False,
    source: Mapping | None = None,
    compression: str | None = None,
) -> str:
    """Writes ``items`` as a UCP checkpoint at ``dest``; returns ``dest`` (the directory of ucp.json)."""
    dest = os.path.abspath(os.fspath(dest)).rstrip("/")
    with commit.save_lock(dest):
        commit.recover_interrupted_swap(dest)
        if os.path.exists(dest) and not force:
            raise FileExistsError(f"{dest} already exists; pass force=True to replace it.")
        commit.check_replaceable(dest)
        commit.remove_stale_temporaries(dest)
        tmp = commit.temporary_path(dest)
        try:
            os.makedirs(tmp)
            # Nothing fsynced per file: ``commit`` makes the directory durable with one syncfs.
            run_coroutine(
                write_stream(tmp, items, source=source, compression=compression, sync=False)
            )
            commit.commit(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return dest


def run_coroutine(coro) -> None:
    """``asyncio.run``, also from code that already runs an event loop (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(coro)
        return
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, coro).result()
