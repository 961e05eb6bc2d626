"""How long does an async save stall training?  ``mngr.save()`` inside ``ocp.CheckpointManager``.

For the same tree (``--gib`` GiB of 4096×4096 float32 on a 2×4 mesh of CPU devices, mixed
PartitionSpecs as in bench_save_restore), measures, alternating within each round:

  * the time until ``mngr.save(step, args=Composite(state=jax_ucp.UCPSave(tree)))`` returns,
    and until ``wait_until_finished()`` (the whole save), in an async manager kept open across
    rounds (as in training: from the second save on, the private host copies reuse the previous
    save's buffers); round 0 (the first save, empty pool) is reported apart;
  * the whole save of the same tree in a blocking manager (``enable_async_checkpointing=False``),
    and the ratio async ÷ blocking per round;
  * the async save without reusing host copies (``UCPCheckpointHandler(reuse_host_copies=False)``:
    every save copies into new memory, as before the pool);
  * the same async save with Orbax's ``StandardSave`` (defaults; ``--no-orbax`` leaves it out);
  * the device→host copy of the same tree three ways: ``jax.device_get(tree)``;
    ``copy_to_host_async()`` on every replica-0 shard then ``np.asarray`` each (what an async
    save must at least do); and a private copy of every replica-0 shard (``np.array(copy=True)``),
    which is what a save has to take on CPU, where ``np.asarray`` aliases the device buffer.

The ratio stall / copy says how much of the blocking part is more than the unavoidable copy.

With ``--budget 256MiB``, the same async and blocking saves with ``UCPSave(memory_budget=)``
(``jax_ucp._src.saving.budget``: the stall copies shards up to the budget, the commit writes the rest
batch by batch) join the rounds. Every save also reports its peak host memory: RssAnon sampled
every 10 ms from a thread (``rss.Peak``), over the process just before ``mngr.save``.

  python benchmarks/bench_async_stall.py [--gib 1] [--rounds 5] [--dir /tmp/ucp_stall] [--no-orbax]
      [--budget 256MiB]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import orbax.checkpoint as ocp
from bench_save_restore import make_tree
from jax.sharding import Mesh
from rss import Peak, status

import jax_ucp


def replica0(tree):
    return [s.data for x in jax.tree.leaves(tree) for s in x.addressable_shards if not s.replica_id]


def copy_device_get(tree):
    out = jax.device_get(tree)
    return out


def copy_async_block(tree):
    shards = replica0(tree)
    for d in shards:
        d.copy_to_host_async()
    return [np.asarray(d) for d in shards]


def copy_private(tree):
    return [np.array(d, copy=True) for d in replica0(tree)]


def manager_save(mngr, step, tree, args_fn):
    """One save in a manager kept open across rounds, as in training (the async one reuses the
    previous save's host copies); the previous step's directory is removed outside the timing."""
    base = status().get("RssAnon", 0)
    with Peak() as peak:
        t0 = time.perf_counter()
        mngr.save(step, args=ocp.args.Composite(state=args_fn(tree)))
        stall = time.perf_counter() - t0
        mngr.wait_until_finished()
        total = time.perf_counter() - t0
    return stall, total, peak.anon - base


# name -> (save args, async manager?, item handler or None for Orbax's registered one)
SAVES = {
    "jax_ucp UCPSave async": (lambda t: jax_ucp.UCPSave(t), True, None),
    "jax_ucp async, no reuse": (
        lambda t: jax_ucp.UCPSave(t),
        True,
        lambda: jax_ucp.UCPCheckpointHandler(reuse_host_copies=False),
    ),
    "jax_ucp UCPSave blocking": (lambda t: jax_ucp.UCPSave(t), False, None),
    "orbax StandardSave async": (lambda t: ocp.args.StandardSave(t), True, None),
}
COPIES = {
    "jax.device_get": copy_device_get,
    "copy_to_host_async+asarray": copy_async_block,
    "private copy (np.array)": copy_private,
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/ucp_stall")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-orbax", action="store_true", help="leave Orbax's StandardSave out")
    ap.add_argument("--budget", default=None, help="add saves with UCPSave(memory_budget=)")
    args = ap.parse_args()
    if args.budget:
        budget = args.budget
        SAVES[f"jax_ucp async, budget {budget}"] = (
            lambda t: jax_ucp.UCPSave(t, memory_budget=budget),
            True,
            None,
        )
        SAVES[f"jax_ucp blocking, budget {budget}"] = (
            lambda t: jax_ucp.UCPSave(t, memory_budget=budget),
            False,
            None,
        )
    if args.no_orbax:
        SAVES.pop("orbax StandardSave async")
    devs = np.array(jax.devices()[:8])
    tree = make_tree(args.gib, Mesh(devs.reshape(2, 4), ("data", "model")))
    jax.block_until_ready(tree)
    nbytes = sum(x.nbytes for x in tree.values())
    shard_bytes = sum(d.nbytes for d in replica0(tree))
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    print(
        f"{len(tree)} tensors, {nbytes / 2**30:.2f} GiB ({shard_bytes / 2**30:.2f} GiB of replica-0 "
        f"shards) on a 2×4 CPU mesh; {args.rounds} rounds (+1 warm-up), alternating",
        flush=True,
    )
    stall = {k: [] for k in SAVES}
    total = {k: [] for k in SAVES}
    peak = {k: [] for k in SAVES}
    first = {}
    copy = {k: [] for k in COPIES}
    managers = {}
    for i, (name, (_, use_async, handler)) in enumerate(SAVES.items()):
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=use_async, create=True)
        managers[name] = ocp.CheckpointManager(
            os.path.join(args.dir, str(i)),
            options=options,
            item_handlers=None if handler is None else {"state": handler()},
        )
    for r in range(args.rounds + 1):
        names = list(SAVES) + list(COPIES)
        if r % 2:
            names.reverse()
        for name in names:
            gc.collect()
            if name in SAVES:
                os.sync()
                s, t, mem = manager_save(managers[name], r, tree, SAVES[name][0])
                shutil.rmtree(os.path.join(str(managers[name].directory), str(r)))
                time.sleep(1.0)  # training steps between saves (the pool's copy compiles)
                if r:
                    stall[name].append(s)
                    total[name].append(t)
                    peak[name].append(mem)
                else:
                    first[name] = (s, t)
                print(
                    f"  round {r} {name:28s} stall {s:6.3f}s  whole save {t:6.2f}s  "
                    f"peak +{mem / 2**20:6.0f} MiB  (load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
            else:
                t0 = time.perf_counter()
                out = COPIES[name](tree)
                t = time.perf_counter() - t0
                del out
                if r:
                    copy[name].append(t)
                print(f"  round {r} {name:28s} {t:6.3f}s", flush=True)
    for mngr in managers.values():
        mngr.close()
    shutil.rmtree(args.dir, ignore_errors=True)
    med = statistics.median

    def spread(xs):
        return f"{min(xs):.2f}–{max(xs):.2f}"

    ref = med(copy["private copy (np.array)"])
    print(
        f"\n{'what':30s} {'stall s':>8s} {'÷ private copy':>15s} {'whole save s':>13s} "
        f"{'(min–max)':>11s} {'first save s':>13s} {'peak MiB':>9s}"
    )
    for name in SAVES:
        print(
            f"{name:30s} {med(stall[name]):8.3f} {med(stall[name]) / ref:15.2f} "
            f"{med(total[name]):13.2f} {spread(total[name]):>11s} {first[name][1]:13.2f} "
            f"{max(peak[name]) / 2**20:9.0f}"
        )
    blocking = total["jax_ucp UCPSave blocking"]
    ratios = [a / b for a, b in zip(total["jax_ucp UCPSave async"], blocking)]
    no_reuse = [a / b for a, b in zip(total["jax_ucp async, no reuse"], blocking)]
    print(
        f"async ÷ blocking whole save, per round: median {med(ratios):.2f} "
        f"(min {min(ratios):.2f}, max {max(ratios):.2f}); first save (empty pool): "
        f"{first['jax_ucp UCPSave async'][1] / first['jax_ucp UCPSave blocking'][1]:.2f}; "
        f"without reuse: median {med(no_reuse):.2f} (min {min(no_reuse):.2f}, "
        f"max {max(no_reuse):.2f})"
    )
    budgeted = {}
    if args.budget:
        for kind in ("async", "blocking"):
            xs = [a / b for a, b in zip(total[f"jax_ucp {kind}, budget {args.budget}"], blocking)]
            budgeted[kind] = xs
            print(
                f"{kind} with budget {args.budget} ÷ blocking (no budget) whole save, per round: "
                f"median {med(xs):.2f} (min {min(xs):.2f}, max {max(xs):.2f})"
            )
    for name in COPIES:
        print(f"{name:30s} {med(copy[name]):9.3f} {'':13s} {med(copy[name]) / ref:15.2f}")
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"(medians of {args.rounds} rounds after a warm-up round)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                    "command": f"python benchmarks/bench_async_stall.py --gib {args.gib} "
                    f"--rounds {args.rounds}"
                    + (" --no-orbax" if args.no_orbax else "")
                    + (f" --budget {args.budget}" if args.budget else ""),
                    "bytes": nbytes,
                    "stall_s": stall,
                    "whole_save_s": total,
                    "first_save_s": first,
                    "peak_rss_anon_bytes": peak,
                    "budgeted_over_blocking": budgeted,
                    "async_over_blocking": ratios,
                    "no_reuse_over_blocking": no_reuse,
                    "copy_s": copy,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
