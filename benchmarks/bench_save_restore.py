"""Save, and restore onto another mesh, of a ~1 GiB pytree: jax_ucp vs Orbax vs raw numpy.

Contenders alternate within each round; the median over rounds is reported.  The page cache is
evicted (posix_fadvise DONTNEED after fsync) before every read, so reads come from disk.

  python benchmarks/bench_save_restore.py [--gib 1.0] [--rounds 3] [--dir /tmp/ucp_bench]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

import jax_ucp  # noqa: E402


def evict(path: str) -> None:
    """Drops the files' pages from the page cache so the next read hits the disk."""
    for d, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def make_tree(gib: float, mesh: Mesh):
    """~gib GiB of float32 weights (normal, like trained weights) sharded (data, model) + others."""
    n = max(1, int(round(gib * 16)))  # 64 MiB tensors
    rng = np.random.default_rng(0)
    tree = {}
    specs = [P("data", "model"), P(None, "model"), P("model", None), P()]
    for i in range(n):
        host = rng.standard_normal((4096, 4096), dtype=np.float32) * 0.02
        tree[f"layer_{i:02d}"] = jax.device_put(host, NamedSharding(mesh, specs[i % len(specs)]))
    return tree


# ---- contenders: save(path, tree) and restore(path, shardings) -------------------------------


def ucp_save(path, tree, compression=None, checksum="crc32c"):
    jax_ucp.save(path, tree, compression=compression, checksum=checksum)


def ucp_restore(path, tree, shardings):
    out = jax_ucp.restore(path, shardings=shardings)
    jax.block_until_ready(out)
    return out


def ucp_restore_tensorstore_reads(path, tree, shardings):
    """jax_ucp restore with every read through TensorStore (store.shard_file's reader off)."""
    from jax_ucp.handler import reader

    fast = reader._fast_reader
    reader._fast_reader = lambda root, entry, opened: opened
    try:
        return ucp_restore(path, tree, shardings)
    finally:
        reader._fast_reader = fast


def orbax_save(path, tree, use_compression=True):
    handler = ocp.PyTreeCheckpointHandler(use_compression=use_compression)
    with ocp.AsyncCheckpointer(handler) as ck:
        ck.save(path, args=ocp.args.PyTreeSave(tree))
        ck.wait_until_finished()


def orbax_restore(path, tree, shardings):
    target = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ck:
        out = ck.restore(
            path,
            args=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)
            ),
        )
    jax.block_until_ready(out)
    return out


def raw_save(path, tree):
    """The floor: each process's replica-0 shards written as raw files, fdatasync'd."""
    os.makedirs(path)
    for name, x in tree.items():
        for i, s in enumerate(x.addressable_shards):
            if s.replica_id:
                continue
            with open(os.path.join(path, f"{name}.{i}"), "wb") as f:
                np.asarray(s.data).tofile(f)
                f.flush()
                os.fdatasync(f.fileno())


def raw_restore(path, tree, shardings):
    """Read back the same bytes (whole shard files) and place them on the new mesh."""
    out = {}
    for name, x in tree.items():
        full = np.empty(x.shape, x.dtype)
        for i, s in enumerate(x.addressable_shards):
            if s.replica_id:
                continue
            full[s.index] = np.fromfile(os.path.join(path, f"{name}.{i}"), dtype=x.dtype).reshape(
                s.data.shape
            )
        out[name] = jax.device_put(full, shardings[name])
    jax.block_until_ready(out)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/ucp_bench")
    ap.add_argument("--check", action="store_true", help="verify restored values (slower)")
    args = ap.parse_args()
    devs = np.array(jax.devices()[:8])
    save_mesh = Mesh(devs.reshape(2, 4), ("data", "model"))
    load_mesh = Mesh(devs.reshape(4, 2), ("data", "model"))
    tree = make_tree(args.gib, save_mesh)
    nbytes = sum(x.nbytes for x in tree.values())
    new_specs = [P("model", "data"), P("data", None), P(None, "data"), P("data", "model")]
    shardings = {k: NamedSharding(load_mesh, new_specs[i % 4]) for i, k in enumerate(tree)}
    contenders = {
        "jax_ucp": (ucp_save, ucp_restore),
        "jax_ucp zstd": (lambda p, t: ucp_save(p, t, "zstd"), ucp_restore),
        "jax_ucp no-crc": (lambda p, t: ucp_save(p, t, checksum=None), ucp_restore),
        "jax_ucp TS reads": (ucp_save, ucp_restore_tensorstore_reads),
        "orbax default": (orbax_save, orbax_restore),
        "orbax no-compr": (lambda p, t: orbax_save(p, t, False), orbax_restore),
        "raw numpy": (raw_save, raw_restore),
    }
    save_t = {k: [] for k in contenders}
    load_t = {k: [] for k in contenders}
    size = {}
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    print(
        f"pytree: {len(tree)} tensors, {nbytes / 2**30:.2f} GiB; save on 2×4 mesh, restore onto 4×2 "
        f"with other PartitionSpecs; {args.rounds} rounds, contenders alternating",
        flush=True,
    )
    for r in range(args.rounds):
        order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
        for name in order:
            save_fn, load_fn = contenders[name]
            path = os.path.join(args.dir, name.replace(" ", "_"))
            shutil.rmtree(path, ignore_errors=True)
            os.sync()
            t0 = time.perf_counter()
            save_fn(path, tree)
            save_t[name].append(time.perf_counter() - t0)
            size[name] = du(path)
            evict(path)
            t0 = time.perf_counter()
            out = load_fn(path, tree, shardings)
            load_t[name].append(time.perf_counter() - t0)
            if args.check:
                for k in tree:
                    assert np.array_equal(np.asarray(out[k]), np.asarray(tree[k])), (name, k)
            del out
            shutil.rmtree(path, ignore_errors=True)
            print(
                f"  round {r}: {name:15s} save {save_t[name][-1]:6.2f}s  restore {load_t[name][-1]:6.2f}s",
                flush=True,
            )
    med = lambda xs: statistics.median(xs)
    gb = nbytes / 1e9
    print(
        f"\n{'contender':16s} {'save GB/s':>10s} {'restore GB/s':>13s} {'on disk':>9s} "
        f"{'save vs orbax':>14s} {'restore vs orbax':>17s} {'save vs raw':>12s} {'restore vs raw':>15s}"
    )
    for name in contenders:
        s, load = med(save_t[name]), med(load_t[name])
        print(
            f"{name:16s} {gb / s:10.3f} {gb / load:13.3f} {size[name] / 2**30:8.2f}G "
            f"{med(save_t['orbax default']) / s:13.2f}x {med(load_t['orbax default']) / load:16.2f}x "
            f"{med(save_t['raw numpy']) / s:11.2f}x {med(load_t['raw numpy']) / load:14.2f}x"
        )
    print("(ratios > 1 mean faster than the reference; medians of", args.rounds, "rounds)")


if __name__ == "__main__":
    sys.exit(main())
