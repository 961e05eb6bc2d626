"""How big should inner chunks be?  Save once per bound, restore onto other meshes, compare.

Two workloads: (a) 2-D weights saved on a 2×4 mesh restored onto 4×2 with other specs, and
(b) a replicated embedding (one outer shard) restored sharded over 8 devices, where each device
needs 1/8 and a whole-shard chunk would make every reader read everything.

  python benchmarks/bench_chunk_bound.py [--gib 0.5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from bench_save_restore import evict, make_tree
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ucp

BOUNDS = {
    "256K": 256 << 10,
    "1M": 1 << 20,
    "4M": 4 << 20,
    "16M": 16 << 20,
    "64M": 64 << 20,
    "whole shard": 1 << 40,
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/ucp_chunk_bench")
    args = ap.parse_args()
    devs = np.array(jax.devices()[:8])
    sm, lm = (
        Mesh(devs.reshape(2, 4), ("data", "model")),
        Mesh(devs.reshape(4, 2), ("data", "model")),
    )
    tree = make_tree(args.gib, sm)
    specs = [P("model", "data"), P("data", None), P(None, "data"), P("data", "model")]
    sh = {k: NamedSharding(lm, specs[i % 4]) for i, k in enumerate(tree)}
    emb = {
        "embedding": jax.device_put(
            np.random.default_rng(1).standard_normal((65536, 1024), np.float32),
            NamedSharding(sm, P()),
        )
    }  # 256 MiB replicated
    emb_sh = {"embedding": NamedSharding(Mesh(devs, ("x",)), P("x", None))}
    shutil.rmtree(args.dir, ignore_errors=True)
    res = {k: ([], [], []) for k in BOUNDS}
    for _r in range(args.rounds):
        for name, bound in BOUNDS.items():
            p1, p2 = os.path.join(args.dir, "w"), os.path.join(args.dir, "e")
            t0 = time.perf_counter()
            jax_ucp.save(p1, tree, inner_chunk_bytes=bound, force=True)
            res[name][0].append(time.perf_counter() - t0)
            jax_ucp.save(p2, emb, inner_chunk_bytes=bound, force=True)
            evict(p1)
            t0 = time.perf_counter()
            jax.block_until_ready(jax_ucp.restore(p1, shardings=sh))
            res[name][1].append(time.perf_counter() - t0)
            evict(p2)
            t0 = time.perf_counter()
            jax.block_until_ready(jax_ucp.restore(p2, shardings=emb_sh))
            res[name][2].append(time.perf_counter() - t0)
    gb = sum(x.nbytes for x in tree.values()) / 1e9
    print(
        f"{'inner bound':12s} {'save GB/s':>10s} {'reshard GB/s':>13s} {'replicated→sharded s':>21s}"
    )
    for name in BOUNDS:
        s, load, e = (statistics.median(v) for v in res[name])
        print(f"{name:12s} {gb / s:10.3f} {gb / load:13.3f} {e:21.3f}")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
