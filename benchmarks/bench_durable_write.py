"""How a save's shard files should reach the disk (issue 41): per-file strategies of
``store.shard_writer.write``'s non-sync path, side by side with the disk's own sequential rate.

Every strategy writes the same bytes as a 1 GB ``bench_scale.py --parts jax`` save does: 8 MiB
shard files (zarr v3 shards of 4 MiB inner chunks with crc32c trailers, ``shard_writer.encode``),
16 arrays of 8 files, from ``durable.write_pool()``'s threads; each is timed until everything is
durable (``local.make_tree_durable``: one syncfs + the directories), the write phase (until the
writers return) on its own:

* ``fadvise``: ``posix_fadvise(POSIX_FADV_DONTNEED)`` after each file (write-back started, pages
  dropped once clean), one syncfs at the commit (the strategy before issue 41),
* ``none``: nothing per file, one syncfs at the commit,
* ``sfr``: ``sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)`` after each file (write-back
  started, nothing waited for or dropped), one syncfs at the commit,
* ``small``: as ``none`` but every part its own ``write`` (many 4 MiB writes instead of one
  ``writev`` per file): whether fewer, larger writes matter,
* ``fsync``: ``fsync`` per file (``sync=True``), the reference,
* ``disk``: one file of the same bytes written sequentially with 8 MiB writes + ``fdatasync``
  (``dd bs=8M conv=fdatasync``), then read back cold (``posix_fadvise(DONTNEED)`` first): GB/s.

``--save``: the same per-file strategies (``fadvise``, ``none``, ``sfr``) inside a real
``jax_ucp.save`` of ``--gb`` GB of float32 (64 MiB tensors sharded over a 2x4 mesh of 8 CPU
devices, as ``bench_scale.py --parts jax``), ``shard_writer.start_writeback`` swapped for each;
timed from the call to its return (the save's own syncfs and commit included).

Rounds alternate the strategies (the order rotated each round) so they share the host's load;
the load average is printed with every round. Dirty + Writeback at the end of the write phase
is how much unwritten data a strategy leaves in memory.

    python benchmarks/bench_durable_write.py [--gb 1,4] [--rounds 3] [--dir /tmp/ucp_durable]
    python benchmarks/bench_durable_write.py --save [--gb 1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from jax_ucp._src.store import shard_writer  # noqa: E402
from jax_ucp._src.store.storage import local  # noqa: E402
from jax_ucp._src.store.zarr3 import ArrayLayout  # noqa: E402
from jax_ucp._src.writer import durable  # noqa: E402

GB = 10**9
MiB = 2**20
FILE_SHAPE = (4096, 512)  # float32: 8 MiB, a 4096x4096 tensor's shard on 8 devices
LAYOUT = ArrayLayout((4096, 4096), "float32", FILE_SHAPE, (2048, 512), checksum="crc32c")
STRATEGIES = ("fadvise", "none", "sfr", "small", "fsync", "disk")


SFR = shard_writer.sync_file_range()  # the binding the writer itself uses


def meminfo(*keys: str) -> int:
    total = 0
    with open("/proc/meminfo") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in keys:
                total += int(v.split()[0]) * 1024
    return total


def write_one(path: str, data: np.ndarray, strategy: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    parts = shard_writer.encode(data, LAYOUT)
    shard_writer.digest_of_parts(parts)  # the crc32c work a save does, the same for all
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        if strategy == "small":
            for p in parts:
                shard_writer.write_parts(fd, [p])
        else:
            shard_writer.write_parts(fd, parts)
        if strategy == "fsync":
            os.fsync(fd)
        elif strategy == "fadvise":
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        elif strategy == "sfr" and SFR is not None:
            SFR(fd, 0, 0, 2)  # SYNC_FILE_RANGE_WRITE
    finally:
        os.close(fd)


def run_strategy(root: str, blocks: list[np.ndarray], nfiles: int, strategy: str) -> dict:
    os.makedirs(root)
    pool = durable.write_pool()
    t0 = time.perf_counter()
    futures = []
    for i in range(nfiles):
        path = os.path.join(root, "arrays", f"w{i // 8:04d}", "c", str(i % 8), "0")
        futures.append(pool.submit(write_one, path, blocks[i % len(blocks)], strategy))
    for f in futures:
        f.result()
    t_write = time.perf_counter() - t0
    dirty = meminfo("Dirty", "Writeback")
    local.make_tree_durable(root)
    total = time.perf_counter() - t0
    return {"write_s": t_write, "total_s": total, "dirty_mib": dirty / MiB}


def run_disk(root: str, block: np.ndarray, nbytes: int) -> dict:
    """dd bs=8M conv=fdatasync, then a cold sequential read of the file."""
    os.makedirs(root)
    path = os.path.join(root, "disk")
    buf = memoryview(block.reshape(-1).view(np.uint8))
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        left = nbytes
        while left:
            n = os.write(fd, buf[: min(left, 8 * MiB)])
            left -= n
        os.fdatasync(fd)
    finally:
        os.close(fd)
    total = time.perf_counter() - t0
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        out = bytearray(8 * MiB)
        t1 = time.perf_counter()
        while os.readv(fd, [out]):
            pass
        read = time.perf_counter() - t1
    finally:
        os.close(fd)
    return {"write_s": total, "total_s": total, "read_s": read, "dirty_mib": 0.0}


def hint(strategy: str):
    """The per-file step of ``strategy`` in place of ``shard_writer.start_writeback``."""
    if strategy == "fadvise":
        return lambda fd: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    if strategy == "sfr":
        return lambda fd: SFR(fd, 0, 0, 2) if SFR is not None else None
    return lambda fd: None


def run_saves(a, strategies: list[str]) -> None:
    """``--save``: the strategies inside ``jax_ucp.save`` (rounds alternating, order rotated)."""
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ucp

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
    specs = [P("x", "y"), P("y", "x"), P(None, ("x", "y")), P(("x", "y"), None)]
    rng = np.random.default_rng(0)
    for gb in [float(s) for s in a.gb.split(",")]:
        n = max(1, round(gb * GB / (64 * MiB)))
        tree = {
            f"w{i:03d}": jax.device_put(
                rng.standard_normal((4096, 4096), dtype=np.float32),
                NamedSharding(mesh, specs[i % 4]),
            )
            for i in range(n)
        }
        jax.block_until_ready(tree)
        jax_ucp.save(os.path.join(a.dir, "warm-up"), tree)  # first-call costs, not timed
        clean(os.path.join(a.dir, "warm-up"))
        times: dict = {}
        for r in range(a.rounds):
            order = strategies[r % len(strategies) :] + strategies[: r % len(strategies)]
            for s in order:
                path = os.path.join(a.dir, "save_" + s)
                clean(path)
                shard_writer.start_writeback = hint(s)
                os.sync()
                load = os.getloadavg()[0]
                t0 = time.perf_counter()
                jax_ucp.save(path, tree)
                t = time.perf_counter() - t0
                clean(path)
                times.setdefault(s, []).append((t, load))
                print(f"  save {n * 64 * MiB / GB:.2f} GB round {r + 1} {s:8} {t:6.2f} s  "
                      f"{n * 64 * MiB / GB / t:5.2f} GB/s  load {load:.2f}", flush=True)  # fmt: skip
        print(f"\njax_ucp.save of {n * 64 * MiB / GB:.2f} GB, medians of {a.rounds}:")
        print("| per-file step | save s (median) | rounds s | GB/s | loads |")
        print("|---|---|---|---|---|")
        for s in strategies:
            ts = times[s]
            med = statistics.median(t for t, _ in ts)
            each = ", ".join(f"{t:.2f}" for t, _ in ts)
            loads = ", ".join(f"{x:.1f}" for _, x in ts)
            print(f"| {s} | {med:.2f} | {each} | {n * 64 * MiB / GB / med:.2f} | {loads} |")
        del tree


def clean(root: str) -> None:
    if os.path.isdir(root):
        shutil.rmtree(root)
        local.sync_filesystem(os.path.dirname(root))  # the deletions off the next round's disk


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", default="1", help="sizes in GB, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--dir", default="/tmp/ucp_durable")
    ap.add_argument("--json", default=None, help="also write the rounds here")
    ap.add_argument("--save", action="store_true", help="the strategies inside jax_ucp.save")
    a = ap.parse_args()
    strategies = a.strategies.split(",")
    if a.save:
        picked = [s for s in strategies if s in ("fadvise", "none", "sfr")]
        run_saves(a, picked or ["fadvise", "none", "sfr"])
        shutil.rmtree(a.dir, ignore_errors=True)
        return 0
    if SFR is None and "sfr" in strategies:
        print("no sync_file_range in libc here: 'sfr' runs as 'none'")
    rng = np.random.default_rng(0)
    blocks = [
        rng.integers(0, 2**32, FILE_SHAPE, dtype=np.uint32).view(np.float32) for _ in range(16)
    ]  # 128 MiB of incompressible data, reused file after file
    results: dict = {}
    print(f"kernel {os.uname().release}, {os.cpu_count()} cores, dirty_ratio "
          f"{open('/proc/sys/vm/dirty_ratio').read().strip()}, {a.dir}")  # fmt: skip
    for gb in [float(s) for s in a.gb.split(",")]:
        nfiles = max(1, round(gb * GB / (8 * MiB)))
        nbytes = nfiles * 8 * MiB
        for r in range(a.rounds):
            order = strategies[r % len(strategies) :] + strategies[: r % len(strategies)]
            for s in order:
                root = os.path.join(a.dir, s)
                clean(root)
                load = os.getloadavg()[0]
                if s == "disk":
                    res = run_disk(root, np.concatenate([b.reshape(-1) for b in blocks]), nbytes)
                else:
                    res = run_strategy(root, blocks, nfiles, s)
                clean(root)
                res |= {"load": load, "utc": time.strftime("%H:%M:%S", time.gmtime())}
                results.setdefault((gb, s), []).append(res)
                extra = f"  read cold {nbytes / GB / res['read_s']:.2f} GB/s" if s == "disk" else ""
                print(f"  {gb:g} GB round {r + 1} {s:8} write {res['write_s']:6.2f} s  durable "
                      f"{res['total_s']:6.2f} s  {nbytes / GB / res['total_s']:5.2f} GB/s  dirty "
                      f"{res['dirty_mib']:6.0f} MiB  load {load:.2f}{extra}", flush=True)  # fmt: skip
        print(f"\n{gb:g} GB ({nbytes / GB:.2f} GB, {nfiles} files of 8 MiB), medians of "
              f"{a.rounds}:")  # fmt: skip
        print(
            "| strategy | write phase s | durable s | GB/s to durable | × disk | dirty MiB | loads |"
        )
        print("|---|---|---|---|---|---|---|")
        disk = results.get((gb, "disk"))
        disk_s = statistics.median(x["total_s"] for x in disk) if disk else None
        for s in strategies:
            rs = results[(gb, s)]
            w = statistics.median(x["write_s"] for x in rs)
            t = statistics.median(x["total_s"] for x in rs)
            d = statistics.median(x["dirty_mib"] for x in rs)
            loads = ", ".join(f"{x['load']:.1f}" for x in rs)
            rel = f"{disk_s / t:.2f}" if disk_s else ""
            name = s
            if s == "disk":
                rd = statistics.median(nbytes / GB / x["read_s"] for x in rs)
                name = f"disk (dd + fdatasync; read cold {rd:.2f} GB/s)"
            print(f"| {name} | {w:.2f} | {t:.2f} | {nbytes / GB / t:.2f} | {rel} | {d:.0f} | "
                  f"{loads} |")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{"gb": k[0], "strategy": k[1], "rounds": v} for k, v in results.items()],
                      f, indent=1)  # fmt: skip
    shutil.rmtree(a.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
