"""The command line on a CheckpointManager run root (``commands.py``): ``--step N|latest`` for
inspect / verify / plan / export, ``latest ROOT``, and ``verify ROOT`` over every committed step;
the step names and the choice are the resume's own (``restoring.resume``)."""

from __future__ import annotations

import glob
import os
import shutil

import numpy as np
import orbax.checkpoint as ocp
import pytest
from typer.testing import CliRunner

import jax_ucp
from jax_ucp._src.cli import app

runner = CliRunner()
WIDE = {"COLUMNS": "300"}


def _run(root, steps=(10, 20, 30)) -> str:
    with ocp.CheckpointManager(root) as mngr:
        for s in steps:
            state = {"w": np.full((4, 4), float(s), np.float32), "step": s}
            mngr.save(s, args=ocp.args.Composite(state=jax_ucp.UCPSave(state)))
        mngr.wait_until_finished()
    return str(root)


def _flip_a_shard_byte(step_dir) -> None:
    shard = next(
        f
        for f in glob.glob(os.path.join(step_dir, "state", "arrays", "**"), recursive=True)
        if os.path.isfile(f) and not f.endswith("zarr.json")
    )
    raw = bytearray(open(shard, "rb").read())
    raw[len(raw) // 3] ^= 0x10
    open(shard, "wb").write(bytes(raw))


def test_inspect_verify_plan_export_take_a_step_of_a_run_root(tmp_path):
    """Users hold run roots: these said "pick one, e.g. …/30/state" (exit 1)."""
    root = _run(tmp_path / "run")
    r = runner.invoke(app, ["inspect", root, "--step", "latest"], env=WIDE)
    assert r.exit_code == 0, r.output
    assert os.path.join(root, "30", "state") in r.output
    r = runner.invoke(app, ["inspect", root, "--step", "10", "--json"], env=WIDE)
    assert r.exit_code == 0 and os.path.join(root, "10", "state") in r.output
    r = runner.invoke(app, ["verify", root, "--step", "20"], env=WIDE)
    assert r.exit_code == 0 and "read back intact" in r.output
    r = runner.invoke(app, ["plan", root, "--step", "latest", "--mesh", "data=1"], env=WIDE)
    assert r.exit_code == 0, r.output
    assert os.path.join(root, "30", "state") in r.output
    out = str(tmp_path / "out")
    r = runner.invoke(app, ["export", root, out, "--step", "20", "--select", ""], env=WIDE)
    assert r.exit_code == 0, r.output
    from safetensors.numpy import load_file

    assert float(load_file(os.path.join(out, "model.safetensors"))["w"][0, 0]) == 20.0


def test_a_step_option_is_the_resumes_step_rule(tmp_path):
    """A step number in other digits is a usage error; a step that is not committed, or a
    step folder linked to another run, is refused naming it."""
    root = _run(tmp_path / "run")
    for bad in ("١٢", "abc", "-1"):
        r = runner.invoke(app, ["inspect", root, "--step", bad], env=WIDE)
        assert r.exit_code == 2 and "--step" in r.output, (bad, r.output)
    r = runner.invoke(app, ["inspect", root, "--step", "40"], env=WIDE)
    assert r.exit_code == 1 and "no committed step 40" in r.output
    other = _run(tmp_path / "other", steps=(40,))
    os.symlink(os.path.join(other, "40"), os.path.join(root, "40"))
    for command in (["inspect", root, "--step", "40"], ["inspect", root, "--step", "latest"]):
        r = runner.invoke(app, command, env=WIDE)
        assert r.exit_code == 1 and "is a link" in r.output, r.output


def test_latest_prints_the_step_a_resume_takes_and_why_newer_ones_were_skipped(tmp_path):
    root = _run(tmp_path / "run")
    r = runner.invoke(app, ["latest", root], env=WIDE)
    assert r.exit_code == 0 and "step 30:" in r.output, r.output
    _flip_a_shard_byte(os.path.join(root, "30"))
    os.remove(os.path.join(root, "20", "state", "ucp.json"))
    shutil.copytree(os.path.join(root, "10"), os.path.join(root, "１５"))
    r = runner.invoke(app, ["latest", root], env=WIDE)
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "step 30 skipped:" in text and "step 20 skipped:" in text and "ucp.json" in text
    assert "１５: not a step" in text
    assert text.endswith(f"step 10: {os.path.join(root, '10', 'state')}")
    with pytest.warns(jax_ucp.ResumeWarning):
        assert jax_ucp.latest_step(root, fallback=True) == 10  # the same rule
    r = runner.invoke(app, ["latest", root, "--no-fallback"], env=WIDE)  # its files are there
    assert r.exit_code == 0 and "step 30:" in r.output and "as it is restored" in r.output
    os.remove(os.path.join(root, "30", "state", "ucp.json"))
    r = runner.invoke(app, ["latest", root, "--no-fallback"], env=WIDE)
    assert r.exit_code == 1 and "latest committed step 30 cannot be read" in r.output


def test_verify_of_a_run_root_checks_every_committed_step(tmp_path):
    root = _run(tmp_path / "run")
    r = runner.invoke(app, ["verify", root], env=WIDE)
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "3 committed steps verified" in text and "a resume takes step 30" in text
    _flip_a_shard_byte(os.path.join(root, "30"))
    r = runner.invoke(app, ["verify", root], env=WIDE)
    text = " ".join(r.output.split())
    assert r.exit_code == 1
    assert "✗ step 30:" in text and "✓ step 20:" in text and "✓ step 10:" in text
    assert "a resume takes step 20 (restore(root, step='latest', fallback=True))" in text
    r = runner.invoke(app, ["verify", root, "--newest", "1"], env=WIDE)
    text = " ".join(r.output.split())
    assert r.exit_code == 1 and "1 committed step verified (the newest of 3)" in text
    assert "step 20" not in text and "no step verified here can be resumed from" in text
