"""Where a cold restore's time goes beside the disk's own figure (issue 59, items 3 and 4): the
same bytes read several ways, side by side, alternating, each from a cold page cache
(``bench_save_restore.evict``), with the wall time, the process's CPU seconds and minor faults.

    python benchmarks/bench_restore_costs.py CKPT [--rounds 3] [--warm]

CKPT is a checkpoint ``bench_scale.py --child jax-save`` wrote (``--gb 1``: 15 tensors of 64 MiB
in 120 shard files of 8 MiB). Rows:

* ``one file, 8 MiB reads``: the shard files' bytes concatenated into ONE file (written here once,
  beside CKPT) read sequentially into one reused buffer: ``bench_scale.py``'s ``disk`` contender;
* ``one file per tensor``: each array's shard files concatenated into one file (written here
  once), read sequentially like the row above: what larger shard files would read at;
* ``shard files, 1 thread`` / ``16 threads``: the checkpoint's own files read whole, the first
  sequentially, the second as ``ShardReader`` issues them (16 reads in flight), into reused
  buffers (no fresh memory);
* ``shard files, 16 threads, fresh``: the same into fresh 4 KiB-page mappings, as a restore
  reads into the arrays it hands over (``sharding.assemble.aligned_empty``); ``+ populate``:
  each mapping pre-faulted with ``MADV_POPULATE_WRITE`` in the reading thread first;
* ``jax_ucp.restore``: the restore itself (onto 4x2 with other specs, like bench_scale), in
  this process after one warm-up restore (its imports and first-call set-up excluded).

``--warm``: the page cache is not evicted (what the CPU work alone costs)."""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import mmap
import os
import resource
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_save_restore import evict

MiB = 2**20
_MADV_POPULATE_WRITE = 23  # Linux 5.14
_libc = ctypes.CDLL(None, use_errno=True)


def shard_files(root: str) -> list[str]:
    out = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "arrays")) for f in fs]
    return sorted(f for f in out if os.path.getsize(f) >= MiB)


def read_whole(path: str, buf) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [buf], 0)
    finally:
        os.close(fd)


def parallel(files: list[str], fresh: bool, populate: bool) -> None:
    local, kept = threading.local(), []

    def one(path: str) -> None:
        n = os.path.getsize(path)
        if fresh:
            buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            kept.append(buf)  # held to the end, like a restore's arrays
            if populate:
                addr = ctypes.c_void_p(np.frombuffer(buf, np.uint8).ctypes.data)
                if _libc.madvise(addr, ctypes.c_size_t(n), _MADV_POPULATE_WRITE):
                    raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE)")
        else:
            buf = getattr(local, "buf", None)
            if buf is None or len(buf) < n:
                buf = local.buf = bytearray(n)
        read_whole(path, memoryview(buf)[:n])

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(one, files))


def restorer(root: str):
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import gc

    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ucp

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    specs = [P("y", "x"), P("x", "y"), P(("y", "x"), None), P(None, ("x", "y"))]
    names = sorted(os.listdir(os.path.join(root, "arrays")))
    shardings = {k: NamedSharding(mesh, specs[i % 4]) for i, k in enumerate(names)}

    def run() -> None:
        out = jax_ucp.restore(root, shardings=shardings)
        jax.block_until_ready(out)
        del out
        gc.collect()

    run()  # warm-up: imports and first-call set-up
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm", action="store_true")
    a = ap.parse_args()
    files = shard_files(a.ckpt)
    one_dir = a.ckpt.rstrip("/") + "_onefile"
    one = os.path.join(one_dir, "data")
    if not os.path.exists(one):
        os.makedirs(one_dir, exist_ok=True)
        with open(one, "wb") as f:
            for p in files:
                with open(p, "rb") as g:
                    f.write(g.read())
            os.fsync(f.fileno())
    per_dir = a.ckpt.rstrip("/") + "_pertensor"
    if not os.path.isdir(per_dir):
        os.makedirs(per_dir)
        for name in sorted(os.listdir(os.path.join(a.ckpt, "arrays"))):
            mine = [p for p in files if p.split(os.sep)[-4] == name]  # arrays/NAME/c/i/j
            with open(os.path.join(per_dir, name), "wb") as f:
                for p in mine:
                    with open(p, "rb") as g:
                        f.write(g.read())
                os.fsync(f.fileno())
    per_tensor = sorted(os.path.join(per_dir, f) for f in os.listdir(per_dir))
    buf = bytearray(8 * MiB)

    def one_file() -> None:
        fd = os.open(one, os.O_RDONLY)
        try:
            while os.readv(fd, [buf]):
                pass
        finally:
            os.close(fd)

    def sequential(paths: list[str]) -> None:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                while os.readv(fd, [buf]):
                    pass
            finally:
                os.close(fd)

    rows = {
        "one file, 8 MiB reads": (one_dir, one_file),
        "one file per tensor, 8 MiB reads": (per_dir, lambda: sequential(per_tensor)),
        "shard files, 1 thread": (a.ckpt, lambda: sequential(files)),
        "shard files, 16 threads": (a.ckpt, lambda: parallel(files, False, False)),
        "shard files, 16 threads, fresh": (a.ckpt, lambda: parallel(files, True, False)),
        "... + populate": (a.ckpt, lambda: parallel(files, True, True)),
        "jax_ucp.restore": (a.ckpt, restorer(a.ckpt)),
    }
    got: dict[str, list] = {k: [] for k in rows}
    loads = [os.getloadavg()[0]]
    for r in range(a.rounds):
        for name in list(rows)[:: -1 if r % 2 else 1]:
            where, fn = rows[name]
            if not a.warm:
                evict(where)
            ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            fn()
            seconds, ru = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
            cpu = ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime
            got[name].append((seconds, cpu, ru.ru_minflt - ru0.ru_minflt))
        loads.append(os.getloadavg()[0])
    total = sum(os.path.getsize(p) for p in files)
    print(f"{total / 1e9:.2f} GB in {len(files)} files, {'warm' if a.warm else 'cold'}, "
          f"{a.rounds} rounds, load {' → '.join(f'{x:.1f}' for x in loads)}")  # fmt: skip
    print("| read | wall s (median; rounds) | GB/s | CPU s | minor faults |\n|---|---|---|---|---|")
    for name, runs in got.items():
        s = statistics.median(x[0] for x in runs)
        print(f"| {name} | {s:.3f} ({', '.join(f'{x[0]:.2f}' for x in runs)}) | "
              f"{total / 1e9 / s:.2f} | {statistics.median(x[1] for x in runs):.2f} | "
              f"{int(statistics.median(x[2] for x in runs))} |")  # fmt: skip


if __name__ == "__main__":
    main()
