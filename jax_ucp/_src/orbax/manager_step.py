"""A stream of host tensors (an import) written as step N of an Orbax CheckpointManager directory.

The standalone form needs no Orbax (``writer.write_host_checkpoint``); a manager step does, so
this lives with the Orbax integration. The step is written by a CheckpointManager rooted in the
transaction's temporary directory (``<root>/<step>.ucp-tmp-<host>.<pid>.<ns>``, a name Orbax
never reads as a step) and committed like any checkpoint: renamed into place, or swapped in
for an existing step (``commit.transaction``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import orbax.checkpoint as ocp

from jax_ucp._src import writer
from jax_ucp._src.orbax.handler import UCPStreamSave
from jax_ucp._src.writer import HostItem, commit


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
    """Writes ``items`` as ``<dest>/<step>/<item_name>``, the layout a CheckpointManager reads.

    Args:
        dest: the CheckpointManager root directory.
        items: the tensors and values, written as they come.
        step: the step number.
        force: replace an existing step (only one holding jax_ucp checkpoints).
        source: provenance recorded in the manifest.
        item_name: the item's name in the step (``ocp.args.Composite(state=...)``).
        compression: the arrays' codec (``None``: the format's default).

    Returns:
        The UCP directory ``<dest>/<step>/<item_name>``.
    """
    dest = os.path.abspath(os.fspath(dest)).rstrip("/")
    step_dir = os.path.join(dest, str(step))
    args = UCPStreamSave(
        items=items,
        source=dict(source or {}),
        compression=compression,
        memory_budget=writer.memory_budget(),  # convert's, set in this thread
    )
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
    with (
        commit.transaction(
            step_dir, force=force, kind="import", what=f"step {step}", inner=str(step)
        ) as tx,
        ocp.CheckpointManager(tx.path, options=options) as mngr,
    ):
        mngr.save(step, args=ocp.args.Composite(**{item_name: args}))
        mngr.wait_until_finished()
    return os.path.join(step_dir, item_name)
