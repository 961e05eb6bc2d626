"""flax NNX states through the public API (issue 51): a model's params, batch stats and RNG
streams and its ``nnx.Optimizer`` state saved as the user writes them, restored onto another
mesh with a target and without one, as the ``nnx.State`` of Variables that was saved (classes,
metadata, int keys), typed PRNG keys as keys; roles and logical axes recorded by class."""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jax_ucp
from tests.ucp_testing import assert_bit_exact, mesh

RULES = [("embed", "fsdp"), ("mlp", "tp")]


class Model(nnx.Module):
    def __init__(self, rngs):
        up = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
        down = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("mlp", "embed"))
        self.up = nnx.Linear(8, 16, kernel_init=up, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.down = nnx.Linear(16, 8, kernel_init=down, rngs=rngs)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _state(saved_on):
    with jax.set_mesh(saved_on), nn.logical_axis_rules(RULES):
        model = Model(nnx.Rngs(0, dropout=1))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    return {"model": nnx.state(model), "opt": nnx.state(optimizer), "step": 7}


def _assert_same_values(got, want):
    got_leaves = jax.tree.leaves_with_path(got)
    want_leaves = jax.tree.leaves_with_path(want)
    assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves]
    for (path, g), (_, w) in zip(got_leaves, want_leaves):
        if isinstance(w, jax.Array) and jax.dtypes.issubdtype(w.dtype, jax.dtypes.prng_key):
            assert g.dtype == w.dtype, path
            g, w = jax.random.key_data(g), jax.random.key_data(w)
        assert_bit_exact(np.asarray(g), np.asarray(w), jax.tree_util.keystr(path))


@pytest.mark.timeout(120)
def test_an_nnx_state_comes_back_as_saved_without_a_target_on_another_mesh(tmp_path):
    state = _state(mesh((2, 4), ("fsdp", "tp")))
    jax_ucp.save(tmp_path / "c", state)

    entries = {e.name: e for e in jax_ucp.inspect(tmp_path / "c").tensors}
    kernel = entries["model/up/kernel/value"]
    assert (kernel.role, kernel.logical_axes) == ("param", ("embed", "mlp"))
    assert entries["model/bn/mean/value"].role == "other"  # batch stats are no parameters
    mu = entries["opt/opt_state/0/mu/up/kernel/value"]
    assert (mu.role, mu.sub_role, mu.logical_axes) == ("opt_state", "mu", ("embed", "mlp"))
    assert entries["model/drop/rngs/key/value"].key_impl == "threefry2x32"
    assert jax_ucp.inspect(tmp_path / "c").notices == []

    new = mesh((4, 2), ("fsdp", "tp"))
    out = jax_ucp.restore(tmp_path / "c", mesh=new, rules=RULES)
    assert jax.tree.structure(out, is_leaf=_is_var) == jax.tree.structure(state, is_leaf=_is_var)
    assert type(out["model"]) is nnx.State and list(out["opt"]["opt_state"]) == [0]
    got_kernel = out["model"]["up"]["kernel"]
    assert type(got_kernel) is nnx.Param
    assert got_kernel.get_metadata()["out_sharding"] == ("embed", "mlp")
    assert got_kernel.get_value().sharding.spec == P("fsdp", "tp")
    assert got_kernel.get_value().sharding.mesh.devices.shape == (4, 2)
    key = out["model"]["drop"]["rngs"]["key"]
    assert type(key) is nnx.RngKey and key.get_metadata()["tag"] == "dropout"
    assert type(out["opt"]["opt_state"][0]["mu"]["up"]["kernel"]) is nnx.OptVariable
    _assert_same_values(out, state)

    # ready for nnx.update: the model and optimizer continue from the restored state
    with jax.set_mesh(new), nn.logical_axis_rules(RULES):
        model = Model(nnx.Rngs(5, dropout=6))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    nnx.update(model, out["model"])
    nnx.update(optimizer, out["opt"])
    _assert_same_values(nnx.state(model), state["model"])
    _assert_same_values(nnx.state(optimizer), state["opt"])
    assert model.drop.rngs.key.get_metadata()["tag"] == "dropout"


@pytest.mark.timeout(120)
def test_an_nnx_state_with_rng_streams_restores_into_an_abstract_target(tmp_path):
    saved_on = mesh((2, 4), ("fsdp", "tp"))
    state = _state(saved_on)
    jax_ucp.save(tmp_path / "c", state)
    new = mesh((2, 2), ("fsdp", "tp"), jax.devices()[4:])
    with jax.set_mesh(new), nn.logical_axis_rules(RULES):
        abstract = nnx.eval_shape(lambda: Model(nnx.Rngs(0, dropout=1)))
        abstract_opt = nnx.eval_shape(
            lambda: nnx.Optimizer(Model(nnx.Rngs(0, dropout=1)), optax.adamw(1e-3), wrt=nnx.Param)
        )
    target = {"model": nnx.state(abstract), "opt": nnx.state(abstract_opt), "step": 0}
    got = jax_ucp.restore(tmp_path / "c", target=target, mesh=new)
    assert jax.tree.structure(got) == jax.tree.structure(target)
    assert got["model"]["drop"]["rngs"]["key"].get_value().dtype == jax.random.key(0).dtype
    assert got["model"]["up"]["kernel"].get_value().sharding.spec == P("fsdp", "tp")
    assert got["step"] == 7
    _assert_same_values(got, state)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_prng_keys_come_back_as_keys(tmp_path, impl):
    keys = jax.random.split(jax.random.key(3, impl=impl), 4)
    m = mesh((4,), ("data",))
    sharded = jax.device_put(keys, jax.sharding.NamedSharding(m, P("data")))
    jax_ucp.save(tmp_path / "c", {"rng": {"one": jax.random.key(9, impl=impl), "many": sharded}})
    out = jax_ucp.restore(tmp_path / "c")
    assert out["rng"]["many"].dtype == keys.dtype and out["rng"]["many"].shape == (4,)
    assert_bit_exact(jax.random.key_data(out["rng"]["many"]), jax.random.key_data(keys))
    on_mesh = jax_ucp.restore(tmp_path / "c", mesh=m)
    assert on_mesh["rng"]["one"].dtype == keys.dtype
    target = {
        "rng": {
            "one": jax.ShapeDtypeStruct((), keys.dtype),
            "many": jax.ShapeDtypeStruct((4,), keys.dtype, sharding=sharded.sharding),
        }
    }
    got = jax_ucp.restore(tmp_path / "c", target=target)
    assert got["rng"]["many"].sharding == sharded.sharding
    cast = jax_ucp.restore(tmp_path / "c", target=target, dtype=np.float32)  # keys stay keys
    assert cast["rng"]["one"].dtype == keys.dtype
    assert jax_ucp.restore(tmp_path / "c", dtype=np.float32)["rng"]["one"].dtype == keys.dtype
    assert_bit_exact(
        jax.random.key_data(got["rng"]["one"]), jax.random.key_data(jax.random.key(9, impl=impl))
    )
    # the keys still draw what the saved ones drew
    assert_bit_exact(
        jax.random.normal(got["rng"]["one"]), jax.random.normal(jax.random.key(9, impl=impl))
    )


@pytest.mark.timeout(60)
def test_a_key_target_of_another_implementation_is_refused_naming_the_leaf(tmp_path):
    jax_ucp.save(tmp_path / "c", {"k": jax.random.key(1, impl="rbg")})
    wrong = {"k": jax.ShapeDtypeStruct((), jax.random.key(0, impl="unsafe_rbg").dtype)}
    with pytest.raises(jax_ucp.CheckpointError, match=r"'k'.*'rbg'.*unsafe_rbg"):
        jax_ucp.restore(tmp_path / "c", target=wrong)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "key_impl,why",
    [
        ("os.system", r"key_impl: expected one of"),  # only JAX's own implementations
        ("rbg", r"key_impl: expected uint32 key data of shape \(\.\.\., 4\)"),  # 2 words, not 4
    ],
)
def test_a_manifest_key_impl_is_checked_before_anything_is_read(tmp_path, key_impl, why):
    jax_ucp.save(tmp_path / "c", {"k": jax.random.key(1)})
    path = tmp_path / "c" / "ucp.json"
    d = json.loads(path.read_text())
    d["entries"][0]["key_impl"] = key_impl
    path.write_text(json.dumps(d))
    with pytest.raises(jax_ucp.CheckpointError, match=why):
        jax_ucp.restore(tmp_path / "c")


@pytest.mark.timeout(60)
def test_a_dicts_int_keys_come_back_as_ints(tmp_path):
    jax_ucp.save(tmp_path / "c", {"layers": {0: np.ones(2), 1: np.zeros(2)}, "n": {"0": 1}})
    out = jax_ucp.restore(tmp_path / "c")
    assert list(out["layers"]) == [0, 1] and list(out["n"]) == ["0"]
    # a manifest naming two children "1" and "01" as int keys: both kept, never one lost
    path = tmp_path / "c" / "ucp.json"
    d = json.loads(path.read_text())
    layers = next(c for n, _, c in d["tree"]["children"] if n == "layers")
    layers["children"][0][0] = "01"
    for e in d["entries"]:
        if e["key"] == ["layers", "0"]:
            e["key"] = ["layers", "01"]
    path.write_text(json.dumps(d))
    assert sorted(map(str, jax_ucp.restore(tmp_path / "c")["layers"])) == ["01", "1"]


@pytest.mark.timeout(60)
def test_the_roles_of_an_nnx_state_follow_its_variable_classes(tmp_path):
    state = {"weights": nnx.State({"w": nnx.Param(jnp.ones(3))}), "ema": {"w": jnp.ones(3)}}
    jax_ucp.save(tmp_path / "c", state)
    roles = {e.name: e.role for e in jax_ucp.inspect(tmp_path / "c").tensors}
    assert roles == {"weights/w/value": "param", "ema/w": "other"}


@pytest.mark.slow  # CI runs it in its second stage (-m "torch or slow"), as written
@pytest.mark.timeout(900)
def test_the_nnx_resume_example_runs_as_written(tmp_path, monkeypatch):
    """examples/nnx_resume.py as docs/NNX.md shows it: trained on 8 devices, preempted,
    resumed without a target on 4 devices and grown back to 8, each in a fresh process."""
    import runpy

    from tests.ucp_testing import REPO

    monkeypatch.setenv("PYTHONPATH", REPO)  # the phases' processes import this checkout
    example = runpy.run_path(f"{REPO}/examples/nnx_resume.py", run_name="nnx_resume")
    out = example["main"](str(tmp_path))
    results = out["results"]
    assert results["resume"]["devices"] == 4 and results["grow"]["devices"] == 8
    assert results["resume"]["mesh"] == {"fsdp": 2, "tp": 2}
    assert results["grow"]["mesh"] == {"fsdp": 4, "tp": 2}
    for phase in ("resume", "grow"):
        assert results[phase]["kernel_spec"] == ["fsdp", "tp"]
    # every step after the preemption is trained once more, from the last committed save
    assert results["resume"]["first"] <= example["PREEMPT_AT"] < results["grow"]["first"]
    assert set(results["grow"]["losses"]) >= {str(example["STEPS"] - 1)}
    assert out["worst"] < 1e-5, out["worst"]  # the losses continue the uninterrupted run's


@pytest.mark.timeout(60)
def test_a_variables_recorded_metadata_is_json_scalars_and_never_flaxs_own(tmp_path):
    jax_ucp.save(tmp_path / "c", {"m": nnx.State({"w": nnx.Param(jnp.ones(2), tag="x")})})
    path = tmp_path / "c" / "ucp.json"
    d = json.loads(path.read_text())
    node = d["tree"]["children"][0][2]["children"][0][2]
    assert node["class"].endswith(":Param") and node["metadata"] == {"tag": "x"}
    node["metadata"] = {"tag": "y", "hijax": True, "ref": True}  # flax's own: not from a file
    path.write_text(json.dumps(d))
    w = jax_ucp.restore(tmp_path / "c")["m"]["w"]
    assert type(w) is nnx.Param and w.get_metadata()["tag"] == "y"
    assert w.get_metadata()["hijax"] is False and w.get_metadata()["ref"] is False
    node["metadata"] = {"tag": {"nested": "object"}}
    path.write_text(json.dumps(d))
    with pytest.raises(jax_ucp.CheckpointError, match=r"metadata\.tag: expected bool \| int"):
        jax_ucp.restore(tmp_path / "c")
