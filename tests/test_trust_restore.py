"""Trust holes on restore and save: no code from a manifest, clear errors instead of raw ones,
no silent overflow in narrowing casts, and plans whose cost follows the checkpoint.

Every hostile input is built here, in tmp_path."""

from __future__ import annotations

import json
import re

import numpy as np
import optax
import pytest
from typer.testing import CliRunner

import jax_ucp
from jax_ucp.cli import app

runner = CliRunner()


# --- 1. container classes named by ucp.json --------------------------------------------------


def _with_class(tmp_path, kind: str, cls: str):
    """A checkpoint whose dict node "cmd" claims to be ``cls``: its children's names would be
    the command line ["/bin/touch", "<tmp>/pwned"] if the class were called with them."""
    marker = tmp_path / "pwned"
    path = tmp_path / "c"
    jax_ucp.save(path, {"cmd": {"/bin/touch": 0, str(marker): 1}, "w": np.arange(3.0)})
    manifest = path / "ucp.json"
    d = json.loads(manifest.read_text())
    node = next(child for name, _, child in d["tree"]["children"] if name == "cmd")
    node.update(type=kind, **{"class": cls})
    manifest.write_text(json.dumps(d))
    return path, marker


HOSTILE_CLASSES = [
    ("object", "jax.version:subprocess.Popen"),
    ("namedtuple", "jax.version:subprocess.Popen"),
    ("object", "builtins:str"),
    ("object", "builtins:frozenset"),
    ("object", "builtins:SystemExit"),
    ("object", "collections:Counter"),
    ("namedtuple", "optax:tree_utils.__builtins__"),
    ("object", "optax._src.base:GradientTransformation"),  # allow-listed, but a NamedTuple
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind,cls", HOSTILE_CLASSES)
def test_a_manifest_class_outside_the_allow_list_is_never_instantiated(tmp_path, kind, cls):
    path, marker = _with_class(tmp_path, kind, cls)
    out = jax_ucp.restore(path)
    assert type(out["cmd"]) is dict and list(out["cmd"]) == ["/bin/touch", str(marker)]
    assert [int(v) for v in out["cmd"].values()] == [0, 1]
    part = jax_ucp.restore(path, select=r"cmd/.*")
    assert type(part["cmd"]) is dict and not marker.exists()
    notice = f"Tree node 'cmd': class {cls!r} is not in the allow-list of container classes"
    if cls.startswith("optax._src.base"):
        notice = f"Tree node 'cmd': class {cls!r} is allow-listed but its fields are not"
    assert jax_ucp.verify(path) == [] and len(jax_ucp.verify(path).notices) == 1
    assert jax_ucp.verify(path).notices[0][0] == "cmd"
    assert jax_ucp.verify(path).notices[0][1].startswith(notice)
    assert jax_ucp.inspect(path).notices == [jax_ucp.verify(path).notices[0][1]]
    for command in ("verify", "inspect"):
        r = runner.invoke(app, [command, str(path)], env={"COLUMNS": "300"})
        assert r.exit_code == 0, r.output
        assert "gives it back as a dict of its fields" in " ".join(r.output.split())
    assert not marker.exists()


@pytest.mark.timeout(60)
def test_allow_listed_optax_states_are_rebuilt_even_from_a_moved_module(tmp_path):
    params = {"w": np.ones(3, np.float32)}
    state = {"opt": optax.chain(optax.add_decayed_weights(1e-2), optax.adam(1e-3)).init(params)}
    jax_ucp.save(tmp_path / "c", state)
    manifest = tmp_path / "c" / "ucp.json"
    d = json.loads(manifest.read_text())
    adam = d["tree"]["children"][0][2]["children"][1][2]["children"][0][2]
    assert adam["class"] == "optax._src.transform:ScaleByAdamState"
    adam["class"] = "optax._src.old_place:ScaleByAdamState"  # as an older optax recorded it
    manifest.write_text(json.dumps(d))
    out = jax_ucp.restore(tmp_path / "c")
    assert type(out["opt"][1][0]) is optax.ScaleByAdamState
    assert type(out["opt"][0]) is optax.EmptyState and type(out["opt"][1][1]) is optax.EmptyState
    assert jax_ucp.inspect(tmp_path / "c").notices == []


# --- 2. raw errors that named neither file nor tensor ----------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "tree,match",
    [
        ({"a": {"\ud800": np.ones(2)}}, r"Key path 'a/\\ud800': component '\\ud800' is not valid"),
        ({"p": {1: np.ones(2), "1": np.ones(2)}}, r"Dict at key path 'p' mixes key types"),
        ({1: np.ones(2), "b": np.ones(2)}, r"Dict at key path '\(the root\)' mixes key types"),
    ],
    ids=["lone-surrogate", "int-and-str-1", "int-and-str-b"],
)
def test_save_names_a_key_path_it_cannot_write(tmp_path, tree, match):
    jax_ucp.save(tmp_path / "c", {"old": np.arange(3)})
    with pytest.raises(jax_ucp.UCPError, match=match):
        jax_ucp.save(tmp_path / "c", tree, force=True)
    with pytest.raises(ValueError, match=match):  # TreeError is a ValueError too
        jax_ucp.save(tmp_path / "new", tree)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # nothing written or left
    assert list(jax_ucp.restore(tmp_path / "c")) == ["old"]


@pytest.mark.timeout(60)
def test_save_of_a_deleted_or_donated_array_names_it_before_writing(tmp_path):
    import jax
    import jax.numpy as jnp

    deleted = jnp.ones(4)
    deleted.delete()
    donated = jnp.ones((2, 3))
    jax.jit(lambda a: a + 1, donate_argnums=0)(donated)
    for key, leaf in (("x", deleted), ("y", donated)):
        if not leaf.is_deleted():  # pragma: no cover - a backend without donation
            continue
        shape = tuple(leaf.shape)
        with pytest.raises(
            jax_ucp.UCPError,
            match=rf"Leaf 'state/{key}': the jax.Array \(shape {re.escape(str(shape))}, float32\) "
            r"has been deleted or donated",
        ):
            jax_ucp.save(tmp_path / "c", {"state": {"w": np.ones(2), key: leaf}})
        assert not (tmp_path / "c").exists() and list(tmp_path.iterdir()) == []
    assert donated.is_deleted() and deleted.is_deleted()


def _huge(tmp_path):
    """A checkpoint whose ucp.json and zarr.json both declare w as 2**20 x 2**20 float32
    (4 TiB); no chunk exists."""
    path = tmp_path / "c"
    jax_ucp.save(path, {"w": np.zeros((4, 4), np.float32), "b": np.ones(3)}, checksum=None)
    n = 2**20
    manifest = json.loads((path / "ucp.json").read_text())
    for entry in manifest["entries"]:
        if entry["key"] == ["w"]:
            entry.update(shape=[n, n], chunk_shape=[n, n], inner_chunk_shape=[n, n])
    (path / "ucp.json").write_text(json.dumps(manifest))
    zarr_json = path / "arrays" / "w" / "zarr.json"
    z = json.loads(zarr_json.read_text())
    z["shape"] = z["chunk_grid"]["configuration"]["chunk_shape"] = [n, n]
    z["codecs"][0]["configuration"]["chunk_shape"] = [n, n]
    zarr_json.write_text(json.dumps(z))
    return path


@pytest.mark.timeout(60)
def test_a_tensor_larger_than_the_host_is_refused_before_allocating(tmp_path):
    from ucp_testing import mesh

    path = _huge(tmp_path)
    match = (
        rf"Tensor 'w' \({re.escape(str(path / 'arrays' / 'w'))}\): restoring it needs 4.0 TiB "
        r"of host memory \(shape \(1048576, 1048576\), float32, the slices this process "
        r"reads\), which exceeds (physical memory|the RLIMIT_\w+ limit) \("
    )
    with pytest.raises(jax_ucp.CheckpointError, match=match):
        jax_ucp.restore(path)
    with pytest.raises(jax_ucp.CheckpointError, match=match):
        jax_ucp.restore(path, mesh=mesh((8,), ("x",)))
    problems = jax_ucp.verify(path)
    assert [name for name, _ in problems] == ["w"] and re.match(match, problems[0][1])
    assert list(jax_ucp.restore(path, select="b")) == ["b"]  # the rest stays readable


# --- 3. narrowing float casts -----------------------------------------------------------------

VALUES = np.array([1.0, 1e10, np.inf, -np.inf, np.nan, 500.0, -2.5, 448.0], np.float32)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "dtype,count,largest",
    [("float8_e4m3fn", 4, "448.0"), ("float16", 1, "65504.0"), ("bfloat16", 0, None)],
)
def test_a_narrowing_cast_that_overflows_is_an_error_unless_unsafe(tmp_path, dtype, count, largest):
    import warnings

    import jax
    import ml_dtypes
    from jax.sharding import NamedSharding, PartitionSpec
    from ucp_testing import assert_bit_exact, mesh

    target_dtype = np.dtype(getattr(ml_dtypes, dtype, None) or dtype)
    jax_ucp.save(tmp_path / "c", {"x": VALUES})
    with np.errstate(over="ignore", invalid="ignore"):
        want = VALUES.astype(target_dtype)
    sharded = NamedSharding(mesh((4,), ("d",)), PartitionSpec("d"))
    asks = [
        {"dtype": target_dtype},
        {"target": {"x": np.zeros(8, target_dtype)}},
        {"target": {"x": jax.ShapeDtypeStruct((8,), target_dtype, sharding=sharded)}},
    ]
    for ask in asks:
        if count == 0:  # bfloat16 keeps float32's range: nothing overflows, no warning
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert_bit_exact(jax_ucp.restore(tmp_path / "c", **ask)["x"], want)
            continue
        message = (
            rf"Tensor 'x' \({re.escape(str(tmp_path / 'c' / 'arrays' / 'x'))}\): {count} of "
            rf"its values \(of 8\) overflow {dtype} \(largest finite {largest}\) converting from "
            r"float32: they became inf or NaN\."
        )
        with pytest.raises(jax_ucp.CheckpointError, match=message + " A 'same_kind' cast"):
            jax_ucp.restore(tmp_path / "c", **ask)
        with pytest.warns(RuntimeWarning, match=message + "$"):
            got = jax_ucp.restore(tmp_path / "c", casting="unsafe", **ask)
        assert_bit_exact(got["x"], want)


@pytest.mark.timeout(60)
def test_overflow_is_counted_exactly_across_conversion_blocks(tmp_path):
    x = np.linspace(-60000.0, 60000.0, 300_001, dtype=np.float32)  # several 65536-value blocks
    hits = [0, 70_000, 131_072, 300_000]
    x[hits] = [1e6, -1e30, np.inf, 7e4]  # the inf stays inf in float16: not an overflow
    jax_ucp.save(tmp_path / "c", {"x": x, "i": np.array([70000, 1, -65520], np.int32)})
    with pytest.raises(jax_ucp.CheckpointError, match=r"'x' .*: 3 of its values \(of 300001\)"):
        jax_ucp.restore(tmp_path / "c", select="x", dtype=np.float16)
    with pytest.raises(jax_ucp.CheckpointError, match=r"'i' .*: 2 of its values \(of 3\) "):
        jax_ucp.restore(tmp_path / "c", target={"i": np.zeros(3, np.float16)})
    out = jax_ucp.restore(tmp_path / "c", select="x", dtype=np.float32)  # no cast, no check
    assert np.array_equal(out["x"], x)
