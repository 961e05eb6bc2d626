"""The ``--processes N`` machinery of ``jax-ucp convert``: this same command re-run as N local
processes of one jax.distributed job, watched until the first failure, cleaned up after. Apart
from the commands so that what they do reads apart from how processes are run."""

from __future__ import annotations

import os

import typer

from jax_ucp.cli import output

#: host memory one convert process takes before it reads anything (JAX, TensorStore and
#: jax_ucp imported, measured ~350 MiB), with room for its reads
PROCESS_MEMORY = 512 << 20
#: local processes per CPU: converting is I/O-bound, but each process is a whole JAX runtime
PROCESSES_PER_CPU = 4


def local_process_limit() -> tuple[int, str]:
    """How many local convert processes this machine can hold, and what sets the limit."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    by_cpu = max(1, (cpus or 1) * PROCESSES_PER_CPU)
    available = _available_memory()
    if available is None:
        return by_cpu, f"{cpus} CPUs x {PROCESSES_PER_CPU}"
    by_memory = max(1, available // PROCESS_MEMORY)
    if by_memory < by_cpu:
        return by_memory, f"{available >> 20} MiB available / {PROCESS_MEMORY >> 20} MiB each"
    return by_cpu, f"{cpus} CPUs x {PROCESSES_PER_CPU}"


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_parallel(processes, coordinator, num_processes, process_id) -> None:
    """How many processes convert: ``--processes N`` spawns N local ones; ``--coordinator``,
    ``--num-processes`` and ``--process-id`` make this one process of a jax.distributed job
    (several hosts: run the same command on each, sharing one file system). Checked together:
    a usage error (exit 2) names the option (``--processes`` is at least 1: typer's ``min``,
    and at most what the machine holds: :func:`local_process_limit`, before anything starts)."""
    if processes and processes > 1 and coordinator:
        raise typer.BadParameter(
            "--processes spawns its own job; use --coordinator without it",
            param_hint="--processes",
        )
    if coordinator and (num_processes is None or process_id is None):
        raise typer.BadParameter(
            "--coordinator needs --num-processes and --process-id",
            param_hint="--coordinator",
        )
    if processes and processes > 1:
        limit, why = local_process_limit()
        if processes > limit:
            raise typer.BadParameter(
                f"{processes} local processes is more than this machine holds: at most {limit} "
                f"({why}); use fewer, or --coordinator across hosts",
                param_hint="--processes",
            )


def spawn_local(n: int, dst: str) -> None:
    """Runs this same command as ``n`` processes of a jax.distributed job on 127.0.0.1; the
    first one's output is shown, the others' only if they fail. A process killed by a signal
    stops the others at once (one that fails with an error lets them finish reporting theirs,
    10 s at most); then what the killed ones left beside DST is removed, and the error names
    each failed process (index and pid) and whether DST was committed."""
    import contextlib
    import signal
    import socket
    import subprocess
    import sys
    import tempfile
    import threading

    from jax_ucp import store, writer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = child_argv(sys.argv[1:])
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    before = dir_identity(dst)
    with contextlib.ExitStack() as stack:
        procs, logs = [], []
        if threading.current_thread() is threading.main_thread():  # SIGTERM: clean up first
            terminated = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
            stack.callback(signal.signal, signal.SIGTERM, terminated)
        try:
            for i in range(n):
                cmd = [sys.executable, "-m", "jax_ucp.cli", *argv]
                cmd += ["--coordinator", f"127.0.0.1:{port}"]
                cmd += ["--num-processes", str(n), "--process-id", str(i)]
                log = stack.enter_context(tempfile.TemporaryFile("w+")) if i else None
                logs.append(log)  # process 0 talks to the terminal
                stderr = None if log is None else subprocess.STDOUT
                procs.append(subprocess.Popen(cmd, env=env, text=True, stdout=log, stderr=stderr))
            failed, stopped = wait_for_children(procs)
        finally:
            for p in procs:  # Ctrl-C, SIGTERM or an error here: no process outlives the command
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            if any(p.returncode for p in procs) and not store.is_url(dst):
                writer.remove_abandoned(dst)  # what killed processes left beside dst
        if not failed:
            return
        lines = failure_lines(procs, logs, failed, stopped)
        after = dir_identity(dst)
        if after is not None and after != before:
            lines.append(f"{dst} was committed before that, with every process's part")
        else:
            lines.append(f"nothing was committed: {dst} is {'unchanged' if after else 'absent'}")
        output.console.print(
            f"[red]error:[/red] convert across {n} processes failed:", highlight=False
        )
        text = "\n".join(output.printable(part) for line in lines for part in line.split("\n"))
        output.console.print(text, highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(1)


def child_argv(argv: list[str]) -> list[str]:
    """This command's arguments without ``--processes N`` (each child is one process)."""
    out, args = [], iter(argv)
    for arg in args:
        if arg == "--processes":
            next(args, None)  # its value
        elif not arg.startswith("--processes="):
            out.append(arg)
    return out


def failure_lines(procs, logs, failed: list[int], stopped: list[int]) -> list[str]:
    """One line per failed process (with the tail of its output), then the ones stopped.

    Args:
        procs: the child processes, by process index.
        logs: each child's captured output (None: it printed to the terminal).
        failed: indices of the processes that failed.
        stopped: indices of those stopped because another failed.
    """
    lines = []
    for i in failed:
        code = procs[i].returncode
        why = f"exited with code {code}" if code > 0 else f"was killed by {signal_name(-code)}"
        lines.append(f"process {i} (pid {procs[i].pid}) {why}")
        if i and code > 0:
            logs[i].seek(0)
            lines.append(logs[i].read()[-4000:].rstrip())
    if stopped:
        others = ", ".join(f"{i} (pid {procs[i].pid})" for i in stopped)
        lines.append(f"stopped the other process(es): {others}")
    return lines


def wait_for_children(procs) -> tuple[list[int], list[int]]:
    """Waits for every process; returns the indices of those that failed (the first one first)
    and of those it stopped: once one is killed by a signal, the others are killed at once;
    once one exits with an error, the others get 10 s to finish first (they report theirs)."""
    import subprocess
    import time

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
    """Blocks until a child in ``pending`` exits; the indices of those that have, reaped. One
    killed by SIGABRT comes after the others: jax aborts a process whose coordinator died."""
    import signal
    import time

    if hasattr(os, "waitid"):
        try:  # sleeps until a child exits, without reaping it (Popen does)
            os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass
    while True:
        done = [i for i, p in pending.items() if p.poll() is not None]
        if done:
            return sorted(done, key=lambda i: (pending[i].returncode == -signal.SIGABRT, i))
        time.sleep(0.02)  # waitid woke for a child that is not ours


def signal_name(number: int) -> str:
    """The name of signal ``number`` (``SIGKILL``), for the message about a killed process."""
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def dir_identity(path: str):
    """(device, inode) of a directory: a commit renames a new one into place."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino
