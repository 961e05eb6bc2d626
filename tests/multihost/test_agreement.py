"""multihost.agreement.Exchange and multihost.liveness: a peer that dies is named from the
exchange's first message on, even one killed before it said who it is (before "hello"): the
process serving jax.distributed's coordinator counts the connections made to it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from jax_ucp._src.multihost import agreement, liveness
from tests.ucp_testing import REPO, free_port


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs /proc/net")
def test_the_processes_connected_to_a_served_port_are_counted_as_they_come_and_go():
    """Each process running JAX counts once however many connections it holds; a program that
    does not run JAX (a raw socket of another program) is no peer and is not counted."""
    import jax  # noqa: F401  (this process runs JAX, as a job's does)

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert liveness.serves(port) and not liveness.serves(free_port())
        assert liveness.connected(port) == 0
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        accepted = [server.accept()[0] for _ in clients]
        assert liveness.connected(port) == 1  # one process
        foreign = subprocess.Popen(
            [sys.executable, "-c", FOREIGN, str(port)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert foreign.stdout is not None and foreign.stdout.readline().strip() == "CONNECTED"
            accepted.append(server.accept()[0])
            assert liveness.connected(port) == 1  # another program's connection: no peer
        finally:
            foreign.kill()
            foreign.wait()
        for s in clients + accepted:
            s.close()
        assert liveness.connected(port) == 0


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs /proc/net")
def test_a_closed_socket_that_once_had_a_clients_port_does_not_hide_its_owner(monkeypatch):
    """Under load a client's ephemeral port is reused while an old connection from the same
    port lingers in TIME_WAIT (inode 0, another remote end): the client is still matched to
    its process (CI once counted 2 processes where one held both connections)."""
    import jax  # noqa: F401

    real = liveness.tcp_table
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        accepted = [server.accept()[0] for _ in clients]

        def with_time_wait():
            table = real() or []
            lingering = [
                (lo, (rem[0], rem[1] + 1), "06", "0") for lo, rem, _, _ in table if rem[1] == port
            ]
            return table + lingering

        monkeypatch.setattr(liveness, "tcp_table", with_time_wait)
        assert liveness.connected(port) == 1
        for s in clients + accepted:
            s.close()


#: a program that is no process of the job: a raw connection held to the coordinator's port
FOREIGN = """
import socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
print("CONNECTED", flush=True)
time.sleep(120)
"""


def test_fewer_connections_are_a_loss_only_once_they_last_and_name_who_is_not_there(monkeypatch):
    """A count below the job's that recovers (a connection made again) is no loss; one that
    lasts names the processes that have not answered (in a job of 3, which one closed its
    connection is not known)."""
    exchange = agreement.Exchange.__new__(agreement.Exchange)  # no jax.distributed job
    exchange.served, exchange._short_since = 1234, None
    exchange.beats = liveness.Beats(None)  # none beat yet
    exchange.count, exchange.index, exchange.lost = 3, 0, agreement.ProcessLostError
    counts = iter([3, 2, 3, 2, 2])
    monkeypatch.setattr(liveness, "connected", lambda port: next(counts))
    monkeypatch.setattr(agreement, "CUT_OFF_S", 3600.0)
    for _ in range(3):  # full; short for less than the cut-off; full again
        exchange.raise_if_cut_off([2], "hello", "dest: not committed;")
    assert exchange._short_since is None
    exchange.raise_if_cut_off([2], "hello", "dest: not committed;")
    monkeypatch.setattr(agreement, "CUT_OFF_S", 0.0)
    with pytest.raises(agreement.ProcessLostError) as e:
        exchange.raise_if_cut_off([2], "hello", "dest: not committed;")
    assert "1 of the job's 3 processes lost their connection" in str(e.value)
    assert "process(es) 2 had not reached 'hello'" in str(e.value)


DIES_BEFORE_HELLO = r"""
import os, signal, sys, time
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
pid, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid, initialization_timeout=60)
import jax_ucp
mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("data", "model"))
W = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
w = jax.make_array_from_callback(W.shape, NamedSharding(mesh, P("data")), lambda i: W[i])
if pid == 0 and sys.argv[4] == "foreign":  # no process of the job, holding a connection
    import socket, subprocess
    held = socket.create_connection(("127.0.0.1", int(port)))
    other = subprocess.Popen([sys.executable, "-c", sys.argv[5], port], stdout=subprocess.PIPE)
    other.stdout.readline()
if pid == 1:  # killed before its save said anything
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
try:
    jax_ucp.save(path, {"w": w, "step": 7}, force=True)
    print("SAVED", flush=True)
except Exception as e:
    print("FAILED", type(e).__name__, " ".join(str(e).split()), flush=True)
if pid == 0 and sys.argv[4] == "foreign":
    other.kill()
os._exit(0)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("foreign", ["alone", "foreign"])
def test_a_peer_killed_before_the_first_exchange_is_named_not_waited_for(tmp_path, foreign):
    """Process 1 is SIGKILLed after joining the job, before its save's first message: process 0
    raises ProcessLostError naming it and leaves the old checkpoint whole. Before: process 0
    waited in "hello" until jax's heartbeat (100 s) aborted it, with no jax_ucp error; and
    (``foreign``) with connections held to the coordinator's port by process 0 itself and by
    another program, the death stayed hidden (they made the count whole)."""
    import numpy as np

    import jax_ucp

    path = tmp_path / "ckpt"
    jax_ucp.save(path, {"old": np.arange(3)})
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        PYTHONPATH=REPO,
    )
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", DIES_BEFORE_HELLO, str(i), port, str(path), foreign, FOREIGN],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        out, err = procs[0].communicate(timeout=60)  # far below jax's 100 s heartbeat
        procs[1].communicate(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[1].returncode == -signal.SIGKILL
    assert (
        f"FAILED ProcessLostError {path}: not committed; process 1 lost its connection to "
        "jax.distributed's coordinator (served by process 0) before reaching 'hello'"
    ) in out, out + err[-2000:]
    assert [e.name for e in jax_ucp.inspect(path).tensors] == ["old"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_saves_timeout_names_what_sets_it_not_an_option_save_lacks(monkeypatch, tmp_path):
    """A save's processes wait BARRIER_TIMEOUT (save has no option for it); a stopped or hung
    peer of this host lives and is waited for: said when it runs out (probe 9: "(save's
    barrier_timeout)", an option save does not have)."""
    import numpy as np

    import jax_ucp

    seen = {}

    def join(where, timeout, purpose="convert", hint=None):
        seen.update(timeout=timeout, hint=hint)
        raise RuntimeError("joined")

    monkeypatch.setattr(agreement, "join", join)
    with pytest.raises(RuntimeError, match="joined"):
        jax_ucp.save(tmp_path / "ckpt", {"a": np.arange(2)})
    assert "barrier_timeout" not in seen["hint"] and f"{seen['timeout']:g} s" in seen["hint"]
