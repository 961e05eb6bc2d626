"""Streaming writes of host data (importers), committed atomically.

An importer yields ``HostItem``s; each is written as it comes, with a bounded number of bytes in
flight (``tensor_writes.PipelinedWriter``), so peak memory is a few tensors, not the checkpoint.
A standalone import is written into a temporary sibling directory and renamed into place
(``commit``) without importing JAX or Orbax — a conversion is a host-only job and their import
was ~1 s of it; as step N of a CheckpointManager directory it goes through Orbax's manager. Either
way, if the generator raises, the destination is untouched.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from jax_ucp.handler import commit
from jax_ucp.handler.stream import HostItem, write_stream


def write_host_checkpoint(
    dest,
    items: Iterable[HostItem],
    *,
    force: bool = False,
    source: Mapping | None = None,
    step: int | None = None,
    item_name: str = "state",
    compression: str | None = None,
) -> str:
    """Writes ``items`` as a UCP checkpoint at ``dest`` (or as step ``step`` of a manager dir).

    Returns the UCP directory (the one holding ucp.json).
    """
    dest = os.path.abspath(os.fspath(dest)).rstrip("/")
    if step is None:
        if os.path.exists(dest) and not force:
            raise FileExistsError(f"{dest} already exists; pass force=True to replace it.")
        commit.remove_stale_temporaries(dest)
        tmp = commit.temporary_path(dest)
        try:
            os.makedirs(tmp)
            # Nothing fsynced per file: ``commit`` makes the whole directory durable with one syncfs.
            _run(write_stream(tmp, items, source=source, compression=compression, sync=False))
            commit.commit(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return dest
    return _write_manager_step(
        dest,
        items,
        step=step,
        force=force,
        source=source,
        item_name=item_name,
        compression=compression,
    )


def _run(coro) -> None:
    """``asyncio.run``, also from code that already runs an event loop (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(coro)
        return
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, coro).result()


def _write_manager_step(
    dest: str,
    items: Iterable[HostItem],
    *,
    step: int,
    force: bool,
    source: Mapping | None,
    item_name: str,
    compression: str | None,
) -> str:
    import orbax.checkpoint as ocp

    from jax_ucp.handler.checkpoint_handler import UCPStreamSave

    args = UCPStreamSave(items=items, source=dict(source or {}), compression=compression)
    step_dir = os.path.join(dest, str(step))
    replacing = os.path.exists(step_dir)
    if replacing and not force:
        raise FileExistsError(f"{step_dir} already exists; pass force=True to replace step {step}.")
    # An existing step is replaced like a forced standalone save: the new step is committed in a
    # staging manager directory first, then swapped in.
    root = os.path.join(dest, f".ucp-staging-step-{step}") if replacing else dest
    if replacing and os.path.exists(root):
        shutil.rmtree(root)
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
    with ocp.CheckpointManager(root, options=options) as mngr:
        try:
            mngr.save(step, args=ocp.args.Composite(**{item_name: args}))
            mngr.wait_until_finished()
        except BaseException:
            commit.remove_failed_save_leftovers(os.path.join(root, str(step)))
            if replacing:
                shutil.rmtree(root, ignore_errors=True)
            raise
    if replacing:
        commit.replace_committed(os.path.join(root, str(step)), step_dir)
        shutil.rmtree(root)
    return os.path.join(step_dir, item_name)


def host_items_with_progress(
    tensors: Iterable[Any], total: int, progress: Callable[[str, int, int], None] | None
) -> Iterator[HostItem]:
    """Importer tensors (anything with key/value/provenance) → HostItems, reporting each parameter.

    ``progress(name, done, total)`` counts the ``params`` entries, which is what a user waits on.
    """
    done = 0
    for t in tensors:
        yield HostItem(key=t.key, value=t.value, provenance=t.provenance)
        if t.key[0] == "params":
            done += 1
            if progress is not None:
                progress(t.key[-1], done, total)
