"""jax_ucp through Orbax's v1 API (orbax.checkpoint.experimental.v1): a registered
CheckpointableHandler, beside the v0 CheckpointManager path (each reads what the other wrote)."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp_v0
import orbax.checkpoint.experimental.v1 as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ucp
from jax_ucp.orbax import v1 as orbax_v1
from tests.ucp_testing import REPO, assert_bit_exact, mesh


def _state(step=3):
    m = mesh((2, 4), ("data", "model"))
    w = jax.random.normal(jax.random.key(step), (8, 16))
    params = {
        "w": jax.device_put(w, NamedSharding(m, P("data", "model"))),
        "emb": jnp.arange(32.0).reshape(4, 8).astype(jnp.bfloat16),
    }
    return {"params": params, "opt_state": optax.adam(1e-3).init(params), "step": step}


def _abstract(state):
    """On 4 devices with another axis name: w split over columns, the rest replicated."""
    m = mesh((4,), ("x",), devices=jax.devices()[:4])

    def leaf(path, x):
        if not hasattr(x, "shape"):
            return x
        spec = P(None, "x") if jax.tree_util.keystr(path).endswith("['w']") else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(m, spec))

    return jax.tree_util.tree_map_with_path(leaf, state)


def _check(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        if hasattr(w, "shape"):
            assert g.dtype == w.dtype, path
            assert_bit_exact(np.asarray(g), np.asarray(w), jax.tree_util.keystr(path))
        else:
            assert g == w, path


@pytest.fixture
def registered():
    """jax_ucp's handler in v1's global registry, registered as Orbax documents (once per
    process: Orbax refuses a second registration of a class)."""
    entries = ocp.handlers.global_registry().get_all_entries()
    if not any(handler is jax_ucp.UCPHandler for handler, _ in entries):
        typestrs = orbax_v1.SECONDARY_TYPESTRS
        ocp.handlers.register_handler(jax_ucp.UCPHandler, secondary_typestrs=typestrs)


@pytest.mark.timeout(120)
def test_v1_checkpointables_save_and_load_onto_another_mesh(tmp_path, registered):
    state, path = _state(), tmp_path / "ckpt"
    ocp.save_checkpointables(path, {"model": jax_ucp.UCPSave(state), "meta": {"lr": 1e-3}})
    assert sorted(os.listdir(path / "model")) == ["arrays", "ucp.json"]
    # the public name, importable (where the code sits inside jax_ucp._src may change)
    recorded = json.loads((path / "_CHECKPOINT_METADATA").read_text())["item_handlers"]
    assert recorded["model"] == "jax_ucp.orbax.v1.UCPHandler"
    abstract = _abstract(state)
    loaded = ocp.load_checkpointables(path, {"model": jax_ucp.UCPRestore(target=abstract)})
    _check(loaded["model"], state)
    w = loaded["model"]["params"]["w"]
    assert w.sharding == abstract["params"]["w"].sharding
    assert isinstance(loaded["model"]["opt_state"][0], optax.ScaleByAdamState)
    # no abstract: the saved tree as host numpy; a plain abstract tree: Orbax picks the handler
    # the checkpoint records, ours
    everything = ocp.load_checkpointables(path)
    assert everything["meta"] == {"lr": 1e-3}
    _check(everything["model"], state)
    plain = ocp.load_checkpointables(path, {"model": abstract})
    assert plain["model"]["params"]["w"].sharding == abstract["params"]["w"].sharding
    assert isinstance(ocp.checkpointables_metadata(path).metadata["model"], jax_ucp.Manifest)
    _check(jax_ucp.restore(path, target=abstract), state)  # jax_ucp reads the v1 step directly


@pytest.mark.timeout(120)
def test_v1_context_save_and_training_checkpointer_beside_v0_manager(tmp_path):
    states = {1: _state(1), 2: _state(2)}
    abstract = _abstract(states[1])
    with jax_ucp.orbax_v1_context():
        ocp.save(tmp_path / "one", states[1])  # v1's default pytree call, saved as UCP
        one = ocp.load_checkpointables(tmp_path / "one", {"state": abstract})["state"]
        with ocp.training.Checkpointer(tmp_path / "run") as ckptr:
            for step, state in states.items():
                ckptr.save(step, state)
            assert [c.step for c in ckptr.checkpoints] == [1, 2]
            two = ckptr.load_checkpointables(2, {"state": abstract})["state"]
    assert sorted(os.listdir(tmp_path / "one" / "state")) == ["arrays", "ucp.json"]
    _check(one, states[1])
    _check(two, states[2])
    # the v0 CheckpointManager restores the steps the v1 Checkpointer wrote ...
    with ocp_v0.CheckpointManager(tmp_path / "run") as mngr:
        assert mngr.all_steps() == [1, 2]
        got = mngr.restore(1, args=ocp_v0.args.Composite(state=jax_ucp.UCPRestore(target=abstract)))
        _check(got.state, states[1])
    # ... and v1 loads a step the v0 manager wrote with UCPSave (a plain abstract tree: the
    # handler is found by the v0 handler's name Orbax recorded)
    with ocp_v0.CheckpointManager(tmp_path / "v0") as mngr:
        mngr.save(5, args=ocp_v0.args.Composite(state=jax_ucp.UCPSave(states[2])))
        mngr.wait_until_finished()
    with jax_ucp.orbax_v1_context():
        loaded = ocp.load_checkpointables(tmp_path / "v0" / "5", {"state": abstract})
    _check(loaded["state"], states[2])


@pytest.mark.timeout(60)
def test_v1_plain_pytrees_stay_with_orbax(tmp_path, registered):
    """Registering jax_ucp's handler changes nothing for a v1 user who does not ask for it."""
    state = _state()
    ocp.save(tmp_path / "plain", state)
    assert "_METADATA" in os.listdir(tmp_path / "plain" / "state")
    assert "ucp.json" not in os.listdir(tmp_path / "plain" / "state")
    _check(ocp.load(tmp_path / "plain", _abstract(state)), state)
    # an item jax_ucp's handler is asked to load but did not write goes to Orbax's handler
    loaded = jax_ucp.UCPHandler().load(tmp_path / "plain" / "state", _abstract(state))
    import asyncio

    _check(asyncio.run(_await(loaded)), state)


async def _await(coro):
    return await (await coro)


def test_checkpoint_written_under_the_old_handler_name_loads(tmp_path, registered):
    """A v1 checkpoint recording ``jax_ucp.handler.orbax_v1.UCPHandler`` (the handler's name
    before the package moves; tools/fixtures/make_orbax_manager_step.py) loads by that name,
    through the global registration and through the context."""
    path = tmp_path / "ckpt"
    shutil.copytree(os.path.join(REPO, "tests", "fixtures", "orbax_v1_checkpoint"), path)
    recorded = json.loads((path / "_CHECKPOINT_METADATA").read_text())["item_handlers"]
    assert recorded == {"model": "jax_ucp.handler.orbax_v1.UCPHandler"}
    want = {
        "params": {
            "b": np.arange(16, dtype=np.int32),
            "w": np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 7,
        },
        "step": 3,
    }
    _check(ocp.load_checkpointables(path)["model"], want)
    with jax_ucp.orbax_v1_context("elsewhere"):
        _check(ocp.load_checkpointables(path)["model"], want)
