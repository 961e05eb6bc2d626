"""A stream of host tensors (an import) written as step N of an Orbax CheckpointManager directory.

The standalone form needs no Orbax (``writer.write_host_checkpoint``); a manager step does, so
this lives with the Orbax integration. An existing step is replaced like a forced standalone
save: the new step is committed in a staging manager directory first, then swapped in.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import orbax.checkpoint as ocp

from jax_ucp.handler.checkpoint_handler import UCPStreamSave
from jax_ucp.writer import HostItem, commit


def write_manager_step(
    dest,
    items: Iterable[HostItem],
    *,
    step: int,
    force: bool = False,
    source: Mapping | None = None,
    item_name: str = "state",
    compression: str | None = None,
) -> str:
    """Writes ``items`` as ``<dest>/<step>/<item_name>``; returns that UCP directory."""
    dest = os.path.abspath(os.fspath(dest)).rstrip("/")
    step_dir = os.path.join(dest, str(step))
    with commit.save_lock(step_dir):
        commit.recover_interrupted_swap(step_dir)
        return _write_locked(dest, step_dir, items, step, force, source, item_name, compression)


def _write_locked(dest, step_dir, items, step, force, source, item_name, compression) -> str:
    args = UCPStreamSave(items=items, source=dict(source or {}), compression=compression)
    replacing = commit.claim(step_dir, force=force, what=f"step {step}")  # UCP items only
    root = os.path.join(dest, f".ucp-staging-step-{step}") if replacing else dest
    if replacing and os.path.exists(root):
        commit.discard(root, "staging directory of an earlier replacement of this step")
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
    with ocp.CheckpointManager(root, options=options) as mngr:
        try:
            mngr.save(step, args=ocp.args.Composite(**{item_name: args}))
            mngr.wait_until_finished()
        except BaseException:
            commit.remove_failed_save_leftovers(os.path.join(root, str(step)))
            if replacing:
                commit.discard(root, "staging directory of a failed replacement")
            raise
    if replacing:  # committed beside the old step, then swapped in (see writer.commit)
        os.rename(os.path.join(root, str(step)), step_dir + commit.REPLACING)
        commit.replace_committed(step_dir + commit.REPLACING, step_dir)
        commit.discard(root, "staging directory, its step now in place")
    return os.path.join(step_dir, item_name)
