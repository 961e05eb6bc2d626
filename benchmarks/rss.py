"""Memory sampling shared by the benchmarks: RssAnon / VmRSS from /proc, of one process (from a
thread inside it) or of a process tree (from the parent), and a command run measured.

RssAnon is what a converter really allocates; memory-mapped checkpoint pages are file-backed
(RssFile) and reclaimable, so they are not charged to it. Linux only (/proc).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

KEYS = ("RssAnon", "VmRSS", "RssFile", "VmHWM")


def status(pid: int | str = "self") -> dict[str, int]:
    """``KEYS`` of /proc/<pid>/status in bytes ({} once the process is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in KEYS:
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (children first)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in children(k)]


class Peak:
    """Samples a process (``pid=None``: this one, from a thread) or a process tree every
    ``interval`` seconds until ``stop()``; peaks in bytes:

    ``anon`` / ``rss``: the tree's summed RssAnon / VmRSS; ``anon_process``: the largest single
    process's RssAnon (what each host of a multi-host job needs).
    """

    def __init__(self, pid: int | None = None, interval: float = 0.01):
        self.pid, self.interval = pid, interval
        self.anon = self.rss = self.anon_process = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        pids = ["self"] if self.pid is None else [self.pid, *children(self.pid)]
        got = [status(p) for p in pids]
        anon = [s.get("RssAnon", 0) for s in got]
        self.anon = max(self.anon, sum(anon))
        self.rss = max(self.rss, sum(s.get("VmRSS", 0) for s in got))
        self.anon_process = max(self.anon_process, max(anon, default=0))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.interval)

    def start(self) -> Peak:
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> Peak:
        self._stop.set()
        self._thread.join()
        self.sample()
        return self

    def __enter__(self) -> Peak:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_measured(cmd: list[str], env: dict | None = None, cwd: str | None = None) -> dict:
    """Runs ``cmd`` after a ``sync``, its tree sampled every 20 ms: wall time to exit and to
    durable output (exit + ``sync``), peaks (``Peak``), and its stdout; raises if it fails."""
    os.sync()  # nothing left over from an earlier run is charged to this one
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd)
    peak = Peak(p.pid, interval=0.02).start()
    out, err = p.communicate()
    wall = time.perf_counter() - t0
    peak.stop()
    os.sync()
    durable = time.perf_counter() - t0
    if p.returncode:
        raise RuntimeError(f"{cmd[:6]} failed ({p.returncode}):\n{(out + err).decode()[-3000:]}")
    return {
        "wall_s": wall,
        "durable_s": durable,
        "peak_rss_anon": peak.anon,
        "peak_rss_anon_process": peak.anon_process,
        "peak_vm_rss": peak.rss,
        "stdout": out.decode(errors="replace"),
    }
