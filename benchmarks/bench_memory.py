"""Peak host memory of a save and of a restore: jax_ucp vs Orbax, each in a fresh process.

One subprocess per contender and direction (save, then restore of what it saved), on 8 CPU
devices.  A save starts once its arrays exist (``--tensors`` × ``--mib`` MiB float32 on a 2×4
mesh, P('x','y')); a restore reads them onto a 4×2 mesh with other PartitionSpecs (P('y','x')),
from a cold page cache.  Before the operation the child resets the kernel's high-water mark
(``/proc/self/clear_refs`` ← 5) and records VmRSS / RssAnon; a thread samples RssAnon every 5 ms.
Reported, in bytes and in units of "× the bytes of this process's arrays" (the saved tree, or
the restored one, counted once per device buffer):

  * peak increase of VmHWM over the baseline and peak increase of RssAnon (sampled);
  * for a restore, the *excess*: the increase minus the restored arrays themselves (on CPU the
    device buffers are host memory, so a restore can never cost less than 1×).

  python benchmarks/bench_memory.py [--tensors 64] [--mib 64] [--dir /tmp/ucp_mem] [--json F]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import shutil
import subprocess
import sys
import threading
import time

# "jax_ucp async": an async save, CheckpointManager + jax_ucp.UCPSave (private host copies on CPU).
CONTENDERS = ("jax_ucp", "jax_ucp async", "orbax default", "orbax no-compr")


def status(pid="self") -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out


class Sampler:
    """Peak RssAnon, sampled every ``period`` seconds in a thread."""

    def __init__(self, period: float = 0.005):
        self.peak = status()["RssAnon"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._thread.start()

    def _run(self, period):
        while not self._stop.is_set():
            self.peak = max(self.peak, status()["RssAnon"])
            time.sleep(period)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, status()["RssAnon"])
        return self.peak


def _settle() -> None:
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed temporaries back to the OS


def child(args) -> dict:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ucp

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_save_restore import evict

    devs = np.array(jax.devices()[:8])
    n = args.mib * (1 << 20) // 4
    side = int(np.sqrt(n))
    shape = (side, n // side) if side * (n // side) == n else (n // 4096, 4096)
    names = [f"w{i:03d}" for i in range(args.tensors)]
    if args.child == "save":
        mesh = Mesh(devs.reshape(2, 4), ("x", "y"))
        sharding = NamedSharding(mesh, P("x", "y"))
        rng = np.random.default_rng(0)
        tree = {}
        for k in names:
            host = rng.random(shape, dtype=np.float32)
            tree[k] = jax.device_put(host, sharding)
            del host
        jax.block_until_ready(tree)
        op_bytes = sum(s.data.nbytes for x in tree.values() for s in x.addressable_shards)
    else:
        mesh = Mesh(devs.reshape(4, 2), ("x", "y"))
        sharding = NamedSharding(mesh, P("y", "x"))
        shardings = {k: sharding for k in names}
        evict(args.path)
    _settle()
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    base = status()
    sampler = Sampler()
    t0 = time.perf_counter()
    if args.child == "save":
        if args.contender == "jax_ucp":
            jax_ucp.save(args.path, tree)
        elif args.contender == "jax_ucp async":
            options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True, create=True)
            with ocp.CheckpointManager(args.path, options=options) as mngr:
                mngr.save(0, args=ocp.args.Composite(state=jax_ucp.UCPSave(tree)))
                mngr.wait_until_finished()
        elif args.contender == "orbax default":
            with ocp.StandardCheckpointer() as ck:
                ck.save(args.path, tree)
                ck.wait_until_finished()
        else:
            handler = ocp.PyTreeCheckpointHandler(use_compression=False)
            with ocp.AsyncCheckpointer(handler) as ck:
                ck.save(args.path, args=ocp.args.PyTreeSave(tree))
                ck.wait_until_finished()
    else:
        if args.contender == "jax_ucp":
            out = jax_ucp.restore(args.path, shardings=shardings)
        elif args.contender == "jax_ucp async":
            out = jax_ucp.restore(os.path.join(args.path, "0"), shardings=shardings)
        else:
            target = {k: jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding) for k in names}
            with ocp.StandardCheckpointer() as ck:
                out = ck.restore(args.path, target)
        jax.block_until_ready(out)
        op_bytes = sum(s.data.nbytes for x in out.values() for s in x.addressable_shards)
    seconds = time.perf_counter() - t0
    peak_anon = sampler.stop()
    end = status()
    return {
        "contender": args.contender,
        "direction": args.child,
        "seconds": seconds,
        "array_bytes": op_bytes,
        "baseline": base,
        "VmHWM_increase": end["VmHWM"] - base["VmRSS"],
        "RssAnon_peak_increase": peak_anon - base["RssAnon"],
        "RssAnon_end_increase": end["RssAnon"] - base["RssAnon"],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--mib", type=int, default=64, help="MiB per float32 tensor")
    ap.add_argument("--dir", default="/tmp/ucp_mem")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--child", choices=("save", "restore"), help=argparse.SUPPRESS)
    ap.add_argument("--contender", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    total = args.tensors * args.mib << 20
    print(
        f"{args.tensors} × {args.mib} MiB float32 = {total / 2**30:.2f} GiB on 8 CPU devices; "
        f"save from a 2×4 mesh P('x','y'), restore onto 4×2 P('y','x'); one fresh process each",
        flush=True,
    )
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    results = []
    for c in args.contenders.split(","):
        path = os.path.join(args.dir, c.replace(" ", "_"))
        for direction in ("save", "restore"):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", direction]
            cmd += ["--contender", c, "--path", path]
            cmd += ["--tensors", str(args.tensors), "--mib", str(args.mib)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"{c} {direction} failed ({proc.returncode})")
            r = json.loads(lines[-1][len("RESULT ") :])
            results.append(r)
            ab = r["array_bytes"]
            extra = (
                ""
                if direction == "save"
                else f"  excess over arrays (HWM) {r['VmHWM_increase'] / ab - 1:5.2f}×"
            )
            print(
                f"  {c:15s} {direction:7s} {r['seconds']:6.1f}s  arrays {ab / 2**30:5.2f} GiB  "
                f"VmHWM +{r['VmHWM_increase'] / 2**30:5.2f} GiB ({r['VmHWM_increase'] / ab:4.2f}×)  "
                f"RssAnon peak +{r['RssAnon_peak_increase'] / 2**30:5.2f} GiB "
                f"({r['RssAnon_peak_increase'] / ab:4.2f}×){extra}",
                flush=True,
            )
        shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    print(
        f"\n{'contender':15s} {'direction':9s} {'s':>6s} {'arrays GiB':>10s} {'HWM +GiB':>9s} "
        f"{'HWM ×':>6s} {'anon +GiB':>9s} {'anon ×':>7s} {'excess ×':>9s}"
    )
    for r in results:
        ab = r["array_bytes"]
        hwm, anon = r["VmHWM_increase"], r["RssAnon_peak_increase"]
        excess = (hwm - ab) / ab if r["direction"] == "restore" else hwm / ab
        print(
            f"{r['contender']:15s} {r['direction']:9s} {r['seconds']:6.1f} {ab / 2**30:10.2f} "
            f"{hwm / 2**30:9.2f} {hwm / ab:6.2f} {anon / 2**30:9.2f} {anon / ab:7.2f} {excess:9.2f}"
        )
    print(
        "(× = bytes / this process's array bytes; save: increase over the baseline with the arrays "
        "already in memory; restore: excess = increase minus the restored arrays)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                    "command": "python benchmarks/bench_memory.py "
                    f"--tensors {args.tensors} --mib {args.mib}",
                    "results": results,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
