"""jax_ucp.plan / jax-ucp plan: a restore planned from the manifest alone (no tensor data read,
no devices needed), with the same PartitionSpecs restore gives."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from typer.testing import CliRunner

import jax_ucp
from jax_ucp._src.restoring import pictures
from jax_ucp._src.restoring.plan import Layouts, TensorPlan, abstract_mesh
from jax_ucp.cli import app
from tests.ucp_testing import assert_bit_exact, mesh
from tests.ucp_testing import save_small_tree as _save
from tests.ucp_testing import tree_digest as _digest

runner = CliRunner()
RULES = [("embed", "fsdp"), ("mlp", "tp"), ("odd", "fsdp")]


def _saved(tmp_path):
    """w 8x16 f32 saved P(data, model); v 6x4 f32 saved P(data); b 16 f32; i 5 int64; a value."""
    m = mesh((2, 4), ("data", "model"))
    w = jax.device_put(np.ones((8, 16), np.float32), NamedSharding(m, P("data", "model")))
    v = jax.device_put(np.ones((6, 4), np.float32), NamedSharding(m, P("data")))
    jax_ucp.save(
        tmp_path / "c",
        {
            "w": w,
            "v": v,
            "b": np.zeros(16, np.float32),
            "i": np.arange(5, dtype=np.int64),
            "step": 3,
        },
        logical_axes={
            "w": ("embed", "mlp"),
            "v": ("odd", None),
            "b": ("mlp",),
            "i": None,
            "step": None,
        },
    )
    return tmp_path / "c"


def test_rules_on_a_concrete_mesh_match_restore_byte_for_byte(tmp_path):
    path = _saved(tmp_path)
    target = mesh((4, 2), ("fsdp", "tp"))
    result = jax_ucp.plan(path, mesh=target, rules=RULES)
    by = {t.name: t for t in result.tensors}
    assert by["w"].partition_spec == P("fsdp", "tp") and by["w"].bytes_per_device == 2 * 8 * 4
    assert by["b"].partition_spec == P("tp") and by["b"].bytes_per_device == 8 * 4
    assert by["v"].partition_spec == P(None, None) and by["v"].bytes_per_device == 6 * 4 * 4
    assert by["v"].not_divisible == (
        "dimension 0 (size 6) is not divisible by mesh axis 'fsdp' (size 4): replicated",
    )
    assert by["i"].on_host and by["i"].partition_spec is None  # int64 without jax_enable_x64
    assert result.not_divisible == ["v"] and result.replicated == ["v"] and result.on_host == ["i"]
    assert result.values == 1 and result.errors == {}
    assert result.device_bytes == {d.id: 64 + 32 + 96 for d in target.devices.flat}
    # one process: it reads each distinct slice once (w, b, v whole) plus i (host) whole
    assert result.process_read_bytes == {0: 8 * 16 * 4 + 16 * 4 + 6 * 4 * 4 + 5 * 8}
    assert by["w"].read_bytes == {0: 8 * 16 * 4}
    restored = jax_ucp.restore(path, mesh=target, rules=RULES)
    for t in result.tensors:  # the plan is what restore does
        x = restored[t.name]
        if t.on_host:
            assert isinstance(x, np.ndarray)
            continue
        assert x.sharding.spec == t.partition_spec, t.name
        for shard in x.addressable_shards:
            assert shard.data.nbytes == t.bytes_per_device, t.name


def test_mesh_alone_on_an_abstract_mesh_with_processes(tmp_path):
    path = _saved(tmp_path)
    # data=4 (new size), model=2: w keeps (data, model); v's saved P(data) does not divide 6
    result = jax_ucp.plan(path, mesh=abstract_mesh([("data", 4), ("model", 2)]), processes=2)
    by = {t.name: t for t in result.tensors}
    assert by["w"].partition_spec == P("data", "model") and by["w"].bytes_per_device == 2 * 8 * 4
    assert by["v"].partition_spec == P(None, None)
    assert by["v"].not_divisible == (
        "dimension 0 (size 6) is not divisible by mesh axis 'data' (size 4): replicated",
    )
    assert by["b"].partition_spec == P() and by["b"].replicated  # saved without a spec
    assert sorted(result.device_bytes) == list(range(8))
    assert set(result.device_bytes.values()) == {64 + 96 + 64}
    # process 0 holds mesh rows data=0,1 (devices 0..3): half of w's rows; v, b, i whole
    assert by["w"].read_bytes == {0: 4 * 16 * 4, 1: 4 * 16 * 4}
    assert result.process_read_bytes == {p: 256 + 96 + 64 + 40 for p in (0, 1)}
    assert result.max_device_bytes == 224


def test_slices_match_jax_for_every_kind_of_spec():
    m = mesh((2, 2, 2), ("a", "b", "c"))
    for spec in [P(), P("a"), P(None, "b"), P(("a", "b"), "c"), P(("c", "a")), P("c", ("b", "a"))]:
        sharding = NamedSharding(m, spec)
        shape = (8, 8)
        want = {
            d.id: tuple(s.indices(n)[:2] for s, n in zip(index, shape))
            for d, index in sharding.devices_indices_map(shape).items()
        }
        boxes = pictures.device_slices(shape, tuple(spec), list(m.shape.items()))
        got = {d.id: boxes[position] for position, d in enumerate(m.devices.flat)}
        assert got == want, spec


def test_explicit_shardings_list_what_restore_would_refuse(tmp_path):
    path = _saved(tmp_path)
    m = mesh((4, 2), ("fsdp", "tp"))
    shardings = {
        "w": NamedSharding(m, P("tp", "fsdp")),
        "v": NamedSharding(m, P("fsdp")),  # 6 % 4: restore raises, the plan lists it
        "b": None,  # host numpy
        "i": SingleDeviceSharding(jax.devices()[3]),  # 64-bit on a device: refused
    }
    result = jax_ucp.plan(path, shardings=shardings)
    by = {t.name: t for t in result.tensors}
    assert by["w"].partition_spec == P("tp", "fsdp") and by["w"].bytes_per_device == 4 * 4 * 4
    assert set(result.errors) == {"v", "i"}
    assert "dimension 0 (size 6) is not divisible by mesh axis 'fsdp'" in result.errors["v"]
    assert "silently narrow" in result.errors["i"]
    assert by["v"].bytes_per_device is None and by["b"].on_host
    assert result.device_bytes == {d.id: 64 for d in m.devices.flat}
    assert result.process_read_bytes == {0: 8 * 16 * 4 + 16 * 4}
    with pytest.raises(ValueError, match="dimension 0 \\(size 6\\) is not divisible"):
        jax_ucp.restore(path, shardings={"v": shardings["v"]})
    single = jax_ucp.plan(path, shardings={"w": SingleDeviceSharding(jax.devices()[5])})
    assert single.device_bytes == {5: 8 * 16 * 4} and single.tensors[0].partition_spec is None


def test_target_shapes_and_dtypes(tmp_path):
    path = _saved(tmp_path)
    m = mesh((2,), ("x",))
    target = {
        "w": jax.ShapeDtypeStruct((8, 16), jax.numpy.bfloat16, sharding=NamedSharding(m, P("x"))),
        "v": jax.ShapeDtypeStruct((6, 5), np.float32, sharding=NamedSharding(m, P())),
        "step": 0,
    }
    result = jax_ucp.plan(path, target=target)
    by = {t.name: t for t in result.tensors}
    assert by["w"].dtype == "bfloat16" and by["w"].bytes_per_device == 4 * 16 * 2
    assert "the target asks for shape (6, 5), the checkpoint holds shape (6, 4)" in by["v"].error
    assert result.values == 1
    with pytest.raises(jax_ucp.CheckpointError, match=r"'nope'.*not in"):
        jax_ucp.plan(path, target={"nope": np.zeros(2)})


def test_reads_no_tensor_data(tmp_path):
    path = _saved(tmp_path)
    shutil.rmtree(path / "arrays")  # only ucp.json is left
    result = jax_ucp.plan(
        path, mesh=abstract_mesh([("x", 1024)]), strict=False
    )  # no such devices either
    assert len(result.device_bytes) == 1024 and len(result.tensors) == 4


def test_usage_errors(tmp_path):
    path = _saved(tmp_path)
    with pytest.raises(ValueError, match="needs a mesh"):
        jax_ucp.plan(path)
    with pytest.raises(ValueError, match="does not have"):
        jax_ucp.plan(path, mesh=abstract_mesh([("x", 2)]), rules=[("embed", "nope")])
    with pytest.raises(ValueError, match="processes=3"):
        jax_ucp.plan(path, mesh=abstract_mesh([("x", 4)]), processes=3)


def test_cli_at_80_columns(tmp_path):
    path = _saved(tmp_path)
    r = runner.invoke(
        app,
        [
            "plan",
            str(path),
            "--mesh",
            "fsdp=4,tp=2",
            "--rules",
            "embed=fsdp,mlp=tp",
            "--rules",
            "odd=fsdp",
        ],
        env={"COLUMNS": "80"},
    )
    assert r.exit_code == 0, r.output
    assert all(len(line) <= 80 for line in r.output.splitlines()), r.output
    text = " ".join(r.output.split())
    assert "on mesh fsdp=4 × tp=2 (8 devices, 1 process): 4 tensors, 1 value" in text
    assert "(fsdp, tp)" in text and "per device: 192 B each" in text
    assert "per process read: 712 B" in text
    assert "replicated on every device (1): v" in text
    assert "kept on host (64-bit; jax_enable_x64 is off) (1): i" in text
    assert "not divisible (1): v: dimension 0" in text
    assert "v: dimension 0 (size 6) is not divisible by mesh axis 'fsdp' (size 4)" in text
    r = runner.invoke(
        app,
        ["plan", str(path), "--mesh", "data=16,model=64", "--processes", "4"],
        env={"COLUMNS": "120"},
    )
    assert r.exit_code == 0, r.output  # 1024 devices, none needed
    text = " ".join(r.output.split())  # the title holds a long temporary path: it wraps
    assert "(1024 devices, 4 processes)" in text and "each (4 processes)" in text


def test_cli_errors(tmp_path):
    path = _saved(tmp_path)
    r = runner.invoke(app, ["plan", str(path), "--mesh", "data=x"])
    assert r.exit_code == 2 and "axis=size" in r.output  # usage
    r = runner.invoke(app, ["plan", str(path), "--mesh", "x=2,x=2"])
    assert r.exit_code == 2 and "repeat" in r.output
    r = runner.invoke(
        app,
        ["plan", str(path), "--mesh", "fsdp=4", "--rules", "embed=nope"],
        env={"COLUMNS": "200"},
    )
    assert r.exit_code == 1 and "'nope'" in r.output
    r = runner.invoke(
        app, ["plan", str(path), "--mesh", "x=4", "--processes", "3"], env={"COLUMNS": "200"}
    )
    assert r.exit_code == 1 and "--processes 3" in r.output


def test_spec_transforms_are_planned_like_restore(tmp_path):
    from jax_ucp import language as L

    jax_ucp.save(tmp_path / "s", {"params": {"layers": {"w": np.ones((3, 4, 8), np.float32)}}})
    spec = L.Spec(restore=[L.RestoreRule(r"layers/(?P<r>.*)", "layers_{i}/{r}", ops=["unstack"])])
    m = mesh((2,), ("x",))
    result = jax_ucp.plan(tmp_path / "s", mesh=m, spec=spec, strict=False)
    assert [(t.name, t.shape) for t in result.tensors] == [
        (f"params/layers_{i}/w", (4, 8)) for i in range(3)
    ]
    assert result.replicated == [
        f"params/layers_{i}/w" for i in range(3)
    ]  # no saved spec for views
    assert set(result.device_bytes.values()) == {3 * 4 * 8 * 4}
    restored = jax_ucp.restore(tmp_path / "s", mesh=m, spec=spec, strict=False)
    assert restored["params"]["layers_0"]["w"].sharding.spec == result.tensors[0].partition_spec


def test_target_shape_mismatch(ckpt):
    before = _digest(ckpt)
    t = {"params": {"w": jax.ShapeDtypeStruct((8, 4), np.float32)}}
    with pytest.raises(
        jax_ucp.CheckpointError, match=r"params/w.*shape \(8, 4\).*holds shape \(8, 8\)"
    ):
        jax_ucp.restore(ckpt, target=t)
    assert _digest(ckpt) == before


def test_missing_tensor_in_checkpoint(ckpt):
    t = {"params": {"gamma": jax.ShapeDtypeStruct((8,), np.float32)}}
    with pytest.raises(jax_ucp.CheckpointError, match=r"params/gamma.*not in"):
        jax_ucp.restore(ckpt, target=t)


def test_64bit_onto_devices_without_x64_is_refused(tmp_path):
    jax_ucp.save(tmp_path / "c", {"d": np.arange(8, dtype=np.float64)})
    m = mesh((2,), ("x",))
    with pytest.raises(jax_ucp.CheckpointError, match=r"'d' is float64.*narrow"):
        jax_ucp.restore(tmp_path / "c", shardings={"d": NamedSharding(m, P("x"))})
    # mesh-only restore keeps it exact on host
    out = jax_ucp.restore(tmp_path / "c", mesh=m, strict=False)
    assert isinstance(out["d"], np.ndarray) and out["d"].dtype == np.float64


# --- restore: what the target asks for vs what was saved --------------------------------------------
@pytest.mark.timeout(120)
def test_value_saved_where_the_target_wants_an_array(tmp_path):
    path = tmp_path / "c"
    _save(path)
    target = {"step": np.zeros((), np.int32)}  # int 5 → int32 keeps the value (as Orbax does)
    assert_bit_exact(jax_ucp.restore(path, target=target)["step"], np.asarray(5, np.int32))
    target = {"step": np.zeros((), np.bool_)}
    with pytest.raises(jax_ucp.UCPError, match=r"'step'.*bool.*int 5"):
        jax_ucp.restore(path, target=target)
    got = jax_ucp.restore(path, target=target, casting="unsafe")
    assert_bit_exact(got["step"], np.asarray(True))


@pytest.mark.timeout(120)
def test_array_saved_where_the_target_is_a_python_scalar(tmp_path):
    path = tmp_path / "c"
    _save(path)
    assert jax_ucp.restore(path, target={"count": 0}) == {"count": 1000}
    with pytest.raises(jax_ucp.UCPError, match=r"'params/w'.*Python float"):
        jax_ucp.restore(path, target={"params": {"w": 0.0}})


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

    from jax_ucp._src.restoring.plan import abstract_mesh

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

    from jax_ucp._src.restoring.plan import IndexedBytes, Layouts, abstract_mesh

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
            layouts = Layouts(m, p)
            for spec in specs:
                devices = IndexedBytes()
                per_device, reads = layouts.place(shape, NamedSharding(m, spec), 2, devices)
                seen: dict[int, set] = {}
                boxes = pictures.device_slices(shape, tuple(spec), list(zip(names, sizes)))
                for position, box in boxes.items():  # processes hold contiguous blocks
                    seen.setdefault(position // (n // p), set()).add(box)
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


@pytest.mark.parametrize("concrete", [True, False])
def test_tensors_sharing_a_placement_add_their_device_bytes_once(tmp_path, monkeypatch, concrete):
    # 12 tensors of 2 (shape, dtype, saved sharding): the devices' totals are added once per
    # distinct placement (not once per tensor) and still count every tensor
    m = mesh((2, 4), ("data", "model"))
    tree = {
        f"t{i:02d}": jax.device_put(
            np.full((8, 16) if i % 2 else (4, 4), i, np.float32),
            NamedSharding(m, P("data", "model") if i % 2 else P()),
        )
        for i in range(12)
    }
    jax_ucp.save(tmp_path / "c", tree)
    calls = []
    real = Layouts.add_devices
    monkeypatch.setattr(
        Layouts, "add_devices", lambda self, *a: (calls.append(a[1]), real(self, *a))[1]
    )
    target = mesh((4, 2), ("data", "model")) if concrete else abstract_mesh([("data", 8)])
    result = jax_ucp.plan(tmp_path / "c", mesh=target)
    # every device listed (1), then per distinct placement: Layouts.place's and the others'
    assert len(calls) <= 1 + 2 * 2
    per_tensor = {t.name: t.bytes_per_device for t in result.tensors}
    assert len(per_tensor) == 12
    assert set(result.device_bytes.values()) == {sum(per_tensor.values())}
    assert len(result.device_bytes) == 8
    fields = {f.name for f in dataclasses.fields(TensorPlan)}
    for t in result.tensors:  # every field set, as TensorPlan(...) would
        assert set(vars(t)) == fields
        assert t == TensorPlan(**{f: getattr(t, f) for f in fields})
        with pytest.raises(dataclasses.FrozenInstanceError):
            t.name = "x"  # type: ignore[misc]
