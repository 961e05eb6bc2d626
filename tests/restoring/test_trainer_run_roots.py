"""Run roots of torch trainers (a Trainer's output_dir, torchtitan's checkpoint/, a DeepSpeed
save_dir, a Megatron or verl save root): ``restore(root, step="latest")``, ``latest_step``,
``jax-ucp latest`` and ``optax_from_torch(root)`` take the newest complete checkpoint and say why
each newer one was passed over. Run roots built from the real fixtures, torch-free."""

from __future__ import annotations

import os
import re
import shutil

import jax
import numpy as np
import pytest

import jax_ucp
from tests.ucp_testing import FIXTURES, assert_bit_exact, run_cli

TRAINER_CKPT = os.path.join(FIXTURES, "hf_trainer", "llama_z2_dp2", "checkpoint-2")


def _same(got, want):
    flat_got, flat_want = jax.tree.leaves_with_path(got), jax.tree.leaves_with_path(want)
    assert [p for p, _ in flat_got] == [p for p, _ in flat_want]
    for (path, a), (_, b) in zip(flat_got, flat_want, strict=True):
        assert_bit_exact(np.asarray(a), np.asarray(b), jax.tree_util.keystr(path))


def _latest(root, *, why: str, skipped: int | None):
    """restore(root, step="latest") with the warnings it gives; each skipped step named."""
    with pytest.warns(jax_ucp.ResumeWarning) as caught:
        tree = jax_ucp.restore(root, step="latest")
    texts = [str(w.message) for w in caught if issubclass(w.category, jax_ucp.ResumeWarning)]
    assert any(f"step {skipped} skipped" in t and why in t for t in texts), texts
    return tree


@pytest.fixture
def trainer_root(tmp_path):
    """A Trainer output_dir: checkpoint-2 complete, checkpoint-4 a save that died before the
    Trainer wrote its trainer_state.json."""
    root = tmp_path / "out"
    shutil.copytree(TRAINER_CKPT, root / "checkpoint-2")
    shutil.copytree(TRAINER_CKPT, root / "checkpoint-4")
    os.remove(root / "checkpoint-4" / "trainer_state.json")
    (root / "runs").mkdir()  # the Trainer's TensorBoard folder beside them
    return str(root)


def test_trainer_output_dir(trainer_root):
    want = jax_ucp.restore(os.path.join(trainer_root, "checkpoint-2"))
    _same(_latest(trainer_root, why="no trainer_state.json", skipped=4), want)
    with pytest.warns(jax_ucp.ResumeWarning, match="checkpoint-4"):
        assert jax_ucp.latest_step(trainer_root) == 2
    _same(jax_ucp.restore(trainer_root, step=2), want)
    with pytest.raises(jax_ucp.CheckpointError, match=r"step 4 cannot be read.*trainer_state"):
        jax_ucp.restore(trainer_root, step=4)
    with pytest.raises(jax_ucp.CheckpointError, match=r"no committed step 3 .*committed: 4, 2"):
        jax_ucp.restore(trainer_root, step=3)
    with pytest.warns(jax_ucp.ResumeWarning, match="checkpoint-4"):  # the root itself: as latest
        _same(jax_ucp.restore(trainer_root), want)


def test_trainer_output_dir_cli(trainer_root):
    r = run_cli("latest", trainer_root)
    assert r.returncode == 0, r.stdout + r.stderr
    out = " ".join(r.stdout.split())
    assert "step 4 skipped" in out and "no trainer_state.json" in out
    squeezed = "".join(r.stdout.split())  # rich folds a long path at the terminal's width
    assert f"step2:{os.path.join(trainer_root, 'checkpoint-2')}" in squeezed


@pytest.mark.filterwarnings("ignore:.*the translation goes on without:UserWarning")
def test_optax_from_torch_on_the_output_dir(trainer_root):
    """The run continues from the newest complete checkpoint of the root, as from that folder."""
    with pytest.warns(jax_ucp.ResumeWarning, match="checkpoint-4"):
        run = jax_ucp.optax_from_torch(trainer_root, spec="hf_llama")
    from_folder = jax_ucp.optax_from_torch(
        os.path.join(trainer_root, "checkpoint-2"), spec="hf_llama"
    )
    _same(run.params, from_folder.params)
    _same(run.opt_state, from_folder.opt_state)


def test_a_damaged_newest_checkpoint_falls_back(trainer_root, tmp_path):
    """A checkpoint whose save completed but whose files are damaged since: the error names it;
    with fallback=True the older one, and why."""
    step = os.path.join(trainer_root, "checkpoint-4")
    shutil.copy(os.path.join(trainer_root, "checkpoint-2", "trainer_state.json"), step)
    rank = os.path.join(step, "global_step2", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with open(rank, "r+b") as f:
        f.truncate(os.path.getsize(rank) // 2)
    with pytest.raises(jax_ucp.UCPError, match="zero_pp_rank_1"):
        jax_ucp.restore(trainer_root, step="latest")
    with pytest.warns(jax_ucp.ResumeWarning, match=r"step 4 skipped: .*zero_pp_rank_1"):
        tree = jax_ucp.restore(trainer_root, step="latest", fallback=True)
    _same(tree, jax_ucp.restore(TRAINER_CKPT))
    r = run_cli("latest", trainer_root)  # --fallback: each candidate's import planned
    assert r.returncode == 0 and "step 2:" in r.stdout, r.stdout + r.stderr


def test_torchtitan_checkpoint_folder(tmp_path):
    root = tmp_path / "checkpoint"
    src = os.path.join(FIXTURES, "torch", "torchtitan_fp32")
    shutil.copytree(src, root / "step-10")
    shutil.copytree(src, root / "step-20")
    os.remove(root / "step-20" / ".metadata")  # DCP writes it once every rank's files are
    tree = _latest(str(root), why="no torch DCP .metadata", skipped=20)
    _same(tree, jax_ucp.restore(src))
    with pytest.warns(jax_ucp.ResumeWarning):
        assert jax_ucp.latest_step(str(root)) == 10


def test_torch_checkpointing_step_folder():
    """torchtitan 0.3's torch_checkpointing saves: checkpoint/step-N as well."""
    root = os.path.join(FIXTURES, "torch_checkpointing", "tc_fsdp2_synthetic_layout")
    _same(jax_ucp.restore(root, step="latest"), jax_ucp.restore(os.path.join(root, "step-3")))
    assert jax_ucp.latest_step(root) == 3


@pytest.mark.parametrize(
    "fixture, newer, why",
    [
        (("deepspeed", "z2_bf16_dp2", "ckpt"), ("global_step2", "global_step5"), "`latest`"),
        (
            ("megatron", "legacy_llama_tp2_synthetic"),
            ("iter_0000007", "iter_0000009"),
            "latest_checkpointed_iteration.txt",
        ),
        (("verl", "fsdp2"), ("global_step_3", "global_step_5"), "latest_checkpointed_iteration"),
    ],
    ids=["deepspeed", "megatron", "verl"],
)
def test_tracked_runs(tmp_path, fixture, newer, why):
    """A step folder newer than the one the run's tracker names: its save did not complete
    (the tracker is written once every rank has saved); the tracker's step is taken, as a
    restore of the root itself takes it."""
    root = tmp_path / "run"
    shutil.copytree(os.path.join(FIXTURES, *fixture), root)
    shutil.copytree(root / newer[0], root / newer[1])
    step = int(re.findall("[0-9]+", newer[1])[-1])
    tree = _latest(str(root), why=why, skipped=step)
    _same(tree, jax_ucp.restore(str(root)))  # the root read through its tracker
    _same(tree, jax_ucp.restore(str(root / newer[0])))


def test_no_complete_checkpoint(tmp_path):
    root = tmp_path / "out"
    shutil.copytree(TRAINER_CKPT, root / "checkpoint-2")
    os.remove(root / "checkpoint-2" / "trainer_state.json")
    with pytest.raises(jax_ucp.CheckpointError, match=r"no committed step can be read: step 2"):
        jax_ucp.restore(str(root), step="latest")


def test_a_folder_of_no_run():
    with pytest.raises(jax_ucp.CheckpointError, match="nor a torch trainer's checkpoint folder"):
        jax_ucp.restore(os.path.join(FIXTURES, "deepspeed"), step="latest")
