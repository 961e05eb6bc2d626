"""Orbax integration: ``UCPCheckpointHandler`` with registered ``UCPSave`` / ``UCPRestore`` args.

A thin adapter over the save engine (``saving.engine``), as Orbax's own
``StandardCheckpointHandler`` delegates to its engine: the blocking part of ``async_save`` is
the engine's ``prepare`` (the layout, this process's shards copied to host memory); its
``write`` runs in a commit future after Orbax has created the (temporary) item directory;
``finalize`` is its ``merge``. Orbax's temporary-path + commit machinery makes the save atomic.
``save`` is ``async_save`` plus waiting on its commit futures.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_args as ocp_checkpoint_args
from orbax.checkpoint import future as ocp_future

from jax_ucp._src import format as fmt
from jax_ucp._src import store, writer
from jax_ucp._src.errors import RequestError
from jax_ucp._src.restoring import locate, restore_entry
from jax_ucp._src.restoring.options import RestoreOptions
from jax_ucp._src.saving import engine
from jax_ucp._src.saving import plan as save_plan
from jax_ucp._src.saving.options import SaveArgs
from jax_ucp._src.store.storage import local


class UCPCheckpointHandler(ocp.handlers.AsyncCheckpointHandler):
    """Saves a pytree as one consolidated zarr v3 array per leaf plus ``ucp.json``."""

    def __init__(
        self,
        *,
        multiprocessing_options: ocp.options.MultiprocessingOptions | None = None,
        reuse_host_copies: bool = True,
    ):
        """``reuse_host_copies=False``: every async save copies into new memory and keeps none
        between saves (the pool holds one copy of the process's replica-0 CPU shards)."""
        options = multiprocessing_options or ocp.options.MultiprocessingOptions()
        self._primary_host = options.primary_host
        # Primary only: each save in flight, merged into ucp.json by finalize.
        self._pending: dict[str, engine.PreparedSave] = {}
        # An async save's private host copies (CPU devices), reused by the next (freed by close())
        self.copy_pool = save_plan.HostCopyPool()
        self._reuse_host_copies = reuse_host_copies

    def _commit_futures(self, directory, args, *, copy: bool) -> list[ocp_future.Future]:
        """The save engine's ``prepare`` now (layout, this process's shards copied to host), its
        ``write`` in a commit future.

        ``copy``: private host copies of CPU device buffers, for saves whose caller goes on (a
        donated or deleted array would change under the write); a blocking save skips them.
        """
        directory = os.fspath(directory)
        storage = store.storage_for(directory)  # chosen once for the save
        storage.refuse_renamed_later()
        # which step's item this is, as the run names it: a resume refuses another step's
        args = dataclasses.replace(args, source=_as_step_item(args.source, directory))
        if isinstance(args, UCPStreamSave):
            coro = writer.write_stream(
                directory,
                args.items,
                source=args.source,
                compression=args.compression,
                inner_chunk_bytes=args.inner_chunk_bytes,
                budget=args.memory_budget,
            )
            return [ocp_future.CommitFutureAwaitingContractedSignals(coro, name="ucp_stream_save")]
        # a budgeted save copies, writes and frees its shards batch by batch (saving.budget):
        # the pool's reused copies would hold them all
        pooled = copy and self._reuse_host_copies and args.memory_budget is None
        pool = self.copy_pool if pooled else None
        copies: list = []
        save = engine.prepare(
            storage,
            args,
            primary=ocp.multihost.is_primary_host(self._primary_host),
            copy=copy,
            pool=pool,
            copies_out=copies,
        )
        if save.primary:
            self._pending[directory] = save
        released = None if pool is None or not copies else lambda: pool.release(copies)
        coro = engine.write(save, released)
        return [ocp_future.CommitFutureAwaitingContractedSignals(coro, name="ucp_save")]

    async def async_save(
        self, directory: epath.Path, item: Any = None, args: UCPSave | UCPStreamSave | None = None
    ) -> list[ocp_future.Future] | None:
        return self._commit_futures(directory, args or UCPSave(item), copy=True)

    def save(
        self,
        directory: epath.Path | str,
        item: Any = None,
        args: UCPSave | UCPStreamSave | None = None,
    ) -> None:
        # The same path as async_save, waited on; the caller blocks, so no private copies.
        for f in self._commit_futures(directory, args or UCPSave(item), copy=False):
            f.result()

    def restore(
        self, directory: epath.Path, item: Any = None, args: UCPRestore | None = None
    ) -> Any:
        if args is not None and not isinstance(args, UCPRestore):
            raise RequestError(
                f"{directory}: restore args are a {type(args).__name__}; expected "
                f"jax_ucp.UCPRestore."
            )
        args = args or UCPRestore(target=item)
        # a manager restores its step's item: never another step's swapped or copied in
        storage = store.storage_for(str(directory))
        locate.check_step_item(storage)
        return restore_entry.restore_tree(storage, args)

    def metadata(self, directory: epath.Path) -> fmt.Manifest:
        return store.read_manifest(str(directory))

    def finalize(self, directory: epath.Path | str) -> None:
        """Primary, after every process finished writing: the engine's ``merge`` (``ucp.json``
        last, with the digest of every shard file)."""
        save = self._pending.pop(os.fspath(directory), None)
        if save is not None:  # None: a stream save (it writes its own manifest)
            engine.merge(save, jax.process_count())

    def close(self):
        self.copy_pool.close()


def _refuse_args_as_item(cls: str, field: str, value) -> None:
    """Args inside args (``UCPRestore(target=UCPRestore(...))``, what ``restore(dir, item)``
    with args as the item gives) would be matched as a pytree; refused, never unwrapped."""
    if isinstance(value, ocp.args.CheckpointArgs):
        raise RequestError(
            f"{cls}.{field}: got a {type(value).__name__}, which is checkpoint args, not a "
            f"pytree; pass it as args= (mngr.save(step, args=ocp.args.Composite(state="
            f"jax_ucp.UCPSave(tree))), mngr.restore(step, args=ocp.args.Composite(state="
            f"jax_ucp.UCPRestore(target=...))))."
        )


def _as_step_item(source: dict | None, directory: str) -> dict:
    """``source`` with ``orbax_item``: ``"<step folder>/<item>"`` of the item directory Orbax
    gave, the marks of its temporary names removed (``3.orbax-checkpoint-tmp-<time>/``,
    ``state.orbax-checkpoint-tmp/``); a URL's parts split on "/" alike."""
    names = [n.split(local.ORBAX_TMP_MARK)[0] for n in directory.rstrip("/").split("/")[-2:]]
    source = dict(source or {"framework": "jax"})
    if len(names) == 2 and all(names):
        source[fmt.ORBAX_ITEM] = "/".join(names)
    return source


# Orbax records a handler by ``f"{cls.__module__}.{cls.__qualname__}"`` in every step it saves
# and imports it by that name to read the step: the public module, not where the code sits
# inside ``_src``, so steps saved now and before the move load alike.
UCPCheckpointHandler.__module__ = "jax_ucp.orbax.handler"


@ocp_checkpoint_args.register_with_handler(UCPCheckpointHandler, for_save=True)
@dataclasses.dataclass
class UCPSave(SaveArgs, ocp.args.CheckpointArgs):
    """Save args: the pytree, plus layout options (``SaveArgs``' fields, documented there) as
    Orbax's args. Checked when constructed (as Orbax's ``StandardSaveArgs``), so a wrong
    option fails in the training loop's ``mngr.save`` call, not later in the background commit.
    """

    def __post_init__(self):
        _refuse_args_as_item("UCPSave", "item", self.item)
        super().__post_init__()


@ocp_checkpoint_args.register_with_handler(UCPCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class UCPRestore(RestoreOptions, ocp.args.CheckpointArgs):
    """Restore args: ``RestoreOptions`` (``jax_ucp.restore``'s keywords, documented there) as
    Orbax's args, checked when constructed: a wrong option fails in the training loop's
    ``mngr.restore`` call."""

    def __post_init__(self):
        _refuse_args_as_item("UCPRestore", "target", self.target)
        if self.step is not None or self.fallback:  # the manager picks the step
            raise RequestError(
                "UCPRestore(step=, fallback=): inside a CheckpointManager the step is "
                "mngr.restore's first argument; pass jax_ucp.latest_step(mngr) there "
                "(fallback=True to pass over unreadable steps): the step "
                "jax_ucp.restore(root, step='latest') takes."
            )
        super().__post_init__()


@ocp_checkpoint_args.register_with_handler(UCPCheckpointHandler, for_save=True)
@dataclasses.dataclass
class UCPStreamSave(ocp.args.CheckpointArgs):
    """Save args for a stream of ``HostItem`` (single process: the primary writes everything).

    What ``manager_step`` uses to write an import as a CheckpointManager step; a standalone
    import commits without Orbax (``writer.write_host_checkpoint``).
    """

    items: Iterable[writer.HostItem]
    source: dict | None = None
    compression: str | None = None
    inner_chunk_bytes: int | None = None
    # bytes held at once (None: ``writer.memory_budget()`` where the write runs); Orbax may run
    # the write in another thread, where the caller's budget context is not set
    memory_budget: int | None = None
