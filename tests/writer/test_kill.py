"""SIGKILL at random moments of forced saves, manager saves and converts: every checkpoint that
was committed before restores bit-exact afterwards, and the path is never left unreadable.

Each case starts a worker that saves in a loop (each save with its own values), kills it after
a random (seeded) delay, and then checks what is on disk: the checkpoint at the path is one
whole earlier save, never a mix, and never missing once one save committed.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

import jax_ucp
from tests.ucp_testing import REPO, assert_bit_exact

pytestmark = pytest.mark.timeout(180)

FORCED = textwrap.dedent(
    """
    import sys, numpy as np, jax_ucp
    path = sys.argv[1]
    print("READY", flush=True)
    for v in range(1, 1000):
        jax_ucp.save(path, {f"t{i}": np.full((256, 512), v, np.float32) for i in range(24)},
                     force=True)
        print("SAVED", v, flush=True)
    """
)

MANAGER = textwrap.dedent(
    """
    import sys, numpy as np, jax, orbax.checkpoint as ocp, jax_ucp
    root = sys.argv[1]
    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    with ocp.CheckpointManager(root, options=options) as mngr:
        print("READY", flush=True)
        for step in range(1000):
            state = {f"t{i}": jax.numpy.full((256, 512), step, np.float32) for i in range(24)}
            mngr.save(step, args=ocp.args.Composite(state=jax_ucp.UCPSave(state)))
            print("SAVED", step, flush=True)
    """
)

CONVERT = textwrap.dedent(
    """
    import sys, jax_ucp
    src, dest = sys.argv[1], sys.argv[2]
    print("READY", flush=True)
    for n in range(1000):
        jax_ucp.convert(src, dest, force=True)
        print("SAVED", n, flush=True)
    """
)

DS_FIXTURE = os.path.join(REPO, "tests", "fixtures", "deepspeed", "z2_bf16_dp2", "ckpt")


def _run_and_kill(script, args, seed, max_delay):
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"),
    )
    assert proc.stdout.readline().startswith("READY"), proc.stderr.read()[-3000:]
    time.sleep(random.Random(seed).uniform(0.05, max_delay))
    proc.send_signal(signal.SIGKILL)
    out, _err = proc.communicate(timeout=60)
    return out


def _single_value(tree) -> float:
    values = {float(np.unique(np.asarray(a))[0]) for a in tree.values()}
    assert len(values) == 1, f"a mix of saves: {sorted(values)}"
    return values.pop()


def _seeds(seeds, slow):
    """The seeds, those in ``slow`` marked slow (CI stage 2 runs every seed). Each seed is a kill
    delay drawn from the same range; the default set keeps the ones spread over that range (the
    delays, in seconds: forced saves 0.58 1.33 2.51 3.83, manager saves 0.92 3.51 5.88, converts
    0.16 1.02 1.92); each slow one is within 0.5 s of a kept one, or, for forced seed 6 (3.18)
    and manager seed 5 (5.27), between two kept ones."""
    return [pytest.param(s, marks=pytest.mark.slow) if s in slow else s for s in seeds]


@pytest.mark.parametrize("seed", _seeds(range(8), slow={0, 3, 4, 6}))
def test_sigkill_during_forced_saves(tmp_path, seed):
    path = tmp_path / "c"
    out = _run_and_kill(FORCED, [path], seed, 4.0)
    committed = [int(line.split()[1]) for line in out.splitlines() if line.startswith("SAVED")]
    if not committed and not os.path.exists(path):
        return  # killed before the first save committed: nothing was promised
    got = jax_ucp.restore(path)
    assert len(got) == 24
    value = _single_value(got)
    # The last save reported, or the one after it (committed, killed before printing).
    last = committed[-1] if committed else 0
    assert value in (last, last + 1), (value, committed[-3:])
    jax_ucp.save(path, {"x": np.ones(3)}, force=True)  # the next save recovers any leftovers
    assert sorted(n for n in os.listdir(tmp_path)) == ["c"]


@pytest.mark.parametrize("seed", _seeds(range(6), slow={2, 3, 4, 5}))
def test_sigkill_during_manager_saves(tmp_path, seed):
    import orbax.checkpoint as ocp

    root = tmp_path / "run"
    _run_and_kill(MANAGER, [root], 100 + seed, 6.0)
    if not os.path.exists(root):
        return
    with ocp.CheckpointManager(root) as mngr:
        steps = mngr.all_steps()
        for step in steps:
            try:
                got = mngr.restore(step, args=ocp.args.Composite(state=jax_ucp.UCPRestore()))
            except (jax_ucp.UCPError, KeyError) as e:
                # Orbax deletes steps beyond max_to_keep=2 with a plain rmtree: a kill during
                # that deletion leaves a half-deleted old step listed. It must be one of those
                # being deleted (never a kept one) and read as a clear error, not garbage: ours
                # when the item is partly gone, Orbax's KeyError when its folder is gone.
                said = "missing" if isinstance(e, jax_ucp.UCPError) else "was not found"
                assert step < sorted(steps)[-2] and said in str(e), (step, steps, e)
                continue
            assert len(got.state) == 24
            assert _single_value(got.state) == step


@pytest.mark.parametrize("seed", _seeds(range(6), slow={1, 3, 5}))
def test_sigkill_during_converts(tmp_path, seed):
    reference = jax_ucp.convert(DS_FIXTURE, tmp_path / "reference")
    want = jax_ucp.restore(reference)
    dest = tmp_path / "c"
    _run_and_kill(CONVERT, [DS_FIXTURE, dest], 200 + seed, 2.5)
    if not os.path.exists(dest) and not os.path.exists(str(dest) + ".ucp-replacing"):
        return
    got = jax_ucp.restore(dest)
    for top in want:
        for name, value in want[top].items() if isinstance(want[top], dict) else []:
            if isinstance(value, dict):
                for k, v in value.items():
                    assert_bit_exact(got[top][name][k], v, f"{top}/{name}/{k}")
            else:
                assert_bit_exact(got[top][name], value, f"{top}/{name}")


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
        _wait_for_partial(tmp_path, "ckpt.ucp-tmp-")
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
from jax_ucp._src.writer import HostItem, write_host_checkpoint
block = np.full((1280, 1024), 7, np.float32)
write_host_checkpoint(sys.argv[1], (HostItem(("params", f"t{i}"), block) for i in range(160)), force=True)
print("DONE", flush=True)
"""


def test_sigkill_during_import_keeps_old_checkpoint_and_next_import_cleans_up(tmp_path):
    """Imports commit without Orbax (temporary sibling + rename): same guarantees, same cleanup."""
    from jax_ucp._src.store.storage import local
    from jax_ucp._src.writer import HostItem, write_host_checkpoint

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
        partial = _wait_for_partial(tmp_path, "ckpt" + local.TMP_MARK)
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    finally:
        p.kill()
    assert os.path.isdir(partial)
    assert list(jax_ucp.restore(path)) == ["old"]
    # A live writer's temporary directory (another process on this host) must survive cleanup.
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = f"{path}{local.TMP_MARK}{socket.gethostname()}.{sleeper.pid}.1"
        os.makedirs(live)
        write_host_checkpoint(path, iter([HostItem(("new",), np.ones(3, np.float32))]), force=True)
        assert sorted(os.listdir(tmp_path)) == [
            "ckpt",
            os.path.basename(live),
        ]  # the killed one's is gone
    finally:
        sleeper.kill()
    assert list(jax_ucp.restore(path)) == ["new"]
