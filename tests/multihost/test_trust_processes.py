"""A conversion across processes that loses one of them (SIGKILL) fails within a bound, names the
lost process (index and pid), never commits after the loss, and leaves nothing a following
convert does not remove; the following convert succeeds, bit-exact.

The kill points are set from outside the library: a ``sitecustomize`` written by the test (on
the children's PYTHONPATH) makes the chosen process SIGKILL itself at the chosen point, or the
test kills it at a random moment of the write."""

from __future__ import annotations

import glob
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

import jax_ucp
from jax_ucp.multihost.agreement import SharedWriteError
from jax_ucp.writer import HostItem, write_shared_checkpoint
from tests.ucp_testing import REPO, free_port

BOUND = 60  # seconds any one run may take: a hang is a failure
N_TENSORS = 12

HOOK = r"""
import os, signal

_spec = os.environ.get("UCP_TEST_KILL")  # "<process index>:<point>[:<n>]"
if _spec:
    with open("/proc/self/cmdline", "rb") as f:
        _argv = f.read().decode().split("\0")
    _rank, _point, *_n = _spec.split(":")
    if "--process-id" in _argv and _argv[_argv.index("--process-id") + 1] == _rank:
        import jax_ucp.multihost.agreement
        import jax_ucp.writer.checkpoint as ck

        def _die():
            with open(os.environ["UCP_TEST_KILLED"], "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)

        _agree = ck.agree

        def agree(gather, step, *args, **kwargs):
            if step == _point:  # "planned": before anything is written; "written": all written
                _die()
            return _agree(gather, step, *args, **kwargs)

        ck.agree = jax_ucp.multihost.agreement.agree = agree
        _write_stream = ck.write_stream

        def write_stream(directory, items, **kwargs):
            def counted():
                for i, item in enumerate(items):
                    if _point == "item" and i == int(_n[0]):
                        _die()
                    yield item

            return _write_stream(directory, counted(), **kwargs)

        ck.write_stream = write_stream
        _commit = ck.commit.commit

        def commit(tmp, path):
            if _point == "commit":  # the primary, parts merged, before the rename
                _die()
            return _commit(tmp, path)

        ck.commit.commit = commit
"""


def _source(tmp_path) -> str:
    rng = np.random.default_rng(1)
    tensors = {
        f"layer.{i}.w": rng.standard_normal((96, 64)).astype(np.float32) for i in range(N_TENSORS)
    }
    src = tmp_path / "hf"
    src.mkdir()
    save_file(tensors, str(src / "model.safetensors"))
    return str(src)


def _env(tmp_path, **extra) -> dict:
    hooks = tmp_path / "hooks"
    hooks.mkdir(exist_ok=True)
    (hooks / "sitecustomize.py").write_text(HOOK)
    env = dict(os.environ, JAX_PLATFORMS="cpu", **extra)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(hooks), REPO, env.get("PYTHONPATH", "")])
    return env


def _convert(src, dst, *extra, env):
    return subprocess.Popen(
        [sys.executable, "-m", "jax_ucp.cli", "convert", "safetensors", src, dst, *extra]
        + ["--processes", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=REPO,
    )


def _children(parent: int) -> dict[int, int]:
    """process index -> pid of the convert processes ``parent`` spawned."""
    try:
        with open(f"/proc/{parent}/task/{parent}/children") as f:
            pids = [int(p) for p in f.read().split()]
    except OSError:
        return {}
    found = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
        except OSError:
            continue
        if "--process-id" in argv:
            found[int(argv[argv.index("--process-id") + 1])] = pid
    return found


def _same(a, b):
    x, y = jax_ucp.restore(a), jax_ucp.restore(b)
    fx = dict(jax.tree_util.tree_leaves_with_path(x))
    fy = dict(jax.tree_util.tree_leaves_with_path(y))
    assert fx.keys() == fy.keys()
    for k in fx:
        u, v = np.asarray(fx[k]), np.asarray(fy[k])
        assert u.dtype == v.dtype and u.shape == v.shape and u.tobytes() == v.tobytes(), k
    assert jax_ucp.verify(b) == []


def _beside(tmp_path, name) -> list[str]:
    return sorted(d for d in os.listdir(tmp_path) if d.startswith((name + ".", "." + name + ".")))


@pytest.mark.timeout(6 * BOUND)
def test_a_killed_process_fails_the_convert_and_the_next_one_succeeds(tmp_path):
    """Four runs of ``convert --processes 2``, each losing one process (index chosen at random)
    to SIGKILL: before anything is written, after a random number of tensors (replacing a
    committed DST with --force), after its whole part is written or just before the primary's
    rename, and at a random moment from the children's start to the commit. Each exits 1 within
    the bound naming the killed process and its pid; DST is absent, or the old one intact
    (save_id, verify), or, if the kill came after the commit, committed and whole; nothing is
    left beside it. A following convert succeeds, bit-exact to a single process."""
    seed = time.time_ns() % 10**6
    rng = random.Random(seed)
    src = _source(tmp_path)
    single = str(tmp_path / "single")
    jax_ucp.convert(src, single)
    dst = str(tmp_path / "out")
    first = rng.randrange(2)
    trials = [
        (first, "planned", None, False),
        (1 - first, "item", rng.randrange(1, N_TENSORS // 2), True),
        (0, "commit", None, False) if rng.randrange(2) else (1, "written", None, False),
        (rng.randrange(2), "random", None, False),
    ]
    for rank, point, n, forced in trials:
        where = f"seed {seed}: process {rank} killed at {point} {n}"
        if forced:
            jax_ucp.convert(src, dst)
            before = jax_ucp.inspect(dst).save_id
        killed = tmp_path / "killed"
        killed.unlink(missing_ok=True)
        spec = f"{rank}:{point}" + (f":{n}" if n is not None else "")
        env = _env(tmp_path, UCP_TEST_KILL=spec, UCP_TEST_KILLED=str(killed))
        proc = _convert(src, dst, *(["--force"] if forced else []), env=env)
        if point == "random":  # from the children's start until the commit at the latest
            deadline = time.monotonic() + BOUND
            while len(children := _children(proc.pid)) < 2 and time.monotonic() < deadline:
                time.sleep(0.002)
            deadline = time.monotonic() + rng.uniform(0, 4)
            while not os.path.exists(dst) and time.monotonic() < deadline:
                time.sleep(0.002)
            os.kill(children[rank], signal.SIGKILL)
            killed.write_text(str(children[rank]))
        out, _ = proc.communicate(timeout=BOUND)
        if point == "random" and proc.returncode == 0:  # it had exited: the kill came too late
            _same(single, dst)
            shutil.rmtree(dst)
            continue
        assert proc.returncode == 1, f"{where}\n{out}"
        assert killed.exists(), f"{where}\n{out}"
        assert f"process {rank} (pid {killed.read_text()}) was killed by SIGKILL" in out, where
        assert "Check failure stack trace" not in out, where
        if forced:
            assert f"nothing was committed: {dst} is unchanged" in out, f"{where}\n{out}"
            assert jax_ucp.inspect(dst).save_id == before, where
            assert jax_ucp.verify(dst) == [], where
            assert _beside(tmp_path, "out") == [], where
            shutil.rmtree(dst)
        elif "was committed before that" in out:  # a random kill after the rename
            assert point == "random", f"{where}\n{out}"
            _same(single, dst)
            assert _beside(tmp_path, "out") == [], where
            shutil.rmtree(dst)
        else:
            assert f"nothing was committed: {dst} is absent" in out, f"{where}\n{out}"
            assert not os.path.lexists(dst) and _beside(tmp_path, "out") == [], where
    proc = _convert(src, dst, "--force", env=_env(tmp_path))
    out, _ = proc.communicate(timeout=BOUND)
    assert proc.returncode == 0, out
    _same(single, dst)
    assert _beside(tmp_path, "out") == []


WORKER = r"""
import os, signal, sys
import jax
index, port, src, dst, die = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=index, initialization_timeout=60)
import jax_ucp
from jax_ucp.format import safetensors as safetensors_hf
read = safetensors_hf.SafetensorsFile.tensor
count = [0]
def tensor(self, name):
    count[0] += 1
    if str(index) == die and count[0] == 3:  # mid-write
        os.kill(os.getpid(), signal.SIGKILL)
    return read(self, name)
safetensors_hf.SafetensorsFile.tensor = tensor
try:
    jax_ucp.convert(src, dst, distributed=True, force=True, barrier_timeout=120)
    print("OK", flush=True)
except Exception as e:
    print("FAILED", type(e).__name__, e, flush=True)
    os._exit(3)  # jax.distributed's shutdown would wait for the lost process
"""


def _job(tmp_path, src, dst, die: int):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(i), port, src, dst, str(die)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=REPO,
        )
        for i in range(2)
    ]
    return [(p.pid, p.communicate(timeout=BOUND)[0], p.returncode) for p in procs]


@pytest.mark.timeout(4 * BOUND)
def test_library_job_names_a_lost_process_and_the_next_convert_cleans_up(tmp_path):
    """``convert(distributed=True)`` in a jax.distributed job, no parent watching. Process 1
    killed mid-write: process 0 raises ProcessLostError naming it (index, pid, host) at once
    (not after jax's 100 s heartbeat), removes the temporary directory, and the committed DST
    is untouched. Process 0 (the coordinator) killed mid-write: jax ends process 1; the
    temporary directory, named after process 0, is removed by the next convert, which commits."""
    src = _source(tmp_path)
    dst = str(tmp_path / "out")
    jax_ucp.convert(src, dst)
    before = jax_ucp.inspect(dst).save_id
    (pid0, out0, code0), (pid1, _, code1) = _job(tmp_path, src, dst, die=1)
    assert code1 == -signal.SIGKILL
    assert code0 == 3, out0
    assert (
        f"FAILED ProcessLostError {dst}: not committed; process 1 (pid {pid1} on "
        f"{socket.gethostname()}) died while process 0 waited for it at 'written'"
    ) in out0
    assert jax_ucp.inspect(dst).save_id == before and jax_ucp.verify(dst) == []
    assert _beside(tmp_path, "out") == []

    (pid0, _, code0), (_, out1, code1) = _job(tmp_path, src, dst, die=0)
    assert code0 == -signal.SIGKILL
    assert code1 != 0, out1
    left = [d for d in _beside(tmp_path, "out") if d.startswith("out.")]
    assert len(left) == 1 and left[0].startswith(f"out.ucp-tmp-{socket.gethostname()}.{pid0}.")
    assert jax_ucp.inspect(dst).save_id == before
    jax_ucp.convert(src, dst, force=True)
    assert jax_ucp.inspect(dst).save_id != before
    assert _beside(tmp_path, "out") == []
    single = str(tmp_path / "single")
    jax_ucp.convert(src, single)
    _same(single, dst)


class _Exchange:
    """``gather`` for threads standing in for the processes of a shared write."""

    def __init__(self, count: int):
        self.count, self.values, self.cond = count, {}, threading.Condition()

    def gather_of(self, index: int, before=None):
        def gather(step, value, wait=True):
            if before is not None:
                before(step)
            with self.cond:
                self.values[step, index] = value
                self.cond.notify_all()
                if not wait:
                    return []
                everyone = lambda: all((step, i) in self.values for i in range(self.count))  # noqa: E731
                assert self.cond.wait_for(everyone, timeout=30), f"no one else at {step}"
                return [self.values[step, i] for i in range(self.count)]

        return gather


def _shared_write(dest, keys_of, before_of=lambda i: None):
    """Process i (a thread) writes ``keys_of(i)``; each thread's result or error."""
    exchange, results = _Exchange(2), [None, None]

    def items_of(i):
        for k in keys_of(i):  # "step": a JSON scalar, no array
            value = 7 if k == "step" else np.full((4, 3), len(k), np.float32)
            yield HostItem(("params", k), value, role="param")

    def run(i):
        items = items_of(i)
        gather = exchange.gather_of(i, before_of(i))
        try:
            results[i] = write_shared_checkpoint(dest, items, index=i, count=2, gather=gather)
        except Exception as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


@pytest.mark.timeout(60)
def test_shared_write_commits_only_the_parts_its_processes_reported(tmp_path):
    """The primary merges a part only if it is byte for byte the one its process reported
    (sha256 exchanged with its "done"): a part changed after it was reported is an error in
    both processes naming it, and nothing is committed or left behind."""
    dest = str(tmp_path / "out")

    def change_after_reporting(i):
        def before(step):
            if i == 1 and step == "written":  # its sha256 is in the value it is posting
                (part,) = glob.glob(dest + ".ucp-tmp-*/ucp.part-1.json")
                with open(part, "a") as f:
                    f.write(" ")

        return before

    keys = [["a", "c"], ["b", "d"]]
    results = _shared_write(dest, keys.__getitem__, change_after_reporting)
    assert isinstance(results[0], SharedWriteError), results
    assert re.fullmatch(
        r".*/out\.ucp-tmp-[^/]*/ucp\.part-1\.json: not the part process 1 reported "
        r"\(sha256 [0-9a-f]{64}, found [0-9a-f]{64}\)",
        str(results[0]),
    ), results[0]
    assert isinstance(results[1], SharedWriteError)
    assert str(results[1]).startswith(
        f"{dest}: not committed; it failed in process 0: SharedWriteError: "
    )
    assert not os.path.lexists(dest) and _beside(tmp_path, "out") == []
    results = _shared_write(dest, keys.__getitem__)  # the same, untouched: committed
    assert results == [dest, dest]
    assert sorted(jax_ucp.restore(dest)["params"]) == ["a", "b", "c", "d"]


@pytest.mark.timeout(60)
def test_shared_write_refuses_a_tensor_written_by_two_processes(tmp_path):
    dest = str(tmp_path / "out")
    """An entry in two processes' parts (their shares overlap) is refused by the merge: a
    tensor's second writer already fails (its array exists), a JSON value has no file."""
    keys = [["a", "step"], ["b", "step"]]
    results = _shared_write(dest, keys.__getitem__)
    assert isinstance(results[0], SharedWriteError)
    assert str(results[0]).endswith(
        "ucp.part-1.json: 'params/step' written by process 0 and process 1"
    ), results[0]
    assert str(results[1]).startswith(f"{dest}: not committed; it failed in process 0: ")
    assert not os.path.lexists(dest) and _beside(tmp_path, "out") == []


@pytest.mark.timeout(2 * BOUND)
def test_coordinator_process_names_a_lost_peer_and_exits(tmp_path):
    """``jax-ucp convert ... --coordinator`` (one process of a job, no parent watching): process
    1 killed after two tensors, process 0 exits 1 at once with one line naming it, instead of
    waiting in jax.distributed's shutdown for the lost process (its 100 s heartbeat timeout)
    and aborting with a C++ stack; nothing is left beside DST."""
    src = _source(tmp_path)
    dst = str(tmp_path / "out")
    env = _env(tmp_path, UCP_TEST_KILL="1:item:2", UCP_TEST_KILLED=str(tmp_path / "killed"))
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "jax_ucp.cli", "convert", "safetensors", src, dst]
            + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
            + ["--process-id", str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=REPO,
        )
        for i in range(2)
    ]
    out = procs[0].communicate(timeout=BOUND)[0]
    procs[1].communicate(timeout=BOUND)
    assert procs[1].returncode == -signal.SIGKILL
    assert procs[0].returncode == 1, out
    pid = (tmp_path / "killed").read_text()
    assert (
        f"error: {dst}: not committed; process 1 (pid {pid} on {socket.gethostname()}) died "
        f"while process 0 waited for it at 'written'"
    ) in " ".join(out.split()), out
    assert "Check failure stack trace" not in out
    assert _beside(tmp_path, "out") == []
