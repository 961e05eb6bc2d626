"""Hostile and faulty inputs: each gives exact data or a clear jax_ucp error, nothing is lost.

Table-driven: every case damages a freshly saved checkpoint (or asks for something unsafe) and
states the outcome exactly: the library's own exception (``jax_ucp.UCPError`` or a subclass)
with a message naming the file/field or tensor, or bit-exact data. Hangs are failures (each
test has a timeout). Importer inputs (torch pickles, zip members, DeepSpeed ranks) are in
tests/importers/test_reliability_importers.py; kill tests in tests/writer/test_kill.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading

import jax
import ml_dtypes
import numpy as np
import pytest

import jax_ucp
from jax_ucp.language import Spec
from tests.ucp_testing import REPO, assert_bit_exact

pytestmark = pytest.mark.timeout(120)

W = np.arange(64 * 48, dtype=np.float32).reshape(64, 48) / 7
COUNT = np.asarray(1000, np.int32)


def _save(path, **kw):
    tree = {"params": {"w": W, "b": np.arange(6, dtype=np.int8)}, "count": COUNT, "step": 5}
    return jax_ucp.save(path, tree, inner_chunk_bytes=1024, **kw)


def _save_sharded(path):
    """w in 8 shard files (saved from a 2x4 mesh), so shards can be swapped."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
    w = jax.device_put(W, NamedSharding(mesh, P("x", "y")))
    return jax_ucp.save(
        path, {"w": w, "v": jax.device_put(W + 1, NamedSharding(mesh, P("x", "y")))}
    )


def _manifest(path) -> dict:
    return json.loads((path / "ucp.json").read_text())


def _write_manifest(path, d) -> None:
    (path / "ucp.json").write_text(json.dumps(d))


def _tensor(d, name):
    return next(e for e in d["entries"] if "/".join(e["key"]) == name)


def _edit(fn):
    """A case that edits the manifest dict in place."""

    def damage(path):
        d = _manifest(path)
        fn(d)
        _write_manifest(path, d)

    return damage


def _raw(text: bytes):
    def damage(path):
        (path / "ucp.json").write_bytes(text)

    return damage


def _fifo(rel):
    def damage(path):
        target = path / rel
        target.unlink()
        os.mkfifo(target)

    return damage


def _symlink(rel, to):
    def damage(path):
        target = path / rel
        target.unlink()
        target.symlink_to(to)

    return damage


def _remove(rel):
    def damage(path):
        (path / rel).unlink()

    return damage


# --- the manifest: every error names ucp.json and the field -------------------------------------
MANIFEST_CASES = {
    "missing": (_remove("ucp.json"), r"no such checkpoint|no ucp\.json|not a jax_ucp"),
    "not json": (_raw(b"{nope"), r"ucp\.json: corrupt manifest, not valid JSON"),
    "empty file": (_raw(b""), r"ucp\.json: corrupt manifest"),
    "fifo": (_fifo("ucp.json"), r"ucp\.json: not a regular file \(a FIFO\)"),
    "symlink to /dev/zero": (
        _symlink("ucp.json", "/dev/zero"),
        r"not a regular file \(a character device\)",
    ),
    "non utf-8": (_raw(b'{"format": "\xff"}'), r"ucp\.json: not UTF-8"),
    "5000-digit int": (
        _raw(b'{"format": "jax_ucp", "version": ' + b"9" * 5000 + b"}"),
        r"integer of 5000 digits",
    ),
    "200k-deep nesting": (_raw(b"[" * 200_000 + b"]" * 200_000), r"nested deeper than 512"),
    "NaN literal": (_raw(b'{"format": "jax_ucp", "version": NaN}'), r"NaN is not valid JSON"),
    "a JSON list": (_raw(b"[1, 2]"), r"not a jax_ucp manifest"),
    "other format": (_edit(lambda d: d.update(format="orbax")), r"not a jax_ucp manifest"),
    "newer version": (_edit(lambda d: d.update(version=99)), r"version 99 is newer"),
    "version as string": (_edit(lambda d: d.update(version="1")), r"version: expected an integer"),
    "version as bool": (_edit(lambda d: d.update(version=True)), r"version: expected an integer"),
    "kvstore as string": (
        _edit(lambda d: d.update(kvstore="x")),
        r"kvstore: expected a JSON object",
    ),
    "no save_id": (_edit(lambda d: d.pop("save_id")), r"missing field 'save_id'"),
    "unknown top-level field": (
        _edit(lambda d: d.update(extra=1)),
        r"unknown field\(s\) \['extra'\]",
    ),
    "entries not a list": (_edit(lambda d: d.update(entries={})), r"entries: expected a list"),
    "empty key": (
        _edit(lambda d: d["entries"][0].update(key=[])),
        r"entries\[0\]\.key: expected a non-empty list",
    ),
    "key as string": (
        _edit(lambda d: d["entries"][0].update(key="params")),
        r"entries\[0\]\.key: expected a non-empty list of strings",
    ),
    "key of ints": (
        _edit(lambda d: d["entries"][0].update(key=[1, 2])),
        r"expected a list of strings",
    ),
    "dir with ..": (
        _edit(lambda d: _tensor(d, "params/w").update(dir="arrays/../../etc")),
        r"\.dir: expected 'arrays/<escaped key>'",
    ),
    "dir absolute": (
        _edit(lambda d: _tensor(d, "params/w").update(dir="/etc")),
        r"\.dir: expected",
    ),
    "dtype float128": (
        _edit(lambda d: _tensor(d, "params/w").update(dtype="float128")),
        r"\.dtype: expected one of",
    ),
    "dtype uint4": (
        _edit(lambda d: _tensor(d, "params/w").update(dtype="uint4")),
        r"\.dtype: expected one of",
    ),
    "negative dim": (
        _edit(lambda d: _tensor(d, "params/w").update(shape=[-1, 48])),
        r"\.shape: expected a list of integers ≥ 0",
    ),
    "bool dim": (
        _edit(lambda d: _tensor(d, "params/w").update(shape=[True, 48])),
        r"\.shape: expected a list of integers",
    ),
    "rank mismatch": (
        _edit(lambda d: _tensor(d, "params/w").update(chunk_shape=[64])),
        r"\.chunk_shape: expected 2 dimensions",
    ),
    "zero chunk": (
        _edit(lambda d: _tensor(d, "params/w").update(chunk_shape=[0, 48])),
        r"\.chunk_shape: expected a list of integers ≥ 1",
    ),
    "bad role": (
        _edit(lambda d: _tensor(d, "params/w").update(role="weights")),
        r"\.role: expected one of",
    ),
    "bad checksum": (
        _edit(lambda d: _tensor(d, "params/w").update(checksum="md5")),
        r"\.checksum: expected one of",
    ),
    "bad digest": (
        _edit(lambda d: _tensor(d, "params/w")["shard_digests"].update({"c/0/0": "zz"})),
        r"\.shard_digests: expected shard key -> 8 hex digits",
    ),
    "bool value as string": (
        _edit(lambda d: _tensor(d, "step").update(type="bool", value="false")),
        r"\.value: expected a JSON boolean",
    ),
    "int value as float": (
        _edit(lambda d: _tensor(d, "step").update(value=5.5)),
        r"\.value: expected a JSON integer",
    ),
    "float value not hex": (
        _edit(lambda d: _tensor(d, "step").update(type="float", value="0xZ")),
        r"\.value: expected a float\.hex string",
    ),
    "unknown entry type": (
        _edit(lambda d: d["entries"][0].update(entry="blob")),
        r"entries\[0\]\.entry: expected \"tensor\" or \"value\"",
    ),
    "duplicate leaf": (
        _edit(lambda d: d["entries"].append(dict(d["entries"][0]))),
        r"Duplicate leaf",
    ),
    "shape differs from zarr.json": (
        _edit(
            lambda d: _tensor(d, "params/w").update(
                shape=[48, 64], chunk_shape=[48, 64], inner_chunk_shape=[1, 64]
            )
        ),
        r"zarr\.json has shape \(64, 48\)",
    ),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_hostile_manifest_is_a_clear_error(tmp_path, case):
    damage, message = MANIFEST_CASES[case]
    path = tmp_path / "c"
    _save(path)
    damage(path)
    with pytest.raises(jax_ucp.UCPError, match=message) as info:
        jax_ucp.restore(path)
    assert (
        "ucp.json" in str(info.value)
        or "zarr.json" in str(info.value)
        or "no such" in str(info.value)
    )
    assert len(str(info.value)) < 2000  # cut, never the whole hostile input


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
        put = lambda x: jax.device_put(x, NamedSharding(mesh, P("x", "y")))  # noqa: E731
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


@pytest.mark.parametrize("make", [_zero_d_case, _zstd_case, _int4_case, _no_checksum_case])
def test_a_deleted_shard_is_never_read_as_zeros_on_any_read_path(tmp_path, make):
    path = tmp_path / "c"
    rel, name = make(path)
    os.remove(path / rel)
    with pytest.raises(jax_ucp.UCPError, match="missing"):
        jax_ucp.restore(path)
    assert jax_ucp.verify(path), "verify must report the missing shard"


def test_a_deleted_shard_is_an_error_through_a_spec_view(tmp_path):
    path = tmp_path / "c"
    jax_ucp.save(path, {"params": {"w": W}})
    os.remove(path / "arrays/params.w/c/0/0")
    spec = Spec(restore=[{"pattern": "w", "target": "w_t", "ops": ["transpose"]}])
    with pytest.raises(jax_ucp.UCPError, match=r"params\.w/c/0/0 is missing"):
        jax_ucp.restore(path, spec=spec)


# --- restore: what the target asks for vs what was saved --------------------------------------------
def test_value_saved_where_the_target_wants_an_array(tmp_path):
    path = tmp_path / "c"
    _save(path)
    target = {"step": np.zeros((), np.int32)}  # int 5 → int32 keeps the value (as Orbax does)
    assert_bit_exact(jax_ucp.restore(path, target=target)["step"], np.asarray(5, np.int32))
    target = {"step": np.zeros((), np.bool_)}
    with pytest.raises(
        jax_ucp.UCPError, match=r"Leaf 'step': the target asks for a bool array.*int 5"
    ):
        jax_ucp.restore(path, target=target)
    got = jax_ucp.restore(path, target=target, casting="unsafe")
    assert_bit_exact(got["step"], np.asarray(True))


def test_float_into_int_is_refused_unless_unsafe(tmp_path):
    path = tmp_path / "c"
    jax_ucp.save(path, {"x": np.array([300.0, np.nan], np.float32)})
    with pytest.raises(jax_ucp.UCPError, match=r"'x' was saved as float32; converting it to int8"):
        jax_ucp.restore(path, target={"x": np.zeros(2, np.int8)})
    with pytest.raises(jax_ucp.UCPError, match="casting='unsafe'"):
        jax_ucp.restore(path, dtype=np.int8)
    assert jax_ucp.restore(path, dtype=np.int8, casting="unsafe")["x"].dtype == np.int8


def test_float32_into_bfloat16_is_a_requested_precision_change(tmp_path):
    path = tmp_path / "c"
    jax_ucp.save(path, {"x": W})
    got = jax_ucp.restore(path, target={"x": np.zeros(W.shape, ml_dtypes.bfloat16)})["x"]
    assert_bit_exact(got, W.astype(ml_dtypes.bfloat16))


def test_array_saved_where_the_target_is_a_python_scalar(tmp_path):
    path = tmp_path / "c"
    _save(path)
    assert jax_ucp.restore(path, target={"count": 0}) == {"count": 1000}
    with pytest.raises(jax_ucp.UCPError, match=r"'params/w': the target is a Python float"):
        jax_ucp.restore(path, target={"params": {"w": 0.0}})


def test_restore_of_a_plain_file_says_so(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(jax_ucp.UCPError, match="is a file, not a checkpoint directory"):
        jax_ucp.restore(tmp_path / "f")


# --- save: what may not be written, what must not be lost -------------------------------------------
@pytest.mark.parametrize(
    "tree, message",
    [
        ({"s": "\ud800"}, r"Leaf 's': value: not encodable as UTF-8"),
        ({"big": 10**5000}, r"Leaf 'big': an int of more than 64 digits"),
        ({"obj": object()}, r"Leaf 'obj': cannot save a builtins\.object"),
        ({"q": np.zeros(3, ml_dtypes.uint4)}, r"dtype uint4 is not supported"),
    ],
    ids=["lone surrogate", "5000-digit int", "object", "uint4"],
)
def test_unsavable_leaves_are_clear_errors_and_nothing_is_left(tmp_path, tree, message):
    with pytest.raises((jax_ucp.UCPError, TypeError), match=message):
        jax_ucp.save(tmp_path / "c", tree)
    assert os.listdir(tmp_path) == []


def test_force_never_replaces_a_users_folder_or_file(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("precious")
    with pytest.raises(jax_ucp.UCPError, match="not a jax_ucp checkpoint or an Orbax step"):
        jax_ucp.save(folder, {"x": W}, force=True)
    assert (folder / "notes.txt").read_text() == "precious"
    (tmp_path / "file").write_text("precious")
    with pytest.raises(jax_ucp.UCPError, match="not a checkpoint directory"):
        jax_ucp.save(tmp_path / "file", {"x": W}, force=True)
    assert (tmp_path / "file").read_text() == "precious"
    with pytest.raises(FileExistsError, match="force=True"):
        jax_ucp.save(folder, {"x": W})


def test_force_replaces_a_checkpoint(tmp_path):
    path = tmp_path / "c"
    _save(path)
    jax_ucp.save(path, {"x": W + 1}, force=True)
    assert_bit_exact(jax_ucp.restore(path)["x"], W + 1)
    assert sorted(os.listdir(tmp_path)) == ["c"]


FILL_DISK = textwrap.dedent(
    """
    import os, resource, signal, sys
    import numpy as np
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
    import jax_ucp
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    try:
        jax_ucp.save(sys.argv[1], {f"t{i}": np.full((512, 1024), i, np.float32) for i in range(8)},
                     force=True)
    except Exception as e:
        print("FAILED", type(e).__name__, str(e)[:300])
    """
)


def test_a_failed_save_leaves_no_temporary_directory_and_the_old_checkpoint(tmp_path):
    """File-size limit hit mid-save (like a full disk): clean failure, previous checkpoint whole."""
    path = tmp_path / "c"
    _save(path)
    out = subprocess.run(
        [sys.executable, "-c", FILL_DISK, str(path)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=REPO),
        timeout=120,
    )
    assert "FAILED" in out.stdout, out.stdout + out.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["c"]
    assert_bit_exact(jax_ucp.restore(path)["params"]["w"], W)


# --- concurrency -----------------------------------------------------------------------------------
SAVER = textwrap.dedent(
    """
    import sys, numpy as np, jax_ucp
    path, value, force = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1"
    try:
        jax_ucp.save(path, {f"t{i}": np.full((256, 256), value, np.float32) for i in range(16)},
                     force=force)
        print("SAVED")
    except jax_ucp.UCPError as e:
        print("REFUSED", e)
    except FileExistsError as e:
        print("EXISTS", e)
    """
)


def _savers(path, values, force):
    env = dict(os.environ, PYTHONPATH=REPO)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SAVER, str(path), str(v), "1" if force else "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for v in values
    ]
    return [p.communicate(timeout=120)[0] for p in procs]


def _whole(path) -> float:
    """The single value every tensor of the checkpoint holds (asserts it is not a mix)."""
    got = jax_ucp.restore(path)
    assert len(got) == 16, sorted(got)
    values = {float(np.unique(a)[0]) for a in got.values()}
    assert len(values) == 1, values
    return values.pop()


@pytest.mark.parametrize("force", [False, True], ids=["new path", "force"])
def test_two_savers_of_one_path_never_commit_a_mix(tmp_path, force):
    path = tmp_path / "c"
    if force:
        _save(path)
    outs = _savers(path, [1.0, 2.0], force)
    saved = [o for o in outs if o.startswith("SAVED")]
    assert saved, outs
    for o in outs:
        assert o.startswith(("SAVED", "REFUSED", "EXISTS")), outs
        if o.startswith("REFUSED"):
            assert "another save to this path is in progress" in o
    assert _whole(path) in (1.0, 2.0)
    assert [n for n in os.listdir(tmp_path) if not n.startswith(".")] == ["c"]


def test_restores_during_forced_saves_are_whole_old_or_whole_new(tmp_path):
    path = tmp_path / "c"
    jax_ucp.save(path, {f"t{i}": np.full((256, 256), 0.0, np.float32) for i in range(16)})
    seen, errors = set(), []
    stop = threading.Event()

    def restore_loop():
        while not stop.is_set():
            try:
                seen.add(_whole(path))
            except jax_ucp.UCPError as e:  # allowed: a clear error, never a mix
                errors.append(str(e))

    reader = threading.Thread(target=restore_loop)
    reader.start()
    try:
        for v in (1.0, 2.0, 3.0, 4.0):
            _savers(path, [v], force=True)
    finally:
        stop.set()
        reader.join()
    assert seen, errors
    assert seen <= {0.0, 1.0, 2.0, 3.0, 4.0}


def test_an_interrupted_swap_is_readable_and_the_next_save_recovers_it(tmp_path):
    """Killed between the two renames of a forced save: both whole checkpoints sit beside path."""
    path = tmp_path / "c"
    jax_ucp.save(path, {"x": W})
    jax_ucp.save(tmp_path / "c.ucp-replacing", {"x": W + 1})
    os.rename(path, tmp_path / "c.ucp-replaced")
    assert_bit_exact(jax_ucp.restore(path)["x"], W + 1)  # the newer one, read in place
    jax_ucp.save(path, {"x": W + 2}, force=True)
    assert_bit_exact(jax_ucp.restore(path)["x"], W + 2)
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_convert_never_writes_into_or_over_its_source(tmp_path):
    src = tmp_path / "ds"
    shutil.copytree(os.path.join(REPO, "tests/fixtures/deepspeed/z2_bf16_dp2/ckpt"), src)
    before = sorted(p for p, _, _ in os.walk(src))
    for dest in (src, src / "global_step2" / "out", tmp_path):
        with pytest.raises(jax_ucp.UCPError, match="is, contains or lies inside the source"):
            jax_ucp.convert(src, dest, force=True)
    assert sorted(p for p, _, _ in os.walk(src)) == before
