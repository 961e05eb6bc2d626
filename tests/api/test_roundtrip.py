"""Save on one mesh, restore on another: every byte equal."""

import os

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import zarr
from hypothesis import given
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ucp
from tests.ucp_testing import assert_bit_exact, mesh

ALL_DTYPES = [
    np.float32,
    ml_dtypes.bfloat16,
    np.float16,
    np.float64,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e5m2fnuz,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint32,
    np.bool_,
]


def _random_bits(shape, dtype, seed=0):
    """Arbitrary bit patterns (NaN payloads, -0.0, denormals) for floats; all values for ints."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_dtype_round_trips_bit_exact(tmp_path, dtype):
    m = mesh((2, 4), ("data", "model"))
    host = _random_bits((8, 12), dtype)
    if np.dtype(dtype) == np.float64 or np.dtype(dtype) == np.int64:
        tree = {"x": host}  # 64-bit stays host-side unless jax_enable_x64
    else:
        tree = {"x": jax.device_put(host, NamedSharding(m, P("data", "model")))}
    tree |= {"scalar": host[0, 0], "empty": np.zeros((0, 3), dtype), "row": host[1]}
    jax_ucp.save(tmp_path / "c", tree)
    back = jax_ucp.restore(tmp_path / "c")
    assert_bit_exact(back["x"], host)
    assert_bit_exact(back["scalar"], host[0, 0])
    assert_bit_exact(back["empty"], np.zeros((0, 3), dtype))
    assert_bit_exact(back["row"], host[1])
    m2 = mesh((4,), ("model",))
    back2 = jax_ucp.restore(tmp_path / "c", mesh=m2, strict=False)
    assert_bit_exact(np.asarray(back2["x"]), host)


@pytest.mark.parametrize(
    "dtype",
    [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8, np.bool_],
)
def test_zarr_python_reads_native_dtypes(tmp_path, dtype):
    host = _random_bits((6, 10), dtype, seed=3)
    m = mesh((2, 4), ("a", "b"))
    leaf = host if np.dtype(dtype).itemsize == 8 else jax.device_put(host, NamedSharding(m, P("a")))
    jax_ucp.save(tmp_path / "c", {"t": leaf, "z": np.zeros((), dtype)})
    entry = {e.name: e for e in jax_ucp.inspect(tmp_path / "c").tensors}["t"]
    arr = zarr.open(str(tmp_path / "c" / entry.dir), mode="r")
    assert arr.shape == host.shape
    assert_bit_exact(arr[:], host)
    assert_bit_exact(arr[2:5, 3:7], host[2:5, 3:7])


def test_values_and_structure_without_target(tmp_path):
    tree = {
        "params": {"w": jnp.ones((4, 4))},
        "step": 7,
        "lr": 0.5,
        "name": "run-1",
        "flag": False,
        "nothing": None,
        "layers": [np.arange(3), {"b": np.ones(2)}],
    }
    jax_ucp.save(tmp_path / "c", tree)
    back = jax_ucp.restore(tmp_path / "c")
    assert back["step"] == 7 and isinstance(back["step"], int)
    assert back["lr"] == 0.5 and back["name"] == "run-1" and back["flag"] is False
    assert back["nothing"] is None
    assert isinstance(back["layers"], list) and len(back["layers"]) == 2
    assert isinstance(back["params"]["w"], np.ndarray)
    assert_bit_exact(back["layers"][1]["b"], np.ones(2))


def test_optax_state_restores_into_target_namedtuples(tmp_path):
    m = mesh((2, 4), ("data", "model"))
    params = {
        "w": jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(m, P("data", "model"))),
        "b": jnp.zeros((4,)),
    }
    opt = optax.adamw(1e-3)
    state = {"params": params, "opt_state": opt.init(params), "step": 3}
    jax_ucp.save(tmp_path / "c", state)
    m2 = mesh((4, 2), ("model", "data"))
    target = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(m2, P()))
            if isinstance(x, jax.Array)
            else x
        ),
        state,
    )
    back = jax_ucp.restore(tmp_path / "c", target=target)
    assert type(back["opt_state"][0]) is type(state["opt_state"][0])
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
        assert_bit_exact(np.asarray(a), np.asarray(b))
    assert back["params"]["w"].sharding.mesh.shape == m2.shape


SPECS = [P(), P("a"), P(None, "b"), P("a", "b"), P("b", "a"), P(("a", "b")), P(None, ("b", "a"))]
MESHES = [
    ((8,), ("a",)),
    ((2, 4), ("a", "b")),
    ((4, 2), ("a", "b")),
    ((1, 8), ("a", "b")),
    ((2, 2), ("a", "b")),
    ((1,), ("a",)),
]


def _fit(spec, mesh_):
    return all(
        all(n in mesh_.shape for n in (e if isinstance(e, tuple) else (e,)))
        for e in spec
        if e is not None
    )


@given(
    dtype=st.sampled_from([np.float32, ml_dtypes.bfloat16, np.int8, np.bool_, np.float16]),
    rows=st.integers(1, 3),
    cols=st.integers(1, 3),
    save_mesh=st.sampled_from(MESHES),
    load_mesh=st.sampled_from(MESHES),
    save_spec=st.sampled_from(SPECS),
    load_spec=st.sampled_from(SPECS),
    seed=st.integers(0, 2**16),
)
def test_property_save_on_one_mesh_restore_on_another(
    tmp_path_factory, dtype, rows, cols, save_mesh, load_mesh, save_spec, load_spec, seed
):
    ms, ml = mesh(*save_mesh), mesh(*load_mesh)
    if not _fit(save_spec, ms):
        save_spec = P()
    if not _fit(load_spec, ml):
        load_spec = P()
    shape = (rows * 8, cols * 8)  # divisible by every axis size used
    host = _random_bits(shape, dtype, seed)
    x = jax.device_put(host, NamedSharding(ms, save_spec))
    d = tmp_path_factory.mktemp("prop") / "c"
    jax_ucp.save(d, {"x": x})
    y = jax_ucp.restore(d, shardings={"x": NamedSharding(ml, load_spec)})["x"]
    assert y.sharding == NamedSharding(ml, load_spec)
    assert_bit_exact(np.asarray(y), host)
    for shard in y.addressable_shards:
        assert_bit_exact(np.asarray(shard.data), host[shard.index])


def test_dtype_conversion_on_request(tmp_path):
    host = np.linspace(-3, 3, 24, dtype=np.float32).reshape(4, 6)
    jax_ucp.save(tmp_path / "c", {"x": host.astype(ml_dtypes.bfloat16)})
    m = mesh((2,), ("d",))
    t = {"x": jax.ShapeDtypeStruct((4, 6), jnp.float32, sharding=NamedSharding(m, P("d")))}
    y = jax_ucp.restore(tmp_path / "c", target=t)["x"]
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y), host.astype(ml_dtypes.bfloat16).astype(np.float32))
    z = jax_ucp.restore(tmp_path / "c", dtype=np.float32)["x"]
    assert z.dtype == np.float32


def test_mesh_only_reuses_saved_spec_where_it_fits(tmp_path):
    m = mesh((2, 4), ("data", "model"))
    x = jax.device_put(jnp.zeros((8, 12)), NamedSharding(m, P("data", "model")))
    y = jax.device_put(jnp.zeros((6, 8)), NamedSharding(m, P(None, "model")))
    jax_ucp.save(tmp_path / "c", {"x": x, "y": y})
    # model=8 does not divide 12 → that dimension is replicated; data=1 divides 8.
    m2 = mesh((1, 8), ("data", "model"))
    back = jax_ucp.restore(tmp_path / "c", mesh=m2)
    assert back["x"].sharding.spec == P("data", None)
    assert back["y"].sharding.spec == P(None, "model")
    # Axis names the new mesh lacks → replicated, when strict=False allows it (and said).
    with pytest.warns(
        jax_ucp.ReplicationWarning,
        match=r"2 tensor\(s\) saved sharded .* \(576 B per device\): .x., .y.",
    ):
        back = jax_ucp.restore(tmp_path / "c", mesh=mesh((4,), ("fsdp",)), strict=False)
    assert back["x"].sharding.spec == P(None, None)


def test_logical_axis_rules(tmp_path):
    m = mesh((2, 4), ("data", "model"))
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(m, P("data", "model")))
    jax_ucp.save(
        tmp_path / "c",
        {"params": {"kernel": x}},
        logical_axes={"params": {"kernel": ("embed", "mlp")}},
    )
    e = jax_ucp.inspect(tmp_path / "c").tensors[0]
    assert e.logical_axes == ("embed", "mlp")
    m2 = mesh((4, 2), ("fsdp", "tp"))
    back = jax_ucp.restore(tmp_path / "c", mesh=m2, rules=[("embed", "fsdp"), ("mlp", "tp")])
    assert back["params"]["kernel"].sharding.spec == P("fsdp", "tp")
    assert_bit_exact(np.asarray(back["params"]["kernel"]), np.asarray(x))


def test_flax_partitioned_boxes_record_logical_axes(tmp_path):
    import flax.linen as nn

    boxed = {"params": {"k": nn.LogicallyPartitioned(jnp.ones((4, 2)), names=("embed", "heads"))}}
    jax_ucp.save(tmp_path / "c", boxed)
    assert jax_ucp.inspect(tmp_path / "c").tensors[0].logical_axes == ("embed", "heads")


def test_indivisible_target_is_a_clear_error(tmp_path):
    jax_ucp.save(tmp_path / "c", {"params": {"w": np.zeros((6, 5), np.float32)}})
    m = mesh((4,), ("model",))
    with pytest.raises(
        jax_ucp.RequestError, match=r"params/w.*dimension 1 \(size 5\).*'model' \(size 4\)"
    ):
        jax_ucp.restore(
            tmp_path / "c", shardings={"params": {"w": NamedSharding(m, P(None, "model"))}}
        )


def test_sub_mesh_and_single_device(tmp_path):
    m = mesh((2, 4), ("data", "model"))
    host = np.arange(96, dtype=np.float32).reshape(8, 12)
    jax_ucp.save(tmp_path / "c", {"x": jax.device_put(host, NamedSharding(m, P("data", "model")))})
    sub = mesh((2,), ("model",), devices=jax.devices()[5:7])
    y = jax_ucp.restore(tmp_path / "c", shardings={"x": NamedSharding(sub, P(None, "model"))})["x"]
    assert {d.id for d in y.devices()} == {5, 6}
    assert_bit_exact(np.asarray(y), host)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[3])
    z = jax_ucp.restore(tmp_path / "c", shardings={"x": one})["x"]
    assert_bit_exact(np.asarray(z), host)


@pytest.mark.timeout(120)
def test_compression_is_an_option_of_save_and_ucpsave(tmp_path):
    """zstd through save() and through UCPSave in a CheckpointManager: restored bit for bit,
    the level recorded in zarr.json, zero moments (a fresh optimizer state) nearly free."""
    import json

    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    w = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32)
    w = jax.device_put(w, NamedSharding(mesh, P("data", "model")))
    state = {"params": {"w": w}, "opt_state": {"mu": {"w": np.zeros((64, 128), np.float32)}}}

    def disk(path, name):
        d = path / "arrays" / name
        return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())

    jax_ucp.save(tmp_path / "plain", state)
    jax_ucp.save(tmp_path / "zstd", state, compression="zstd")
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        args = jax_ucp.UCPSave(state, compression="zstd", compression_level=7)
        mngr.save(1, args=ocp.args.Composite(state=args))
        mngr.wait_until_finished()
    zarr = json.loads(
        (tmp_path / "run" / "1" / "state" / "arrays" / "params.w" / "zarr.json").read_text()
    )
    codecs = zarr["codecs"][0]["configuration"]["codecs"]
    assert {"name": "zstd", "configuration": {"level": 7, "checksum": False}} in codecs
    assert disk(tmp_path / "zstd", "opt_state.mu.w") * 50 < disk(
        tmp_path / "plain", "opt_state.mu.w"
    )
    new = Mesh(np.array(jax.devices()[:2]), ("data",))
    for path in (tmp_path / "zstd", tmp_path / "run" / "1"):
        got = jax_ucp.restore(path, mesh=new, strict=False)
        assert np.asarray(got["params"]["w"]).tobytes() == np.asarray(w).tobytes()
        assert not np.asarray(got["opt_state"]["mu"]["w"]).any()


def _nested(levels: int) -> dict:
    tree: dict = {"x": np.arange(3, dtype=np.float32)}
    for _ in range(levels - 1):
        tree = {"a": tree}
    return tree


@pytest.mark.parametrize("levels", [300, 700])
def test_a_tree_too_deep_to_read_back_is_refused_at_save(tmp_path, levels):
    """What save writes, restore reads: one depth limit, checked at save with a clear error
    (not a checkpoint restore then refuses, nor a RecursionError), nothing written."""
    with pytest.raises(jax_ucp.UCPError, match=r"nests containers deeper than 170 levels"):
        jax_ucp.save(tmp_path / "c", _nested(levels))
    assert not (tmp_path / "c").exists()


def test_a_tree_at_the_depth_limit_round_trips(tmp_path):
    from jax_ucp._src.format import MAX_TREE_DEPTH

    jax_ucp.save(tmp_path / "c", _nested(MAX_TREE_DEPTH))
    back = jax_ucp.restore(tmp_path / "c")
    for _ in range(MAX_TREE_DEPTH - 1):
        back = back["a"]
    np.testing.assert_array_equal(back["x"], np.arange(3, dtype=np.float32))


def test_an_unreadable_shard_is_called_permission_denied_not_corruption(tmp_path):
    """A shard file this user may not read (chmod 000): verify names the permission, it does not
    guess at corruption. As root the read is made as a user without CAP_DAC_OVERRIDE."""
    import glob
    import shutil
    import subprocess
    import sys

    from tests.ucp_testing import REPO

    ckpt = tmp_path / "c"
    jax_ucp.save(ckpt, {"w": np.arange(64, dtype=np.float32).reshape(8, 8)})
    for f in glob.glob(str(ckpt / "arrays" / "w" / "c" / "**"), recursive=True):
        if os.path.isfile(f):
            os.chmod(f, 0)
    code = "import sys, jax_ucp; print(jax_ucp.verify(sys.argv[1]))"
    cmd = [sys.executable, "-c", code, str(ckpt)]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv: cannot read as a user the file mode stops")
        drop = "-dac_override,-dac_read_search"
        cmd = ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}", *cmd]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO)
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "permission denied" in done.stdout and "corrupt" not in done.stdout, done.stdout
