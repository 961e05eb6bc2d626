"""``optax_from_torch`` straight from the Trainer's ``checkpoint-3/`` (no convert, nothing
written): on a mesh by rules, a jitted step gives torch's recorded losses of steps 4 and 5, and
the run (params, Adam's moments, step, schedule, notes) equals the one read from convert's copy."""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding

import jax_ucp
from jax_ucp.conversion import TorchOptions
from jax_ucp.models import LMConfig
from tests.test_optax_torch import _steps
from tests.ucp_testing import REPO

pytestmark = pytest.mark.timeout(600)
FIX = os.path.join(REPO, "tests", "fixtures", "hf_trainer")


def test_a_trainer_run_continues_on_a_mesh_straight_from_its_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # torch-free: the order given
    src = os.path.join(FIX, "trainer_fp32", "checkpoint-3")
    with np.load(os.path.join(FIX, "trainer_fp32.truth.npz")) as z:
        names = [k.split("/", 1)[1] for k in z.files if k.startswith("param/")]
        tokens, want, lrs = z["next_tokens"], z["next_losses"], z["next_lrs"]
    norms = [n for n in names if n.endswith("norm.weight")]
    importing = TorchOptions(parameter_order=[n for n in names if n not in norms] + norms)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    rules = [("embed", "data"), ("heads", "model"), ("mlp", "model"), ("vocab", "model")]
    before = sorted(os.listdir(src))
    run = jax_ucp.optax_from_torch(
        src,
        spec="hf_llama",
        options=jax_ucp.RestoreOptions(mesh=mesh, rules=rules, importing=importing),
    )
    assert sorted(os.listdir(src)) == before and list(tmp_path.iterdir()) == []
    adam = next(s for s in run.opt_state if isinstance(s, optax.ScaleByAdamState))
    for p, mu in zip(jax.tree.leaves(run.params), jax.tree.leaves(adam.mu)):
        assert isinstance(p.sharding, NamedSharding) and mu.sharding == p.sharding
    assert run.step == 3
    assert [float(run.schedule(3 + i)) for i in range(len(lrs))] == pytest.approx(lrs, rel=1e-6)
    with open(os.path.join(src, "config.json")) as f:
        cfg = LMConfig.from_hf_llama(json.load(f))
    losses, stepped = _steps(run, cfg, tokens)
    np.testing.assert_allclose(losses, want, rtol=0, atol=1e-5)
    # the state as a jitted step returns it, placement included: the next step runs the program
    # the first one compiled (a step count off the mesh made a user's train step compile twice)
    for a, b in zip(jax.tree.leaves(run.opt_state), jax.tree.leaves(stepped)):
        assert (a.shape, a.dtype, a.sharding) == (b.shape, b.dtype, b.sharding), (a, b)

    ckpt = jax_ucp.convert(src, tmp_path / "ucp", importing=importing)
    converted = jax_ucp.optax_from_torch(
        ckpt, spec="hf_llama", options=jax_ucp.RestoreOptions(mesh=mesh, rules=rules)
    )
    assert (run.notes, run.unrecovered, run.optimizer) == (
        converted.notes,
        converted.unrecovered,
        converted.optimizer,
    )
    for a, b in zip(jax.tree.leaves(run.opt_state), jax.tree.leaves(converted.opt_state)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(run.params), jax.tree.leaves(converted.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_source_without_its_optimizer_says_so(tmp_path):
    src = os.path.join(REPO, "tests", "fixtures", "torch", "hf_bin")
    with pytest.raises(jax_ucp.UCPError, match=r"no torch optimizer recorded"):
        jax_ucp.optax_from_torch(src)


@pytest.mark.parametrize(
    ("fixture", "says"),
    [
        ("megatron_bridge/llama_tp1dp2", None),
        ("megatron/legacy_gpt_distopt_pp2dp2_synthetic", r"opt_param_scheduler.max_lr"),
    ],
)
def test_a_megatron_run_is_read_by_its_recipe_not_as_a_torch_record(tmp_path, fixture, says):
    """A Megatron import records its optimizer layout under source["optimizer_layout"] (an
    earlier jax_ucp put it under source["optimizer"], the key of torch's record: optax_from_torch
    raised a raw AttributeError on it; harness long run, optax-direct, seed 29). Its arguments and
    scheduler state are read by continuation.megatron, straight from the source and converted
    alike: continued, or refused naming the field its record lacks."""
    src = os.path.join(REPO, "tests", "fixtures", fixture)
    out = jax_ucp.convert(src, tmp_path / "ucp")
    assert jax_ucp.inspect(out).source["optimizer_layout"] in ("dp_reshardable", "distrib_optim")
    for ckpt in (src, out):
        if says is not None:
            with pytest.raises(jax_ucp.UCPError, match=says):
                jax_ucp.optax_from_torch(ckpt)
            continue
        run = jax_ucp.optax_from_torch(ckpt)
        assert run.notes[0].startswith("megatron-core Adam") and run.step > 0


def test_an_earlier_manifests_megatron_layout_is_no_torch_record():
    """Checkpoints converted by an earlier jax_ucp keep the layout name (or a flag) under
    source["optimizer"]: read as no torch record, never as one."""
    from jax_ucp._src.format.manifest import torch_optimizer_record

    assert torch_optimizer_record({"optimizer": "dp_reshardable"}) == {}
    assert torch_optimizer_record({"optimizer": True}) == {}
    assert torch_optimizer_record({"optimizer": {"param_groups": [1]}}) == {"param_groups": [1]}
