"""Conversion across processes (``convert(..., distributed=True)``, ``jax-ucp convert
--processes N``): every process of a jax.distributed job on 127.0.0.1 reads and writes its share
of the parameters into one directory; process 0 commits once. The result equals the
single-process conversion bit for bit, entry for entry; a failure in any process leaves the
destination untouched."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

import jax_ucp
from jax_ucp.conversion import MegatronOptions
from tests.ucp_testing import REPO, free_port, run_cli

pytestmark = pytest.mark.timeout(300)
DS = os.path.join(REPO, "tests", "fixtures", "deepspeed")
MEGATRON = os.path.join(REPO, "tests", "fixtures", "megatron")


def _leaves(path):
    return dict(jax.tree_util.tree_leaves_with_path(jax_ucp.restore(path)))


def _assert_same_checkpoint(single, shared):
    a, b = _leaves(single), _leaves(shared)
    assert a.keys() == b.keys()
    for key in a:
        x, y = np.asarray(a[key]), np.asarray(b[key])
        assert x.dtype == y.dtype and x.shape == y.shape, key
        assert x.tobytes() == y.tobytes(), jax.tree_util.keystr(key)
    ma, mb = jax_ucp.inspect(single), jax_ucp.inspect(shared)
    assert [e.name for e in ma.tensors] == [e.name for e in mb.tensors]  # same order
    assert ma.source == mb.source
    assert jax_ucp.verify(shared) == []
    parent, name = os.path.split(shared)
    assert [d for d in os.listdir(parent) if d.startswith(name + ".")] == []  # nothing left


@pytest.mark.parametrize(
    "fmt, src, extra",
    [
        ("deepspeed", os.path.join(DS, "z3_bf16_dp3", "ckpt"), []),
        pytest.param(  # the default run keeps one layout per importer family (5-6 s each)
            "deepspeed",
            os.path.join(DS, "megatron_ds_tp2_pp2_dp2_z1_bf16_synthetic", "ckpt"),
            [],
            marks=pytest.mark.slow,
        ),
        (
            "megatron",
            os.path.join(MEGATRON, "mcore_versions", "0.16.1", "gpt_distopt_tp2pp2_dp_reshardable"),
            ["--vocab-size", "61"],
        ),
        pytest.param(
            "megatron",
            os.path.join(MEGATRON, "legacy_gpt_distopt_pp2dp2_synthetic"),
            ["--vocab-size", "61"],
            marks=pytest.mark.slow,
        ),
    ],
    ids=["zero3", "megatron-deepspeed", "torch_dist-dp_reshardable", "legacy-distrib_optim"],
)
def test_cli_processes_equal_a_single_process(tmp_path, fmt, src, extra):
    single = str(tmp_path / "single")
    importing = MegatronOptions(vocab_size=61) if extra else None
    jax_ucp.convert(src, single, format=fmt, importing=importing)
    shared = str(tmp_path / "shared")
    r = run_cli("convert", src, shared, "--from", fmt, *extra, "--processes", "3")
    assert r.returncode == 0, r.stdout + r.stderr
    _assert_same_checkpoint(single, shared)


WORKER = r"""
import os, sys
import jax
pid, n, port, src, dst = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=n,
                           process_id=pid, initialization_timeout=120)
import jax_ucp
from jax_ucp._src.format import safetensors as safetensors_hf
if os.environ.get("FAIL_PROCESS") == str(pid):
    def broken(self, name):
        raise OSError(f"disk gone while reading {name}")
    safetensors_hf.SafetensorsFile.tensor = broken
try:
    out = jax_ucp.convert(src, dst, distributed=True, force=True, barrier_timeout=120)
    print("OK", out)
except Exception as e:
    print("FAILED", type(e).__name__, e)
    sys.exit(3)
"""


def _run_job(tmp_path, src, dst, n=2, fail=None):
    port = str(free_port())
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    if fail is not None:
        env["FAIL_PROCESS"] = str(fail)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(i), str(n), port, src, dst],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=REPO,
        )
        for i in range(n)
    ]
    return [(p.wait(timeout=240), p.stdout.read()) for p in procs]


def _safetensors(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {f"layer.{i}.w": rng.standard_normal((64, 48)).astype(np.float32) for i in range(7)}
    src = tmp_path / "hf"
    src.mkdir()
    save_file(tensors, str(src / "model.safetensors"))
    return str(src)


def test_python_api_distributed_and_a_failing_process(tmp_path):
    """convert(distributed=True) from each process of a jax.distributed job equals the
    single-process result; then, replacing it (force=True), process 1 fails while reading: both
    processes raise (process 0 naming process 1's error), and the committed checkpoint is
    untouched, no temporary directory left."""
    src = _safetensors(tmp_path)
    single = str(tmp_path / "single")
    jax_ucp.convert(src, single)
    shared = str(tmp_path / "shared")
    results = _run_job(tmp_path, src, shared)
    assert all(code == 0 for code, _ in results), results
    _assert_same_checkpoint(single, shared)
    before = jax_ucp.inspect(shared).save_id
    results = _run_job(tmp_path, src, shared, fail=1)
    assert [code for code, _ in results] == [3, 3], results
    assert "process 1: OSError: disk gone" in results[0][1]
    assert "disk gone" in results[1][1]
    assert jax_ucp.inspect(shared).save_id == before
    assert [d for d in os.listdir(tmp_path) if d.startswith("shared.")] == []  # no temporary
    assert jax_ucp.verify(shared) == []


def test_leftover_of_a_killed_shared_import_is_removed(tmp_path):
    """A killed shared import leaves its temporary directory, named after its primary process;
    the next one (holding the save lock) removes it, as its primary is gone, and commits only
    its own files."""
    src = _safetensors(tmp_path)
    shared = str(tmp_path / "shared")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer runs
    stale = f"{shared}.ucp-tmp-{socket.gethostname()}.{gone.pid}.1"
    os.makedirs(os.path.join(stale, "arrays", "stale"))
    with open(os.path.join(stale, "ucp.part-1.json"), "w") as f:
        f.write("{}")
    results = _run_job(tmp_path, src, shared)
    assert all(code == 0 for code, _ in results), results
    assert not os.path.exists(stale)
    assert not os.path.exists(os.path.join(shared, "arrays", "stale"))
    assert sorted(jax_ucp.restore(shared)["params"]) == [f"layer.{i}.w" for i in range(7)]


# A conversion across processes that loses one of them (SIGKILL) fails within a bound, names the
# lost process (index and pid), never commits after the loss, and leaves nothing a following convert
# does not remove; the following convert succeeds, bit-exact.


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
        import jax_ucp._src.multihost.agreement
        import jax_ucp._src.store.storage.local as local_storage
        import jax_ucp._src.writer.checkpoint as ck

        def _die():
            with open(os.environ["UCP_TEST_KILLED"], "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)

        _agree = jax_ucp._src.multihost.agreement.agree

        def agree(gather, step, *args, **kwargs):
            if step == _point:  # "planned": before anything is written; "written": all written
                _die()
            return _agree(gather, step, *args, **kwargs)

        jax_ucp._src.multihost.agreement.agree = agree
        _write_stream = ck.write_stream

        def write_stream(directory, items, **kwargs):
            def counted():
                for i, item in enumerate(items):
                    if _point == "item" and i == int(_n[0]):
                        _die()
                    yield item

            return _write_stream(directory, counted(), **kwargs)

        ck.write_stream = write_stream
        _commit = local_storage.commit

        def commit(tmp, path):
            if _point == "commit":  # the primary, parts merged, before the rename
                _die()
            return _commit(tmp, path)

        local_storage.commit = commit
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
        [sys.executable, "-m", "jax_ucp.cli", "convert", src, dst, "--from", "safetensors", *extra]
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


@pytest.mark.slow  # 12-16 s; the default run keeps the lost-process tests of the library job
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


LOSING_WORKER = r"""
import os, signal, sys
import jax
index, port, src, dst, die = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=index, initialization_timeout=60)
import jax_ucp
import jax_ucp._src.writer.checkpoint as ck
write_stream = ck.write_stream
def counted(items):
    for i, item in enumerate(items):
        if str(index) == die and i == 2:  # mid-write: the third tensor
            os.kill(os.getpid(), signal.SIGKILL)
        yield item
ck.write_stream = lambda directory, items, **kw: write_stream(directory, counted(items), **kw)
try:
    jax_ucp.convert(src, dst, distributed=True, force=True, barrier_timeout=120)
    print("OK", flush=True)
except Exception as e:
    print("FAILED", type(e).__name__, e, flush=True)
    os._exit(3)  # jax.distributed's shutdown would wait for the lost process
"""


def _two_processes(args_of, env) -> list[subprocess.Popen]:
    """Processes 0 and 1 of a job: Python run with ``args_of(i)``, output and errors in one."""
    return [
        subprocess.Popen(
            [sys.executable, *args_of(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=REPO,
        )
        for i in range(2)
    ]


def _job(tmp_path, src, dst, die: int):
    script = tmp_path / "worker.py"
    script.write_text(LOSING_WORKER)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    port = str(free_port())
    procs = _two_processes(lambda i: [str(script), str(i), port, src, dst, str(die)], env)
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
    procs = _two_processes(
        lambda i: (
            ["-m", "jax_ucp.cli", "convert", src, dst, "--from", "safetensors"]
            + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
            + ["--process-id", str(i)]
        ),
        env,
    )
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


def test_more_local_processes_than_the_machine_holds_are_refused_before_any_starts(
    tmp_path, monkeypatch
):
    """``--processes 1000`` on a small machine: a usage error naming the limit and what sets it,
    and no process spawned."""
    from typer.testing import CliRunner

    from jax_ucp._src.cli import app, spawn
    from jax_ucp._src.multihost import launch

    started = []
    monkeypatch.setattr(spawn, "spawn_local", lambda *a: started.append(a))
    limit, why = launch.local_process_limit()
    src = os.path.join(REPO, "tests", "fixtures", "torch", "plain_state_dict.pt")
    result = CliRunner().invoke(app, ["convert", src, str(tmp_path / "out"), "--processes", "1000"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"at most {limit}" in text and "--processes" in text, text
    assert started == [] and not (tmp_path / "out").exists()
    assert 1 <= limit <= 4 * (os.cpu_count() or 1), (limit, why)
