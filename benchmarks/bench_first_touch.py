"""What first-touching fresh host memory costs a cold read, and what pre-faulting, reusing
buffers or huge pages buy (issue 52): the restore's floor beside the disk's.

One file of ``--mib`` MiB is written once, then read cold (page cache evicted before each
read) with 8 MiB ``preadv`` calls, one thread, into each kind of destination, alternating
within every round:

  * ``reused``: one buffer touched before the clock starts (the disk's own figure, as ``dd``);
  * ``numpy``: a fresh ``np.empty`` (what a restore's part buffers are; numpy asks for huge
    pages with ``madvise`` on buffers of 4 MiB and more);
  * ``mmap 4k``: a fresh anonymous mapping with ``MADV_NOHUGEPAGE`` (4 KiB pages only);
  * ``mmap hugepage``: a fresh anonymous mapping with ``MADV_HUGEPAGE``;
  * ``populate``: a fresh mapping with ``MAP_POPULATE`` (the kernel faults and zeroes every
    page in ``mmap`` itself, counted in the time), then read;
  * ``prefault thread``: a fresh ``np.empty`` whose pages a second thread touches ahead of the
    reads (``MADV_POPULATE_WRITE`` where the kernel has it, else one write a page).

Reports wall time (median), GB/s, the fraction of ``reused``, the process's CPU time (user +
system: the kernel's zeroing and copying, steadier than wall time on a loaded host) and the
deterministic counts:
minor page faults of the process during the read (``ru_minflt``) and the huge pages the
buffer got (``AnonHugePages`` of ``/proc/self/smaps_rollup``). Load average beside each round.

    python benchmarks/bench_first_touch.py --mib 512 --rounds 3 [--dir /tmp/ucp_first_touch]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import statistics
import threading
import time

import numpy as np

CHUNK = 8 << 20
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def read_into(fd: int, buf: memoryview, size: int) -> None:
    pos = 0
    while pos < size:
        got = os.preadv(fd, [buf[pos : pos + CHUNK]], pos)
        if got <= 0:
            raise OSError(f"short read at {pos}")
        pos += got


def fresh_mmap(size: int, advice: int | None, populate: bool = False) -> mmap.mmap:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if populate:
        flags |= mmap.MAP_POPULATE
    m = mmap.mmap(-1, size, flags=flags)
    if advice is not None:
        m.madvise(advice)
    return m


def prefaulted(size: int) -> tuple[np.ndarray, threading.Thread]:
    """A fresh buffer whose pages a second thread faults in, 8 MiB ahead at a time."""
    buf = np.empty(size, np.uint8)

    def touch():
        for start in range(0, size, CHUNK):
            buf[start : start + CHUNK : 4096] = 0

    t = threading.Thread(target=touch)
    t.start()
    return buf, t


def one(kind: str, path: str, size: int, reused: np.ndarray) -> dict:
    evict(path)
    fd = os.open(path, os.O_RDONLY)
    huge_before = anon_huge_kib()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    keep: object = None
    thread = None
    if kind == "reused":
        view = memoryview(reused)
    elif kind == "numpy":
        keep = np.empty(size, np.uint8)
        view = memoryview(keep)
    elif kind == "mmap 4k":
        keep = fresh_mmap(size, mmap.MADV_NOHUGEPAGE)
        view = memoryview(keep)
    elif kind == "mmap hugepage":
        keep = fresh_mmap(size, mmap.MADV_HUGEPAGE)
        view = memoryview(keep)
    elif kind == "populate":
        keep = fresh_mmap(size, None, populate=True)
        view = memoryview(keep)
    elif kind == "prefault thread":
        keep, thread = prefaulted(size)
        view = memoryview(keep)
    else:
        raise ValueError(kind)
    read_into(fd, view, size)
    if thread is not None:
        thread.join()
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    flt = ru1.ru_minflt - ru0.ru_minflt
    sys_s = ru1.ru_stime - ru0.ru_stime
    cpu = sys_s + ru1.ru_utime - ru0.ru_utime
    huge = anon_huge_kib() - huge_before
    os.close(fd)
    view.release()
    if isinstance(keep, mmap.mmap):
        keep.close()
    del keep
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "sys_s": sys_s,
        "minor_faults": flt,
        "anon_huge_kib": huge,
        "load": os.getloadavg()[0],
    }


KINDS = ["reused", "numpy", "mmap 4k", "mmap hugepage", "populate", "prefault thread"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/ucp_first_touch")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--json")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, f"data_{args.mib}")
    size = args.mib << 20
    if not os.path.exists(path) or os.path.getsize(path) != size:
        rng = np.random.default_rng(0)
        with open(path, "wb") as f:
            for _ in range(size // CHUNK):
                f.write(rng.integers(0, 256, CHUNK, np.uint8).tobytes())
            os.fsync(f.fileno())
    reused = np.ones(size, np.uint8)  # touched: no fault during its reads
    results: dict[str, list[dict]] = {k: [] for k in kinds}
    load0 = os.getloadavg()
    for r in range(args.rounds):
        for k in kinds if r % 2 == 0 else kinds[::-1]:
            res = one(k, path, size, reused)
            results[k].append(res)
            print(
                f"round {r} {k:16s} {res['wall_s']:6.3f} s  {size / res['wall_s'] / 1e9:5.2f} GB/s"
                f"  CPU {res['cpu_s']:5.3f} s  faults {res['minor_faults']:7d}  huge {res['anon_huge_kib'] >> 10:5d} MiB"
                f"  load {res['load']:.1f}",
                flush=True,
            )
    load1 = os.getloadavg()
    base = statistics.median(r["wall_s"] for r in results["reused"]) if "reused" in kinds else None
    print(f"\n{size / 1e9:.2f} GB, medians of {args.rounds}, load {load0[0]:.1f} → {load1[0]:.1f}")
    print(
        f"{'kind':16s} {'s':>6s} {'GB/s':>6s} {'% of reused':>11s} {'CPU s':>6s} {'faults':>8s}"
        f" {'huge MiB':>8s}"
    )
    for k, runs in results.items():
        wall = statistics.median(r["wall_s"] for r in runs)
        cpu = statistics.median(r["cpu_s"] for r in runs)
        faults = statistics.median(r["minor_faults"] for r in runs)
        huge = statistics.median(r["anon_huge_kib"] for r in runs) / 1024
        pct = f"{100 * base / wall:.0f} %" if base else ""
        print(
            f"{k:16s} {wall:6.3f} {size / wall / 1e9:6.2f} {pct:>11s} {cpu:6.3f} {faults:8.0f}"
            f" {huge:8.0f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                    "command": f"python benchmarks/bench_first_touch.py --mib {args.mib} "
                    f"--rounds {args.rounds}",
                    "bytes": size,
                    "load_average": [load0, load1],
                    "results": results,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
