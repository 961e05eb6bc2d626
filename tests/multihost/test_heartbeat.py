"""multihost.liveness (beats): the processes of a jax.distributed job prove they live through its
key-value store, so a process killed on another host is named while another waits for it,
whatever else connects to the coordinator's port, and a live one that is only slow is not."""

from __future__ import annotations

import json
import signal

import pytest

from jax_ucp._src.multihost import liveness
from tests.ucp_testing import run_workers

# Each process passes for one of a machine of its own (its host name), so /proc cannot tell
# whether the other lives: only its beat can. Process 0 serves the coordinator and holds one
# more connection to its port, as any other program could.
WORKER = r"""
import os, signal, socket, sys, time
pid, port, mode, busy = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
import jax
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid, initialization_timeout=60)
socket.gethostname = lambda: f"host{pid}"
from jax_ucp._src.multihost import agreement
if pid == 0:
    foreign = socket.create_connection(("127.0.0.1", int(port)))  # no process of the job
exchange = agreement.Exchange("probe", "probe:", timeout=40)
if pid == 1 and mode == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
if pid == 1:  # busy in Python far longer than the cut-off; its beat goes on
    end = time.monotonic() + busy
    while time.monotonic() < end:
        sum(range(1000))
try:
    print("GOT", exchange.gather("step", str(pid)), flush=True)
    exchange.gather("read", "")  # neither leaves before the other has read "step"
except Exception as e:
    print("FAILED", type(e).__name__, " ".join(str(e).split()), flush=True)
    os._exit(0)
jax.distributed.shutdown()
"""


@pytest.mark.timeout(120)
def test_a_peer_killed_on_another_host_is_named_though_another_program_connects(tmp_path):
    """Process 1 ("host1") is SIGKILLed after the first exchange while process 0 holds one more
    connection to the coordinator's port: process 0 names it from its beat. Before: the
    connection count stayed whole and process 0 waited until the step's timeout (40 s)."""
    (rc0, out, err), (rc1, _, _) = run_workers(tmp_path, WORKER, "killed", "0", timeout=90)
    assert rc1 == -signal.SIGKILL and rc0 == 0, err[-2000:]
    assert "FAILED ProcessLostError probe: process 1 (pid " in out, out + err[-2000:]
    assert (
        "on host1) stopped beating while process 0 waited for it at 'step': no sign of life "
        f"for {liveness.CUT_OFF_S:g} s"
    ) in out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_live_peer_busy_longer_than_the_cut_off_is_waited_for(tmp_path):
    """Process 1 ("host1") computes for twice the cut-off before it answers: process 0 waits
    for it (its beat moves) and both get every value."""
    busy = str(2 * liveness.CUT_OFF_S)
    results = run_workers(tmp_path, WORKER, "busy", busy, timeout=90)
    for rc, out, err in results:
        assert rc == 0 and "GOT ['0', '1']" in out, out + err[-2000:]


class _Store:
    """The beats a key-value store holds (synthetic)."""

    def __init__(self):
        self.beats = {"jax_ucp/beat/1": json.dumps({"pid": 7, "start": "9", "n": 0})}

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.beats.items() if k.startswith(prefix)]


def test_a_beat_standing_still_is_stopped_only_over_the_cut_off_of_steady_polling(monkeypatch):
    """A counter that does not move for the cut-off, polled every 0.25 s, is stopped; one that
    moved is not; one never heard is not judged; a waiting process held up between two polls
    (longer than a second) counts afresh."""
    clock = [1000.0]
    monkeypatch.setattr(liveness.time, "monotonic", lambda: clock[0])
    store = _Store()
    beats = liveness.Beats(store)

    def poll_for(seconds):  # every 0.25 s (exact in binary)
        for _ in range(round(seconds / 0.25)):
            clock[0] += 0.25
            beats.hear()

    poll_for(liveness.CUT_OFF_S - 0.25)
    assert not beats.stopped(1) and not beats.stopped(2)
    store.beats["jax_ucp/beat/1"] = json.dumps({"pid": 7, "start": "9", "n": 1})  # it moved
    poll_for(liveness.CUT_OFF_S)  # heard moving at the first of these polls
    assert not beats.stopped(1)
    poll_for(0.25)
    assert beats.stopped(1) and not beats.stopped(2)
    assert beats.identity(1) == {"pid": 7, "start": "9", "n": 1} and beats.identity(2) is None
    clock[0] += liveness.CUT_OFF_S  # this process held up: nothing heard meanwhile
    beats.hear()
    assert not beats.stopped(1)
    poll_for(liveness.CUT_OFF_S - 0.25)
    assert not beats.stopped(1)
    poll_for(0.25)
    assert beats.stopped(1)


def test_beats_another_program_writes_are_not_heard(monkeypatch):
    """Keys under ``jax_ucp/beat/`` that no process of the job wrote: an index in other digits
    or not a number, a beat that is no JSON object (or names a key twice, or has no pid), and
    a moving beat under process 1's index with another process's identity (synthetic). None
    is heard: process 1, whose own beat stood still, is stopped after the cut-off. Before: a
    raw ``ValueError`` from ``int()`` / ``json.loads`` inside every waiting process's poll,
    and the forged counter kept a dead process 1 "alive"."""
    clock = [1000.0]
    monkeypatch.setattr(liveness.time, "monotonic", lambda: clock[0])
    store = _Store()
    beats = liveness.Beats(store)
    beats.expect = [{"pid": 5, "start": "8"}, {"pid": 7, "start": "9"}]
    beats.hear()
    for n in range(round(liveness.CUT_OFF_S / 0.25)):
        store.beats.update(
            {
                "jax_ucp/beat/x": "{}",
                "jax_ucp/beat/\u0661": json.dumps({"pid": 7, "start": "9", "n": n}),
                "jax_ucp/beat/0": f'{{"pid": 5, "pid": 6, "start": "8", "n": {n}}}',
                "jax_ucp/beat/2": f"[{n}]",
                "jax_ucp/beat/3": '{"pid": NaN, "start": "1"}',
            }
        )
        clock[0] += 0.25
        beats.hear()
        store.beats["jax_ucp/beat/1"] = json.dumps({"pid": 99, "start": "9", "n": n})  # forged
    assert beats.stopped(1) and beats.identity(1) == {"pid": 7, "start": "9", "n": 0}
    assert sorted(beats.heard) == [1]
