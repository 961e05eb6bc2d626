"""The processes of one ``jax.distributed`` job: this one joined to it (``initialize``), or N
local ones started and watched until the first failure (``run_local``), for Python callers and
the CLI's ``--processes N`` alike. JAX is imported only inside ``initialize``."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from jax_ucp._src.multihost import liveness

#: host memory one convert process takes before it reads anything (~350 MiB measured), and more
PROCESS_MEMORY = 512 << 20
#: local processes per CPU: converting is I/O-bound, but each process is a whole JAX runtime
PROCESSES_PER_CPU = 4
#: how long the process serving a job waits at its end for the others to leave (2.4 s measured
#: for two local ones under load)
LEAVE_S = 30.0


def initialize(coordinator: str | None, num_processes=None, process_id=None, **kwargs) -> None:
    """Joins this process to a ``jax.distributed`` job (what ``--coordinator`` does).

    Args:
        coordinator: ``host:port`` where process 0 serves the job (None: the cluster's).
        num_processes: how many processes the job has (None: the cluster's).
        process_id: this process's index (None: the cluster's).
        **kwargs: passed on to ``jax.distributed.initialize``."""
    import jax

    jax.distributed.initialize(coordinator, num_processes, process_id, **kwargs)
    liveness.start_beat()  # from now on, not from its first exchange: a death before it is seen
    atexit.register(shutdown)  # before JAX's own (atexit runs the last registered first)


def shutdown() -> None:
    """Leaves the ``jax.distributed`` job, the process serving it last: its coordinator stops
    only when the others have closed their connections to it (or after ``LEAVE_S``). JAX's
    own shutdown stops it as soon as every process has reached its shutdown barrier; a process
    that has not yet stopped polling the coordinator then finds it gone and aborts (SIGABRT,
    seen in CI under load after a committed convert). A no-op where there is no job."""
    import jax
    from jax._src import distributed

    state = distributed.global_state
    port = liveness.served_port()
    service, state.service = state.service, None
    try:
        jax.distributed.shutdown()  # this process's client: the shutdown barrier
    finally:  # a failed barrier (a peer lost) still stops the coordinator
        deadline = time.monotonic() + LEAVE_S
        while port is not None and time.monotonic() < deadline and liveness.connected(port, True):
            time.sleep(0.05)
        if service is not None:
            service.shutdown()


def local_process_limit() -> tuple[int, str]:
    """How many local processes of a job this machine can hold, and what sets the limit."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    by_cpu = max(1, (cpus or 1) * PROCESSES_PER_CPU)
    available = _available_memory()
    if available is not None and (by_memory := max(1, available // PROCESS_MEMORY)) < by_cpu:
        return by_memory, f"{available >> 20} MiB available / {PROCESS_MEMORY >> 20} MiB each"
    return by_cpu, f"{cpus} CPUs x {PROCESSES_PER_CPU}"


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


@dataclasses.dataclass
class LocalRun:
    """How ``run_local``'s processes ended: ``failed``, ``stopped``, and their ``outputs``."""

    procs: list[subprocess.Popen]
    failed: list[int]
    stopped: list[int]
    outputs: dict[int, str]

    def failure_lines(self) -> list[str]:
        """One line per failed process (with the end of its output), then the ones stopped."""
        lines = []
        for i in self.failed:
            code = self.procs[i].returncode
            why = f"exited with code {code}" if code > 0 else f"was killed by {signal_name(-code)}"
            lines.append(f"process {i} (pid {self.procs[i].pid}) {why}")
            if i in self.outputs:
                lines.append(self.outputs[i])
        if self.stopped:
            others = ", ".join(f"{i} (pid {self.procs[i].pid})" for i in self.stopped)
            lines.append(f"stopped the other process(es): {others}")
        return lines


def run_local(n: int, command: Callable[[int, str], list[str]], env=None) -> LocalRun:
    """Runs ``command(index, coordinator)`` as ``n`` local processes of a jax.distributed job and
    waits; no process outlives this call.

    Args:
        n: how many processes.
        command: the argv of process ``index`` joining the job served at ``coordinator``.
        env: their environment (None: this one's), ``JAX_PLATFORMS`` defaulting to "cpu"."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    env = dict(os.environ if env is None else env)
    env.setdefault("JAX_PLATFORMS", "cpu")
    procs: list[subprocess.Popen] = []
    outputs: dict[int, str] = {}
    with contextlib.ExitStack() as stack:
        logs = []
        if threading.current_thread() is threading.main_thread():  # SIGTERM: clean up first
            terminated = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
            stack.callback(signal.signal, signal.SIGTERM, terminated)
        try:
            for i in range(n):
                log = stack.enter_context(tempfile.TemporaryFile("w+")) if i else None
                logs.append(log)  # process 0 talks to the terminal
                stderr = None if log is None else subprocess.STDOUT
                cmd = command(i, coordinator)
                procs.append(subprocess.Popen(cmd, env=env, text=True, stdout=log, stderr=stderr))
            failed, stopped = wait_for_children(procs)
        finally:
            for p in procs:  # no process outlives the call
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
        for i in failed:
            log = logs[i]
            if log is not None:  # a signal's last words (an abort's fatal log line) too
                log.seek(0)
                outputs[i] = log.read()[-4000:].rstrip()
    return LocalRun(procs, failed, stopped, outputs)


def wait_for_children(procs) -> tuple[list[int], list[int]]:
    """Waits for every process; the indices of those that failed and those it stopped."""
    pending = dict(enumerate(procs))
    failed: list[int] = []
    while pending and not failed:
        for i in next_exits(pending):
            del pending[i]
            if procs[i].returncode != 0:
                failed.append(i)
    if failed and pending:
        if procs[failed[0]].returncode > 0:
            deadline = time.monotonic() + 10
            for i, p in list(pending.items()):
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    continue
                del pending[i]
                if p.returncode != 0:
                    failed.append(i)
        for p in pending.values():
            p.kill()
            p.wait()
    return failed, sorted(pending)


def next_exits(pending: dict) -> list[int]:
    """Blocks until a child in ``pending`` exits; those that have, reaped, SIGABRT ones last."""
    if hasattr(os, "waitid"):
        # sleeps until a child exits, without reaping it (Popen does)
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
    while True:
        done = [i for i, p in pending.items() if p.poll() is not None]
        if done:
            return sorted(done, key=lambda i: (pending[i].returncode == -signal.SIGABRT, i))
        time.sleep(0.02)  # waitid woke for a child that is not ours


def signal_name(number: int) -> str:
    """The name of signal ``number`` (``SIGKILL``), for the message about a killed process."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
