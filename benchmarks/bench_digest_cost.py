"""Cost of the per-shard digests on a cold restore onto another mesh: the same checkpoint with
and without ``shard_digests`` in its manifest, restored alternately, page cache dropped before
each restore (needs root for /proc/sys/vm/drop_caches). Prints the median ratio.

    python benchmarks/bench_digest_cost.py
"""

import json
import os
import shutil
import statistics
import tempfile
import time

ROOT = tempfile.mkdtemp(prefix="ucp_digest_")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ucp

mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
rng = np.random.default_rng(0)
tree = {
    f"w{i}": jax.device_put(
        rng.standard_normal((2048, 2048), dtype=np.float32), NamedSharding(mesh, P("x", "y"))
    )
    for i in range(16)
}
a, b = os.path.join(ROOT, "with"), os.path.join(ROOT, "without")
for p in (a, b):
    shutil.rmtree(p, ignore_errors=True)
t = time.perf_counter()
jax_ucp.save(a, tree)
print("save", time.perf_counter() - t)
shutil.copytree(a, b)
m = json.load(open(f"{b}/ucp.json"))


def strip(x):
    if isinstance(x, dict):
        x.pop("shard_digests", None)
        for v in x.values():
            strip(v)
    elif isinstance(x, list):
        for v in x:
            strip(v)


strip(m)
json.dump(m, open(f"{b}/ucp.json", "w"))
for f in os.listdir(b):
    if f.startswith("ucp.digests"):
        os.remove(os.path.join(b, f))
new = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
res = {a: [], b: []}
for r in range(5):
    for p in (a, b) if r % 2 == 0 else (b, a):
        os.system("sync; echo 3 > /proc/sys/vm/drop_caches")
        t = time.perf_counter()
        out = jax_ucp.restore(p, mesh=new)
        jax.block_until_ready(out)
        res[p].append(time.perf_counter() - t)
for p in res:
    print(
        os.path.basename(p),
        [round(x, 3) for x in res[p]],
        "median",
        round(statistics.median(res[p]), 3),
    )
print(
    "digest cost (median ratio):", round(statistics.median(res[a]) / statistics.median(res[b]), 3)
)
