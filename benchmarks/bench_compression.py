"""Compression: size on disk vs save and restore time, jax_ucp without and with zstd, and Orbax's
``StandardCheckpointer`` (zstd by default) beside them.

The state is a flax MLP stack (4.2M parameters, float32: 50 MB with its Adam moments) with optax.adamw, sharded over 8 CPU
devices, at three moments of a run:

- ``fresh``: just initialised (Adam moments all zero: what issue 24 measured, 49 MB vs 15 MB);
- ``trained``: after N training steps on random data (moments dense);
- ``bf16 params``: the trained state with params in bfloat16 (mixed-precision weights).

Per state and contender: bytes on disk, then the median over rounds of the save time (to a
durable, committed checkpoint) and of the restore time onto a 4-device mesh (page cache evicted
before each read). Also the per-role sizes (params, opt_state) so the question "compress the
optimizer state by default?" is answered from the figures.

  python benchmarks/bench_compression.py [--rounds 3] [--steps 20] [--width 512]
      [--dir /tmp/ucp_bench_zstd] [--out docs/benchmark_compression.json]

``--width 1024``: the same model 4x larger (16.8M parameters, 200 MB with its moments).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ucp
from jax_ucp._src.saving import engine
from jax_ucp._src.saving.options import SaveArgs

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_save_restore import du, evict  # noqa: E402


class Stack(nn.Module):
    width: int = 512
    depth: int = 4

    @nn.compact
    def __call__(self, x):
        for i in range(self.depth):
            x = nn.relu(nn.Dense(self.width * 2, name=f"up_{i}")(x))
            x = nn.Dense(self.width, name=f"down_{i}")(x)
        return x


def make_states(mesh: Mesh, steps: int, width: int):
    """(name, state) for the fresh, trained and bf16-params states, sharded on ``mesh``."""
    model, tx = Stack(width=width), optax.adamw(1e-3)
    x = jnp.ones((16, width))
    params = model.init(jax.random.key(0), x)["params"]

    def shard(leaf):
        if leaf.ndim == 2:
            return jax.device_put(leaf, NamedSharding(mesh, P("data", "model")))
        return jax.device_put(leaf, NamedSharding(mesh, P()))

    params = jax.tree.map(shard, params)
    fresh = {"params": params, "opt_state": tx.init(params), "step": 0}

    @jax.jit
    def step(state, batch):
        def loss(p):
            return jnp.mean((model.apply({"params": p}, batch) - batch) ** 2)

        grads = jax.grad(loss)(state["params"])
        updates, opt = tx.update(grads, state["opt_state"], state["params"])
        return {
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt,
            "step": state["step"] + 1,
        }

    rng = np.random.default_rng(0)
    trained = fresh
    for _ in range(steps):
        trained = step(trained, jnp.asarray(rng.standard_normal((16, width), np.float32)))
    jax.block_until_ready(trained)
    bf16 = dict(trained, params=jax.tree.map(lambda a: a.astype(jnp.bfloat16), trained["params"]))
    return [("fresh", fresh), (f"trained ({steps} steps)", trained), ("bf16 params", bf16)]


def on_mesh(x, mesh: Mesh):
    """The restore target of one leaf: the same PartitionSpec on ``mesh``."""
    if not isinstance(x, jax.Array):
        return x
    spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else P()
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))


def role_bytes(path: str) -> dict[str, int]:
    """Bytes on disk under arrays/ per top-level name (params, opt_state)."""
    out: dict[str, int] = {}
    arrays = os.path.join(path, "arrays")
    for name in os.listdir(arrays):
        role = name.split(".")[0]
        out[role] = out.get(role, 0) + du(os.path.join(arrays, name))
    return out


CONTENDERS = {
    "jax_ucp": dict(compression=None),
    "jax_ucp zstd-1": dict(compression="zstd", level=1),
    "jax_ucp zstd-3": dict(compression="zstd", level=3),
    "orbax (zstd)": None,
}


def save(name: str, opts, path: str, state) -> None:
    if opts is None:
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(path, state)
            ckptr.wait_until_finished()
        return
    if opts["compression"] is None:
        jax_ucp.save(path, state)
        return
    args = SaveArgs(state, compression="zstd", compression_level=opts["level"])
    engine.save(path, args, force=False)


def restore(opts, path: str, abstract):
    if opts is None:
        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore(path, abstract)
    return jax_ucp.restore(path, target=abstract)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--width", type=int, default=512, help="512: 50 MB state; 1024: 200 MB")
    ap.add_argument("--dir", default="/tmp/ucp_bench_zstd")
    ap.add_argument("--out", default=os.path.join(HERE, "..", "docs", "benchmark_compression.json"))
    a = ap.parse_args()
    devices = np.array(jax.devices()[:8])
    mesh = Mesh(devices.reshape(2, 4), ("data", "model"))
    new_mesh = Mesh(devices[:4].reshape(4, 1), ("data", "model"))
    results = []
    for state_name, state in make_states(mesh, a.steps, a.width):
        abstract = jax.tree.map(lambda x: on_mesh(x, new_mesh), state)
        live = sum(x.nbytes for x in jax.tree.leaves(state) if isinstance(x, jax.Array))
        for name, opts in CONTENDERS.items():
            saves, restores, size, roles = [], [], 0, {}
            for r in range(a.rounds):
                path = os.path.join(a.dir, f"r{r}")
                shutil.rmtree(a.dir, ignore_errors=True)
                os.makedirs(a.dir)
                t = time.perf_counter()
                save(name, opts, path, state)
                saves.append(time.perf_counter() - t)
                size = du(path)
                if opts is not None:
                    roles = role_bytes(path)
                evict(path)
                t = time.perf_counter()
                out = restore(opts, path, abstract)
                jax.block_until_ready(out)
                restores.append(time.perf_counter() - t)
                if r == 0:  # every contender restores what was saved, bit for bit
                    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(out)):
                        assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), name
            row = dict(
                state=state_name,
                contender=name,
                live_bytes=live,
                disk_bytes=size,
                disk_bytes_by_role=roles,
                save_s=statistics.median(saves),
                restore_s=statistics.median(restores),
                save_runs=saves,
                restore_runs=restores,
            )
            results.append(row)
            by_role = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in sorted(roles.items()))
            print(
                f"{state_name:<20} {name:<15} {size / 1e6:7.1f} MB  save {row['save_s']:6.2f} s  "
                f"restore {row['restore_s']:6.2f} s  {by_role}",
                flush=True,
            )
    shutil.rmtree(a.dir, ignore_errors=True)
    with open(a.out, "w") as f:
        json.dump(
            {"rounds": a.rounds, "steps": a.steps, "width": a.width, "results": results},
            f,
            indent=1,
        )
    print(f"wrote {os.path.relpath(a.out)}")


if __name__ == "__main__":
    main()
