"""A flax/optax user's state comes back whole (issue 24, items 1-4), through the public API as
the user writes it: flax's sharding-guide ``TrainState`` (boxed params, initialised under
``jax.jit(create, out_shardings=nn.logical_to_mesh_sharding(...))``) saved in a
``CheckpointManager`` and restored into a boxed abstract state; names that would replicate
silently; ``select=``; Python scalars into a ``jax.eval_shape`` target. Where Orbax is the
reference (boxes kept, ``step`` as a ``jax.Array``), its own restore of the same state is the
expectation."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from typer.testing import CliRunner

import jax_ucp
from jax_ucp._src import store
from jax_ucp.cli import app
from tests.ucp_testing import assert_bit_exact, mesh


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        up = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        down = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed"))
        h = nn.relu(nn.Dense(32, kernel_init=up, use_bias=False)(x))
        return nn.Dense(8, kernel_init=down, use_bias=False)(h)


TX = optax.adamw(1e-2)
BATCH = jnp.linspace(-1, 1, 4 * 8, dtype=jnp.float32).reshape(4, 8)
RULES = [("embed", "data"), ("mlp", "model")]


def _create(rng):
    params = MLP().init(rng, BATCH)["params"]
    return train_state.TrainState.create(apply_fn=MLP().apply, params=params, tx=TX)


def _shardings(m, rules):
    abstract = jax.eval_shape(_create, jax.random.key(0))
    return nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), m, rules)


def _is_box(x) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


def _boxed_target(m, rules):
    """The sharding guide's abstract state on ``m``: boxes of ShapeDtypeStructs with shardings."""

    def leaf(x, s):
        if _is_box(x):
            return x.replace_boxed(jax.ShapeDtypeStruct(x.value.shape, x.value.dtype, sharding=s))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    abstract = jax.eval_shape(_create, jax.random.key(0))
    return jax.tree.map(leaf, abstract, _shardings(m, rules), is_leaf=_is_box)


@jax.jit
def _train_step(state, x):
    def loss(params):
        return jnp.mean(state.apply_fn({"params": params}, x) ** 2)

    return state.apply_gradients(grads=jax.grad(loss)(state.params))


def _trained_state():
    saved_on = mesh((2, 4), ("data", "model"))
    state = jax.jit(_create, out_shardings=_shardings(saved_on, RULES))(jax.random.key(0))
    for _ in range(2):
        state = _train_step(state, BATCH)
    return state


def _values(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _by_name(tree) -> dict[str, np.ndarray]:
    """'/'-joined key names (as the manifest writes them) → values, boxes opened."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_box)[0]:
        parts = (getattr(p, "key", getattr(p, "idx", getattr(p, "name", p))) for p in path)
        out["/".join(map(str, parts))] = np.asarray(leaf.value if _is_box(leaf) else leaf)
    return out


# --- 1. boxed state --------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_sharding_guide_train_state_comes_back_boxed_in_a_checkpoint_manager(tmp_path):
    state = _trained_state()
    assert isinstance(state.params["Dense_0"]["kernel"], nn.LogicallyPartitioned)
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(2, args=ocp.args.Composite(state=jax_ucp.UCPSave(state)))
        mngr.wait_until_finished()
    names = {e.name: e.logical_axes for e in jax_ucp.inspect(tmp_path / "run" / "2").tensors}
    assert names["params/Dense_0/kernel"] == ("embed", "mlp")  # from the boxes
    assert names["opt_state/0/mu/Dense_1/kernel"] == ("mlp", "embed")

    new = mesh((2, 2), ("fsdp", "tp"))  # 4 devices, other axis names
    target = _boxed_target(new, [("embed", "fsdp"), ("mlp", "tp")])
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        args = ocp.args.Composite(state=jax_ucp.UCPRestore(target=target))
        restored = mngr.restore(2, args=args).state
    assert jax.tree.structure(restored) == jax.tree.structure(target)
    kernel = restored.params["Dense_0"]["kernel"]
    assert type(kernel) is nn.LogicallyPartitioned and kernel.names == ("embed", "mlp")
    assert kernel.value.sharding == target.params["Dense_0"]["kernel"].value.sharding
    assert restored.opt_state[0].mu["Dense_1"]["kernel"].value.sharding.spec == P("tp", "fsdp")
    for got, want in zip(_values(restored), _values(state)):
        assert_bit_exact(got, want)

    # Plain Orbax, the reference: the same state, the same target, the same treedef back.
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "orbax", state)
        ckptr.wait_until_finished()
        reference = ckptr.restore(tmp_path / "orbax", target)
    assert jax.tree.structure(reference) == jax.tree.structure(restored)

    # Training goes on from the restored state as from the saved one, bit for bit.
    for got, want in zip(
        _values(_train_step(restored, BATCH)), _values(_train_step(reference, BATCH))
    ):
        assert_bit_exact(got, want)


@pytest.mark.timeout(120)
def test_partitioned_boxes_are_kept_and_the_readme_target_is_unboxed(tmp_path):
    """``nn.Partitioned`` (mesh-axis names) boxes are kept; an unboxed target (the README's
    ``nn.meta.unbox(...)``) still gives bare arrays: the result follows the target."""
    m = mesh((2, 4), ("data", "model"))
    w = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(m, P("data")))
    jax_ucp.save(tmp_path / "c", {"w": nn.Partitioned(w, names=("data", None))})
    assert jax_ucp.inspect(tmp_path / "c").tensors[0].logical_axes == ("data", None)
    new = mesh((4,), ("data",))
    sds = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(new, P("data")))
    out = jax_ucp.restore(tmp_path / "c", target={"w": nn.Partitioned(sds, names=("data", None))})
    assert type(out["w"]) is nn.Partitioned and out["w"].names == ("data", None)
    assert out["w"].value.sharding == sds.sharding
    assert_bit_exact(out["w"].value, np.asarray(w))
    bare = jax_ucp.restore(tmp_path / "c", target={"w": sds})
    assert isinstance(bare["w"], jax.Array)


class _NNXModel(nnx.Module):
    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
        self.up = nnx.Linear(8, 32, kernel_init=init, use_bias=False, rngs=rngs)


@pytest.mark.timeout(120)
def test_nnx_state_keeps_its_variables_and_records_their_axis_names(tmp_path):
    saved_on = mesh((2, 4), ("data", "model"))
    with jax.set_mesh(saved_on), nn.logical_axis_rules(RULES):
        model = _NNXModel(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    jax_ucp.save(tmp_path / "c", state)
    names = {e.name: e.logical_axes for e in jax_ucp.inspect(tmp_path / "c").tensors}
    assert names["model/up/kernel/value"] == ("embed", "mlp")  # nnx.Variable metadata
    assert names["optimizer/opt_state/0/mu/up/kernel/value"] == ("embed", "mlp")

    # Restored onto another mesh through the recorded names, no target needed.
    new = mesh((4, 2), ("fsdp", "tp"))
    out = jax_ucp.restore(tmp_path / "c", mesh=new, rules=[("embed", "fsdp"), ("mlp", "tp")])
    assert out["model"]["up"]["kernel"].get_value().sharding.spec == P("fsdp", "tp")

    # nnx.eval_shape under jax.set_mesh gives shardings on an AbstractMesh: mesh= makes them
    # concrete, and the State of Variables comes back as the target's.
    with jax.set_mesh(saved_on), nn.logical_axis_rules(RULES):
        abstract = nnx.eval_shape(lambda: _NNXModel(nnx.Rngs(1)))
    target = {"model": nnx.state(abstract)}
    with pytest.raises(jax_ucp.CheckpointError, match=r"'model/up/kernel/value'.*AbstractMesh"):
        jax_ucp.restore(tmp_path / "c", target=target)
    got = jax_ucp.restore(tmp_path / "c", target=target, mesh=saved_on)
    assert jax.tree.structure(got) == jax.tree.structure(target)
    kernel = got["model"]["up"]["kernel"]
    assert isinstance(kernel, nnx.Param) and kernel.get_metadata()["out_sharding"] == (
        "embed",
        "mlp",
    )
    assert kernel.get_value().sharding == NamedSharding(saved_on, P("data", "model"))
    assert_bit_exact(kernel.get_value(), np.asarray(model.up.kernel.get_value()))


@pytest.mark.timeout(120)
def test_a_train_state_resumes_without_a_target_inside_a_checkpoint_manager(tmp_path):
    """The no-target resume of issue 51 for linen: what comes back is placed by the recorded
    logical axes and the rules, its optax states as optax's NamedTuples, ready for
    ``train_state.replace``; the TrainState itself (its apply_fn and tx are not data) is named
    in one notice and comes back as the dict of its fields."""
    state = _trained_state()
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(2, args=ocp.args.Composite(state=jax_ucp.UCPSave(state)))
        mngr.wait_until_finished()
    new = mesh((2, 2), ("fsdp", "tp"), jax.devices()[4:])
    rules = [("embed", "fsdp"), ("mlp", "tp")]
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        args = ocp.args.Composite(state=jax_ucp.UCPRestore(mesh=new, rules=rules))
        out = mngr.restore(jax_ucp.latest_step(tmp_path / "run"), args=args).state
    assert sorted(out) == ["opt_state", "params", "step"]
    kernel = out["params"]["Dense_0"]["kernel"]
    assert kernel.sharding == NamedSharding(new, P("fsdp", "tp"))
    assert type(out["opt_state"][0]) is optax.ScaleByAdamState
    assert out["opt_state"][0].mu["Dense_0"]["kernel"].sharding.spec == P("fsdp", "tp")
    [notice] = jax_ucp.inspect(tmp_path / "run" / "2" / "state").notices
    assert "TrainState" in notice and "dict of its fields" in notice
    resumed = state.replace(**out)
    assert_bit_exact(
        resumed.params["Dense_0"]["kernel"], np.asarray(state.params["Dense_0"]["kernel"].value)
    )
    with jax.set_mesh(new):
        _train_step(resumed, BATCH)  # training goes on from the restored state


# --- 2. no silent replication ----------------------------------------------------------------


def _saved(tmp_path):
    jax_ucp.save(tmp_path / "c", _trained_state())
    return tmp_path / "c"


@pytest.mark.timeout(120)
def test_names_that_would_replicate_are_errors_naming_the_closest(tmp_path):
    path = _saved(tmp_path)
    m = mesh((2, 4), ("data", "model"))
    with pytest.raises(
        jax_ucp.RequestError,
        match=r"'embd'.*\(closest: 'embed'; the checkpoint's names: 'embed', 'mlp'\).*strict=False",
    ):
        jax_ucp.restore(path, mesh=m, rules=[("embd", "data"), ("mlp", "model")])
    typo = mesh((2, 4), ("data", "modle"))
    with pytest.raises(
        jax_ucp.RequestError,
        match=r"'modle' \(size 4\).*\(saved axes 'data', 'model'; closest: 'model'\).*strict=False",
    ):
        jax_ucp.restore(path, mesh=typo)
    with pytest.raises(jax_ucp.RequestError, match=r"Mesh axis 'modle' \(size 4\)"):
        jax_ucp.restore(path, mesh=typo, rules=[("embed", "data")])
    with pytest.raises(jax_ucp.RequestError, match=r"Mesh axis 'modle'"):
        jax_ucp.plan(path, mesh=typo)
    with pytest.raises(jax_ucp.RequestError, match=r"Logical-axis rule 'mlps'"):
        restore_args = jax_ucp.UCPRestore(mesh=m, rules=[("embed", "data"), ("mlps", "model")])
        with ocp.Checkpointer(jax_ucp.UCPCheckpointHandler()) as ckptr:
            ckptr.restore(path, args=restore_args)
    # Names unlike every known one are no typo: rules shared with activation axes ('batch') and
    # a purely data-parallel axis pass.
    restore_args = jax_ucp.UCPRestore(mesh=m, rules=[*RULES, ("batch", "data")])
    with ocp.Checkpointer(jax_ucp.UCPCheckpointHandler()) as ckptr:
        ckptr.restore(path, args=restore_args)
    dp = mesh((2, 2, 2), ("replica", "data", "model"))
    out = jax_ucp.restore(path, mesh=dp, rules=RULES)
    assert not out["params"]["Dense_0"]["kernel"].sharding.is_fully_replicated


@pytest.mark.timeout(120)
def test_strict_false_restores_what_fits_without_a_warning(tmp_path):
    """strict=False allows the typo'd axis; the saved 'data' splits are kept, nothing is
    replicated whole, so nothing is said."""
    path = _saved(tmp_path)
    typo = mesh((2, 4), ("data", "modle"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jax_ucp.ReplicationWarning)
        out = jax_ucp.restore(path, mesh=typo, strict=False)
    assert out["params"]["Dense_0"]["kernel"].sharding.spec == P("data", None)
    assert out["params"]["Dense_1"]["kernel"].sharding.spec == P(None, "data")
    got, want = _by_name(out), _by_name(_trained_state())
    assert sorted(got) == sorted(want)
    for name in want:
        assert_bit_exact(got[name], want[name], name)


@pytest.mark.timeout(120)
def test_mesh_alone_that_replicates_everything_warns_with_the_bytes(tmp_path):
    path = _saved(tmp_path)
    other = mesh((4,), ("fsdp",))  # axis names of another job: no typo, so a warning
    with pytest.warns(
        jax_ucp.ReplicationWarning,
        match=r"6 tensor\(s\).*replicated.*\(6\.0 KiB per device\): 'params/Dense_0/kernel', 'params/Dense_1/kernel', 'opt_state/0/mu/Dense_0/kernel'",
    ):
        out = jax_ucp.restore(path, mesh=other)
    assert out["params"]["Dense_0"]["kernel"].sharding.is_fully_replicated
    # Asked for: rules mapping every name to None replicate without a warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error", jax_ucp.ReplicationWarning)
        jax_ucp.restore(path, mesh=other, rules=[("embed", None), ("mlp", None)], strict=False)


@pytest.mark.timeout(120)
def test_cli_plan_refuses_a_mesh_axis_typo(tmp_path):
    path = _saved(tmp_path)
    runner = CliRunner()
    r = runner.invoke(app, ["plan", str(path), "--mesh", "data=4,modle=2"], env={"COLUMNS": "80"})
    text = " ".join(r.output.split())
    assert r.exit_code == 1, r.output
    assert "Mesh axis 'modle' (size 2)" in text and "closest: 'model'" in text, text
    assert "--no-strict" in text and "strict=False" not in text, text
    r = runner.invoke(
        app, ["plan", str(path), "--mesh", "data=4,modle=2", "--no-strict"], env={"COLUMNS": "80"}
    )
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "params/Dense_0/kernel 8x32 (data, None) 256 B" in text, text
    r = runner.invoke(
        app,
        ["plan", str(path), "--mesh", "data=2,model=4", "--rules", "embd=data,mlp=model"],
        env={"COLUMNS": "80"},
    )
    assert r.exit_code == 1 and "Logical-axis rule 'embd'" in " ".join(r.output.split())


# --- 3. select= ------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_select_returns_only_matched_leaves_and_their_containers(tmp_path):
    state = _trained_state()
    plain = {"params": nn.meta.unbox(state.params), "opt_state": state.opt_state, "step": 2}
    jax_ucp.save(tmp_path / "c", plain)
    weights = jax_ucp.restore(tmp_path / "c", select=r"params/.*")  # the README's line
    assert list(weights) == ["params"]
    assert jax.tree.structure(weights["params"]) == jax.tree.structure(plain["params"])
    for got, want in zip(_values(weights), _values(plain["params"])):
        assert_bit_exact(got, want)
    mu = jax_ucp.restore(tmp_path / "c", select=r"opt_state/0/mu/.*")
    assert list(mu) == ["opt_state"] and list(mu["opt_state"]) == [0]  # a tuple's position
    assert list(mu["opt_state"][0]) == ["mu"]
    assert_bit_exact(
        mu["opt_state"][0]["mu"]["Dense_0"]["kernel"],
        np.asarray(plain["opt_state"][0].mu["Dense_0"]["kernel"].value),  # boxed, like params
    )
    assert jax_ucp.restore(tmp_path / "c", select="step") == {"step": 2}
    whole = jax_ucp.restore(tmp_path / "c", select=r"opt_state/.*")  # complete: rebuilt
    assert type(whole["opt_state"][0]).__name__ == "ScaleByAdamState"
    assert type(whole["opt_state"][1]).__name__ == "EmptyState"
    with pytest.raises(
        jax_ucp.CheckpointError,
        match=r"select='param/\.\*'.*top-level names: 'opt_state', 'params', 'step'",
    ):
        jax_ucp.restore(tmp_path / "c", select=r"param/.*")
    with pytest.raises(jax_ucp.CheckpointError, match=r"matches no tensor or value"):
        jax_ucp.restore(tmp_path / "c", select=lambda name: False)


# --- 4. Python scalars into a jax.eval_shape target ------------------------------------------


@pytest.mark.timeout(120)
def test_python_scalars_restore_into_an_eval_shape_target_as_orbax_does(tmp_path):
    m = mesh((2, 4), ("data", "model"))
    saved = {"step": 5, "lr": 0.5, "done": True, "w": np.arange(8, dtype=np.float32)}
    jax_ucp.save(tmp_path / "c", saved)

    def init():
        return {
            "step": jnp.int32(0),
            "lr": jnp.float32(0),
            "done": jnp.bool_(False),
            "w": jnp.zeros(8, jnp.float32),
        }

    replicated = NamedSharding(m, P())
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
        jax.eval_shape(init),
    )
    out = jax_ucp.restore(tmp_path / "c", target=target)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "orbax", saved)
        ckptr.wait_until_finished()
        reference = ckptr.restore(tmp_path / "orbax", target)
    for name in ("step", "lr", "done"):
        assert isinstance(out[name], jax.Array) and isinstance(reference[name], jax.Array)
        assert out[name].sharding == reference[name].sharding == replicated
        assert_bit_exact(out[name], reference[name], name)
    assert int(out["step"]) == 5

    def one(value_target):
        return jax_ucp.restore(tmp_path / "c", target=value_target)

    sds = jax.ShapeDtypeStruct
    with pytest.raises(
        jax_ucp.CheckpointError,
        match=r"'lr'.*int32.*Python float 0\.5.*float64 → int32.*'same_kind'.*casting='unsafe'",
    ):
        one({"lr": sds((), jnp.int32, sharding=replicated)})
    jax_ucp.save(tmp_path / "big", {"step": 2**40})
    with pytest.raises(jax_ucp.CheckpointError, match=r"1099511627776.*int32"):
        jax_ucp.restore(tmp_path / "big", target={"step": sds((), jnp.int32, sharding=replicated)})
    with pytest.raises(
        jax_ucp.CheckpointError,
        match=r"'step'.*shape \(2,\).*Python int 5 \(a scalar\)",
    ):
        one({"step": sds((2,), jnp.int32, sharding=replicated)})
    unsafe = jax_ucp.restore(
        tmp_path / "c", target={"lr": sds((), jnp.int32, sharding=replicated)}, casting="unsafe"
    )
    assert isinstance(unsafe["lr"], jax.Array) and unsafe["lr"].sharding == replicated
    assert int(unsafe["lr"]) == 0


def test_partial_restore_reads_nothing_else(tmp_path):
    big = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
    tree = {"params": {"w": big[:64]}, "opt_state": {"mu": {"w": big}, "nu": {"w": big}}}
    jax_ucp.save(tmp_path / "c", tree)
    before = store.bytes_read()
    out = jax_ucp.restore(tmp_path / "c", select=r"params/.*")
    read = store.bytes_read() - before
    assert list(out) == ["params"]
    assert_bit_exact(out["params"]["w"], big[:64])
    assert big[:64].nbytes <= read < 2 * big[:64].nbytes  # the moments (2 MiB) were not read
    one = jax_ucp.restore(tmp_path / "c", select=lambda name: name == "opt_state/nu/w")
    assert list(one) == ["opt_state"] and list(one["opt_state"]) == ["nu"]
    sharded = jax_ucp.restore(
        tmp_path / "c", select="opt_state/mu/.*", mesh=mesh((4,), ("x",)), strict=False
    )
    assert isinstance(sharded["opt_state"]["mu"]["w"].sharding, NamedSharding)
    with pytest.raises(ValueError, match="select="):
        jax_ucp.restore(tmp_path / "c", select="x", target=tree)
