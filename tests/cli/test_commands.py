"""The jax-ucp command line: inspect, verify (detects corruption), errors, demo."""

import os
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

import jax_ucp
from jax_ucp import demo
from jax_ucp.cli import app

runner = CliRunner()


def _ckpt(tmp_path):
    jax_ucp.save(
        tmp_path / "c", {"params": {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}, "step": 2}
    )
    return tmp_path / "c"


def test_inspect_lists_tensors_and_values(tmp_path):
    r = runner.invoke(app, ["inspect", str(_ckpt(tmp_path))], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "params/w" in r.output and "3x4" in r.output and "float32" in r.output
    assert "step" in r.output


def test_verify_reads_everything_and_flags_corruption(tmp_path):
    path = _ckpt(tmp_path)
    r = runner.invoke(app, ["verify", str(path)])
    assert r.exit_code == 0 and "read back intact" in r.output
    shard = path / "arrays" / "params.w" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[3] ^= 0x10
    shard.write_bytes(bytes(data))
    r = runner.invoke(app, ["verify", str(path)], env={"COLUMNS": "300"})
    assert r.exit_code == 1
    assert "params/w" in r.output and "checksum" in r.output


def test_errors_are_one_clear_line(tmp_path):
    r = runner.invoke(app, ["inspect", str(tmp_path / "missing")])
    assert r.exit_code == 1  # a failed operation; 2 is for usage errors
    assert "error:" in r.output and "missing" in r.output and "Traceback" not in r.output
    assert runner.invoke(app, ["inspect"]).exit_code == 2  # usage: missing argument
    (tmp_path / "empty").mkdir()
    r = runner.invoke(app, ["convert", "deepspeed", str(tmp_path / "empty"), str(tmp_path / "out")])
    assert r.exit_code == 1 and "error:" in r.output
    assert "importing" not in r.output  # no empty progress bar before the error
    assert "no DeepSpeed checkpoint" in " ".join(r.output.split())


def test_demo_runs_bit_exact(tmp_path):
    assert demo.run(str(tmp_path))


def test_version():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"jax_ucp {jax_ucp.__version__}"


def test_force_advice_uses_the_cli_flag(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    from safetensors.numpy import save_file

    save_file({"w": np.ones(3, np.float32)}, str(src / "model.safetensors"))
    out = tmp_path / "out"
    assert runner.invoke(app, ["convert", "safetensors", str(src), str(out)]).exit_code == 0
    r = runner.invoke(app, ["convert", "safetensors", str(src), str(out)], env={"COLUMNS": "200"})
    assert r.exit_code == 1 and "--force" in r.output and "force=True" not in r.output


def test_inspect_at_80_columns_is_readable(tmp_path):
    tree = {f"params/layer_{i}": np.zeros((4, 8), np.float32) for i in range(5)}
    tree.update(step=1, lr=0.5)
    jax_ucp.save(tmp_path / "c", tree)
    r = runner.invoke(app, ["inspect", str(tmp_path / "c"), "--limit", "3"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert all(len(line) <= 80 for line in lines), r.output
    header = next(line for line in lines if "name" in line)
    for column in ("name", "shape", "dtype", "size", "role"):
        assert column in header.split(), header
    assert "…" not in header
    text = " ".join(r.output.split())
    assert "5 tensors, 2 values" in text and "… and 4 more" in text
    one = runner.invoke(app, ["inspect", str(_ckpt(tmp_path / "x"))], env={"COLUMNS": "80"})
    assert "1 tensor, 1 value," in " ".join(one.output.split())


def test_inspect_of_a_file_or_a_manager_root_says_what_it_is(tmp_path):
    import orbax.checkpoint as ocp

    (tmp_path / "f").write_text("x")
    r = runner.invoke(app, ["inspect", str(tmp_path / "f")], env={"COLUMNS": "200"})
    assert r.exit_code == 1 and "is a file, not a checkpoint directory" in r.output
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        for step in (10, 20):
            mngr.save(step, args=ocp.args.Composite(state=jax_ucp.UCPSave({"x": np.ones(2)})))
        mngr.wait_until_finished()
    r = runner.invoke(app, ["inspect", str(tmp_path / "run")], env={"COLUMNS": "300"})
    assert r.exit_code == 1
    assert "CheckpointManager directory with 2 steps (10, 20)" in r.output
    assert str(tmp_path / "run" / "20" / "state") in r.output
    assert runner.invoke(app, ["inspect", str(tmp_path / "run" / "20")]).exit_code == 0


def test_demo_leaves_nothing_in_the_temp_dir(tmp_path, monkeypatch):
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    assert demo.run()
    assert list(scratch.iterdir()) == []


def test_verify_reports_each_problem_once(tmp_path):
    path = _ckpt(tmp_path)
    shard = path / "arrays" / "params.w" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[3] ^= 0x10
    shard.write_bytes(bytes(data))
    r = runner.invoke(app, ["verify", str(path)], env={"COLUMNS": "300"})
    assert r.exit_code == 1
    problems = [line for line in r.output.splitlines() if line.startswith("✗")]
    assert len(problems) == 1 and problems[0].count("params/w") == 1, r.output
    assert problems[0].count("checksum") == 1 and r.output.count(str(shard)) == 1
    assert r.output.splitlines()[-1] == "1 tensor of 1 failed"
    (tmp_path / "f").write_text("x")
    r = runner.invoke(app, ["verify", str(tmp_path / "f")], env={"COLUMNS": "300"})
    assert r.exit_code == 1 and "is a file, not a checkpoint directory" in r.output


def test_inspect_wraps_long_names_at_slashes_and_shows_values(tmp_path):
    deep = "params/transformer/layers_0/attention/query_key_value/kernel"
    jax_ucp.save(
        tmp_path / "c",
        {deep: np.zeros((64, 192), np.float32), "lr": 0.25, "name": "x" * 100},
        logical_axes={deep: ("embed", "mlp"), "lr": None, "name": None},
    )
    r = runner.invoke(app, ["inspect", str(tmp_path / "c")], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert all(len(line) <= 80 for line in lines), r.output
    name_lines = [line.split()[0] for line in lines if "attention" in line or "kernel" in line]
    assert "".join(name_lines) == deep and all(n.endswith("/") for n in name_lines[:-1])
    assert any(line.split()[:2] == ["lr", "0.25"] for line in lines)
    assert "'xxxxxxx" in r.output and "…" in r.output  # a long value is cut, not wrapped
    r = runner.invoke(app, ["inspect", str(tmp_path / "c")], env={"COLUMNS": "160"})
    header = next(line for line in r.output.splitlines() if line.startswith("name"))
    assert "logical axes" in header  # room for it when wide
    assert "saved spec" not in header  # numpy arrays have none: the empty column is dropped
    assert "(embed, mlp)" in r.output


@pytest.mark.parametrize("max_read_bytes", [1, 3 * 4096, None], ids=["one", "three", "default"])
def test_verify_checks_several_tensors_at_once_and_reports_in_order(tmp_path, max_read_bytes):
    """However many tensors are checked together (the read budget), every damaged one is
    reported once, in manifest order, and progress counts each tensor once, in order."""
    tree = {f"t{i}": np.full((32, 32), i, np.float32) for i in range(12)}  # 4 KiB each
    path = tmp_path / "c"
    jax_ucp.save(path, tree)
    damaged = ["t2", "t3", "t9"]
    for name in damaged:
        shard = path / "arrays" / name / "c" / "0" / "0"
        data = bytearray(shard.read_bytes())
        data[5] ^= 0x01
        shard.write_bytes(bytes(data))
    seen = []
    problems = jax_ucp.verify(
        path, max_read_bytes=max_read_bytes, progress=lambda n, d, t: seen.append((n, d, t))
    )
    order = [e.name for e in jax_ucp.inspect(path).tensors]
    assert [name for name, _ in problems] == [n for n in order if n in damaged]
    assert all("checksum" in message for _, message in problems)
    assert seen == [(n, i, 12) for i, n in enumerate(order, 1)]


def _inspect_raising(monkeypatch, error):
    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(jax_ucp, "inspect", broken)


@pytest.mark.timeout(60)
def test_a_refusal_is_one_line_a_bug_is_not_caught_ctrl_c_exits_130(tmp_path, monkeypatch):
    path = str(_ckpt(tmp_path))
    _inspect_raising(monkeypatch, jax_ucp.RequestError(f"{path}: refused as asked"))
    r = runner.invoke(app, ["inspect", path])
    assert (r.exit_code, r.output.strip()) == (1, f"error: {path}: refused as asked")
    _inspect_raising(monkeypatch, TypeError("unsupported operand type(s) for +: 'int' and 'str'"))
    r = runner.invoke(app, ["inspect", path])
    assert r.exit_code == 1 and "error:" not in r.output
    assert isinstance(r.exception, TypeError) and "unsupported operand" in str(r.exception)
    _inspect_raising(monkeypatch, KeyboardInterrupt())
    r = runner.invoke(app, ["inspect", path])
    assert r.exit_code == 130 and "error:" not in r.output


@pytest.mark.timeout(120)
def test_a_bug_prints_its_traceback_from_the_console_script(tmp_path):
    code = (
        "import sys, jax_ucp\n"
        "from jax_ucp.cli import main\n"
        "def broken(*a, **k):\n"
        "    raise TypeError('a bug, not a refusal')\n"
        "jax_ucp.inspect = broken\n"
        "sys.argv = ['jax-ucp', 'inspect', sys.argv[1]]\n"
        "main()\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(_ckpt(tmp_path))],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "COLUMNS": "200", "JAX_PLATFORMS": "cpu"},
    )
    assert r.returncode == 1, r.stderr
    assert "Traceback" in r.stderr and "TypeError: a bug, not a refusal" in r.stderr, r.stderr
    assert "error:" not in r.stdout + r.stderr
