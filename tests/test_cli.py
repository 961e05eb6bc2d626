"""The jax-ucp command line: inspect, verify (detects corruption), errors, demo."""

import numpy as np
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
    assert "params/w" in r.output and "(3, 4)" in r.output and "float32" in r.output
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
    assert r.exit_code == 2
    assert "error:" in r.output and "missing" in r.output and "Traceback" not in r.output
    (tmp_path / "empty").mkdir()
    r = runner.invoke(app, ["convert", "deepspeed", str(tmp_path / "empty"), str(tmp_path / "out")])
    assert r.exit_code == 2 and "error:" in r.output
    assert "no DeepSpeed checkpoint" in " ".join(r.output.split())


def test_demo_runs_bit_exact(tmp_path):
    assert demo.run(str(tmp_path))
