"""jax_ucp inside Orbax's CheckpointManager: async saves, retention, composites, new process."""

from __future__ import annotations

import importlib
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import orbax.checkpoint.experimental.v1 as ocp_v1
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ucp
from tests.ucp_testing import FIXTURES, REPO, assert_bit_exact, mesh, move_out, run_python


def _state(m, step):
    w = jax.device_put(jnp.full((8, 16), float(step)), NamedSharding(m, P("data", "model")))
    params = {"w": w, "b": jnp.arange(16.0) + step}
    return {"params": params, "opt_state": optax.adam(1e-3).init(params), "step": step}


def test_manager_steps_retention_and_composite(tmp_path):
    m = mesh((2, 4), ("data", "model"))
    opts = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=1)
    with ocp.CheckpointManager(tmp_path / "run", options=opts) as mngr:
        for step in range(4):
            mngr.save(
                step,
                args=ocp.args.Composite(
                    state=jax_ucp.UCPSave(_state(m, step)),
                    meta=ocp.args.JsonSave({"step": step, "lr": 1e-3}),
                ),
            )
        mngr.wait_until_finished()
        assert mngr.all_steps() == [2, 3]
        assert mngr.latest_step() == 3
        m2 = mesh((4, 2), ("model", "data"))
        out = mngr.restore(
            3,
            args=ocp.args.Composite(state=jax_ucp.UCPRestore(mesh=m2), meta=ocp.args.JsonRestore()),
        )
    assert out.meta == {"step": 3, "lr": 1e-3}
    w = out.state["params"]["w"]
    assert w.sharding.mesh.shape == m2.shape and w.sharding.spec == P("data", "model")
    assert_bit_exact(np.asarray(w), np.full((8, 16), 3.0, np.float32))
    # The step directory is a restorable UCP checkpoint on its own.
    back = jax_ucp.restore(tmp_path / "run" / "3")
    assert back["step"] == 3
    assert sorted(os.listdir(tmp_path / "run")) == ["2", "3"]
    # Orbax records the handler by the name it imports to read the step: the public one
    recorded = json.loads((tmp_path / "run" / "3" / "_CHECKPOINT_METADATA").read_text())
    public = "jax_ucp.orbax.handler.UCPCheckpointHandler"
    assert recorded["item_handlers"]["state"] == public


def test_async_save_does_not_see_later_mutation(tmp_path):
    """The blocking part copies shards to host; donating/overwriting the buffer afterwards is safe."""
    m = mesh((2, 4), ("data", "model"))
    x = jax.device_put(jnp.ones((8, 16)), NamedSharding(m, P("data", "model")))
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(0, args=ocp.args.Composite(state=jax_ucp.UCPSave({"x": x})))
        x.delete()  # the caller may free or donate the buffers as soon as save() returns
        mngr.wait_until_finished()
    assert_bit_exact(jax_ucp.restore(tmp_path / "run" / "0")["x"], np.ones((8, 16), np.float32))


def test_async_save_survives_a_donating_step_right_after_save(tmp_path):
    """save() returns before its private copies are made (they are enqueued on the runtime); a
    train step that donates the saved arrays and overwrites them in place right away must not
    reach the checkpoint."""
    m = mesh((2, 4), ("data", "model"))
    rng = np.random.default_rng(0)
    host = {f"w{i}": rng.standard_normal((1024, 512)).astype(np.float32) for i in range(8)}
    sharding = NamedSharding(m, P("data", "model"))
    step = jax.jit(lambda t: jax.tree.map(lambda a: a * 0 - 7, t), donate_argnums=0)
    for attempt in range(3):
        state = jax.jit(lambda t: jax.tree.map(lambda a: a + 0, t), out_shardings=sharding)(host)
        pointers = {
            k: [s.data.unsafe_buffer_pointer() for s in v.addressable_shards]
            for k, v in state.items()
        }
        with ocp.CheckpointManager(tmp_path / f"run{attempt}") as mngr:
            mngr.save(0, args=ocp.args.Composite(state=jax_ucp.UCPSave(state)))
            state = step(state)  # donated: written in place while the save goes on
            in_place = all(
                [s.data.unsafe_buffer_pointer() for s in v.addressable_shards] == pointers[k]
                for k, v in state.items()
            )
            mngr.wait_until_finished()
        assert in_place  # otherwise this test would show nothing
        back = jax_ucp.restore(tmp_path / f"run{attempt}" / "0")
        for k, v in host.items():
            assert_bit_exact(back[k], v)
        assert float(np.asarray(state["w0"])[0, 0]) == -7.0


def test_restore_in_new_process_with_fewer_devices(tmp_path):
    m = mesh((2, 4), ("data", "model"))
    state = _state(m, 5)
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(5, args=ocp.args.Composite(state=jax_ucp.UCPSave(state)))
        mngr.wait_until_finished()
    want = {
        jax.tree_util.keystr(k): np.asarray(v).tolist()
        for k, v in jax.tree_util.tree_flatten_with_path(state)[0]
    }
    (tmp_path / "want.json").write_text(json.dumps(want))
    for devices, shape in ((4, (2, 2)), (1, (1, 1))):
        run_python(
            f"""
        import json, jax, numpy as np, optax, orbax.checkpoint as ocp, jax_ucp
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        assert jax.device_count() == {devices}
        m = Mesh(np.array(jax.devices()).reshape({shape}), ("data", "model"))
        params = {{"w": jax.ShapeDtypeStruct((8, 16), np.float32, sharding=NamedSharding(m, P("model", "data"))),
                   "b": jax.ShapeDtypeStruct((16,), np.float32, sharding=NamedSharding(m, P("data")))}}
        target = {{"params": params, "opt_state": jax.eval_shape(optax.adam(1e-3).init, params), "step": 0}}
        target["opt_state"] = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype,
            sharding=NamedSharding(m, P())), target["opt_state"])
        with ocp.CheckpointManager("{tmp_path / "run"}") as mngr:
          out = mngr.restore(mngr.latest_step(), args=ocp.args.Composite(state=jax_ucp.UCPRestore(target=target)))
        got = {{jax.tree_util.keystr(k): np.asarray(v).tolist()
                for k, v in jax.tree_util.tree_flatten_with_path(out.state)[0]}}
        want = json.load(open("{tmp_path / "want.json"}"))
        assert got == want, (got.keys(), want.keys())
        assert type(out.state["opt_state"][0]).__name__ == "ScaleByAdamState"
        assert out.state["params"]["w"].sharding.spec == P("model", "data")
        print("ok")
        """,
            devices=devices,
        )


def test_step_written_under_the_old_handler_name_restores(tmp_path):
    """A step Orbax recorded as ``jax_ucp.handler.checkpoint_handler.UCPCheckpointHandler`` (the
    handler's name before the package moves; tools/fixtures/make_orbax_manager_step.py) restores
    through v0's CheckpointManager, v1's typestr lookup, and jax_ucp.restore."""
    run = tmp_path / "run"
    shutil.copytree(os.path.join(REPO, "tests", "fixtures", "orbax_manager_step"), run)
    recorded = json.loads((run / "3" / "_CHECKPOINT_METADATA").read_text())["item_handlers"]
    assert recorded["model"] == "jax_ucp.handler.checkpoint_handler.UCPCheckpointHandler"
    module, _, name = recorded["model"].rpartition(".")
    assert getattr(importlib.import_module(module), name) is jax_ucp.UCPCheckpointHandler
    w = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 7
    b = np.arange(16, dtype=np.int32)

    def check(state, spec=None):
        assert state["step"] == 3
        assert_bit_exact(np.asarray(state["params"]["w"]), w)
        assert_bit_exact(np.asarray(state["params"]["b"]), b)
        if spec is not None:
            assert state["params"]["w"].sharding.spec == spec

    m2 = mesh((4, 2), ("model", "data"))
    with ocp.CheckpointManager(run) as mngr:
        assert mngr.all_steps() == [3]
        out = mngr.restore(
            3,
            args=ocp.args.Composite(model=jax_ucp.UCPRestore(mesh=m2), meta=ocp.args.JsonRestore()),
        )
    assert out.meta == {"step": 3}
    check(out.model, P("data", "model"))
    # v1 finds the handler by the recorded name (the context scopes no name to it)
    with jax_ucp.orbax_v1_context("elsewhere"):
        loaded = ocp_v1.load_checkpointables(run / "3")
    check(loaded["model"])
    assert loaded["meta"] == {"step": 3}
    check(jax_ucp.restore(run / "3"))


# Nothing outside the checkpoint is read, and no tensor borrows another's bytes.


@pytest.mark.timeout(120)
def test_orbax_step_whose_ucp_item_is_linked_outside_is_refused(tmp_path):
    """An Orbax step (written by a CheckpointManager) whose UCP item folder is a link to
    another checkpoint: ``restore(step)`` refuses it; the real item restores."""
    step = tmp_path / "run" / "3"
    shutil.copytree(os.path.join(FIXTURES, "orbax_manager_step", "3"), step)
    want = jax_ucp.restore(step)["params"]
    move_out(step / "model", tmp_path / "elsewhere")
    with pytest.raises(
        jax_ucp.UCPError, match=r"file name 'model' resolves to \S+/elsewhere/model, outside"
    ):
        jax_ucp.restore(step)
    got = jax_ucp.restore(tmp_path / "elsewhere" / "model")["params"]
    for name in want:
        assert_bit_exact(got[name], want[name], name)
