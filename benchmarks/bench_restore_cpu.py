"""The restore's own CPU seconds and page faults per GB, two source trees side by side (issue 69,
items 2 and 3): each restore in a fresh process, the page cache evicted first, the trees
alternating within each round; ``getrusage`` (user + system, every thread, and minor faults)
taken around ``jax_ucp.restore`` alone (imports and set-up excluded), the load average beside.

    python benchmarks/bench_restore_cpu.py CKPT [CKPT ...] --tree before=/path/a --tree after=.
        [--rounds 3] [--json OUT]

Each CKPT is a ``bench_scale.py --child jax-save --contender jax_ucp --gb N`` checkpoint (64 MiB
float32 tensors saved on 2 x 4), restored onto 4 x 2 with other specs as ``bench_scale`` does
(three specs of four cut its inner chunks between devices). ``--tree NAME=DIR``: a checkout whose
``jax_ucp`` is imported (``PYTHONPATH=DIR``). ``--devices 1``: every tensor onto one device instead
(three layouts of four then read their chunks as strided blocks of it).

A profile of the restore alone (imports excluded), one child run under ``perf``; its JSON line
names the restore's ``CLOCK_MONOTONIC`` window:

    perf record -k CLOCK_MONOTONIC -e cpu-clock -F 1999 -g -o P.data -- python
        benchmarks/bench_restore_cpu.py x --tree x=. --child CKPT [--devices 1]
    perf report -i P.data --time WINDOW --no-children --sort sym --stdio -g none"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def child(path: str, devices: int = 8) -> dict:
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np
    from bench_save_restore import evict
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ucp

    n = len(os.listdir(os.path.join(path, "arrays")))  # bench_scale's names: w000, w001, ...
    names = [f"w{i:03d}" for i in range(n)]
    mesh = Mesh(np.array(jax.devices()[:devices]).reshape(-1, 2 if devices > 1 else 1), ("x", "y"))
    specs = [P("y", "x"), P("x", "y"), P(("y", "x"), None), P(None, ("x", "y"))]
    shardings = {k: NamedSharding(mesh, specs[i % 4]) for i, k in enumerate(names)}
    evict(path)
    m0 = time.clock_gettime(time.CLOCK_MONOTONIC)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out = jax.block_until_ready(jax_ucp.restore(path, shardings=shardings))
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    m1 = time.clock_gettime(time.CLOCK_MONOTONIC)
    nbytes = sum(s.data.nbytes for x in out.values() for s in x.addressable_shards)
    return {
        "gb": nbytes / 1e9,
        "wall": wall,
        "user": r1.ru_utime - r0.ru_utime,
        "sys": r1.ru_stime - r0.ru_stime,
        "minflt": r1.ru_minflt - r0.ru_minflt,
        "window": f"{m0:.6f},{m1:.6f}",  # for ``perf report --time`` (docstring)
        # bit-exactness across trees: a digest of the first two tensors' device buffers
        "digest": hashlib.sha256(
            b"".join(
                np.asarray(s.data).tobytes() for k in names[:2] for s in out[k].addressable_shards
            )
        ).hexdigest()[:16],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("ckpts", nargs="+")
    ap.add_argument("--tree", action="append", required=True, help="NAME=DIR (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--devices", type=int, default=8, choices=(1, 8))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.devices)))
        return
    trees = [t.split("=", 1) for t in a.tree]
    runs: list[dict] = []
    for r in range(a.rounds):
        for ck in a.ckpts:
            for name, tree in trees if r % 2 == 0 else trees[::-1]:
                env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), PYTHONWARNINGS="ignore")
                out = subprocess.run(
                    [
                        sys.executable,
                        os.path.abspath(__file__),
                        "x",
                        "--tree",
                        "x=.",
                        "--child",
                        ck,
                        "--devices",
                        str(a.devices),
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                row = json.loads(out.stdout.strip().splitlines()[-1])
                row.update(tree=name, ckpt=ck, round=r, load=os.getloadavg()[0])
                row["cpu_per_gb"] = (row["user"] + row["sys"]) / row["gb"]
                runs.append(row)
                print(f"{name:8s} {row['gb']:5.2f} GB  wall {row['wall']:6.2f}  cpu {row['user']:.2f}+{row['sys']:.2f}"
                      f"  cpu/GB {row['cpu_per_gb']:.3f}  faults {row['minflt']}  load {row['load']:.1f}", flush=True)  # fmt: skip
    print("\n| tree | GB | wall s median | CPU-s/GB median (each) | minor faults median | load |")
    print("|---|---|---|---|---|---|")
    for ck in a.ckpts:
        for name, _ in trees:
            rs = [x for x in runs if x["tree"] == name and x["ckpt"] == ck]
            each = ", ".join(f"{x['cpu_per_gb']:.2f}" for x in rs)
            sums = {x["digest"] for x in runs if x["ckpt"] == ck}
            print(f"| {name} | {rs[0]['gb']:.2f} | {statistics.median(x['wall'] for x in rs):.2f} | "
                  f"{statistics.median(x['cpu_per_gb'] for x in rs):.3f} ({each}) | "
                  f"{statistics.median(x['minflt'] for x in rs):.0f} | {min(x['load'] for x in rs):.1f}–{max(x['load'] for x in rs):.1f} |"
                  + ("" if len(sums) == 1 else " DIGESTS DIFFER"))  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
