"""multihost.launch: a job's processes leave it in order, the one serving the coordinator last,
so none finds the coordinator gone while it is still leaving."""

from __future__ import annotations

import pytest

from tests.ucp_testing import run_workers

# An atexit handler registered before the job's runs after this process has left the job (atexit
# runs the last registered first): process 1 is then slow to exit, as a loaded host makes it.
WORKER = r"""
import atexit, os, sys, time
pid, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]

def ended():
    if pid == 1:
        time.sleep(2)
    with open(os.path.join(out, f"ended{pid}"), "w") as f:
        f.write(repr(time.time()))

atexit.register(ended)
from jax_ucp._src.multihost import launch
launch.initialize(f"127.0.0.1:{port}", 2, pid, initialization_timeout=60)
"""


@pytest.mark.timeout(120)
def test_the_process_serving_the_job_stops_it_after_the_others_have_left(tmp_path):
    """Process 1 takes 2 s to exit after leaving the job; process 0, which serves it, stops the
    coordinator only then. Before: JAX's shutdown stopped it as soon as both reached the
    shutdown barrier, and a process still polling it aborted (SIGABRT, CI, a loaded host)."""
    results = run_workers(tmp_path, WORKER, str(tmp_path), timeout=90)
    for rc, out, err in results:
        assert rc == 0, out + err[-2000:]
    ended = [float((tmp_path / f"ended{i}").read_text()) for i in range(2)]
    assert ended[0] >= ended[1], ended
