"""Peak host memory of one save, each in a fresh process: async and blocking, with and without
``UCPSave(memory_budget=)``.

``bench_async_stall.py`` times the saves side by side in one process, where memory freed by one
save (glibc keeps it) hides the next one's growth; here every configuration runs alone: a fresh
Python builds the ``bench_save_restore`` tree (``--gib`` GiB of 4096×4096 float32 on a 2×4 CPU
mesh), saves a one-value tree once (Orbax's and the handler's start-up out of the measurement),
then saves the tree in a ``CheckpointManager`` while a thread samples RssAnon every 2 ms. Printed:
the peak over the process just before ``mngr.save``, the stall and the whole save, and the load.

  python benchmarks/bench_async_budget_memory.py [--gib 1] [--budgets 64MiB,256MiB]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

_CHILD = """
import json, os, sys, threading, time
sys.path.insert(0, {here!r})
import jax, numpy as np, orbax.checkpoint as ocp
from jax.sharding import Mesh
from bench_save_restore import make_tree
from rss import status
import jax_ucp

gib, root, mode, budget = float(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
budget = None if budget == "none" else budget
tree = make_tree(gib, Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model")))
jax.block_until_ready(tree)
options = ocp.CheckpointManagerOptions(enable_async_checkpointing=mode == "async")
mngr = ocp.CheckpointManager(root, options=options)
mngr.save(0, args=ocp.args.Composite(state=jax_ucp.UCPSave({{"x": 1.0}}, memory_budget=budget)))
mngr.wait_until_finished()
anon = lambda: status()["RssAnon"]
base, peak, done = anon(), [0], threading.Event()

def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.002)

t = threading.Thread(target=sample, daemon=True)
t.start()
t0 = time.perf_counter()
mngr.save(1, args=ocp.args.Composite(state=jax_ucp.UCPSave(tree, memory_budget=budget)))
stall = time.perf_counter() - t0
mngr.wait_until_finished()
total = time.perf_counter() - t0
done.set()
t.join()
mngr.close()
print("RESULT", json.dumps({{"over": max(peak[0], anon()) - base, "stall": stall, "total": total}}))
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--budgets", default="64MiB,256MiB")
    ap.add_argument("--dir", default="/tmp/ucp_budget_memory")
    args = ap.parse_args()
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        JAX_PLATFORMS="cpu",
    )
    configs = [
        (mode, b) for mode in ("async", "blocking") for b in ["none", *args.budgets.split(",")]
    ]
    print(f"{args.gib} GiB, one fresh process per save; load {os.getloadavg()[0]:.1f}")
    print(
        f"{'save':9s} {'memory_budget':>13s} {'peak RssAnon +MiB':>18s} {'stall s':>8s} "
        f"{'whole s':>8s} {'load':>5s}"
    )
    for mode, budget in configs:
        root = os.path.join(args.dir, f"{mode}-{budget}")
        subprocess.run(["rm", "-rf", root], check=True)
        code = _CHILD.format(here=HERE)
        t0 = time.perf_counter()
        p = subprocess.run(
            [sys.executable, "-c", code, str(args.gib), root, mode, budget],
            env=env,
            capture_output=True,
            text=True,
        )
        if p.returncode:
            print(p.stderr[-3000:])
            return 1
        got = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT"))[6:])
        print(
            f"{mode:9s} {budget:>13s} {got['over'] / 2**20:18.0f} {got['stall']:8.3f} "
            f"{got['total']:8.2f} {os.getloadavg()[0]:5.1f}   ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
        subprocess.run(["rm", "-rf", root], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
