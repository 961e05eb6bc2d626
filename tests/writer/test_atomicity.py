"""A save killed midway (SIGKILL) never damages or hides the previous checkpoint."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

import jax_ucp
from tests.ucp_testing import REPO, assert_bit_exact

SAVER = r"""
import sys, numpy as np, jax, jax.numpy as jnp, orbax.checkpoint as ocp, jax_ucp
mode, path = sys.argv[1], sys.argv[2]
block = np.full((1280, 1024), 7, np.float32)
big = {f"t{i}": block for i in range(160)}  # 800 MB to write, so the kill lands mid-save even on fast disks
if mode == "manager":
  with ocp.CheckpointManager(path) as mngr:
    mngr.save(1, args=ocp.args.Composite(state=jax_ucp.UCPSave({"x": np.ones(4, np.float32)})))
    mngr.wait_until_finished()
    print("STEP1", flush=True)
    mngr.save(2, args=ocp.args.Composite(state=jax_ucp.UCPSave(big)))
    mngr.wait_until_finished()
else:
  jax_ucp.save(path, big, force=True)
print("DONE", flush=True)
"""


def _start(mode, path):
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=REPO,
    )
    return subprocess.Popen(
        [sys.executable, "-c", SAVER, mode, str(path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_partial(parent, pattern_in_name, arrays_min=3, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for d in os.listdir(parent):
            full = os.path.join(parent, d)
            if pattern_in_name in d:
                arrays = [r for r, _, fs in os.walk(full) if "zarr.json" in fs]
                if len(arrays) >= arrays_min:
                    return full
        time.sleep(0.02)
    raise AssertionError(f"no partial save appeared under {parent}")


def test_sigkill_during_manager_save_keeps_previous_step(tmp_path):
    root = tmp_path / "run"
    p = _start("manager", root)
    try:
        assert p.stdout.readline().strip() == "STEP1"
        partial = _wait_for_partial(root, "2.orbax-checkpoint-tmp")
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    finally:
        p.kill()
    assert os.path.isdir(partial)  # killed mid-write, not after
    with ocp.CheckpointManager(root) as mngr:
        assert mngr.all_steps() == [1]
        out = mngr.restore(1, args=ocp.args.Composite(state=jax_ucp.UCPRestore()))
    assert_bit_exact(out.state["x"], np.ones(4, np.float32))
    assert not os.path.exists(root / "2")
    # A new manager with cleanup removes the leftover; the next save of step 2 succeeds.
    opts = ocp.CheckpointManagerOptions(cleanup_tmp_directories=True)
    with ocp.CheckpointManager(root, options=opts) as mngr:
        mngr.save(2, args=ocp.args.Composite(state=jax_ucp.UCPSave({"x": np.zeros(4, np.float32)})))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2]
    assert not any("tmp" in d for d in os.listdir(root))


def test_sigkill_during_forced_standalone_save_keeps_old_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    jax_ucp.save(path, {"old": np.arange(10, dtype=np.int32)})
    p = _start("standalone", path)
    try:
        _wait_for_partial(tmp_path, "ckpt.ucp-replacing")
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    finally:
        p.kill()
    back = jax_ucp.restore(path)
    assert list(back) == ["old"]
    assert_bit_exact(back["old"], np.arange(10, dtype=np.int32))
    # A later forced save replaces it cleanly, leftovers included.
    jax_ucp.save(path, {"new": np.ones(3, np.float32)}, force=True)
    assert list(jax_ucp.restore(path)) == ["new"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


HOST_WRITER = r"""
import sys, numpy as np
from jax_ucp.writer import HostItem, write_host_checkpoint
block = np.full((1280, 1024), 7, np.float32)
write_host_checkpoint(sys.argv[1], (HostItem(("params", f"t{i}"), block) for i in range(160)), force=True)
print("DONE", flush=True)
"""


def test_sigkill_during_import_keeps_old_checkpoint_and_next_import_cleans_up(tmp_path):
    """Imports commit without Orbax (temporary sibling + rename): same guarantees, same cleanup."""
    from jax_ucp.writer import HostItem, commit, write_host_checkpoint

    path = tmp_path / "ckpt"
    write_host_checkpoint(path, iter([HostItem(("old",), np.arange(10, dtype=np.int32))]))
    p = subprocess.Popen(
        [sys.executable, "-c", HOST_WRITER, str(path)],
        env=dict(os.environ, PYTHONPATH=REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        partial = _wait_for_partial(tmp_path, "ckpt" + commit.TMP_MARK)
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    finally:
        p.kill()
    assert os.path.isdir(partial)
    assert list(jax_ucp.restore(path)) == ["old"]
    # A live writer's temporary directory (another process on this host) must survive cleanup.
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = f"{path}{commit.TMP_MARK}{commit.socket.gethostname()}.{sleeper.pid}.1"
        os.makedirs(live)
        write_host_checkpoint(path, iter([HostItem(("new",), np.ones(3, np.float32))]), force=True)
        assert sorted(os.listdir(tmp_path)) == [
            "ckpt",
            os.path.basename(live),
        ]  # the killed one's is gone
    finally:
        sleeper.kill()
    assert list(jax_ucp.restore(path)) == ["new"]


@pytest.mark.parametrize("fixture", ["deepspeed/z2_bf16_dp2/ckpt", "megatron/gpt_tp2"])
def test_import_path_needs_neither_jax_nor_orbax(tmp_path, fixture):
    """A conversion is host-only: it must not pay JAX's and Orbax's import (~1 s)."""
    code = (
        "import sys; from jax_ucp.conversion import convert; convert(sys.argv[1], sys.argv[2]); "
        "import jax_ucp.cli; print(sorted(m for m in ('jax', 'orbax.checkpoint', 'torch') if m in sys.modules))"
    )
    src = os.path.join(REPO, "tests", "fixtures", *fixture.split("/"))
    out = subprocess.run(
        [sys.executable, "-c", code, src, str(tmp_path / "ucp")],
        env=dict(os.environ, PYTHONPATH=REPO),
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    assert "params" in jax_ucp.restore(tmp_path / "ucp")


def test_host_write_from_inside_a_running_event_loop(tmp_path):
    """Notebooks run an event loop: the standalone write must not call asyncio.run on it."""
    import asyncio

    from jax_ucp.writer import HostItem, write_host_checkpoint

    async def main():
        return write_host_checkpoint(tmp_path / "c", iter([HostItem(("x",), np.arange(4.0))]))

    out = asyncio.run(main())
    assert_bit_exact(jax_ucp.restore(out)["x"], np.arange(4.0))
