"""Orbax's v1 API (``orbax.checkpoint.experimental.v1``): jax_ucp as a registered
``CheckpointableHandler``, so ``ocp.save_checkpointables`` / ``ocp.load_checkpointables``,
``ocp.save`` and ``ocp.training.Checkpointer`` (``save``, ``load_checkpointables``) write and
read UCP checkpoints. ``ocp.load`` / ``Checkpointer.load`` do not: Orbax checks for its own
``_METADATA`` file before it asks any handler; ``load_checkpointables`` with the same name is
the v1 call that reads them.

The v1 handler is a thin adapter over the v0 :class:`UCPCheckpointHandler`: ``save`` decides the
layout and copies this process's shards to host in the caller's thread (what v1 expects of the
blocking part) and returns an awaitable that writes the files once Orbax has created the
directory, then ``ucp.json`` last. Orbax's v1 layer calls no ``finalize``, so the awaitable
writes the manifest itself; v1 saves are therefore single-process (a multi-process job saves
through the v0 ``CheckpointManager`` path, whose ``finalize`` runs after every process wrote).

Registered the way Orbax registers any handler: ``ocp.handlers.register_handler(
jax_ucp.UCPHandler, secondary_typestrs=jax_ucp._src.orbax.v1.SECONDARY_TYPESTRS)`` once
per process (the typestrs: v0 CheckpointManager steps saved with ``UCPSave`` load too) (then ``UCPSave`` / ``UCPRestore`` checkpointables and
every item it wrote resolve to it), or scoped with :func:`context`, which needs no global
registration. Nothing is registered on import: a v1 user who does not ask keeps Orbax's handlers.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import jax
import orbax.checkpoint.experimental.v1 as ocp_v1

from jax_ucp._src import format as fmt
from jax_ucp._src import store
from jax_ucp._src.orbax.handler import UCPCheckpointHandler, UCPRestore, UCPSave

STATE = "state"  # Orbax v1's name for the pytree of ocp.save / ocp.load
#: what Orbax records for items the v0 ``UCPCheckpointHandler`` wrote (CheckpointManager
#: steps), and both handlers' names before they moved to ``jax_ucp._src.orbax`` (``jax_ucp.handler``
#: keeps those modules importable): ``register_handler(UCPHandler,
#: secondary_typestrs=SECONDARY_TYPESTRS)`` lets v1 read them
SECONDARY_TYPESTRS = (
    f"{UCPCheckpointHandler.__module__}.{UCPCheckpointHandler.__qualname__}",
    "jax_ucp.handler.checkpoint_handler.UCPCheckpointHandler",
    "jax_ucp.handler.orbax_v1.UCPHandler",
)


class UCPHandler:
    """A v1 ``CheckpointableHandler`` writing each tensor as one consolidated zarr v3 array.

    Chosen by Orbax for a ``jax_ucp.UCPSave(tree)`` checkpointable and a
    ``jax_ucp.UCPRestore(...)`` abstract checkpointable (under any name but the ones Orbax
    scopes to its own handlers, ``"state"`` and ``"metrics"``), for the name :func:`context`
    scopes it to (then ``ocp.save(path, state)`` / ``ocp.load(path, abstract_state)`` are UCP
    saves and restores), and for loading any item it saved (Orbax records the handler).
    """

    async def save(self, directory, checkpointable: Any):
        args = checkpointable if isinstance(checkpointable, UCPSave) else UCPSave(checkpointable)
        if jax.process_count() > 1:
            raise fmt.UCPError(
                f"{directory.path}: a UCP save through Orbax's v1 API is single-process (v1 runs "
                f"no finalize after every process wrote); in a multi-process job save with "
                f"ocp.CheckpointManager and jax_ucp.UCPSave (docs/ORBAX.md)"
            )
        path = directory.path
        v0 = UCPCheckpointHandler(reuse_host_copies=False)  # one handler per save: no next save
        futures = await v0.async_save(path, args=args)  # layout + host copies, now

        async def write() -> None:
            await directory.await_creation()
            for f in futures or []:
                await asyncio.to_thread(f.result)
            await asyncio.to_thread(v0.finalize, path)  # ucp.json last

        return write()

    async def load(self, directory, abstract_checkpointable: Any = None):
        if not os.path.isfile(os.path.join(os.fspath(directory), fmt.MANIFEST_FILE)):
            # chosen only as the last capable handler for an item that records no handler:
            # not ours, so Orbax's own PyTree handler reads it
            return await ocp_v1.handlers.PyTreeHandler().load(directory, abstract_checkpointable)
        args = abstract_checkpointable
        if not isinstance(args, UCPRestore):
            args = UCPRestore(target=abstract_checkpointable)
        # in the caller's thread: jax.Arrays are assembled where the caller will use them
        result = UCPCheckpointHandler().restore(directory, args=args)

        async def done():
            return result

        return done()

    async def metadata(self, directory) -> fmt.Manifest:
        """The manifest (names, shapes, dtypes, roles, saved PartitionSpecs)."""
        return store.read_manifest(os.fspath(directory))

    def is_handleable(self, checkpointable: Any) -> bool:
        # only a UCPSave: a plain pytree goes to Orbax's PyTreeHandler unless this handler is
        # registered for its name
        return isinstance(checkpointable, UCPSave)

    def is_abstract_handleable(self, abstract_checkpointable: Any) -> bool:
        if isinstance(abstract_checkpointable, UCPRestore):
            return True
        return ocp_v1.handlers.PyTreeHandler().is_abstract_handleable(abstract_checkpointable)


# Recorded by Orbax as ``module.qualname`` and imported by it: the public name (as the v0 handler's).
UCPHandler.__module__ = "jax_ucp.orbax.v1"


def context(name: str = STATE, *, base: Any = None):
    """An Orbax v1 ``Context`` in which the checkpointable ``name`` (v1's default ``"state"``:
    what ``ocp.save`` / ``ocp.load`` and ``training.Checkpointer.save_pytree`` /
    ``load_pytree`` use) is saved and loaded by :class:`UCPHandler`; every other name resolves
    as in the global registry. ``base``: a ``Context`` whose other options are kept.

    ``with jax_ucp.orbax_v1_context(): ocp.save(path, state)`` then writes a UCP checkpoint
    under ``path/state``, and ``ocp.load_checkpointables(path, {"state": abstract_state})``
    restores it onto the shardings of ``abstract_state``'s leaves (any mesh). ``UCPSave`` /
    ``UCPRestore`` under other names resolve to :class:`UCPHandler` too.
    """
    registry = ocp_v1.handlers.local_registry(include_global_registry=False)
    known = ocp_v1.handlers.global_registry()
    for handler, scoped in known.get_all_entries():
        if scoped != name and handler is not UCPHandler:
            typestrs = known.get_secondary_typestrs(handler)
            registry.add(handler, checkpointable_name=scoped, secondary_typestrs=typestrs)
    registry.add(UCPHandler, secondary_typestrs=SECONDARY_TYPESTRS)
    registry.add(UCPHandler, checkpointable_name=name)
    ctx = ocp_v1.Context(base)
    ctx.checkpointables.registry = registry
    return ctx


orbax_v1_context = context  # jax_ucp.orbax_v1_context
