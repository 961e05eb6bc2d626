"""Save, and restore onto another mesh, of a ~1 GiB pytree: jax_ucp vs Orbax vs raw numpy.

Contenders alternate within each round; the median over rounds is reported.  The page cache is
evicted (posix_fadvise DONTNEED after fsync) before every read, so reads come from disk.

  python benchmarks/bench_save_restore.py [--gib 1.0] [--rounds 3] [--dir /tmp/ucp_bench]

``--layouts``: the adversarial restore layouts instead (``run_layouts``): 4096×4096 float32 and
bfloat16 tensors saved on a 2×4 mesh with P('x','y'), P('y','x'), P(None,'y'), P('x',None), P(),
restored (a) onto the same mesh and specs, (b) with the mesh axes swapped in every spec,
(c) saved replicated, restored sharded, (d) restored replicated, (e) onto an 8×1 mesh, (f) onto
one device; jax_ucp (default, crc32c) vs Orbax ``StandardCheckpointer`` defaults vs Orbax without
compression. Writes docs/benchmark_restore.json and docs/benchmark_restore.png.

  python benchmarks/bench_save_restore.py --layouts [--sets 1] [--rounds 5] [--check]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ucp


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
    n = max(1, round(gib * 16))  # 64 MiB tensors
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
    """jax_ucp restore with every read through TensorStore (store.shard_reader off: no shard
    layout is recognised, so the UCP source hands out TensorStore views)."""
    from jax_ucp._src.store import shard_file

    layout = shard_file.layout_from_metadata
    shard_file.layout_from_metadata = lambda *a: None
    try:
        return ucp_restore(path, tree, shardings)
    finally:
        shard_file.layout_from_metadata = layout


def ucp_save_tensorstore_writes(path, tree):
    """jax_ucp save with every shard written by TensorStore (store.shard_writer off)."""
    from jax_ucp._src.store import shard_writer

    can_write = shard_writer.can_write
    shard_writer.can_write = lambda *a: False
    try:
        return ucp_save(path, tree)
    finally:
        shard_writer.can_write = can_write


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


# ---- adversarial restore layouts (--layouts) ----------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAVED_SPECS = [P("x", "y"), P("y", "x"), P(None, "y"), P("x", None), P()]
LAYOUT_DTYPES = ("float32", "bfloat16", "bfloat16")  # per saved spec and set: 64 + 32 + 32 MiB


def layout_tree(sets: int, mesh: Mesh, replicated: bool = False):
    """``sets`` × 5 specs × (1 float32 + 2 bfloat16) 4096×4096 tensors on ``mesh``; name -> (host,
    saved spec).  ``replicated``: every tensor saved P() (the source of layout (c))."""
    rng = np.random.default_rng(1)
    host, specs = {}, {}
    for s in range(sets):
        for j, spec in enumerate(SAVED_SPECS):
            for k, dt in enumerate(LAYOUT_DTYPES):
                name = f"s{s}_spec{j}_{k}_{dt}"
                x = rng.standard_normal((4096, 4096), dtype=np.float32) * 0.02
                host[name] = x.astype(jax.numpy.dtype(dt))
                specs[name] = P() if replicated else spec
    return host, specs


def _put(host, specs, mesh):
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in host.items()}


def _swap_axes(spec: P) -> P:
    swap = {"x": "y", "y": "x"}
    return P(*[tuple(swap[a] for a in d) if isinstance(d, tuple) else swap.get(d, d) for d in spec])


def restore_layouts(devs, names: list[str], saved: dict[str, P]) -> dict[str, tuple[str, dict]]:
    """layout name -> (checkpoint "A" (mixed specs) or "R" (all replicated), shardings)."""
    m24 = Mesh(devs.reshape(2, 4), ("x", "y"))
    m81 = Mesh(devs.reshape(8, 1), ("x", "y"))
    m11 = Mesh(devs[:1].reshape(1, 1), ("x", "y"))
    sharded = [P("x", "y"), P("y", "x"), P(None, "y"), P("x", None), P(None, ("x", "y"))]
    on81 = [P("x", None), P(None, "x"), P("y", "x"), P(("x", "y"), None)]
    on11 = [P("x", "y"), P(), P(None, "y"), P("x", None)]

    def each(mesh, spec_of):
        return {n: NamedSharding(mesh, spec_of(i, n)) for i, n in enumerate(names)}

    return {
        "a same mesh": ("A", each(m24, lambda i, n: saved[n])),
        "b transposed axes": ("A", each(m24, lambda i, n: _swap_axes(saved[n]))),
        "a' same mesh, replicated ckpt": ("R", each(m24, lambda i, n: P())),
        "c replicated→sharded": ("R", each(m24, lambda i, n: sharded[i % len(sharded)])),
        "d sharded→replicated": ("A", each(m24, lambda i, n: P())),
        "e 2×4→8×1": ("A", each(m81, lambda i, n: on81[i % len(on81)])),
        "f 2×4→1×1": ("A", each(m11, lambda i, n: on11[i % len(on11)])),
    }


def orbax_standard_save(path, tree):
    """Orbax ``StandardCheckpointer`` defaults (OCDBT, zarr v2 chunks, zstd level 1)."""
    with ocp.StandardCheckpointer() as ck:
        ck.save(path, tree)
        ck.wait_until_finished()


def orbax_uncompressed_save(path, tree):
    """The same format without compression: ``PyTreeCheckpointHandler(use_compression=False)``
    (``StandardCheckpointHandler`` has no compression switch in Orbax 0.12.8)."""
    with ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_compression=False)) as ck:
        ck.save(path, args=ocp.args.PyTreeSave(tree))
        ck.wait_until_finished()


def orbax_standard_restore(path, shardings, shapes):
    target = {
        k: jax.ShapeDtypeStruct(shapes[k][0], shapes[k][1], sharding=s)
        for k, s in shardings.items()
    }
    with ocp.StandardCheckpointer() as ck:
        out = ck.restore(path, target)
    jax.block_until_ready(out)
    return out


def ucp_layout_restore(path, shardings, shapes):
    out = jax_ucp.restore(path, shardings=shardings)
    jax.block_until_ready(out)
    return out


LAYOUT_CONTENDERS = {
    "jax_ucp": (ucp_save, ucp_layout_restore),
    "orbax default": (orbax_standard_save, orbax_standard_restore),
    "orbax no-compr": (orbax_uncompressed_save, orbax_standard_restore),
}


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def read_files(path: str, threads: int = 8) -> int:
    """Reads every byte of every file under ``path`` as 8 MiB preads, ``threads`` at a time (so
    a checkpoint of a few large files, like Orbax's OCDBT, is read as much in parallel as one of
    many files); returns the bytes read."""
    import concurrent.futures

    step = 8 << 20
    files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    ranges = [(f, o) for f in files for o in range(0, os.path.getsize(f), step)]
    try:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            return sum(pool.map(lambda r: len(os.pread(fds[r[0]], step, r[1])), ranges))
    finally:
        for fd in fds.values():
            os.close(fd)


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def paths_of(paths: dict) -> set:
    return {ckpt for ckpt, _ in paths}


def run_layouts(args) -> dict:
    import gc

    devs = np.array(jax.devices()[:8])
    m24 = Mesh(devs.reshape(2, 4), ("x", "y"))
    host, saved = layout_tree(args.sets, m24)
    names = list(host)
    shapes = {k: (v.shape, v.dtype) for k, v in host.items()}
    nbytes = sum(v.nbytes for v in host.values())
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    print(
        f"{len(names)} tensors 4096×4096 ({', '.join(LAYOUT_DTYPES)} per saved spec), "
        f"{nbytes / 2**30:.3f} GiB; saved on a 2×4 mesh; {args.rounds} rounds, contenders "
        f"alternating, page cache evicted before every restore",
        flush=True,
    )
    save_t = {c: {} for c in LAYOUT_CONTENDERS}
    paths = {}
    needed = {"A", "R"} if not args.only_layouts or "c" in args.only_layouts else {"A"}
    for ckpt, replicated in (("A", False), ("R", True)):
        if ckpt not in needed:
            continue
        specs = {k: P() for k in names} if replicated else saved
        tree = _put(host, specs, m24)
        for c, (save_fn, _) in LAYOUT_CONTENDERS.items():
            path = os.path.join(args.dir, f"{ckpt}_{c.replace(' ', '_')}")
            os.sync()
            t0 = time.perf_counter()
            save_fn(path, tree)
            save_t[c][ckpt] = time.perf_counter() - t0
            paths[(ckpt, c)] = path
            print(
                f"  save {ckpt} {c:15s} {save_t[c][ckpt]:6.2f}s  {du(path) / 2**30:.3f} GiB",
                flush=True,
            )
        del tree
        gc.collect()
    layouts = restore_layouts(devs, names, saved)
    if args.only_layouts:  # e.g. "b,d": those (plus the same-mesh baselines the ratios need)
        keep = set(args.only_layouts.split(",")) | {"a", "a'"}
        layouts = {
            k: v for k, v in layouts.items() if k.split()[0] in keep and v[0] in paths_of(paths)
        }
    times = {lay: {c: [] for c in LAYOUT_CONTENDERS} for lay in layouts}
    floor = {c: [] for c in LAYOUT_CONTENDERS}  # cold read of checkpoint A's files, no decoding
    cpu = {lay: {c: [] for c in LAYOUT_CONTENDERS} for lay in layouts}  # user+sys, all threads
    faults = {lay: {c: [] for c in LAYOUT_CONTENDERS} for lay in layouts}  # minor page faults
    for r in range(args.rounds):
        for c in LAYOUT_CONTENDERS:
            evict(paths[("A", c)])
            t0 = time.perf_counter()
            read_files(paths[("A", c)])
            floor[c].append(time.perf_counter() - t0)
        print(
            f"  round {r} disk floor (cold read of A's files, 8 MiB preads, 8 threads) "
            + "  ".join(f"{c} {floor[c][-1]:5.2f}s" for c in LAYOUT_CONTENDERS),
            flush=True,
        )
        for li, (lay, (ckpt, shardings)) in enumerate(layouts.items()):
            order = list(LAYOUT_CONTENDERS)
            if (r + li) % 2:
                order.reverse()
            for c in order:
                path = paths[(ckpt, c)]
                evict(path)
                c0, f0 = _cpu_seconds(), _minor_faults()
                t0 = time.perf_counter()
                out = LAYOUT_CONTENDERS[c][1](path, shardings, shapes)
                times[lay][c].append(time.perf_counter() - t0)
                cpu[lay][c].append(_cpu_seconds() - c0)
                faults[lay][c].append(_minor_faults() - f0)
                if args.check and r == 0:
                    for k in names:
                        assert out[k].sharding == shardings[k], (lay, c, k)
                        assert np.array_equal(np.asarray(out[k]), host[k]), (lay, c, k)
                del out
                gc.collect()
            print(
                f"  round {r} {lay:30s} "
                + "  ".join(
                    f"{c} {times[lay][c][-1]:5.2f}s (cpu {cpu[lay][c][-1]:4.1f}s, "
                    f"{faults[lay][c][-1] / 1e3:.0f}k faults)"
                    for c in LAYOUT_CONTENDERS
                ),
                flush=True,
            )
    shutil.rmtree(args.dir, ignore_errors=True)
    med = statistics.median
    gb = nbytes / 1e9
    same = {"A": "a same mesh", "R": "a' same mesh, replicated ckpt"}
    rows = {}
    for lay, (ckpt, _) in layouts.items():
        if same[ckpt] not in times:
            continue
        m = {c: med(times[lay][c]) for c in LAYOUT_CONTENDERS}
        rows[lay] = {
            "checkpoint": ckpt,
            "seconds": m,
            "gb_per_s": {c: gb / t for c, t in m.items()},
            "all_seconds": times[lay],
            "cpu_seconds": {c: med(cpu[lay][c]) for c in LAYOUT_CONTENDERS},
            "all_cpu_seconds": cpu[lay],
            "minor_page_faults": {c: med(faults[lay][c]) for c in LAYOUT_CONTENDERS},
            "speedup_vs_orbax_default": m["orbax default"] / m["jax_ucp"],
            "speedup_vs_orbax_no_compression": m["orbax no-compr"] / m["jax_ucp"],
            "jax_ucp_vs_same_mesh": m["jax_ucp"] / med(times[same[ckpt]]["jax_ucp"]),
            "jax_ucp_vs_same_mesh_a": m["jax_ucp"] / med(times["a same mesh"]["jax_ucp"]),
        }
    hdr = (
        f"\n{'layout':30s} "
        + " ".join(f"{c + ' s':>16s}" for c in LAYOUT_CONTENDERS)
        + f" {'ucp GB/s':>9s} {'×orbax-def':>10s} {'×orbax-nc':>10s} {'new/same':>9s}"
        + " CPU s: "
        + " / ".join(LAYOUT_CONTENDERS)
    )
    print(hdr)
    for lay, row in rows.items():
        print(
            f"{lay:30s} "
            + " ".join(f"{row['seconds'][c]:16.2f}" for c in LAYOUT_CONTENDERS)
            + f" {row['gb_per_s']['jax_ucp']:9.2f} {row['speedup_vs_orbax_default']:10.2f}"
            f" {row['speedup_vs_orbax_no_compression']:10.2f} {row['jax_ucp_vs_same_mesh']:9.2f}"
            + "        "
            + " / ".join(f"{row['cpu_seconds'][c]:.2f}" for c in LAYOUT_CONTENDERS)
        )
    print(
        f"{'disk floor: read A cold':30s} "
        + " ".join(f"{med(floor[c]):16.2f}" for c in LAYOUT_CONTENDERS)
        + f" {gb / med(floor['jax_ucp']):9.2f}  (every byte of checkpoint A, 8 MiB preads, 8 threads)"
    )
    print(
        "(×orbax = Orbax time / jax_ucp time, > 1 means jax_ucp is faster; new/same = jax_ucp "
        "time / its same-mesh restore of the same checkpoint; medians of",
        args.rounds,
        "rounds)",
    )
    result = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": f"{os.cpu_count()} shared CPU cores, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM",
        "command": "python benchmarks/bench_save_restore.py --layouts "
        f"--sets {args.sets} --rounds {args.rounds}",
        "versions": {
            "jax": jax.__version__,
            "orbax": ocp.__version__,
            "jax_ucp": jax_ucp.__version__,
        },
        "tensors": len(names),
        "bytes": nbytes,
        "save_seconds": save_t,
        "disk_floor_seconds": {c: med(floor[c]) for c in LAYOUT_CONTENDERS},
        "disk_floor_note": "cold read (page cache evicted) of every byte of the checkpoint with "
        "mixed specs (A) as 8 MiB preads, 8 threads, no decoding",
        "layouts": rows,
    }
    if not args.no_write:
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        plot_layouts(result, args.png)
        print("wrote", args.json, "and", args.png)
    return result


def plot_layouts(result: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lays = list(result["layouts"])
    contenders = list(LAYOUT_CONTENDERS)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    w = 0.8 / len(contenders)
    for j, c in enumerate(contenders):
        vals = [result["layouts"][lay]["gb_per_s"][c] for lay in lays]
        bars = ax.bar(
            [i + (j - (len(contenders) - 1) / 2) * w for i in range(len(lays))], vals, w, label=c
        )
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    for c, style in (("jax_ucp", "--"), ("orbax default", ":")):
        floor = result.get("disk_floor_seconds", {}).get(c)
        if floor:
            ax.axhline(
                result["bytes"] / 1e9 / floor,
                ls=style,
                color="gray",
                lw=1,
                label=f"disk floor: cold read of {c}'s files",
            )
    ax.set_xticks(range(len(lays)), [lay.replace(", ", ",\n") for lay in lays], fontsize=8)
    ax.set_ylabel("restore GB/s (cold page cache, median)")
    ax.set_title(
        f"Restore of {result['tensors']} × 4096² fp32/bf16 ({result['bytes'] / 2**30:.2f} GiB) "
        f"saved on 2×4 — {result['date_utc']} UTC, {result['machine']}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=None, help="3 (--layouts: 5)")
    ap.add_argument("--dir", default="/tmp/ucp_bench")
    ap.add_argument("--check", action="store_true", help="verify restored values (slower)")
    ap.add_argument("--layouts", action="store_true", help="the adversarial restore layouts")
    ap.add_argument("--sets", type=int, default=1, help="--layouts: sets of 15 tensors (0.625 GiB)")
    ap.add_argument("--json", default=os.path.join(ROOT, "docs", "benchmark_restore.json"))
    ap.add_argument("--png", default=os.path.join(ROOT, "docs", "benchmark_restore.png"))
    ap.add_argument("--no-write", action="store_true", help="--layouts: print only")
    ap.add_argument("--only-layouts", default="", help="--layouts: e.g. 'b,d' (for profiling)")
    ap.add_argument(
        "--contenders",
        default="",
        help="comma-separated subset, e.g. 'jax_ucp,jax_ucp TS reads,jax_ucp TS writes'",
    )
    args = ap.parse_args()
    if args.rounds is None:
        args.rounds = 5 if args.layouts else 3
    if args.layouts:
        run_layouts(args)
        return 0
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
        "jax_ucp TS writes": (ucp_save_tensorstore_writes, ucp_restore),
        "orbax default": (orbax_save, orbax_restore),
        "orbax no-compr": (lambda p, t: orbax_save(p, t, False), orbax_restore),
        "raw numpy": (raw_save, raw_restore),
    }
    if args.contenders:
        contenders = {k: contenders[k] for k in args.contenders.split(",")}
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

    def ratio(ref, times, t):  # "-" when the reference was not run (--contenders)
        return f"{med(times[ref]) / t:.2f}x" if ref in times else "-"

    for name in contenders:
        s, load = med(save_t[name]), med(load_t[name])
        print(
            f"{name:16s} {gb / s:10.3f} {gb / load:13.3f} {size[name] / 2**30:8.2f}G "
            f"{ratio('orbax default', save_t, s):>14s} {ratio('orbax default', load_t, load):>17s} "
            f"{ratio('raw numpy', save_t, s):>12s} {ratio('raw numpy', load_t, load):>15s}"
        )
    print("(ratios > 1 mean faster than the reference; medians of", args.rounds, "rounds)")


if __name__ == "__main__":
    sys.exit(main())
