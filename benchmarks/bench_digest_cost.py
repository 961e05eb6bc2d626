"""Cost of the per-shard digests on a cold restore onto another mesh.

The same checkpoint with and without ``shard_digests`` in its manifest (digest files removed
too), restored alternately onto a 4x2 mesh, the page cache dropped before each restore (needs
root for /proc/sys/vm/drop_caches). Prints every time and the median ratio.

    python benchmarks/bench_digest_cost.py [--tensors 16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ucp


def strip_digests(node):
    """Removes every ``shard_digests`` field of a manifest (in place)."""
    if isinstance(node, dict):
        node.pop("shard_digests", None)
        for value in node.values():
            strip_digests(value)
    elif isinstance(node, list):
        for value in node:
            strip_digests(value)


def drop_caches() -> None:
    os.system("sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="ucp_digest_")
    with_digests, without = os.path.join(root, "with"), os.path.join(root, "without")
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    rng = np.random.default_rng(0)
    tree = {
        f"w{i}": jax.device_put(
            rng.standard_normal((2048, 2048), dtype=np.float32),
            NamedSharding(mesh, P("x", "y")),
        )
        for i in range(args.tensors)
    }
    jax_ucp.save(with_digests, tree)
    shutil.copytree(with_digests, without)
    with open(os.path.join(without, "ucp.json")) as f:
        manifest = json.load(f)
    strip_digests(manifest)
    with open(os.path.join(without, "ucp.json"), "w") as f:
        json.dump(manifest, f)
    for name in os.listdir(without):
        if name.startswith("ucp.digests"):
            os.remove(os.path.join(without, name))
    new_mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    seconds: dict[str, list[float]] = {with_digests: [], without: []}
    for r in range(args.rounds):
        for path in (with_digests, without) if r % 2 == 0 else (without, with_digests):
            drop_caches()
            start = time.perf_counter()
            jax.block_until_ready(jax_ucp.restore(path, mesh=new_mesh))
            seconds[path].append(time.perf_counter() - start)
    for path, times in seconds.items():
        print(
            f"{os.path.basename(path):8s} {[round(t, 3) for t in times]} "
            f"median {statistics.median(times):.3f} s"
        )
    ratio = statistics.median(seconds[with_digests]) / statistics.median(seconds[without])
    print(f"restore with digests / without: {ratio:.3f}")
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
