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
import contextlib
import os
import shutil
from collections.abc import Callable, Iterable, Mapping

from jax_ucp import format as fmt
from jax_ucp import store
from jax_ucp.format import UCPError
from jax_ucp.writer import commit
from jax_ucp.writer.stream import HostItem, write_stream

SHARED_TMP = ".ucp-shared-tmp"  # the one temporary directory of an import by several processes
PART_FILE = "ucp.part-{}.json"  # one process's entries, merged into ucp.json by the primary
FAILED_FILE = "ucp.part-{}.failed"  # one process's error
ABORTED_FILE = "ABORTED"  # the primary's: the shared import was not committed


def write_host_checkpoint(
    dest,
    items: Iterable[HostItem],
    *,
    force: bool = False,
    source: Mapping | None = None,
    compression: str | None = None,
) -> str:
    """Writes ``items`` as a UCP checkpoint at ``dest``; returns ``dest`` (the directory of ucp.json)."""
    if store.is_url(dest):
        return _write_object_store_checkpoint(dest, items, force, source, compression)
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


def _write_object_store_checkpoint(url, items, force, source, compression) -> str:
    """``s3://`` / ``gs://``: no rename, so ``ucp.json`` written last is the commit; objects of
    an earlier save that never committed are deleted first, and after a failure."""
    location = store.location
    url = url.rstrip("/")
    location.kvstore_root(url)  # a malformed URL fails before anything is read
    if location.exists(url, fmt.MANIFEST_FILE):
        if not force:
            raise FileExistsError(f"{url} already exists; pass force=True to replace it.")
        raise location.cannot_replace(url)
    location.delete_all(url)
    try:
        run_coroutine(write_stream(url, items, source=source, compression=compression, sync=False))
    except BaseException:
        if not location.exists(url, fmt.MANIFEST_FILE):
            location.delete_all(url)
        raise
    return url


class SharedWriteError(UCPError, RuntimeError):
    """A checkpoint written by several processes failed in one of them (names which, and why)."""


def write_shared_checkpoint(
    dest,
    items: Iterable[HostItem],
    *,
    index: int,
    count: int,
    barrier: Callable[[str], None],
    force: bool = False,
    source: Mapping | None = None,
    compression: str | None = None,
) -> str:
    """One UCP checkpoint written by ``count`` processes on a shared file system, process
    ``index`` writing ``items`` (its share of the tensors).

    All write into one temporary sibling of ``dest`` and list their entries in a part file;
    once all have (``barrier``: every process waits there, e.g. jax.distributed's; this layer
    stays JAX-free), the primary (index 0) merges the parts into ``ucp.json`` and commits with
    one rename, as a single-process import does. A failure in any process leaves ``dest``
    untouched and is raised in every process, naming the process and its error."""
    dest = os.path.abspath(os.fspath(dest)).rstrip("/")
    tmp = dest + SHARED_TMP
    primary = index == 0
    if os.path.exists(dest) and not force:  # every process sees it: all raise, none waits
        raise FileExistsError(f"{dest} already exists; pass force=True to replace it.")
    with commit.save_lock(dest) if primary else contextlib.nullcontext():
        if primary:
            commit.recover_interrupted_swap(dest)
            if os.path.exists(dest):
                commit.check_replaceable(dest)
            commit.remove_stale_temporaries(dest)
            shutil.rmtree(tmp, ignore_errors=True)  # a killed shared import's (we hold the lock)
            os.makedirs(tmp)
        barrier("jax_ucp:shared_write:ready")
        failure: BaseException | None = None
        try:
            run_coroutine(
                write_stream(
                    tmp,
                    items,
                    source=source,
                    compression=compression,
                    sync=False,
                    manifest_file=PART_FILE.format(index),
                )
            )
        except BaseException as e:
            failure = e
            with contextlib.suppress(OSError):
                with open(os.path.join(tmp, FAILED_FILE.format(index)), "w") as f:
                    f.write(f"{type(e).__name__}: {e}"[:4000])
        barrier("jax_ucp:shared_write:written")
        if primary:
            try:
                if failure is not None:
                    raise failure
                _merge_parts(tmp, count, source)
                commit.commit(tmp, dest)
            except BaseException as e:
                failure = failure or e
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp, exist_ok=True)
                with open(os.path.join(tmp, ABORTED_FILE), "w") as f:
                    f.write(f"{type(e).__name__}: {e}"[:4000])
        barrier("jax_ucp:shared_write:committed")
        aborted = os.path.join(tmp, ABORTED_FILE)
        if not primary and failure is None and os.path.exists(aborted):
            with open(aborted) as f:
                failure = SharedWriteError(
                    f"{dest}: not committed; the primary process (0) failed: {f.read()}"
                )
        barrier("jax_ucp:shared_write:done")
        if primary and failure is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if failure is not None:
            raise failure
    return dest


def _merge_parts(tmp: str, count: int, source: Mapping | None) -> None:
    """The parts' entries as one ``ucp.json`` (per-parameter groups interleaved in the order the
    processes took them round-robin); the part files removed. Any process's failure, or a
    missing part, is raised naming the process."""
    errors = []
    for i in range(count):
        failed = os.path.join(tmp, FAILED_FILE.format(i))
        if os.path.exists(failed):
            with open(failed) as f:
                errors.append(f"process {i}: {f.read()}")
        elif not os.path.exists(os.path.join(tmp, PART_FILE.format(i))):
            errors.append(f"process {i}: wrote no {PART_FILE.format(i)}")
    if errors:
        raise SharedWriteError(f"{tmp}: the shared import failed in " + "; ".join(errors))
    groups: list[list[list[fmt.Entry]]] = []
    for i in range(count):
        path = os.path.join(tmp, PART_FILE.format(i))
        with open(path, "rb") as f:
            part = fmt.Manifest.loads(f.read(), where=path)
        os.remove(path)
        mine: dict[str, list[fmt.Entry]] = {}
        for entry in part.entries:
            mine.setdefault(entry.key[-1], []).append(entry)
        groups.append(list(mine.values()))
    entries = [
        entry
        for j in range(max(len(g) for g in groups))
        for g in groups
        if j < len(g)
        for entry in g[j]
    ]
    manifest = fmt.new_manifest(entries, source=source)
    with open(os.path.join(tmp, fmt.MANIFEST_FILE), "w") as f:
        f.write(manifest.dumps())


def run_coroutine(coro) -> None:
    """``asyncio.run``, also from code that already runs an event loop (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(coro)
        return
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, coro).result()
