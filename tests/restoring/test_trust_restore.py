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
    (4 TiB) in one shard of 4 MiB inner chunks; no chunk exists."""
    path = tmp_path / "c"
    jax_ucp.save(path, {"w": np.zeros((4, 4), np.float32), "b": np.ones(3)}, checksum=None)
    n = 2**20
    manifest = json.loads((path / "ucp.json").read_text())
    for entry in manifest["entries"]:
        if entry["key"] == ["w"]:
            entry.update(shape=[n, n], chunk_shape=[n, n], inner_chunk_shape=[1, n])
    (path / "ucp.json").write_text(json.dumps(manifest))
    zarr_json = path / "arrays" / "w" / "zarr.json"
    z = json.loads(zarr_json.read_text())
    z["shape"] = z["chunk_grid"]["configuration"]["chunk_shape"] = [n, n]
    z["codecs"][0]["configuration"]["chunk_shape"] = [1, n]  # 4 MiB inner chunks
    zarr_json.write_text(json.dumps(z))
    return path


@pytest.mark.timeout(60)
def test_a_tensor_larger_than_the_host_is_refused_before_allocating(tmp_path):
    from tests.ucp_testing import mesh

    path = _huge(tmp_path)
    match = (
        rf"Tensor 'w' \({re.escape(str(path / 'arrays' / 'w'))}\): restoring it needs 4.0 TiB "
        r"of host memory \(shape \(1048576, 1048576\), float32, the slices this process "
        r"reads\), which exceeds (physical memory|the RLIMIT_\w+ limit) \("
    )
    with pytest.raises(jax_ucp.CheckpointError, match=match):
        jax_ucp.restore(path)
    with pytest.raises(jax_ucp.CheckpointError, match=match):
        jax_ucp.restore(path, mesh=mesh((8,), ("x",)), strict=False)
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

    from tests.ucp_testing import assert_bit_exact, mesh

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


# --- 4. plan: memory follows the checkpoint, not the mesh -------------------------------------


def _planned_checkpoint(tmp_path):
    """A manifest (no arrays: plan reads none) with w of shape (8 * 10**8, 4) float32 whose
    first dimension is the logical axis "embed", and a small b."""
    path = tmp_path / "c"
    jax_ucp.save(
        path,
        {"w": np.zeros((8, 4), np.float32), "b": np.ones(16, np.float32)},
        logical_axes={"w": ("embed", None), "b": None},
        checksum=None,
    )
    manifest = json.loads((path / "ucp.json").read_text())
    for entry in manifest["entries"]:
        if entry["key"] == ["w"]:
            entry.update(shape=[8 * 10**8, 4], chunk_shape=[8 * 10**8, 4])
            entry.update(inner_chunk_shape=[8 * 10**8, 4])
    (path / "ucp.json").write_text(json.dumps(manifest))
    return path


@pytest.mark.timeout(120)
def test_a_plan_on_a_mesh_of_10_8_devices_takes_small_memory(tmp_path):
    import tracemalloc

    from jax.sharding import PartitionSpec as P

    from jax_ucp.restoring.plan import abstract_mesh

    path = _planned_checkpoint(tmp_path)
    huge = abstract_mesh([("data", 10**8)])
    rules = [("embed", "data")]
    tracemalloc.start()
    try:
        one = jax_ucp.plan(path, mesh=huge, rules=rules)
        every = jax_ucp.plan(path, mesh=huge, rules=rules, processes=10**8)
        uneven = jax_ucp.plan(  # 1.25 mesh rows per process: counted, not enumerated
            path,
            mesh=abstract_mesh([("a", 5), ("b", 2 * 10**7)]),
            rules=[("embed", ("a", "b"))],
            processes=4,
        )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 << 20  # a per-device list of 10**8 ints alone is > 800 MiB
    b, w = one.tensors  # manifest order
    assert w.partition_spec == P("data", None) and w.bytes_per_device == 8 * 4 * 4
    assert b.replicated and b.bytes_per_device == 16 * 4
    assert len(one.device_bytes) == 10**8 and 10**8 - 1 in one.device_bytes
    assert one.device_bytes[12345] == 128 + 64 and 10**8 not in one.device_bytes
    assert one.max_device_bytes == one.min_device_bytes == 128 + 64
    assert dict(one.process_read_bytes) == {0: 8 * 10**8 * 16 + 64}
    assert len(every.process_read_bytes) == 10**8 and every.process_read_bytes[99] == 128 + 64
    assert every.process_read_bytes.highest() == every.process_read_bytes.lowest() == 128 + 64
    assert every.tensors[1].read_bytes.highest() == 128
    assert uneven.tensors[1].partition_spec == P(("a", "b"), None)
    assert dict(uneven.process_read_bytes) == dict.fromkeys(range(4), 2 * 10**8 * 16 + 64)
    r = runner.invoke(
        app,
        ["plan", str(path), "--mesh", "data=100000000", "--rules", "embed=data"],
        env={"COLUMNS": "200"},
    )
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "(100000000 devices, 1 process)" in text and "per device: 192 B each" in text


@pytest.mark.timeout(60)
def test_plan_reads_per_process_match_every_device_enumerated():
    """The arithmetic per-process reads equal those of enumerating every device's slice, for
    every small mesh, spec and process split (even and uneven)."""
    import itertools

    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_ucp.restoring.plan import IndexedBytes, _Layouts, abstract_mesh

    shape = (12, 12, 12)
    uneven = 0
    for sizes in [(2, 3), (3, 4), (2, 2, 3), (4, 3), (6,), (2, 3, 2)]:
        names = tuple("xyz"[: len(sizes)])
        m = abstract_mesh(list(zip(names, sizes)))
        n = int(np.prod(sizes))
        specs = [P()]
        for k in range(1, len(names) + 1):
            for axes in itertools.permutations(names, k):
                specs.append(P(*axes))  # one axis per dimension
                specs.append(P(axes))  # all on dimension 0
        for p in [d for d in range(1, n + 1) if n % d == 0]:
            layouts = _Layouts(m, p)
            for spec in specs:
                devices = IndexedBytes()
                per_device, reads = layouts.place(shape, NamedSharding(m, spec), 2, devices)
                seen: dict[int, set] = {}
                for _, process, box in layouts._named(shape, spec, m):
                    seen.setdefault(process, set()).add(box)
                size = {
                    box: 2 * int(np.prod([b - a for a, b in box]))
                    for s in seen.values()
                    for box in s
                }
                want = {q: sum(size[box] for box in boxes) for q, boxes in seen.items()}
                assert dict(reads) == want, (sizes, p, spec)
                assert reads.highest() == max(want.values()), (sizes, p, spec)
                assert reads.lowest() == min(want.values()), (sizes, p, spec)
                assert dict(devices) == dict.fromkeys(range(n), per_device), (sizes, spec)
                assert set(size.values()) == {per_device}, (sizes, spec)
                uneven += len(set(want.values())) > 1
    assert uneven > 10  # the uneven splits were exercised, not only the even ones


@pytest.mark.timeout(60)
def test_chunks_larger_than_the_array_are_refused_before_any_read(tmp_path):
    """A 4x4 tensor whose zarr.json declares 2**20 x 2**20 chunks made TensorStore abort the
    process (std::bad_alloc); with the manifest saying the same, the manifest is refused."""
    path = tmp_path / "c"
    jax_ucp.save(path, {"w": np.zeros((4, 4), np.float32)}, checksum=None)
    zarr_json = path / "arrays" / "w" / "zarr.json"
    z = json.loads(zarr_json.read_text())
    z["chunk_grid"]["configuration"]["chunk_shape"] = [2**20, 2**20]
    z["codecs"][0]["configuration"]["chunk_shape"] = [2**20, 2**20]
    zarr_json.write_text(json.dumps(z))
    match = (
        rf"Tensor 'w': {re.escape(str(path / 'arrays' / 'w'))}/zarr.json has chunk shape "
        r"\(1048576, 1048576\) and inner chunk shape \(1048576, 1048576\), but ucp.json says "
        r"\(4, 4\) and \(4, 4\)\."
    )
    with pytest.raises(jax_ucp.CheckpointError, match=match):
        jax_ucp.restore(path)
    assert re.match(match, jax_ucp.verify(path)[0][1])
    manifest = json.loads((path / "ucp.json").read_text())
    manifest["entries"][0].update(chunk_shape=[2**20, 2**20], inner_chunk_shape=[2**20, 2**20])
    (path / "ucp.json").write_text(json.dumps(manifest))
    with pytest.raises(
        jax_ucp.ManifestError,
        match=r"ucp.json: entries\[0\] \('w'\)\.chunk_shape: expected extents at most shape "
        r"\[4, 4\] \(1 for a zero-size dimension\), found a JSON array of 2 items\.",
    ):
        jax_ucp.restore(path)
