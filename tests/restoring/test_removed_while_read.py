"""A step deleted by a CheckpointManager's retention (max_to_keep, in another process) while it
is read is named as that, never as damage nor a raw FileNotFoundError (issue 56): Orbax's own
deleter removes the step at the first array's read, after ``latest_step()`` chose it."""

from __future__ import annotations

import os
import shutil

import numpy as np
import orbax.checkpoint as ocp
import pytest

import jax_ucp
from jax_ucp._src.sharding.assemble import PendingArray
from jax_ucp.errors import CheckpointError

pytestmark = pytest.mark.timeout(120)

REMOVED = r"step 1 was removed while it was read \(retention of another process\?\)"


@pytest.fixture
def run(tmp_path) -> str:
    root = str(tmp_path / "run")
    with ocp.CheckpointManager(root) as mngr:
        for step in (0, 1):
            tree = {"params": {"a": np.arange(6, dtype=np.float32) + step, "b": np.ones(4)}}
            mngr.save(step, args=ocp.args.Composite(state=jax_ucp.UCPSave(tree)))
    return root


def _at_first_read(monkeypatch, delete) -> None:
    """``delete()`` when the restore starts reading its first array (the plan read already)."""
    start, pending = PendingArray.start, [delete]

    def started(self):
        while pending:
            pending.pop()()
        return start(self)

    monkeypatch.setattr(PendingArray, "start", started)


def test_a_step_removed_by_retention_while_a_manager_restores_it(run, monkeypatch):
    with ocp.CheckpointManager(run) as mngr, ocp.CheckpointManager(run) as other:
        step = mngr.latest_step()
        assert step == 1
        _at_first_read(monkeypatch, lambda: other.delete(step))  # Orbax's own deleter
        with pytest.raises(CheckpointError, match=REMOVED):
            mngr.restore(step, args=ocp.args.Composite(state=jax_ucp.UCPRestore()))
        assert mngr.reload() is None and mngr.all_steps() == [0]


@pytest.mark.parametrize("how", ["step", "item"])
@pytest.mark.parametrize("deleted", ["the folder", "from the top"])
def test_a_step_removed_while_jax_ucp_restores_it(run, monkeypatch, how, deleted):
    """The whole folder gone, or a deletion under way: the step's metadata (and ucp.json)
    first, as Orbax's deleter takes the folders from the top, some arrays already gone."""
    folder = os.path.join(run, "1")

    def delete():
        if deleted == "the folder":
            shutil.rmtree(folder)
        else:
            os.unlink(os.path.join(folder, "_CHECKPOINT_METADATA"))
            shutil.rmtree(os.path.join(folder, "state", "arrays", "params.a"))

    _at_first_read(monkeypatch, delete)
    with pytest.raises(CheckpointError, match=REMOVED):
        if how == "step":
            jax_ucp.restore(run, step=1)
        else:
            jax_ucp.restore(os.path.join(folder, "state"))


def test_damage_in_a_step_that_is_still_there_is_still_damage(run, monkeypatch):
    """The check asks whether the step is being deleted: an array gone from a step whose
    metadata and ucp.json are in place is the checkpoint's own damage, named as that."""
    arrays = os.path.join(run, "1", "state", "arrays", "params.a")
    _at_first_read(monkeypatch, lambda: shutil.rmtree(arrays))
    with pytest.raises(CheckpointError, match=r"params\.a.*missing") as e:
        jax_ucp.restore(run, step=1)
    assert "removed while it was read" not in str(e.value)
