"""multihost.commit.commit_once: every process writes its part, the primary merges and commits
once, a failure anywhere is raised everywhere and nothing is committed. Threads stand in for
the processes of the protocol itself; jax_ucp.save across two real jax.distributed processes
shows it end to end (a forced save failing in one process leaves the old checkpoint whole)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.multihost import commit
from jax_ucp.errors import MultiProcessError
from tests.ucp_testing import REPO, ThreadExchange, assert_bit_exact, free_port


class _Tx:
    def __init__(self, events):
        self.path, self.events = "/shared/tmp", events

    def commit(self):
        self.events.append("commit")


def _run(count, write_of):
    """Each thread's result (None) or error, and what the primary's transaction saw."""
    exchange, events = ThreadExchange(count), []

    @contextlib.contextmanager
    def begin():
        events.append("begin")
        try:
            yield _Tx(events)
        except BaseException as e:
            events.append(f"rolled back: {type(e).__name__}")
            raise

    results = exchange.run(
        lambda i: commit.commit_once(
            "dest",
            index=i,
            gather=exchange.gather_of(i),
            begin=begin,
            write=lambda path: write_of(i, path),
            merge=lambda path, reports: events.append(("merge", path, reports)),
        )
    )
    return results, events


@pytest.mark.timeout(60)
def test_every_part_is_merged_in_process_order_and_committed_once():
    results, events = _run(3, lambda i, path: f"part {i} in {path}")
    assert results == [None, None, None]
    reports = [f"part {i} in /shared/tmp" for i in range(3)]
    assert events == ["begin", ("merge", "/shared/tmp", reports), "commit"]


@pytest.mark.timeout(60)
def test_a_write_failing_in_one_process_is_raised_in_every_one_and_nothing_is_committed():
    def write(i, path):
        if i == 1:
            raise OSError("disk full")
        return "ok"

    results, events = _run(3, write)
    assert isinstance(results[1], OSError)
    for i in (0, 2):
        assert isinstance(results[i], MultiProcessError), results
        assert "process 1: OSError: disk full" in str(results[i])
    assert events == ["begin", "rolled back: MultiProcessError"]  # the write removed, no merge


@pytest.mark.timeout(60)
def test_a_primary_that_cannot_begin_stops_every_process_before_it_writes():
    written = []

    @contextlib.contextmanager
    def refused():
        raise FileExistsError("dest already exists")
        yield

    exchange = ThreadExchange(2)
    results = exchange.run(
        lambda i: commit.commit_once(
            "dest",
            index=i,
            gather=exchange.gather_of(i),
            begin=refused,
            write=lambda path: written.append(i) or "",
            merge=lambda path, reports: None,
        )
    )
    assert isinstance(results[0], FileExistsError)
    assert isinstance(results[1], MultiProcessError) and "dest already exists" in str(results[1])
    assert written == []


def test_a_single_process_gets_its_own_error_unchanged():
    @contextlib.contextmanager
    def begin():
        yield _Tx([])

    def write(path):
        raise ValueError("bad leaf")

    with pytest.raises(ValueError, match=r"^bad leaf$"):
        commit.commit_once(
            "dest", index=0, gather=None, begin=begin, write=write, merge=lambda p, r: None
        )


SAVER = r"""
import sys
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
pid, n, port, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=n,
                           process_id=pid, initialization_timeout=120)
import jax_ucp
from jax_ucp._src.saving import plan as save_plan
mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("data", "model"))
W = np.arange(128 * 96, dtype=np.float32).reshape(128, 96)
w = jax.make_array_from_callback(W.shape, NamedSharding(mesh, P("data", "model")), lambda i: W[i])
write_tensor = save_plan.write_tensor
async def failing(*args, **kwargs):
    raise OSError("disk full on process 1")
if pid == 1:
    save_plan.write_tensor = failing
try:
    jax_ucp.save(path, {"w": w, "step": 5}, force=True)
except Exception as e:
    print("FAILED", type(e).__name__, str(e).replace("\n", " "), flush=True)
if pid == 0:  # its transaction is over: the old checkpoint, nothing beside it
    import os
    names = [e.name for e in jax_ucp.inspect(path).tensors]
    print("AFTER", names, sorted(os.listdir(os.path.dirname(path))), flush=True)
save_plan.write_tensor = write_tensor
jax_ucp.save(path, {"w": w, "step": 6}, force=True)
print("SAVED", pid, flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_processes_save_force_fails_in_one_then_succeeds(tmp_path):
    """The forced save that fails in process 1 is raised in both and leaves the old checkpoint
    whole, with nothing beside it; the next one, written by both, replaces it."""
    path = tmp_path / "ckpt"
    jax_ucp.save(path, {"old": np.arange(4, dtype=np.int32)})
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        PYTHONPATH=REPO,
    )
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SAVER, str(i), "2", port, str(path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=240))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err[-3000:]
    failed = [
        next(line for line in out.splitlines() if line.startswith("FAILED")) for out, _ in outs
    ]
    assert failed[1] == "FAILED OSError disk full on process 1"
    assert failed[0].startswith("FAILED MultiProcessError")
    assert "process 1: OSError: disk full on process 1" in failed[0]
    assert "AFTER ['old'] ['ckpt']" in outs[0][0]
    assert all(f"SAVED {i}" in out for i, (out, _) in enumerate(outs))
    back = jax_ucp.restore(path)
    assert_bit_exact(back["w"], np.arange(128 * 96, dtype=np.float32).reshape(128, 96))
    assert back["step"] == 6
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def _lost_at_committed(exchange, index, after_primary: bool):
    """Process ``index``'s gather, losing the exchange when it waits for the primary's outcome
    (the primary, serving jax.distributed's coordinator, is gone): once the primary posted
    it (``after_primary``), or at once."""
    gather = exchange.gather_of(index)

    def lost(step, value, wait=True):
        if step == "committed" and wait:
            if after_primary:
                with exchange.cond:
                    assert exchange.cond.wait_for(lambda: (step, 0) in exchange.values, 30)
            raise MultiProcessError("dest: not committed; process 0 (pid 1 on h) died while ...")
        return gather(step, value, wait)

    return lost


def _real_commit(tmp_path, exchange, gathers, merge):
    """``commit_once`` of ``tmp_path/dest`` through the real transaction (a temporary directory
    renamed into place), each process writing one file."""
    from jax_ucp._src.writer import commit as writer_commit

    dest = str(tmp_path / "dest")

    def write(i, path):
        with open(os.path.join(path, f"part{i}"), "w") as f:
            f.write(str(i))
        return ""

    results = exchange.run(
        lambda i: commit.commit_once(
            dest,
            index=i,
            gather=gathers[i],
            begin=lambda: writer_commit.transaction(dest, force=False),
            write=lambda path: write(i, path),
            merge=merge,
        )
    )
    return dest, results


@pytest.mark.timeout(60)
def test_a_process_that_loses_the_exchange_after_the_commit_reads_it_from_storage(tmp_path):
    """The primary commits; process 1 then loses the exchange (the primary's process ended):
    it reports the commit storage proves, not "not committed; process 0 died"."""
    exchange = ThreadExchange(2)

    def merge(path, reports):
        with open(os.path.join(path, "ucp.json"), "w") as f:
            f.write("{}")

    gathers = [exchange.gather_of(0), _lost_at_committed(exchange, 1, after_primary=True)]
    dest, results = _real_commit(tmp_path, exchange, gathers, merge)
    assert results == [None, None], results
    assert sorted(os.listdir(dest)) == ["part0", "part1", "ucp.json"]


@pytest.mark.timeout(60)
def test_a_process_that_loses_the_exchange_before_any_commit_says_not_committed(tmp_path):
    """The exchange is lost and the primary never commits (its merge fails after): process 1
    says "not committed" — what storage shows."""
    import threading

    exchange, checked = ThreadExchange(2), threading.Event()
    lost = _lost_at_committed(exchange, 1, after_primary=False)

    def late(step, value, wait=True):
        try:
            return lost(step, value, wait)
        finally:
            if step == "committed":
                checked.set()

    def merge(path, reports):
        checked.wait(20)
        raise OSError("disk full")

    dest, results = _real_commit(tmp_path, exchange, [exchange.gather_of(0), late], merge)
    assert isinstance(results[0], OSError)
    assert isinstance(results[1], MultiProcessError) and "not committed" in str(results[1])
    assert not os.path.exists(dest)


@pytest.mark.timeout(60)
def test_the_primary_returns_only_once_every_process_heard_its_outcome():
    """The primary serves the exchange: returning (and its program ending) before process 1
    read the outcome would take it away; process 1 reads it late here."""
    import time

    events: list[str] = []
    exchange = ThreadExchange(2)

    def before(step):
        if step == "committed":
            time.sleep(0.3)
        if step == "heard":
            events.append("1 heard")

    gathers = [exchange.gather_of(0), exchange.gather_of(1, before)]

    @contextlib.contextmanager
    def begin():
        yield _Tx([])

    def work(i):
        commit.commit_once(
            "dest",
            index=i,
            gather=gathers[i],
            begin=begin,
            write=lambda path: "",
            merge=lambda path, reports: None,
        )
        events.append(f"{i} returned")

    assert exchange.run(work) == [None, None]
    assert events.index("1 heard") < events.index("0 returned"), events


PRIMARY_LEAVES = r"""
import os, sys, time
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
pid, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid, initialization_timeout=60)
import jax_ucp
from jax_ucp._src.multihost import agreement
mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("data", "model"))
W = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
w = jax.make_array_from_callback(W.shape, NamedSharding(mesh, P("data")), lambda i: W[i])
if pid == 1:  # slow to read the outcome: the primary has committed and returned meanwhile
    gather = agreement.Exchange.gather
    def slow(self, step, *args, **kwargs):
        if step == "committed":
            time.sleep(3)
        return gather(self, step, *args, **kwargs)
    agreement.Exchange.gather = slow
try:
    jax_ucp.save(path, {"w": w, "step": 7})
    print("SAVED", pid, flush=True)
except Exception as e:
    print("FAILED", type(e).__name__, " ".join(str(e).split()), flush=True)
if pid == 0:
    time.sleep(1)  # then the program ends at once (its coordinator with it)
os._exit(0)
"""


@pytest.mark.timeout(120)
def test_two_processes_a_primary_leaving_right_after_its_save_leaves_the_other_its_outcome(
    tmp_path,
):
    """Process 0 commits and its program ends a second after its save returns; process 1
    reads the outcome late. Before: process 1 said "not committed; process 0 died" (or was
    aborted by jax when the coordinator went) about a committed checkpoint."""
    path = tmp_path / "ckpt"
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        PYTHONPATH=REPO,
    )
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PRIMARY_LEAVES, str(i), port, str(path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = []
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert "SAVED 0" in outs[0][0], outs[0][0] + outs[0][1][-2000:]
    assert "SAVED 1" in outs[1][0], outs[1][0] + outs[1][1][-2000:]
    assert_bit_exact(jax_ucp.restore(path)["w"], np.arange(16 * 8, dtype=np.float32).reshape(16, 8))
