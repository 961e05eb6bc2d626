"""Benchmark: a fully replicated multi-process restore with ``replicated_read="each"`` (every
process reads every byte) and ``"once"`` (each reads a share, the shares all-gathered over
gloo), side by side in one run, with 2 and 4 local processes (jax.distributed on 127.0.0.1).

Per process: the bytes the reader read (``jax_ucp._src.store.bytes_read()``: TensorStore's file
metric plus ``store.shard_file``'s pread counter, i.e. what the reader asked of storage, the
page cache included) and, from /proc/self/io, ``read_bytes`` (what reached the block device).
Time: the slowest process's restore, the processes started together after a barrier; rounds
alternate the modes and the medians are printed. ``--cold`` evicts the checkpoint's files from
the page cache (posix_fadvise DONTNEED) before every restore.

    python benchmarks/bench_replicated_read.py --mib 256 --processes 2 4 --rounds 3 \\
        --json docs/benchmark_replicated_read.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def make_checkpoint(path: str, mib: int) -> int:
    """bf16 weights of 16 MiB each (plus a float32 bias and an odd-shaped tensor); returns the
    bytes of the tensors' data."""
    import ml_dtypes
    import numpy as np

    import jax_ucp

    rng = np.random.default_rng(0)
    params = {}
    for i in range(max(1, mib // 16)):
        params[f"w{i}"] = rng.standard_normal((2048, 4096), np.float32).astype(ml_dtypes.bfloat16)
    params["bias"] = rng.standard_normal((4096,), np.float32)
    params["odd"] = rng.standard_normal((1001, 37), np.float32)
    jax_ucp.save(path, {"params": params}, force=True)
    return sum(a.nbytes for a in params.values())


def evict(path: str) -> None:
    for d, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def io_read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])


def worker(
    pid: int, n: int, port: str, path: str, modes: list[str], cold: bool, budget: int | None
) -> None:
    import jax
    import numpy as np

    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=n,
        process_id=pid,
        initialization_timeout=120,
    )
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ucp
    from jax_ucp._src import store

    mesh = Mesh(np.array(jax.devices()).reshape(n, -1), ("data", "model"))
    manifest = jax_ucp.inspect(path)
    rep = NamedSharding(mesh, P())
    target = {
        "params": {
            e.name.split("/", 1)[1]: jax.ShapeDtypeStruct(e.shape, np.dtype(e.dtype), sharding=rep)
            for e in manifest.tensors
        }
    }
    reference = None
    for mode in modes:
        if cold and pid == 0:
            evict(path)
        multihost_utils.sync_global_devices("bench:start")
        b0, io0, t0 = store.bytes_read(), io_read_bytes(), time.perf_counter()
        out = jax_ucp.restore(path, target=target, replicated_read=mode, memory_budget=budget)
        jax.block_until_ready(out)
        seconds = time.perf_counter() - t0
        b1, io1 = store.bytes_read(), io_read_bytes()
        first = {k: np.asarray(v.addressable_shards[0].data) for k, v in out["params"].items()}
        if reference is None:
            reference = first
        else:  # every mode gives the same bits
            for k, v in first.items():
                assert np.array_equal(v.view(np.uint8), reference[k].view(np.uint8)), k
        del out, first
        multihost_utils.sync_global_devices("bench:end")
        print(
            "RESULT "
            + json.dumps(
                {
                    "mode": mode,
                    "process": pid,
                    "seconds": seconds,
                    "bytes_read": b1 - b0,
                    "io_read_bytes": io1 - io0,
                }
            ),
            flush=True,
        )
    os._exit(0)  # skip jax.distributed's shutdown barrier


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run_job(n, path, modes, cold, devices, budget) -> list[dict]:
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=ROOT,
    )
    port = free_port()
    args = [path, ",".join(modes), "1" if cold else "0", str(budget or 0)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(i), str(n), port, *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    results, failed = [], []
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=3600)
        if p.returncode != 0:
            failed.append(f"process {i} exit {p.returncode}:\n{err[-1500:]}")
        results += [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    if failed:
        raise SystemExit("workers failed:\n" + "\n".join(failed))
    return results


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        pid, n, port, path, modes, cold, budget = sys.argv[2:9]
        worker(int(pid), int(n), port, path, modes.split(","), cold == "1", int(budget) or None)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="checkpoint size (16 MiB tensors)")
    parser.add_argument("--path", help="an existing checkpoint (else one is made in a tmp dir)")
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--devices", type=int, default=2, help="CPU devices per process")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="evict the files before each")
    parser.add_argument("--memory-budget", type=int, help="restore's memory budget (256 MiB)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    tmp = tempfile.mkdtemp(prefix="bench_replicated_")
    path = args.path or os.path.join(tmp, "ckpt")
    if args.path is None:
        data = make_checkpoint(path, args.mib)
    else:
        import jax_ucp

        data = sum(e.nbytes for e in jax_ucp.inspect(path).tensors)
    files = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    print(f"checkpoint {path}: {data / 2**20:.1f} MiB of tensors, {files / 2**20:.1f} MiB on disk")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; cold={args.cold}")
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "data_bytes": data}
    report["load_average"] = os.getloadavg()[0]
    report["cold"] = args.cold
    report["memory_budget"] = args.memory_budget
    report["jobs"] = {}
    for n in args.processes:
        modes = ["each", "once"] * args.rounds
        results = run_job(n, path, modes, args.cold, args.devices, args.memory_budget)
        rows = {}
        for mode in ("each", "once"):
            mine = [r for r in results if r["mode"] == mode]
            rounds = [[r for r in mine if r["process"] == p] for p in range(n)]
            seconds = [max(rounds[p][k]["seconds"] for p in range(n)) for k in range(args.rounds)]
            total = [sum(rounds[p][k]["bytes_read"] for p in range(n)) for k in range(args.rounds)]
            disk = [
                sum(rounds[p][k]["io_read_bytes"] for p in range(n)) for k in range(args.rounds)
            ]
            rows[mode] = {
                "seconds": seconds,
                "median_s": statistics.median(seconds),
                "first_s": seconds[0],
                "bytes_read_total": statistics.median(total),
                "bytes_read_per_process": [
                    statistics.median(r["bytes_read"] for r in rounds[p]) for p in range(n)
                ],
                "read_vs_checkpoint": statistics.median(total) / data,
                "io_read_bytes_total": statistics.median(disk),
            }
        rows["once_vs_each_time"] = rows["once"]["median_s"] / rows["each"]["median_s"]
        report["jobs"][n] = rows
        print(f"\n{n} processes x {args.devices} devices, P() everywhere, {args.rounds} rounds:")
        print(
            f"  {'mode':6} {'median s':>9} {'first s':>8} {'read/ckpt':>10} {'per process MiB':>22}"
        )
        for mode in ("each", "once"):
            r = rows[mode]
            per = ", ".join(f"{b / 2**20:.0f}" for b in r["bytes_read_per_process"])
            print(
                f"  {mode:6} {r['median_s']:9.2f} {r['first_s']:8.2f} "
                f"{r['read_vs_checkpoint']:9.2f}x {per:>22}"
            )
        print(
            f"  once/each time {rows['once_vs_each_time']:.2f}; block-device reads (all "
            f"processes): each {rows['each']['io_read_bytes_total'] / 2**20:.0f} MiB, once "
            f"{rows['once']['io_read_bytes_total'] / 2**20:.0f} MiB"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.path is None:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
