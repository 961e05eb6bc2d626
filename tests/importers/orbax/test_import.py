"""Importing damaged or hostile Orbax checkpoints: a deleted chunk file, truncated OCDBT files, a
damaged zarr.json are one error line naming the file and the array; a chunk declared larger
than its array is refused before it is decoded; decoded chunks count in the memory budget.
Every hostile input is built here."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest
from typer.testing import CliRunner

import jax_ucp
from jax_ucp._src import writer
from jax_ucp._src.importers import plan_import
from jax_ucp.cli import app
from jax_ucp.errors import SourceError
from tests.ucp_testing import REPO, assert_bit_exact
from tests.ucp_testing import assert_one_error_line as _assert_one_error_line
from tests.ucp_testing import save_and_name as _ucp

runner = CliRunner()


def _run_cli(*args: str, env=None, timeout=240) -> subprocess.CompletedProcess:
    """``jax-ucp ARGS`` in a fresh process (stderr as the terminal would show it)."""
    return subprocess.run(
        [sys.executable, "-m", "jax_ucp.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "300", **(env or {})},
    )


def _orbax(path, *, ocdbt: bool, zarr3: bool = False, tree=None) -> dict:
    rng = np.random.default_rng(0)
    tree = tree or {
        "params": {
            "w": rng.standard_normal((64, 64)).astype(np.float32),
            "b": rng.standard_normal(64).astype(np.float32),
        }
    }
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=zarr3)
    with ocp.Checkpointer(handler) as c:
        c.save(os.fspath(path), args=ocp.args.PyTreeSave(tree))
    return tree


def _only_source_left(tmp_path, src: str) -> None:
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(src)]


@pytest.mark.timeout(240)
def test_a_deleted_orbax_chunk_file_is_one_error_naming_file_and_array(tmp_path):
    src = str(tmp_path / "orbax")
    _orbax(src, ocdbt=False)
    chunk = os.path.join(src, "params.w", "0.0")
    assert os.path.isfile(chunk)
    os.remove(chunk)
    with pytest.raises(SourceError, match=r"array 'params\.w'.*is missing") as e:
        jax_ucp.convert(src, tmp_path / "out")
    assert chunk in str(e.value) and "tensorstore_spec" not in str(e.value)
    _only_source_left(tmp_path, src)
    r = _run_cli("convert", src, str(tmp_path / "out"), "--from", "orbax")
    assert r.returncode == 1
    _assert_one_error_line(r.stdout + r.stderr, "'params.w'", chunk)
    _only_source_left(tmp_path, src)
    zarray = os.path.join(src, "params.w", ".zarray")
    for damage in (os.remove, lambda f: os.truncate(f, 10)):  # Orbax's metadata read fails
        shutil.copy(os.path.join(src, "params.b", ".zarray"), zarray)
        damage(zarray)
        with pytest.raises(SourceError, match=r"metadata of array 'params\.w'") as e:
            jax_ucp.convert(src, tmp_path / "out")
        assert zarray in str(e.value) and "tensorstore_spec" not in str(e.value)
        _only_source_left(tmp_path, src)


@pytest.mark.timeout(300)
def test_truncated_ocdbt_files_are_one_error_naming_file_and_array(tmp_path):
    """Each data file of an OCDBT checkpoint truncated to half, one at a time: the import is
    bit-exact (a file the merged database no longer uses) or one error naming the array and the
    database; never TensorStore's spec dump."""
    src = str(tmp_path / "orbax")
    tree = _orbax(src, ocdbt=True)
    data_files = sorted(
        os.path.relpath(os.path.join(d, f), src)
        for d, _, fs in os.walk(src)
        for f in fs
        if os.path.basename(d) == "d"
    )
    assert len(data_files) >= 2
    refused = []
    for rel in data_files:
        copy = str(tmp_path / "copy")
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(src, copy)
        os.truncate(os.path.join(copy, rel), os.path.getsize(os.path.join(src, rel)) // 2)
        out = tmp_path / "out"
        try:
            jax_ucp.convert(copy, out)
        except SourceError as e:
            text = str(e)
            assert "tensorstore_spec" not in text and "\n" not in text, text
            assert copy in text and ("'params.w'" in text or "'params.b'" in text), text
            assert not out.exists()
            refused.append((rel, text))
            continue
        got = jax_ucp.restore(out)
        assert_bit_exact(got["params"]["w"], tree["params"]["w"])
        assert_bit_exact(got["params"]["b"], tree["params"]["b"])
        shutil.rmtree(out)
    # the metadata B-tree (read by Orbax's metadata) and the chunk data (read by the import)
    assert any("cannot read the metadata of array" in t for _, t in refused), refused
    assert any("reading array 'params.w' failed" in t for _, t in refused), refused
    rel, _ = next((r, t) for r, t in refused if "reading array" in t)
    copy = str(tmp_path / "copy")
    shutil.rmtree(copy)
    shutil.copytree(src, copy)
    os.truncate(os.path.join(copy, rel), os.path.getsize(os.path.join(src, rel)) // 2)
    r = _run_cli("convert", copy, str(tmp_path / "out"), "--from", "orbax")
    assert r.returncode == 1
    _assert_one_error_line(r.stdout + r.stderr, "'params.w'", copy, "OCDBT")


def zstd_zeros(n: int) -> bytes:
    """A zstd frame that decodes to ``n`` zero bytes, made of RLE blocks of 128 KiB (4 bytes
    each): 2 GiB in 64 KB."""
    out = bytearray(struct.pack("<IB", 0xFD2FB528, 0xA0))  # magic; single segment, 4-byte size
    out += struct.pack("<I", n)
    while n:
        size = min(n, 1 << 17)
        n -= size
        header = (size << 3) | (1 << 1) | (n == 0)  # block size, type RLE, last block
        out += header.to_bytes(3, "little") + b"\0"
    return bytes(out)


def test_the_zstd_bomb_builder_makes_valid_frames():
    import numcodecs

    for n in (1, 5, 1 << 17, (1 << 17) + 3, 300_000):
        assert numcodecs.Zstd().decode(zstd_zeros(n)) == bytes(n)
    assert len(zstd_zeros(1 << 31)) < 70_000


@pytest.mark.timeout(300)
def test_an_orbax_chunk_declared_larger_than_its_array_is_refused_before_decoding(tmp_path):
    """16 floats whose ``.zarray`` declares one zstd chunk of 2**29 elements, its file a 64 KB
    frame that decodes to 2 GiB: refused naming the file and the array, the process stays far
    below the 2 GiB (2.7 GB before)."""
    src = str(tmp_path / "orbax")
    _orbax(src, ocdbt=False, tree={"params": {"w": np.arange(16, dtype=np.float32)}})
    array = os.path.join(src, "params.w")
    zarray = json.load(open(os.path.join(array, ".zarray")))
    assert zarray["chunks"] == [16] and zarray["compressor"]["id"] == "zstd"
    zarray["chunks"] = [1 << 29]
    json.dump(zarray, open(os.path.join(array, ".zarray"), "w"))
    (chunk,) = [f for f in os.listdir(array) if f != ".zarray"]
    open(os.path.join(array, chunk), "wb").write(zstd_zeros(4 << 29))
    assert os.path.getsize(os.path.join(array, chunk)) < 70_000
    # The CLI's own peak memory since exec (VmHWM, written at exit): ru_maxrss would keep the
    # high-water mark of the pytest worker that forked it.
    peak_file = tmp_path / "vmhwm"
    launcher = (
        "import atexit, runpy, sys\n"
        "def _peak():\n"
        "    hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n"
        f"    open({str(peak_file)!r}, 'w').write(hwm.split()[1])\n"
        "atexit.register(_peak)\n"
        "sys.argv = ['jax-ucp'] + sys.argv[1:]\n"
        "runpy.run_module('jax_ucp.cli', run_name='__main__')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", launcher, "convert", src, str(tmp_path / "out"), "--from", "orbax"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "300"},
    )
    out = proc.stdout
    assert proc.returncode == 1, out
    _assert_one_error_line(
        out, os.path.join(array, ".zarray"), "'params.w'", "(536870912,)", "larger than the array"
    )
    peak_kib = int(peak_file.read_text())
    peak_file.unlink()
    assert 0 < peak_kib < 1 << 20, peak_kib  # KiB: under 1 GiB
    _only_source_left(tmp_path, src)


@pytest.mark.timeout(120)
def test_a_zarr3_chunk_grid_larger_than_its_array_is_refused(tmp_path):
    src = str(tmp_path / "orbax")
    _orbax(src, ocdbt=False, zarr3=True, tree={"params": {"w": np.arange(16, dtype=np.float32)}})
    meta_file = os.path.join(src, "params.w", "zarr.json")
    meta = json.load(open(meta_file))
    meta["chunk_grid"]["configuration"]["chunk_shape"] = [1 << 29]
    json.dump(meta, open(meta_file, "w"))
    with pytest.raises(SourceError, match=r"larger than the array") as e:
        jax_ucp.convert(src, tmp_path / "out")
    assert meta_file in str(e.value) and "'params.w'" in str(e.value)
    _only_source_left(tmp_path, src)


@pytest.mark.timeout(240)
def test_orbax_arrays_reserve_their_decoded_chunks_in_the_memory_budget(tmp_path):
    """A (256, 256) float32 array saved as 8 chunks of 32 KiB. Read through TensorStore (zarr3):
    under a budget with room for the array and one chunk, its read reserves exactly that
    (TensorStore decodes one chunk at a time); under the default budget, more chunks at once.
    Orbax's default zarr v2 zstd chunks are decoded as a stream into the array: it reserves
    the array alone. Every import bit-exact."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tests.ucp_testing import mesh

    w = np.random.default_rng(2).standard_normal((256, 256)).astype(np.float32)
    sharded = jax.device_put(w, NamedSharding(mesh((8,), ("x",)), P("x")))
    array, chunk = w.nbytes, w.nbytes // 8
    budget = array + chunk + chunk // 2
    for zarr3 in (True, False):
        src = str(tmp_path / f"orbax{zarr3}")
        _orbax(src, ocdbt=True, zarr3=zarr3, tree={"params": {"w": sharded}})
        with writer.memory_budget_scope(budget):
            (item,) = list(plan_import(src).items)
            assert item.value.nbytes == (array + chunk if zarr3 else array)
            jax_ucp.convert(src, tmp_path / f"small{zarr3}", memory_budget=budget)
        (item,) = list(plan_import(src).items)
        want = array + min(8, os.cpu_count() or 1) * chunk if zarr3 else array
        assert item.value.nbytes == want
        assert_bit_exact(jax_ucp.restore(tmp_path / f"small{zarr3}")["params"]["w"], w)


@pytest.mark.timeout(120)
def test_a_damaged_zarr_json_is_one_line_without_tensorstores_spec(tmp_path):
    """A jax_ucp checkpoint whose array metadata is cut short: ``verify``, ``diff`` and
    ``export`` name the tensor and the file in one line (TensorStore's spec dump cut)."""
    ckpt = _ucp(tmp_path / "ckpt", {"params": {"w": np.arange(8, dtype=np.float32)}})
    good = _ucp(tmp_path / "good", {"params": {"w": np.arange(8, dtype=np.float32)}})
    meta = os.path.join(ckpt, "arrays", "params.w", "zarr.json")
    os.truncate(meta, 20)
    for args in (["verify", ckpt], ["diff", good, ckpt], ["export", ckpt, str(tmp_path / "o")]):
        r = runner.invoke(app, args, env={"COLUMNS": "300"})
        assert r.exit_code == 1, (args, r.output)
        text = r.output.replace("✗", "error:") if args[0] == "verify" else r.output
        assert "tensorstore_spec" not in text, text
        line = [x for x in text.splitlines() if x.startswith("error:")]
        assert len(line) == 1 and "'params/w'" in line[0] and meta in line[0], (args, text)
    assert not (tmp_path / "o").exists()


def test_an_item_name_longer_than_a_file_name_is_a_clear_error(tmp_path):
    """A step whose _CHECKPOINT_METADATA names an item of 10 000 characters: an error naming the
    file and what is wrong, not a raw OSError (File name too long)."""
    step = tmp_path / "3"
    shutil.copytree(os.path.join(REPO, "tests", "fixtures", "orbax_manager_step", "3"), step)
    meta_file = step / "_CHECKPOINT_METADATA"
    meta = json.loads(meta_file.read_text())
    meta["item_handlers"] = {
        "x"
        * 10_000: "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"
    }
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(
        jax_ucp.UCPError, match=r"_CHECKPOINT_METADATA: item name of 10000 characters"
    ):
        jax_ucp.convert(step, tmp_path / "out", format="orbax")


_DAMAGED_OCDBT_FROM_PYTHON = """
import os, shutil, sys, time
import numpy as np, orbax.checkpoint as ocp
import jax_ucp
base = sys.argv[1]
src = os.path.join(base, "orbax")
rng = np.random.default_rng(0)
tree = {"params": {"w": rng.standard_normal((64, 64)).astype(np.float32),
                   "b": rng.standard_normal(64).astype(np.float32)}}
with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True)) as c:
    c.save(src, args=ocp.args.PyTreeSave(tree))
data = sorted(os.path.relpath(os.path.join(d, f), src)
              for d, _, fs in os.walk(src) for f in fs if os.path.basename(d) == "d")
refused = 0
for _ in range(2):
    for rel in data:
        copy = os.path.join(base, "copy")
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(src, copy)
        os.truncate(os.path.join(copy, rel), os.path.getsize(os.path.join(src, rel)) // 2)
        try:
            jax_ucp.convert(copy, os.path.join(base, "out"))
        except jax_ucp.UCPError:
            refused += 1
        shutil.rmtree(os.path.join(base, "out"), ignore_errors=True)
time.sleep(0.5)  # TensorStore's late callbacks land here
print("refused", refused)
"""


@pytest.mark.timeout(240)
def test_a_damaged_ocdbt_import_from_python_prints_nothing_after_its_error(tmp_path):
    """From Python (no CLI): each truncated OCDBT database is one clear error, and Orbax's
    closed event loop leaves no stray 'Event loop is closed' traceback on the console."""
    done = subprocess.run(
        [sys.executable, "-c", _DAMAGED_OCDBT_FROM_PYTHON, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=200,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused" in done.stdout and "refused 0" not in done.stdout, done.stdout
    assert "Event loop is closed" not in done.stderr, done.stderr[-3000:]


def _renamed_key(d):
    (entry,) = d["tree_metadata"].values()
    entry["value_metadata"]["skip_deserialize_x"] = entry["value_metadata"].pop("skip_deserialize")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "damage",
    [
        _renamed_key,
        lambda d: d["tree_metadata"].update({k: "x" for k in d["tree_metadata"]}),
        lambda d: d.update(tree_metadata=[1, 2]),
        lambda d: [
            k.update(key_type=7) for v in d["tree_metadata"].values() for k in v["key_metadata"]
        ],
    ],
    ids=["a key renamed", "an entry a string", "the tree a list", "a key type unknown"],
)
def test_an_item_metadata_orbax_cannot_parse_is_named(tmp_path, damage):
    """An item's ``_METADATA`` that is JSON but not Orbax's tree metadata (a flipped byte in a
    key): a SourceError naming the file; before: Orbax's raw KeyError / TypeError /
    AttributeError (found by tests/hostile)."""
    src = tmp_path / "orbax"
    _orbax(src, ocdbt=False, tree={"w": np.ones(3, np.float32)})
    metadata = json.loads((src / "_METADATA").read_text())
    damage(metadata)
    (src / "_METADATA").write_text(json.dumps(metadata))
    with pytest.raises(jax_ucp.SourceError, match=r"orbax/_METADATA: not Orbax's tree metadata"):
        jax_ucp.convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(60)
def test_a_fifo_in_an_item_is_refused_before_tensorstore_blocks_on_it(tmp_path):
    """An array's ``.zarray`` replaced by a FIFO: a SourceError naming it, at once; before: the
    import blocked for ever in TensorStore's read (found by tests/hostile)."""
    src = tmp_path / "orbax"
    _orbax(src, ocdbt=False, tree={"w": np.ones(3, np.float32)})
    (src / "w" / ".zarray").unlink()
    os.mkfifo(src / "w" / ".zarray")
    with pytest.raises(jax_ucp.SourceError, match=r"w/\.zarray: not a regular file \(a FIFO\)"):
        jax_ucp.convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


_LATE_CALLBACK = """
import asyncio, sys
import jax_ucp
from jax_ucp._src.importers.orbax import arrays; from jax_ucp._src.store.storage import LocalDirectory
try:
    arrays.tree_metadata(LocalDirectory(sys.argv[1]), False)  # damaged: the hooks go in
except jax_ucp.UCPError:
    pass
loop = asyncio.new_event_loop()
loop.close()
try:
    loop.call_soon_threadsafe(print)
except RuntimeError as e:  # reported as from native code: asyncio's frames only
    sys.excepthook(type(e), e, e.__traceback__.tb_next)
print("native done", flush=True)
loop.call_soon_threadsafe(print)  # the user's own code: shown
"""


def test_a_late_closed_loop_from_native_code_is_left_out_but_a_users_is_shown(tmp_path):
    """The closed-loop report TensorStore prints (through ``sys.excepthook``, as from
    ``PyErr_Print``: asyncio's frames only) is left out after a failed Orbax read; the same
    error raised in the user's own code still prints its traceback."""
    (tmp_path / "_METADATA").write_text(json.dumps({"tree_metadata": [1, 2]}))
    done = subprocess.run(
        [sys.executable, "-c", _LATE_CALLBACK, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    assert "native done" in done.stdout, done.stderr[-3000:]
    assert done.returncode == 1
    assert done.stderr.count("RuntimeError: Event loop is closed") == 1, done.stderr[-3000:]
    assert 'File "<string>", line 16' in done.stderr, done.stderr[-3000:]  # the user's own
