"""The checked read path of restore: missing, damaged, swapped and stale files are errors naming\nthe file and the tensor; a read never exceeds its memory budget."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import jax_ucp
from jax_ucp._src import store
from jax_ucp._src.restoring import locate
from jax_ucp._src.store.storage import local
from jax_ucp.errors import SaveConflictError
from jax_ucp.exporters import SafetensorsExport
from jax_ucp.language import Spec
from tests.ucp_testing import TREE_COUNT as COUNT
from tests.ucp_testing import TREE_W as W
from tests.ucp_testing import assert_bit_exact, mesh
from tests.ucp_testing import fifo_damage as _fifo
from tests.ucp_testing import remove_damage as _remove


def test_missing_manifest(ckpt):
    os.remove(ckpt / "ucp.json")
    with pytest.raises(jax_ucp.CheckpointError, match=r"no ucp\.json"):
        jax_ucp.restore(ckpt)


def test_missing_array_directory(ckpt):
    shutil.rmtree(ckpt / "arrays" / "params.b")
    with pytest.raises(
        jax_ucp.CheckpointError, match=r"params/b.*listed in ucp\.json.*zarr\.json is missing"
    ):
        jax_ucp.restore(ckpt)


def test_corrupt_chunk_is_detected_by_checksum(ckpt):
    shard = ckpt / "arrays" / "params.w" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(jax_ucp.CheckpointError, match=r"params/w.*params\.w.*(checksum|crc)"):
        jax_ucp.restore(ckpt)


def test_truncated_shard_is_detected(ckpt):
    shard = ckpt / "arrays" / "params.w" / "c" / "0" / "0"
    shard.write_bytes(shard.read_bytes()[:40])
    with pytest.raises(jax_ucp.CheckpointError, match=r"params/w"):
        jax_ucp.restore(ckpt)


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(jax_ucp.CheckpointError, match="not a jax_ucp checkpoint"):
        jax_ucp.restore(tmp_path / "empty")
    with pytest.raises(jax_ucp.CheckpointError, match="no such checkpoint"):
        jax_ucp.restore(tmp_path / "nope")


def _save_sharded(path):
    """w in 8 shard files (saved from a 2x4 mesh), so shards can be swapped."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
    w = jax.device_put(W, NamedSharding(mesh, P("x", "y")))
    return jax_ucp.save(
        path, {"w": w, "v": jax.device_put(W + 1, NamedSharding(mesh, P("x", "y")))}
    )


# --- shard files: missing, swapped, stale, FIFOs, corrupt -------------------------------------------
def _swap(a, b):
    def damage(path):
        pa, pb = path / a, path / b
        tmp = pa.with_name("swap")
        pa.rename(tmp)
        pb.rename(pa)
        tmp.rename(pb)

    return damage


def _stale(rel):
    """The same shard file from an older save of the same tensors (other values)."""

    def damage(path):
        older = path.parent / "older"
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
        put = lambda x: jax.device_put(x, NamedSharding(mesh, P("x", "y")))
        jax_ucp.save(older, {"w": put(W * 2), "v": put(W - 1)})
        shutil.copy(older / rel, path / rel)

    return damage


def _flip(rel, offset=10):
    def damage(path):
        with open(path / rel, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))

    return damage


def _truncate(rel):
    def damage(path):
        with open(path / rel, "r+b") as f:
            f.truncate(os.path.getsize(path / rel) // 2)

    return damage


SHARD_CASES = {
    "deleted shard": (_save_sharded, _remove("arrays/w/c/1/2"), r"arrays/w/c/1/2.*missing"),
    "swapped shards of one tensor": (
        _save_sharded,
        _swap("arrays/w/c/0/0", "arrays/w/c/1/3"),
        r"w/c/(0/0|1/3) is not the shard file this checkpoint saved there",
    ),
    "swapped shards of two tensors": (
        _save_sharded,
        _swap("arrays/w/c/0/1", "arrays/v/c/0/1"),
        r"is not the shard file this checkpoint saved there",
    ),
    "stale shard from an older save": (
        _save_sharded,
        _stale("arrays/w/c/1/1"),
        r"w/c/1/1 is not the shard file .* left from\s+another save",
    ),
    "shard file is a FIFO": (
        _save_sharded,
        _fifo("arrays/w/c/0/0"),
        r"w/c/0/0: not a regular file \(a FIFO\)",
    ),
    "zarr.json is a FIFO": (
        _save_sharded,
        _fifo("arrays/w/zarr.json"),
        r"w/zarr\.json: not a regular file",
    ),
    "zarr.json missing": (
        _save_sharded,
        _remove("arrays/w/zarr.json"),
        r"'w' is listed in ucp\.json but its array .*zarr\.json is missing",
    ),
    "flipped data byte": (_save_sharded, _flip("arrays/w/c/0/0"), r"crc32c checksum mismatch"),
    "truncated shard": (_save_sharded, _truncate("arrays/w/c/0/0"), r"w/c/0/0"),
    "stray shard beyond the grid listed nowhere": (
        _save_sharded,
        lambda p: shutil.copy(p / "arrays/w/c/0/0", p / "arrays/w/c/0/9"),
        None,
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(SHARD_CASES))
def test_damaged_shards_are_errors_on_restore_and_verify(tmp_path, case):
    save, damage, message = SHARD_CASES[case]
    path = tmp_path / "c"
    save(path)
    damage(path)
    if message is None:  # harmless: restore exact, verify clean
        assert_bit_exact(jax_ucp.restore(path)["w"], W)
        assert jax_ucp.verify(path) == []
        return
    with pytest.raises(jax_ucp.UCPError, match=message):
        jax_ucp.restore(path)
    problems = jax_ucp.verify(path)
    assert problems and any(re.search(message, err) for _, err in problems), problems


def _zero_d_case(path):
    jax_ucp.save(path, {"count": COUNT})
    return "arrays/count/c", "count"


def _zstd_case(path):
    jax_ucp.save(path, {"w": W}, compression="zstd")
    return "arrays/w/c/0/0", "w"


def _int4_case(path):
    jax_ucp.save(path, {"q": np.arange(-8, 8, dtype=ml_dtypes.int4).reshape(4, 4)})
    return "arrays/q/c/0/0", "q"


def _no_checksum_case(path):
    jax_ucp.save(path, {"w": W}, checksum=None)
    return "arrays/w/c/0/0", "w"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("make", [_zero_d_case, _zstd_case, _int4_case, _no_checksum_case])
def test_a_deleted_shard_is_never_read_as_zeros_on_any_read_path(tmp_path, make):
    path = tmp_path / "c"
    rel, _name = make(path)
    os.remove(path / rel)
    with pytest.raises(jax_ucp.UCPError, match="missing"):
        jax_ucp.restore(path)
    assert jax_ucp.verify(path), "verify must report the missing shard"


@pytest.mark.timeout(120)
def test_a_deleted_shard_is_an_error_through_a_spec_view(tmp_path):
    path = tmp_path / "c"
    jax_ucp.save(path, {"params": {"w": W}})
    os.remove(path / "arrays/params.w/c/0/0")
    spec = Spec(restore=[{"pattern": "w", "target": "w_t", "ops": ["transpose"]}])
    with pytest.raises(jax_ucp.UCPError, match=r"params\.w/c/0/0 is missing"):
        jax_ucp.restore(path, spec=spec)


@pytest.mark.timeout(120)
def test_float_into_int_is_refused_unless_unsafe(tmp_path):
    path = tmp_path / "c"
    jax_ucp.save(path, {"x": np.array([300.0, np.nan], np.float32)})
    with pytest.raises(jax_ucp.UCPError, match=r"'x' was saved as float32; converting it to int8"):
        jax_ucp.restore(path, target={"x": np.zeros(2, np.int8)})
    with pytest.raises(jax_ucp.UCPError, match="casting='unsafe'"):
        jax_ucp.restore(path, dtype=np.int8)
    assert jax_ucp.restore(path, dtype=np.int8, casting="unsafe")["x"].dtype == np.int8


@pytest.mark.timeout(120)
def test_float32_into_bfloat16_is_a_requested_precision_change(tmp_path):
    path = tmp_path / "c"
    jax_ucp.save(path, {"x": W})
    got = jax_ucp.restore(path, target={"x": np.zeros(W.shape, ml_dtypes.bfloat16)})["x"]
    assert_bit_exact(got, W.astype(ml_dtypes.bfloat16))


@pytest.mark.timeout(120)
def test_restore_of_a_plain_file_says_so(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(jax_ucp.UCPError, match=r"/f\b.*is a file"):
        jax_ucp.restore(tmp_path / "f")


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


def test_restore_keeps_read_buffers_within_memory_budget(tmp_path, monkeypatch):
    from jax_ucp._src.sharding import PendingArray

    tree = {f"t{i}": np.full((256, 1024), i, np.float32) for i in range(8)}  # 1 MiB each
    jax_ucp.save(tmp_path / "c", tree)
    live, peak = [0], [0]
    start, result = PendingArray.start, PendingArray.result

    def counting_start(self):
        live[0] += self.read_bytes
        peak[0] = max(peak[0], live[0])
        return start(self)

    def counting_result(self):
        out = result(self)
        live[0] -= self.read_bytes
        return out

    monkeypatch.setattr(PendingArray, "start", counting_start)
    monkeypatch.setattr(PendingArray, "result", counting_result)
    out = jax_ucp.restore(
        tmp_path / "c", mesh=mesh((2, 4), ("x", "y")), memory_budget=2 << 20, strict=False
    )
    assert peak[0] <= 2 << 20, peak
    for i in range(8):
        assert_bit_exact(np.asarray(out[f"t{i}"]), tree[f"t{i}"])
    peak[0] = 0
    jax_ucp.restore(tmp_path / "c")  # default budget: all 8 MiB at once
    assert peak[0] == 8 << 20


# A reader racing a forced replace gets the old or the new checkpoint, or
# SaveConflictError ("being replaced, retry"), never "corrupt". Two real processes: one
# converts three safetensors sources into one destination in turn (force=True), the other
# restores it. In lockstep the reader is held (by its own select predicate, user code that runs
# after the manifest is read) while the writer replaces the checkpoint twice, so the old
# directory's inode is freed and usually given to the newest one; a free-running loop follows.
# Counted iterations, no clocks.
_TENSORS = 6


_BASES = (1.0, 100.0, 10000.0)  # one per source: which source a restore came from


def _source(path: str, base: float) -> str:
    os.makedirs(path)
    save_file(
        {f"layer{i}.w": np.full((64, 256), base + i, np.float32) for i in range(_TENSORS)},
        os.path.join(path, "model.safetensors"),
    )
    return path


def _which(tree) -> float | None:
    """The source base a restored tree is whole of, None for a mix."""
    params = tree["params"]
    for base in _BASES:
        if all(
            np.array_equal(params[f"layer{i}.w"], np.full((64, 256), base + i, np.float32))
            for i in range(_TENSORS)
        ):
            return base
    return None


def _writer(sources, out, rounds, per_round, reading, replaced):
    import jax_ucp

    n = 0
    for _ in range(rounds):
        if reading is not None and not reading.wait(timeout=120):
            return
        if reading is not None:
            reading.clear()
        for _ in range(per_round):
            n += 1
            jax_ucp.convert(sources[n % len(sources)], out, force=True)
        if replaced is not None:
            replaced.set()


def _reader(out, rounds, reading, replaced, results, stop):
    import jax_ucp

    for _ in range(rounds):
        if stop is not None and stop.is_set():
            break
        held = []

        def hold(name):
            if reading is not None and not held:  # once per restore, after the manifest is read
                held.append(name)
                replaced.clear()
                reading.set()
                replaced.wait(timeout=120)
            return True

        try:
            tree = jax_ucp.restore(out, select=hold)
            results.put(("ok", _which(tree)))
        except Exception as e:  # every outcome is reported, the test judges it
            results.put((type(e).__name__, str(e)))
    results.put(("done", None))


def _outcomes(results) -> list:
    got = []
    while True:
        kind, value = results.get(timeout=300)
        if kind == "done":
            return got
        got.append((kind, value))


def _run(tmp_path, *, lockstep: bool, rounds: int):
    sources = [_source(str(tmp_path / f"src{i}"), b) for i, b in enumerate(_BASES)]
    out = str(tmp_path / "out")
    jax_ucp.convert(sources[0], out)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    reading = ctx.Event() if lockstep else None
    replaced = ctx.Event() if lockstep else None
    stop = None if lockstep else ctx.Event()
    writer = ctx.Process(
        target=_writer, args=(sources, out, rounds, 2 if lockstep else 1, reading, replaced)
    )
    reader = ctx.Process(
        target=_reader,
        args=(out, rounds * (1 if lockstep else 20), reading, replaced, results, stop),
    )
    reader.start()
    writer.start()
    try:
        if not lockstep:
            writer.join(timeout=600)
            stop.set()
        got = _outcomes(results)
    finally:
        for p in (writer, reader):
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
    assert writer.exitcode == 0 and reader.exitcode == 0
    return got, out


@pytest.mark.timeout(600)
def test_a_reader_held_across_two_replaces_gets_a_whole_checkpoint_or_the_retry_error(tmp_path):
    """Each restore reads the manifest, then waits while the checkpoint is replaced twice: on
    the code before the fix most of them called the intact checkpoint corrupt ("swapped with
    another shard": the newest directory had the first one's inode)."""
    rounds = 6
    got, out = _run(tmp_path, lockstep=True, rounds=rounds)
    # round r ends after the writer's conversions 2r+1 and 2r+2 (of source n % 3): the restore
    # started on the checkpoint before them and must give back the one after them, whole
    assert got == [("ok", _BASES[(2 * r + 2) % 3]) for r in range(rounds)], got
    assert _which(jax_ucp.restore(out)) == _BASES[(2 * rounds) % 3]


@pytest.mark.timeout(600)
def test_restores_racing_forced_converts_are_whole_or_the_retry_error(tmp_path):
    """Free-running, as a user would hit it: 12 forced conversions while the other process
    restores in a loop; each restore is one whole source or ``SaveConflictError``."""
    got, out = _run(tmp_path, lockstep=False, rounds=12)
    assert got
    unexpected = [
        (kind, value)
        for kind, value in got
        if not (kind == "ok" and value in _BASES) and kind != SaveConflictError.__name__
    ]
    assert unexpected == [], unexpected
    assert _which(jax_ucp.restore(out)) == _BASES[12 % 3]


def test_a_reader_between_the_two_renames_of_a_swap(tmp_path, monkeypatch):
    """The instant between a swap's renames: ``out`` missing, the new checkpoint at
    ``out.ucp-replacing``; the reader finds that, and the second rename (made here, as the
    writer would) moves it before the reader opens it. Before the fix: "no manifest" there."""
    sources = [_source(str(tmp_path / f"src{i}"), b) for i, b in enumerate(_BASES[:2])]
    out = str(tmp_path / "out")
    jax_ucp.convert(sources[0], out)
    jax_ucp.convert(sources[1], out + local.REPLACING)
    os.rename(out, out + local.REPLACED)
    found = locate.find_checkpoint

    def then_the_second_rename(storage, manifest=None):
        root = found(storage, manifest)
        if os.path.isdir(out + local.REPLACING):
            os.rename(out + local.REPLACING, out)
        return root

    monkeypatch.setattr(locate, "find_checkpoint", then_the_second_rename)
    assert _which(jax_ucp.restore(out)) == _BASES[1]
    assert jax_ucp.inspect(out).save_id == store.read_manifest(out).save_id


def _replaced_twice_by_progress(tmp_path, path: str):
    """A checkpoint converted at ``path`` from the first of three sources, and a progress
    callback that, at its first call, replaces it by the second, then the third (and notes the
    tensor it was called for)."""
    sources = [_source(str(tmp_path / f"src{i}"), b) for i, b in enumerate(_BASES)]
    jax_ucp.convert(sources[0], path)
    replaced: list[str] = []

    def replace_twice(name, done, total):
        if not replaced:
            replaced.append(name)
            jax_ucp.convert(sources[1], path, force=True)
            jax_ucp.convert(sources[2], path, force=True)

    return replaced, replace_twice


def test_verify_racing_two_replaces_reports_no_damage(tmp_path):
    """``verify``'s progress callback (user code, after the first tensor) replaces the
    checkpoint twice, in this process: the checkpoint is verified again, not reported as
    damaged; a real damage is still reported."""
    out = str(tmp_path / "out")
    replaced, replace_twice = _replaced_twice_by_progress(tmp_path, out)
    assert jax_ucp.verify(out, progress=replace_twice, memory_budget=1) == []
    assert replaced and _which(jax_ucp.restore(out)) == _BASES[2]
    shard = os.path.join(out, "arrays", "params.layer0%2Ew", "c", "0", "0")
    data = bytearray(open(shard, "rb").read())
    data[0] ^= 0xFF
    with open(shard, "wb") as f:
        f.write(data)
    problems = jax_ucp.verify(out)
    assert [name for name, _ in problems] == ["params/layer0.w"], problems
    with pytest.raises(jax_ucp.CheckpointError, match="crc32c"):
        jax_ucp.restore(out)


def test_an_export_racing_two_replaces_of_its_source_starts_over(tmp_path):
    """``export``'s progress callback (after the first tensor) replaces the source checkpoint
    twice: the export starts over and holds the newest checkpoint whole, no temporary left."""
    from safetensors.numpy import load_file

    ckpt = str(tmp_path / "ckpt")
    replaced, replace_twice = _replaced_twice_by_progress(tmp_path, ckpt)
    out = tmp_path / "out"
    jax_ucp.export(ckpt, out, SafetensorsExport(progress=replace_twice))
    assert replaced
    assert _which({"params": load_file(str(out / "model.safetensors"))}) == _BASES[2]
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "out", "src0", "src1", "src2"]
