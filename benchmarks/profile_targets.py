"""Small, profiler-friendly targets: one jax_ucp operation repeated, nothing else in the process.

  python benchmarks/profile_targets.py prepare [--dir /tmp/ucp_prof]      # writes the checkpoints
  python benchmarks/profile_targets.py restore d [--repeat 5]             # layout (a)…(f), see
                                                                          # bench_save_restore --layouts
  python benchmarks/profile_targets.py save-10k [--repeat 2]              # 10,000 × 16 KiB save

Under py-spy (then summarise with speedscope_summary.py):

  py-spy record -r 25 --native -f speedscope -o /tmp/restore_d.json -- \\
      python benchmarks/profile_targets.py restore d
  python benchmarks/speedscope_summary.py /tmp/restore_d.json

``restore`` reads the checkpoints ``prepare`` wrote (page cache evicted before each restore), so
the profiled process holds no source tree and does no save. ``save-10k`` leaves its
checkpoints in ``--dir`` (remove them afterwards).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from bench_save_restore import _put, evict, layout_tree, restore_layouts
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ucp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("target", choices=("prepare", "restore", "save-10k"))
    ap.add_argument("layout", nargs="?", default="d", help="restore: a, a', b, c, d, e or f")
    ap.add_argument("--dir", default="/tmp/ucp_prof")
    ap.add_argument("--repeat", type=int, default=None, help="restore: 5, save-10k: 2")
    args = ap.parse_args()
    if args.repeat is None:
        args.repeat = 2 if args.target == "save-10k" else 5
    devs = np.array(jax.devices()[:8])
    m24 = Mesh(devs.reshape(2, 4), ("x", "y"))
    if args.target == "prepare":
        host, saved = layout_tree(1, m24)
        shutil.rmtree(args.dir, ignore_errors=True)
        jax_ucp.save(os.path.join(args.dir, "A"), _put(host, saved, m24))
        jax_ucp.save(os.path.join(args.dir, "R"), _put(host, {k: P() for k in host}, m24))
        return 0
    if args.target == "save-10k":
        rng = np.random.default_rng(0)
        tree = jax.device_put(
            {f"t{i:05d}": rng.standard_normal((64, 64), dtype=np.float32) for i in range(10_000)},
            devs[0],
        )
        jax.block_until_ready(tree)
        paths = [os.path.join(args.dir, f"many_{i}") for i in range(args.repeat)]
        for path in paths:  # removed before, not between, saves: rmtree is not what we profile
            shutil.rmtree(path, ignore_errors=True)
        os.sync()
        for path in paths:
            t0 = time.perf_counter()
            jax_ucp.save(path, tree)
            print(f"save 10k: {time.perf_counter() - t0:.2f}s (left in {path})", flush=True)
        return 0
    # restore: names and saved specs as layout_tree makes them (without generating the data)
    names, saved = [], {}
    from bench_save_restore import LAYOUT_DTYPES, SAVED_SPECS

    for j, spec in enumerate(SAVED_SPECS):
        for k, dt in enumerate(LAYOUT_DTYPES):
            names.append(f"s0_spec{j}_{k}_{dt}")
            saved[names[-1]] = spec
    layouts = restore_layouts(devs, names, saved)
    (ckpt, shardings) = next(v for k, v in layouts.items() if k.split()[0] == args.layout)
    path = os.path.join(args.dir, ckpt)
    for _ in range(args.repeat):
        evict(path)
        t0 = time.perf_counter()
        out = jax_ucp.restore(path, shardings=shardings)
        jax.block_until_ready(out)
        print(f"restore {args.layout}: {time.perf_counter() - t0:.2f}s", flush=True)
        out = free_outside_timing(out)
    return 0


def free_outside_timing(out):
    """Drops the restored arrays (on CPU: munmap of every device buffer, not part of a restore);
    a function of its own so that a profile shows this time under its name."""
    for k in list(out):
        del out[k]
    return None


if __name__ == "__main__":
    sys.exit(main())
