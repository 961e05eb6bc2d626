"""Resume a preempted job from the last good step: ``restore(run_root, step="latest")`` and
``jax_ucp.latest_step`` take the newest committed, readable step of a CheckpointManager root;
``fallback=True`` moves on to older steps, each with a warning naming it and why; a step still
being written, or killed mid-save, is never taken."""

from __future__ import annotations

import glob
import json
import os
import shutil

import numpy as np
import orbax.checkpoint as ocp
import pytest

import jax_ucp


def _run(root, steps=(1, 2, 3)) -> None:
    with ocp.CheckpointManager(root) as mngr:
        for s in steps:
            state = {"w": np.full((4, 4), float(s), np.float32), "step": s}
            mngr.save(s, args=ocp.args.Composite(state=jax_ucp.UCPSave(state)))
        mngr.wait_until_finished()


def _flip_a_shard_byte(step_dir) -> None:
    shard = next(
        f
        for f in glob.glob(os.path.join(step_dir, "state", "arrays", "**"), recursive=True)
        if os.path.isfile(f) and not f.endswith("zarr.json")
    )
    raw = bytearray(open(shard, "rb").read())
    raw[len(raw) // 3] ^= 0x10
    open(shard, "wb").write(bytes(raw))


def test_latest_is_the_newest_committed_step(tmp_path):
    root = str(tmp_path / "run")
    _run(root)
    assert jax_ucp.latest_step(root) == 3
    got = jax_ucp.restore(root, step="latest")
    assert got["step"] == 3 and float(got["w"][0, 0]) == 3.0
    assert jax_ucp.restore(root, step=2)["step"] == 2
    with pytest.raises(jax_ucp.UCPError, match=r"no committed step 7 .*committed: 3, 2, 1"):
        jax_ucp.restore(root, step=7)


def test_a_step_killed_mid_save_or_still_being_written_is_never_taken(tmp_path):
    """Orbax's temporary step folder (a save in progress, or one SIGKILLed), and a step folder
    whose commit was never recorded: skipped without a word, they are not checkpoints yet."""
    root = str(tmp_path / "run")
    _run(root)
    # a live (or killed) save of step 4: Orbax writes it under a temporary name
    shutil.copytree(os.path.join(root, "3"), os.path.join(root, "4.orbax-checkpoint-tmp-1234"))
    # a step 5 folder whose commit Orbax never recorded
    shutil.copytree(os.path.join(root, "3"), os.path.join(root, "5"))
    os.remove(os.path.join(root, "5", "commit_success.txt"))
    meta = os.path.join(root, "5", "_CHECKPOINT_METADATA")
    text = open(meta).read()
    d = json.loads(text)
    d["commit_timestamp_nsecs"] = None
    open(meta, "w").write(json.dumps(d))
    assert jax_ucp.latest_step(root) == 3
    assert jax_ucp.restore(root, step="latest")["step"] == 3


def test_a_damaged_latest_step_is_an_error_unless_fallback_then_warned(tmp_path):
    root = str(tmp_path / "run")
    _run(root)
    _flip_a_shard_byte(os.path.join(root, "3"))
    with pytest.raises(jax_ucp.UCPError, match=r"latest committed step 3 cannot be read.*fallback"):
        jax_ucp.restore(root, step="latest")
    with pytest.warns(jax_ucp.ResumeWarning, match=r"step 3 skipped"):
        got = jax_ucp.restore(root, step="latest", fallback=True)
    assert got["step"] == 2 and float(got["w"][0, 0]) == 2.0


def test_a_step_missing_a_shard_file_is_passed_over_by_latest_step(tmp_path):
    root = str(tmp_path / "run")
    _run(root)
    shard = next(
        f
        for f in glob.glob(os.path.join(root, "3", "state", "arrays", "**"), recursive=True)
        if os.path.isfile(f) and not f.endswith("zarr.json")
    )
    os.remove(shard)
    with pytest.raises(jax_ucp.UCPError, match=r"step 3 cannot be read.*missing"):
        jax_ucp.latest_step(root)
    with pytest.warns(jax_ucp.ResumeWarning, match=r"step 3 skipped"):
        assert jax_ucp.latest_step(root, fallback=True) == 2


def test_fallback_goes_with_latest_only():
    with pytest.raises(jax_ucp.UCPError, match=r"fallback.*step='latest'"):
        jax_ucp.restore("/nonexistent", step=3, fallback=True)


def test_inside_a_manager_the_latest_good_step_goes_to_mngr_restore(tmp_path):
    root = str(tmp_path / "run")
    _run(root)
    _flip_a_shard_byte(os.path.join(root, "3"))
    os.remove(  # step 3 now also lacks a shard: latest_step sees it without reading data
        next(
            f
            for f in glob.glob(os.path.join(root, "3", "state", "arrays", "**"), recursive=True)
            if os.path.isfile(f) and not f.endswith("zarr.json")
        )
    )
    with pytest.warns(jax_ucp.ResumeWarning):
        step = jax_ucp.latest_step(root, fallback=True)
    with ocp.CheckpointManager(root) as mngr:
        got = mngr.restore(step, args=ocp.args.Composite(state=jax_ucp.UCPRestore()))
    assert step == 2 and got["state"]["step"] == 2
    with pytest.raises(jax_ucp.UCPError, match=r"mngr.restore's first argument"):
        jax_ucp.UCPRestore(step="latest")
