"""A cold restore with its host buffers on 4 KiB pages vs on transparent huge pages (issue 52).

numpy asks the kernel for huge pages (``madvise(MADV_HUGEPAGE)``) on every buffer of 4 MiB and
more; where THP's ``defrag`` is ``madvise`` (the kernel's default) a fault in such a buffer may
compact memory first, on the faulting thread. A restore's part buffers are such buffers. This
saves ``--mib`` MiB of float32 (64 MiB tensors, sharded over a data=2 × model=4 mesh of CPU
devices) once, then restores it cold (page cache evicted), alternating within each round:

  * ``hugepage``: numpy's default (``madvise(MADV_HUGEPAGE)`` on large buffers);
  * ``4k``: the same restore with numpy's huge-page advice off;
  * ``disk``: the files read cold into one reused buffer (the disk's own figure).

and reports wall time, the process's CPU time (user + system) and its minor page faults
(``ru_minflt``) during each restore, medians over rounds, and the load average.

    python benchmarks/bench_restore_pages.py --mib 512 --rounds 3

``--against TREE`` compares code instead: each restore in a fresh process (what a job does:
nothing freed before to reuse), this checkout's code vs ``TREE``'s (e.g. ``git archive
COMMIT | tar -x -C TREE``), alternating, beside the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from bench_save_restore import evict
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ucp

try:
    from numpy._core.multiarray import _get_madvise_hugepage, _set_madvise_hugepage
except ImportError:  # numpy < 2
    from numpy.core.multiarray import _get_madvise_hugepage, _set_madvise_hugepage


def disk_read(path: str, buf: np.ndarray) -> int:
    n = 0
    for d, _, files in os.walk(path):
        for f in sorted(files):
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                pos = 0
                while True:
                    got = os.preadv(fd, [memoryview(buf)], pos)
                    if got <= 0:
                        break
                    pos += got
                n += pos
            finally:
                os.close(fd)
    return n


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _usage(wall: float, ru0, ru1) -> dict:
    return {
        "wall_s": wall,
        "cpu_s": ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime,
        "sys_s": ru1.ru_stime - ru0.ru_stime,
        "minor_faults": ru1.ru_minflt - ru0.ru_minflt,
        "load": os.getloadavg()[0],
    }


def _fresh(tree: str, args) -> dict:
    """One cold restore in a fresh process running ``tree``'s jax_ucp."""
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--mib", str(args.mib)]
    out = subprocess.run(cmd + ["--dir", args.dir], env=env, capture_output=True, text=True)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"{tree}: {out.stdout[-2000:]}{out.stderr[-3000:]}")
    res = json.loads(lines[-1][len("RESULT ") :])
    res["load"] = os.getloadavg()[0]
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/ucp_restore_pages")
    ap.add_argument("--json")
    ap.add_argument("--against", help="another checkout's tree: fresh processes, code vs code")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    specs = [P("data", "model"), P(None, "model"), P("model", None), P()]
    n = max(1, args.mib // 64)
    path = os.path.join(args.dir, f"ckpt_{args.mib}")
    if not os.path.exists(os.path.join(path, "ucp.json")):
        rng = np.random.default_rng(0)
        tree = {
            f"layer_{i:02d}": jax.device_put(
                rng.standard_normal((4096, 4096), dtype=np.float32),
                NamedSharding(mesh, specs[i % len(specs)]),
            )
            for i in range(n)
        }
        jax_ucp.save(path, tree)
        del tree
    target = {
        f"layer_{i:02d}": NamedSharding(mesh, P(*reversed(specs[i % len(specs)]))) for i in range(n)
    }
    if args.child:  # one cold restore, its figures as JSON
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        jax.block_until_ready(jax_ucp.restore(path, shardings=target))
        wall = time.perf_counter() - t0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        print("RESULT " + json.dumps(_usage(wall, ru0, ru1)))
        return 0
    default = _get_madvise_hugepage()
    buf = np.ones(8 << 20, np.uint8)
    results: dict[str, list[dict]] = {"disk": [], "hugepage": [], "4k": []}
    if args.against:
        results = {"disk": [], "this code": [], "other code": []}
    load0 = os.getloadavg()
    for r in range(args.rounds):
        kinds = list(results) if r % 2 == 0 else list(results)[::-1]
        for kind in kinds:
            evict(path)
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            if kind == "disk":
                disk_read(path, buf)
            elif args.against:
                tree = ROOT if kind == "this code" else args.against
                res = _fresh(tree, args)
                results[kind].append(res)
                print(f"round {r} {kind:10s} {json.dumps(res)}", flush=True)
                continue
            else:
                _set_madvise_hugepage(kind == "hugepage")
                try:
                    out = jax_ucp.restore(path, shardings=target)
                    jax.block_until_ready(out)
                finally:
                    _set_madvise_hugepage(default)
            wall = time.perf_counter() - t0
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            if kind != "disk":
                del out
            res = _usage(wall, ru0, ru1)
            results[kind].append(res)
            print(
                f"round {r} {kind:9s} {wall:6.3f} s  CPU {res['cpu_s']:6.3f} s (sys "
                f"{res['sys_s']:5.3f})  faults {res['minor_faults']:7d}  load {res['load']:.1f}",
                flush=True,
            )
    load1 = os.getloadavg()
    size = n * (64 << 20)
    med = statistics.median
    base = med(r["wall_s"] for r in results["disk"])
    if args.against:
        print(f"other code: {args.against}")
    print(f"\n{size / 1e9:.2f} GB, medians of {args.rounds}, load {load0[0]:.1f} → {load1[0]:.1f}")
    for kind, runs in results.items():
        wall = med(r["wall_s"] for r in runs)
        print(
            f"{kind:9s} {wall:6.3f} s  {size / wall / 1e9:5.2f} GB/s  {100 * base / wall:4.0f} % of "
            f"disk  CPU {med(r['cpu_s'] for r in runs):6.3f} s  sys "
            f"{med(r['sys_s'] for r in runs):6.3f} s  faults {med(r['minor_faults'] for r in runs):8.0f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                    "command": f"python benchmarks/bench_restore_pages.py --mib {args.mib} "
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
