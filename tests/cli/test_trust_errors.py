"""Clear errors instead of raw ones (issue 30): tensor names holding terminal escapes are printed
escaped by every command, damaged Orbax checkpoints and a full disk are one error line naming the
file and the tensor, a zero-size tensor is refused by an Orbax export by name, and an Orbax chunk
declared larger than its array is refused before it is decoded. Every hostile input is built here.
"""

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
from safetensors.numpy import save_file
from typer.testing import CliRunner

import jax_ucp
from jax_ucp import writer
from jax_ucp.cli import app
from jax_ucp.cli.output import printable
from jax_ucp.exporters import ExportError
from jax_ucp.importers import plan_import
from jax_ucp.importers.orbax import OrbaxImportError
from tests.ucp_testing import assert_bit_exact

runner = CliRunner()

# what a terminal obeys: C0 controls (but the line feed between lines), DEL, C1 controls (0x9b
# is CSI), line/paragraph separators, bidi marks, embeddings, overrides and isolates
_OBEYED = {chr(c) for c in [*range(0x20), *range(0x7F, 0xA0)]} - {"\n"}
_OBEYED |= set("\u2028\u2029\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e")
_OBEYED |= set("\u2066\u2067\u2068\u2069")

_HOSTILE = {
    "title\x1b]0;pwned\x07": "title\\x1b]0;pwned\\x07",  # OSC: sets the window title
    "clear\x1b[2J": "clear\\x1b[2J",  # CSI: clears the screen
    "csi1\x9b31m": "csi1\\x9b31m",  # C1 CSI
    "bidi\u202eevil": "bidi\\u202eevil",  # right-to-left override
    "nl\nx\r": "nl\\nx\\r",
    "bell\x07tab\t": "bell\\x07tab\\t",
}
_MARKUP = "mark[bold]up[/bold]"  # Rich markup: shown as it is, never interpreted


def _raw_controls(text: str) -> list[str]:
    return sorted({c for c in text if c in _OBEYED})


def _run_cli(*args: str, env=None, timeout=240) -> subprocess.CompletedProcess:
    """``jax-ucp ARGS`` in a fresh process (stderr as the terminal would show it)."""
    return subprocess.run(
        [sys.executable, "-m", "jax_ucp.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "300", **(env or {})},
    )


def _assert_one_error_line(out: str, *needles: str) -> str:
    """Exactly one ``error:`` line, holding every needle; no traceback, no TensorStore spec."""
    lines = [line for line in out.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, out
    assert "Traceback" not in out and "tensorstore_spec" not in out and "KvStore(" not in out, out
    # nothing but the progress bar of the tensors written before may precede it
    assert all(line.startswith("error:") or "━" in line for line in lines), out
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


# ---------------------------------------------------------------------------------------------
# terminal escapes in tensor names


def test_printable_escapes_every_control_and_keeps_other_text():
    for c in sorted(_OBEYED | {"\n", "\ud800"}):
        out = printable(f"a{c}b")
        assert not _raw_controls(out) and "\ud800" not in out, repr(c)
        assert out.startswith("a\\") and out.endswith("b"), (repr(c), out)
    for text in ("params/w", "é中文🙂", "back\\slash", _MARKUP, "a b"):
        assert printable(text) == text


def _hostile_checkpoints(tmp_path):
    """Two checkpoints whose tensors and saved values carry terminal escapes; B differs in one
    tensor and has a tensor A lacks."""
    names = [*_HOSTILE, _MARKUP]
    a = {n: np.full(3, i, np.float32) for i, n in enumerate(names)}
    b = dict(a)
    b["clear\x1b[2J"] = np.full(3, 9, np.float32)
    b["only\x1b[2Jin_b"] = np.ones(2, np.float32)
    jax_ucp.save(tmp_path / "a", {"params": a, "note\x1b]0;v\x07": "val\x1b[2J"})
    jax_ucp.save(tmp_path / "b", {"params": b, "note\x1b]0;v\x07": "val\x1b[2J"})
    return str(tmp_path / "a"), str(tmp_path / "b")


@pytest.mark.timeout(240)
def test_names_with_terminal_escapes_are_printed_escaped_by_every_command(tmp_path):
    a, b = _hostile_checkpoints(tmp_path)
    env = {"COLUMNS": "250"}
    outputs = {}
    outputs["inspect"] = runner.invoke(app, ["inspect", a], env=env)
    outputs["plan"] = runner.invoke(app, ["plan", a, "--mesh", "x=3"], env=env)
    outputs["diff"] = runner.invoke(app, ["diff", a, b], env=env)
    outputs["verify"] = runner.invoke(app, ["verify", a], env=env)
    outputs["export"] = runner.invoke(
        app, ["export", a, str(tmp_path / "st"), "--to", "torch-dcp"], env=env
    )
    assert outputs["diff"].exit_code == 1  # they differ
    for command, r in outputs.items():
        if command != "diff":
            assert r.exit_code == 0, (command, r.output)
        assert not _raw_controls(r.output), (command, _raw_controls(r.output), r.output)
    for command in ("inspect", "plan"):
        for escaped in _HOSTILE.values():
            assert f"params/{escaped}" in outputs[command].output, (command, escaped)
        assert f"params/{_MARKUP}" in outputs[command].output, command
    assert "note\\x1b]0;v\\x07" in outputs["inspect"].output  # a saved value's name
    assert "val\\x1b[2J" in outputs["inspect"].output  # and its value
    assert "≠ params/clear\\x1b[2J: 3 of 3 elements differ" in outputs["diff"].output
    assert "+ params/only\\x1b[2Jin_b (only in" in outputs["diff"].output
    label = outputs["export"].output.splitlines()[0]  # the progress bar: the last tensor's name
    assert "━" in label and any(f"params.{e}" in label for e in _HOSTILE.values()), label

    # verify's failure lines and the one error line name the tensor, escaped
    (shard,) = [
        os.path.join(d, f)
        for d, _, fs in os.walk(os.path.join(a, "arrays"))
        for f in fs
        if "clear" in d and f != "zarr.json"
    ]
    data = bytearray(open(shard, "rb").read())
    data[3] ^= 0x10
    open(shard, "wb").write(bytes(data))
    r = runner.invoke(app, ["verify", a], env=env)
    assert r.exit_code == 1 and not _raw_controls(r.output), r.output
    assert "✗" in r.output and "clear\\x1b[2J" in r.output
    r = runner.invoke(app, ["export", a, str(tmp_path / "st2")], env=env)
    assert r.exit_code == 1 and not _raw_controls(r.output), r.output
    assert "clear\\x1b[2J" in _assert_one_error_line(r.output)


@pytest.mark.timeout(240)
def test_an_import_and_an_error_print_hostile_names_escaped(tmp_path):
    """A safetensors file whose tensor names carry escapes: the import's progress bar and
    ``✓`` line show them escaped; an error naming a path with escapes is one escaped line."""
    src = tmp_path / "model.safetensors"
    save_file({n: np.ones(2, np.float32) for n in _HOSTILE}, str(src))
    r = runner.invoke(app, ["convert", "safetensors", str(src), str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    assert not _raw_controls(r.output), (_raw_controls(r.output), r.output)
    r = runner.invoke(app, ["inspect", str(tmp_path / "out")], env={"COLUMNS": "250"})
    assert r.exit_code == 0 and not _raw_controls(r.output)
    assert "params/title\\x1b]0;pwned\\x07" in r.output
    odd = tmp_path / "ckpt\x1b]0;pwned\x07"
    odd.mkdir()
    r = runner.invoke(app, ["inspect", str(odd)])
    assert r.exit_code == 1 and not _raw_controls(r.output), r.output
    assert "ckpt\\x1b]0;pwned\\x07" in _assert_one_error_line(r.output)


# ---------------------------------------------------------------------------------------------
# damaged Orbax checkpoints


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
    with pytest.raises(OrbaxImportError, match=r"array 'params\.w'.*is missing") as e:
        jax_ucp.convert(src, tmp_path / "out")
    assert chunk in str(e.value) and "tensorstore_spec" not in str(e.value)
    _only_source_left(tmp_path, src)
    r = _run_cli("convert", "orbax", src, str(tmp_path / "out"))
    assert r.returncode == 1
    _assert_one_error_line(r.stdout + r.stderr, "'params.w'", chunk)
    _only_source_left(tmp_path, src)
    zarray = os.path.join(src, "params.w", ".zarray")
    for damage in (os.remove, lambda f: os.truncate(f, 10)):  # Orbax's metadata read fails
        shutil.copy(os.path.join(src, "params.b", ".zarray"), zarray)
        damage(zarray)
        with pytest.raises(OrbaxImportError, match=r"metadata of array 'params\.w'") as e:
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
        except OrbaxImportError as e:
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
    r = _run_cli("convert", "orbax", copy, str(tmp_path / "out"))
    assert r.returncode == 1
    _assert_one_error_line(r.stdout + r.stderr, "'params.w'", copy, "OCDBT")


# ---------------------------------------------------------------------------------------------
# Orbax export: a full disk, a file-size limit, a zero-size tensor


def _ucp(path, tree) -> str:
    jax_ucp.save(path, tree)
    return os.fspath(path)


def _can_mount_tmpfs(tmp_path) -> bool:
    probe = tmp_path / "probe"
    probe.mkdir()
    try:
        r = subprocess.run(
            ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs '{probe}'"],
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    finally:
        probe.rmdir()
    return r.returncode == 0


@pytest.mark.timeout(240)
def test_export_orbax_into_a_full_file_system_is_one_line_naming_the_destination(tmp_path):
    """A 1 MiB tmpfs (mounted in a private mount namespace) and a 1.2 MB tensor."""
    if not _can_mount_tmpfs(tmp_path):
        pytest.skip("cannot mount a tmpfs here (no user or mount namespaces)")
    w = np.random.default_rng(1).standard_normal(300_000).astype(np.float32)
    ckpt = _ucp(tmp_path / "ckpt", {"params": {"w": w}})
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = (
        f"mount -t tmpfs -o size=1m tmpfs '{mnt}' || exit 99; "
        f"'{sys.executable}' -m jax_ucp.cli export '{ckpt}' '{mnt}/out' --to orbax; "
        f'echo "rc=$?"; echo "left: $(ls -A \'{mnt}\')"'
    )
    r = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=200,
        env={**os.environ, "COLUMNS": "300"},
    )
    out = r.stdout + r.stderr
    assert "rc=1" in out and "left: \n" in out + "\n" and r.returncode == 0, out
    printed = "\n".join(line for line in out.splitlines() if not line.startswith(("rc=", "left:")))
    _assert_one_error_line(printed, f"{mnt}/out", "'params/w'", "No space left on device")


# a file-size limit (SIGXFSZ ignored: a write past it fails with EFBIG), then the command
_LIMITED = (
    "import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
    "resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10)); "
    "os.execv(sys.executable, [sys.executable, '-m', 'jax_ucp.cli', *sys.argv[1:]])"
)


@pytest.mark.timeout(240)
def test_export_orbax_past_the_file_size_limit_is_one_line_naming_the_destination(tmp_path):
    """The same failure without privileges: a 256 KiB file-size limit (EFBIG) on a 1.2 MB
    tensor."""
    w = np.random.default_rng(1).standard_normal(300_000).astype(np.float32)
    ckpt = _ucp(tmp_path / "ckpt", {"params": {"w": w}})
    dst = str(tmp_path / "out")
    r = subprocess.run(
        [sys.executable, "-c", _LIMITED, "export", ckpt, dst, "--to", "orbax"],
        capture_output=True,
        text=True,
        timeout=200,
        env={**os.environ, "COLUMNS": "300"},
    )
    assert r.returncode == 1, r.stdout + r.stderr
    _assert_one_error_line(r.stdout + r.stderr, dst, "'params/w'", "too large")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


@pytest.mark.timeout(120)
def test_export_orbax_refuses_a_zero_size_tensor_by_name(tmp_path):
    """Orbax's own save refuses zero-size arrays, so the export says which tensor, before
    writing anything (it failed with Orbax's raw '1/2 params are missing')."""
    tree = {"params": {"w": np.arange(6, dtype=np.float32), "empty": np.zeros((0, 4), np.float32)}}
    orbax_itself = tmp_path / "orbax_itself"
    orbax_itself.mkdir()
    with pytest.raises(ValueError, match="Cannot save arrays with zero size"):
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as c:
            c.save(os.fspath(orbax_itself / "x"), args=ocp.args.PyTreeSave(tree))
    ckpt = _ucp(tmp_path / "ckpt", tree)
    with pytest.raises(ExportError, match=r"'params/empty'.*export to safetensors or torch-dcp"):
        jax_ucp.export(ckpt, tmp_path / "out", to="orbax")
    r = runner.invoke(app, ["export", ckpt, str(tmp_path / "out"), "--to", "orbax"])
    assert r.exit_code == 1
    _assert_one_error_line(r.output, "'params/empty'", "no elements")
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "orbax_itself"]
    # the other formats hold it
    jax_ucp.export(ckpt, tmp_path / "dcp", to="torch-dcp", select="")


# ---------------------------------------------------------------------------------------------
# an Orbax chunk declared larger than its array


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
        [sys.executable, "-c", launcher, "convert", "orbax", src, str(tmp_path / "out")],
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
    with pytest.raises(OrbaxImportError, match=r"larger than the array") as e:
        jax_ucp.convert(src, tmp_path / "out")
    assert meta_file in str(e.value) and "'params.w'" in str(e.value)
    _only_source_left(tmp_path, src)


@pytest.mark.timeout(240)
def test_orbax_arrays_reserve_their_decoded_chunks_in_the_memory_budget(tmp_path):
    """A (256, 256) float32 array saved as 8 chunks of 32 KiB: under a budget with room for the
    array and one chunk, its read reserves exactly that (TensorStore decodes one chunk at a
    time); under the default budget, more chunks at once; both imports bit-exact."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tests.ucp_testing import mesh

    w = np.random.default_rng(2).standard_normal((256, 256)).astype(np.float32)
    sharded = jax.device_put(w, NamedSharding(mesh((8,), ("x",)), P("x")))
    src = str(tmp_path / "orbax")
    _orbax(src, ocdbt=True, tree={"params": {"w": sharded}})
    array, chunk = w.nbytes, w.nbytes // 8
    budget = array + chunk + chunk // 2
    with writer.memory_budget_scope(budget):
        (item,) = list(plan_import(src).items)
        assert item.value.nbytes == array + chunk
        jax_ucp.convert(src, tmp_path / "small", memory_budget=budget)
    (item,) = list(plan_import(src).items)
    assert item.value.nbytes == array + min(8, os.cpu_count() or 1) * chunk
    for out in ("small",):
        assert_bit_exact(jax_ucp.restore(tmp_path / out)["params"]["w"], w)


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
