"""A run continued from a torch checkpoint keeps its logical axes: what ``optax_from_torch(...,
spec=)`` / ``restore(..., spec=)`` returns on a mesh, stepped and saved (``save`` or ``UCPSave``),
records the names the spec gave (``sharding.restored_axes``), so a restore onto a mesh with
other axis names and rules shards it; no "replicated" warning where nothing is replicated. The
same for megatron-core and Megatron-DeepSpeed runs through their shipped specs."""

from __future__ import annotations

import os
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jax_ucp
from tests.ucp_testing import FIXTURES, mesh

SRC = os.path.join(FIXTURES, "hf_trainer", "llama_z2_dp2", "checkpoint-2")  # DeepSpeed inside
RULES = [("embed", "data"), ("heads", "model"), ("mlp", "model"), ("vocab", "model")]
OTHER = [("embed", "fsdp"), ("heads", "tp"), ("mlp", "tp"), ("vocab", "tp")]


def _continued():
    """optax_from_torch on a 2 x 4 mesh, one jitted step: new arrays, the same places."""
    m = mesh((2, 4), ("data", "model"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the schedule the files do not record
        run = jax_ucp.optax_from_torch(
            SRC, spec="hf_llama", options=jax_ucp.RestoreOptions(mesh=m, rules=RULES)
        )

    @jax.jit
    def step(params, opt_state):
        grads = jax.tree.map(lambda p: (p * 0.5).astype(p.dtype), params)
        updates, opt_state = run.tx.update(grads, opt_state, params)
        return jax.tree.map(lambda p, u: p + u, params, updates), opt_state

    params, opt_state = step(run.params, run.opt_state)
    return m, {"params": params, "opt_state": opt_state}, run


def _check_sharded_elsewhere(path, state):
    """Restored onto (fsdp, tp) with other rules: every tensor of 2+ elements sharded, values
    as saved."""
    other = mesh((4, 2), ("fsdp", "tp"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jax_ucp.ReplicationWarning)
        got = jax_ucp.restore(path, mesh=other, rules=OTHER)
    flat = jax.tree.leaves_with_path(got)
    big = [(p, x) for p, x in flat if x.ndim and x.size > 1]
    assert big and all(not x.sharding.is_fully_replicated for _, x in big), [
        jax.tree_util.keystr(p) for p, x in big if x.sharding.is_fully_replicated
    ]
    for (p, a), (_, b) in zip(flat, jax.tree.leaves_with_path(state), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(p)


def test_saved_continued_run_records_the_spec_axes(tmp_path):
    m, state, _ = _continued()
    path = jax_ucp.save(tmp_path / "c", state)
    entries = {e.key: e for e in jax_ucp.inspect(path).tensors}
    params = {k[1:]: e for k, e in entries.items() if k[0] == "params"}
    assert len(params) == 15  # hf_llama's tree: q, k, v fused, 2 layers
    layer = params[("layers_0", "attn", "qkv", "kernel")]
    assert layer.logical_axes == ("embed", "heads")  # what hf_llama's rule names
    assert params[("wte", "embedding")].logical_axes == ("vocab", "embed")
    for key, e in params.items():
        assert e.logical_axes is not None, key
    moments = [e for k, e in entries.items() if k[0] == "opt_state" and len(e.shape) > 0]
    assert moments and all(e.logical_axes is not None for e in moments)
    _check_sharded_elsewhere(path, state)
    with warnings.catch_warnings():  # the same mesh names: placed as saved, nothing said
        warnings.simplefilter("error", jax_ucp.ReplicationWarning)
        jax_ucp.restore(path, mesh=m, rules=RULES)


def test_ucpsave_through_a_checkpoint_manager(tmp_path):
    _, state, _ = _continued()
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(3, args=ocp.args.Composite(state=jax_ucp.UCPSave(state)))
        mngr.wait_until_finished()
    _check_sharded_elsewhere(os.path.join(tmp_path, "run", "3", "state"), state)


def test_restored_arrays_saved_as_they_are(tmp_path):
    """restore(spec=, mesh=, rules=) then save, no step: the arrays themselves."""
    m = mesh((2, 4), ("data", "model"))
    tree = jax_ucp.restore(SRC, spec="hf_llama", mesh=m, rules=RULES)
    path = jax_ucp.save(tmp_path / "c", {"params": tree["params"]})
    axes = {e.key[1:]: e.logical_axes for e in jax_ucp.inspect(path).tensors}
    assert axes[("layers_1", "mlp", "fc2", "kernel")] == ("mlp", "embed")
    assert axes[("ln_f", "scale")] == ("embed",)


def test_other_places_get_no_names(tmp_path):
    """An array at another path (or of another shape) than any restored one records none."""
    m = mesh((2, 4), ("data", "model"))
    tree = jax_ucp.restore(SRC, spec="hf_llama", mesh=m, rules=RULES)
    kernel = tree["params"]["layers_0"]["attn"]["proj"]["kernel"]
    stepped = jax.jit(lambda x: x * 2)(kernel)  # same shape and sharding, a new array
    path = jax_ucp.save(tmp_path / "c", {"other": {"w": stepped}, "params": {"x": stepped}})
    assert all(e.logical_axes is None for e in jax_ucp.inspect(path).tensors)


def test_unnamed_checkpoint_on_its_own_mesh_names_warns_nothing(tmp_path):
    """A checkpoint saved without names (plain sharded arrays) restored with rules on the mesh
    it was saved on is placed as saved: no warning. Onto other mesh names it is replicated,
    and the warning says so."""
    m = mesh((2, 4), ("data", "model"))
    x = jax.device_put(
        np.arange(64.0, dtype=np.float32).reshape(8, 8),
        jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec("data", "model")),
    )
    path = jax_ucp.save(tmp_path / "c", {"params": {"w": x}})
    with warnings.catch_warnings():
        warnings.simplefilter("error", jax_ucp.ReplicationWarning)
        got = jax_ucp.restore(path, mesh=m, rules=RULES)
    assert got["params"]["w"].sharding.spec == x.sharding.spec
    with pytest.warns(jax_ucp.ReplicationWarning, match="replicated"):
        jax_ucp.restore(path, mesh=mesh((4, 2), ("fsdp", "tp")), rules=OTHER)


def _whole(tree) -> list[str]:
    """The arrays of 2 or more dimensions that sit whole on every device."""
    return [
        jax.tree_util.keystr(p)
        for p, x in jax.tree.leaves_with_path(tree)
        if getattr(x, "ndim", 0) > 1 and x.sharding.is_fully_replicated
    ]


@pytest.mark.parametrize(
    "rel, spec",
    [
        ("megatron/llama_distopt_bf16_tp2dp2", "llama"),  # megatron-core, distributed optimizer
        ("deepspeed/megatron_ds_tp2_dp2_z1_bf16_synthetic/ckpt", "megatron_lm_gpt"),
    ],
)
def test_a_megatron_or_deepspeed_run_lands_sharded_and_its_save_stays_so(tmp_path, rel, spec):
    """Restored with the shipped spec and the docs' rules on a 2 x 4 mesh: no weight, fp32
    master or Adam moment of 2+ dimensions whole on every device, nothing said; saved, the
    manifest records every such tensor's names, and a restore onto other mesh names and
    rules shards them all again, values as saved."""
    m = mesh((2, 4), ("data", "model"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jax_ucp.ReplicationWarning)
        tree = jax_ucp.restore(os.path.join(FIXTURES, rel), spec=spec, mesh=m, rules=RULES)
    assert not _whole(tree)
    moments = [tree["opt_state"]["0"][k] for k in ("mu", "nu")]  # fp32 masters: "params"
    assert sum(x.ndim > 1 for x in jax.tree.leaves(moments)) >= 2 * 7  # every matrix, twice
    path = jax_ucp.save(tmp_path / "c", tree)
    unnamed = [
        e.key for e in jax_ucp.inspect(path).tensors if len(e.shape) > 1 and not e.logical_axes
    ]
    assert not unnamed
    with warnings.catch_warnings():
        warnings.simplefilter("error", jax_ucp.ReplicationWarning)
        got = jax_ucp.restore(path, mesh=mesh((4, 2), ("fsdp", "tp")), rules=OTHER)
    assert not _whole(got)
    for (p, a), (_, b) in zip(
        jax.tree.leaves_with_path(got), jax.tree.leaves_with_path(tree), strict=True
    ):
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(p)
