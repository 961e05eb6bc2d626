"""Exporting to Orbax: a full file system or the file-size limit is one error line naming the
destination; a zero-size tensor is refused by name."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest
from typer.testing import CliRunner

import jax_ucp
from jax_ucp.cli import app
from jax_ucp.errors import RequestError
from jax_ucp.exporters import OrbaxExport, TorchDcpExport
from tests.ucp_testing import assert_one_error_line as _assert_one_error_line
from tests.ucp_testing import save_and_name as _ucp

runner = CliRunner()


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
    with (
        pytest.raises(ValueError, match="Cannot save arrays with zero size"),
        ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as c,
    ):
        c.save(os.fspath(orbax_itself / "x"), args=ocp.args.PyTreeSave(tree))
    ckpt = _ucp(tmp_path / "ckpt", tree)
    with pytest.raises(RequestError, match=r"'params/empty'.*export to safetensors or torch-dcp"):
        jax_ucp.export(ckpt, tmp_path / "out", OrbaxExport())
    r = runner.invoke(app, ["export", ckpt, str(tmp_path / "out"), "--to", "orbax"])
    assert r.exit_code == 1
    _assert_one_error_line(r.output, "'params/empty'", "no elements")
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "orbax_itself"]
    # the other formats hold it
    jax_ucp.export(ckpt, tmp_path / "dcp", TorchDcpExport(select=""))
