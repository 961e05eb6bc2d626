"""Benchmark (simulation): a 70B-parameter restore planned onto 8 → 4096 devices in 1 → 512
processes, and a distributed import split across N processes, without the hosts.

SYNTHETIC. The checkpoint is a manifest only: ``ucp.json`` (written with the format's own
dataclasses and ``Manifest.dumps``, read back by ``jax_ucp``'s strict reader) plus every
array's ``zarr.json`` (written by ``store.create``, TensorStore's zarr3 driver), and no shard
file. Its folder is named ``llama3_70b_adamw_manifest_only_synthetic``.

What is built (``--param-dtype``, default float32):

* Llama-3-70B shapes: 80 layers, hidden 8192, MLP 28672, 64 query heads and 8 KV heads of 128,
  vocabulary 128256, untied embedding and LM head, RMSNorm scales; one tensor per layer and
  matrix (``params/layers_17/attention/wq``), 723 parameters, 70.55 B values.
* AdamW's state as optax keeps it: ``opt_state/mu/...`` and ``opt_state/nu/...`` in float32 with
  the parameters' shapes and logical axes, and ``opt_state/count`` (int32, 0-d).
* Assumption: parameters in float32 (the master copy optax updates), so the state is
  12 bytes/parameter, 847 GB: the issue's "~840 GB". ``--param-dtype bfloat16`` gives bf16
  parameters with fp32 moments (10 bytes/parameter, 706 GB).
* Saved from a training mesh ``fsdp=32 × tensor=8`` (256 devices; ``--save-fsdp`` for another)
  with the logical rules ``embed→fsdp, heads/kv_heads/mlp/vocab→tensor``; chunk (= shard file)
  and inner-chunk shapes come from ``writer.layout.array_layout`` on
  ``NamedSharding.shard_shape``, exactly what ``jax_ucp.save`` computes; ``saved_sharding`` from
  ``sharding.describe``; ``shard_digests`` list every shard file of the grid (the digests are
  made up: no data exists to digest).

Then for each target mesh (8 devices per process), ``jax_ucp.plan(path, mesh=abstract_mesh(...),
rules=..., processes=N)`` is timed, and for every process (or ``--sample`` of them) the reads a
restore would issue are replayed from the plan's PartitionSpecs through the shard reader's own
task split (``store.shard_reader.ShardReader._tasks``): shard files opened, read requests
(preads), bytes read (data + crc32c trailers + shard indices + digest trailers), and metadata
fetched (``ucp.json`` + each array's ``zarr.json``). Finally the distributed import
(``jax-ucp convert --coordinator``): its split is computed from ``importers.plan.Share`` and the
part files each process would write; process 0's merge (``writer.checkpoint._merge_parts``) is
run for real on part manifests of the 70B state.

    python benchmarks/bench_plan_scale.py --json docs/benchmark_plan_scale.json
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import math
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from typing import Any, cast

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import jax_ucp  # noqa: E402
from jax_ucp._src import format as fmt  # noqa: E402
from jax_ucp._src import sharding as sharding_lib  # noqa: E402
from jax_ucp._src import store  # noqa: E402
from jax_ucp._src.importers.plan import Share  # noqa: E402
from jax_ucp._src.restoring.plan import abstract_mesh  # noqa: E402
from jax_ucp._src.sharding import mesh_layout  # noqa: E402
from jax_ucp._src.sharding.mesh_layout import axes_of  # noqa: E402
from jax_ucp._src.store.shard_reader import ShardReader  # noqa: E402
from jax_ucp._src.writer import checkpoint as writer_checkpoint  # noqa: E402
from jax_ucp._src.writer.layout import ArrayOptions, array_layout, tensor_entry, value_entry  # noqa: E402

NAME = "llama3_70b_adamw_manifest_only_synthetic"

# Llama-3-70B
LAYERS, HIDDEN, MLP, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 80, 8192, 28672, 64, 8, 128, 128256

SAVE_MESH = (("fsdp", 32), ("tensor", 8))
RULES = (
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
)
# target meshes: (label, axes); 8 devices per process
MESHES = (
    ("fsdp=1 × tensor=8", (("fsdp", 1), ("tensor", 8))),
    ("fsdp=8 × tensor=8", (("fsdp", 8), ("tensor", 8))),
    ("fsdp=64 × tensor=8", (("fsdp", 64), ("tensor", 8))),
    ("fsdp=512 × tensor=8", (("fsdp", 512), ("tensor", 8))),
    # a data-parallel axis the rules do not use: each of the 8 replicas reads the whole state
    ("data=8 × fsdp=64 × tensor=8", (("data", 8), ("fsdp", 64), ("tensor", 8))),
)
DEVICES_PER_PROCESS = 8


def parameters() -> list[tuple[tuple[str, ...], tuple[int, ...], tuple[Any, ...]]]:
    """(key under params/, shape, logical axes) of every Llama-3-70B parameter, in model order."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out = [(("embed", "embedding"), (VOCAB, HIDDEN), ("vocab", "embed"))]
    for i in range(LAYERS):
        layer = f"layers_{i}"
        out += [
            ((layer, "attention_norm", "scale"), (HIDDEN,), ("embed",)),
            ((layer, "attention", "wq"), (HIDDEN, q), ("embed", "heads")),
            ((layer, "attention", "wk"), (HIDDEN, kv), ("embed", "kv_heads")),
            ((layer, "attention", "wv"), (HIDDEN, kv), ("embed", "kv_heads")),
            ((layer, "attention", "wo"), (q, HIDDEN), ("heads", "embed")),
            ((layer, "ffn_norm", "scale"), (HIDDEN,), ("embed",)),
            ((layer, "mlp", "w_gate"), (HIDDEN, MLP), ("embed", "mlp")),
            ((layer, "mlp", "w_up"), (HIDDEN, MLP), ("embed", "mlp")),
            ((layer, "mlp", "w_down"), (MLP, HIDDEN), ("mlp", "embed")),
        ]
    out += [
        (("norm", "scale"), (HIDDEN,), ("embed",)),
        (("lm_head", "kernel"), (HIDDEN, VOCAB), ("embed", "vocab")),
    ]
    return out


def _tree(keys) -> dict:
    """The manifest's ``tree``: nested dicts down to the leaves, in flatten (sorted) order."""
    root: dict = {}
    for key in keys:
        node = root
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = None

    def encode(node):
        if node is None:
            return {"type": "leaf"}
        children = [[k, "key", encode(node[k])] for k in sorted(node)]
        return {"type": "dict", "children": children}

    return encode(root)


def build(
    path: str,
    param_dtype: str,
    inner_chunk_bytes: int = store.DEFAULT_INNER_CHUNK_BYTES,
    save_mesh=SAVE_MESH,
):
    """Writes the synthetic manifest-only checkpoint at ``path`` (inner chunks bounded by
    ``inner_chunk_bytes``, ``jax_ucp.save``'s keyword); returns its manifest, what it holds and
    each array's zarr.json size."""
    mesh = abstract_mesh(save_mesh)
    options = ArrayOptions(inner_chunk_bytes=inner_chunk_bytes)
    entries: list = []
    layouts = {}
    for top, dtype in (
        (("params",), param_dtype),
        (("opt_state", "mu"), "float32"),
        (("opt_state", "nu"), "float32"),
    ):
        itemsize = np.dtype(jax.numpy.dtype(dtype)).itemsize
        for sub, shape, logical in parameters():
            key = top + sub
            spec = mesh_layout.partition_spec_from_logical(shape, logical, RULES, cast(Any, mesh))
            sharding = NamedSharding(mesh, spec)
            layout = array_layout(shape, dtype, sharding.shard_shape(shape), itemsize, options)
            grid = [s // c for s, c in zip(shape, layout.chunk_shape)]
            digests = {
                "c/" + "/".join(map(str, pos)): f"{zlib.crc32(repr((key, pos)).encode()):08x}"
                for pos in np.ndindex(*grid)
            }
            role, sub_role = fmt.role_of(key)
            entry = tensor_entry(
                key,
                ("key",) * len(key),
                layout,
                role=role,
                sub_role=sub_role,
                logical_axes=logical,
                saved_sharding=sharding_lib.describe(sharding),
            )
            entries.append(_with_digests(entry, digests))
            layouts[key] = layout
    count = ("opt_state", "count")
    count_layout = array_layout((), "int32", (), 4, options)
    entries.append(
        _with_digests(
            tensor_entry(count, ("key", "key"), count_layout, role="opt_state", sub_role="count"),
            {"c": "00000000"},
        )
    )
    layouts[count] = count_layout
    entries.append(value_entry(("step",), ("key",), 0))
    manifest = fmt.new_manifest(
        entries,
        source={"framework": "jax", "synthetic": "manifest only, no array data (issue 41)"},
        tree=_tree(e.key for e in entries),
    )
    os.makedirs(path)
    for entry in manifest.tensors:  # zarr.json only: no shard file is written
        kv = store.kvstore_config(path, entry.dir)
        store.create(kv, layouts[entry.key], primary=True, sync=False).result()
    text = manifest.dumps()
    with open(os.path.join(path, fmt.MANIFEST_FILE), "w") as f:
        f.write(text)
    zarr_bytes = {
        e.key: os.path.getsize(os.path.join(path, e.dir, "zarr.json")) for e in manifest.tensors
    }
    info = {
        "tensors": len(manifest.tensors),
        "parameters": sum(math.prod(s) for _, s, _ in parameters()),
        "tensor_bytes": manifest.nbytes,
        "shard_files": sum(len(e.shard_digests or {}) for e in manifest.tensors),
        "ucp_json_bytes": len(text.encode()),
        "zarr_json_bytes": sum(zarr_bytes.values()),
        "param_dtype": param_dtype,
        "inner_chunk_bytes": inner_chunk_bytes,
        "saved_mesh": dict(save_mesh),
    }
    return manifest, info, zarr_bytes


def _with_digests(entry: fmt.TensorEntry, digests: dict) -> fmt.TensorEntry:
    import msgspec

    return msgspec.structs.replace(entry, shard_digests=digests)


# --- the reads a restore issues, replayed from the plan ---------------------------------------


def process_regions(shape, spec, sizes, names, q: int, block: int) -> list:
    """The distinct slices (``((start, stop), ...)``) process ``q``'s devices hold of a tensor of
    ``shape`` under ``spec`` on an abstract mesh of ``sizes`` (processes own contiguous
    row-major blocks of ``block`` devices, as ``plan(processes=)`` assumes)."""
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    dims = [[names.index(a) for a in axes_of(entry)] for entry in spec]
    seen = set()
    for position in range(q * block, (q + 1) * block):
        coords = np.unravel_index(position, sizes)
        box = []
        for size, axes in zip(shape, dims):
            parts, index = 1, 0
            for a in axes:
                index = index * sizes[a] + int(coords[a])
                parts *= sizes[a]
            step = size // parts
            box.append((index * step, (index + 1) * step))
        seen.add(tuple(box))
    return sorted(seen)


def entry_layout(entry: fmt.TensorEntry) -> store.ArrayLayout:
    """The stored array layout a manifest entry records (what the shard reader reads by)."""
    return store.ArrayLayout(
        shape=entry.shape,
        dtype=entry.dtype,
        chunk_shape=entry.chunk_shape,
        inner_chunk_shape=entry.inner_chunk_shape,
        compression=entry.compression,
        checksum=entry.checksum,
    )


def reads_of(entry: fmt.TensorEntry, regions) -> dict:
    """What ``ShardReader.read_into`` issues for ``regions`` of ``entry``: one open and one
    index pread per task (a batch of ≤ 16 MiB of inner chunks of one shard file), one preadv per
    inner chunk (data + its crc32c trailer), and for each shard file read in part the digest
    check's reopen and one 4-byte pread per inner chunk not read."""
    layout = entry_layout(entry)
    dtype = np.dtype(jax.numpy.dtype(entry.dtype))
    reader = ShardReader("/synthetic", layout, dtype, digests=entry.shard_digests)
    tasks = reader._tasks(regions)
    n_inner = layout.inner_chunk_count
    crc = 4 if entry.checksum else 0
    index_bytes = n_inner * 16 + crc
    chunk_bytes = math.prod(layout.inner_chunk_shape) * dtype.itemsize
    per_shard: dict = {}
    for pos, chunks in tasks:
        per_shard[pos] = per_shard.get(pos, 0) + len(chunks)
    chunks = sum(per_shard.values())
    partial = {pos: n for pos, n in per_shard.items() if n < n_inner}
    digest_reads = sum(n_inner - n for n in partial.values()) if entry.shard_digests else 0
    return {
        "data_bytes": chunks * chunk_bytes,
        "bytes": chunks * (chunk_bytes + crc) + len(tasks) * index_bytes + 4 * digest_reads,
        "shard_files": len(per_shard),
        "opens": len(tasks) + (len(partial) if entry.shard_digests else 0),
        "requests": len(tasks) + chunks + digest_reads,
    }


def replay(manifest, result, axes, processes: int, sample: list[int], zarr_bytes, ucp_bytes):
    """Per sampled process: the reads of every tensor (cached per tensor class and regions)."""
    names = tuple(a for a, _ in axes)
    sizes = tuple(s for _, s in axes)
    block = math.prod(sizes) // processes
    entries = {e.name: e for e in manifest.tensors}
    cache: dict = {}
    rows = []
    for q in sample:
        total: dict[str, int] = dict.fromkeys(
            ("data_bytes", "bytes", "shard_files", "opens", "requests"), 0
        )
        meta = ucp_bytes
        meta_files = 1
        for t in result.tensors:
            e = entries[t.name]
            spec = tuple(t.partition_spec) if t.partition_spec is not None else ()
            regions = process_regions(e.shape, spec, sizes, names, q, block)
            if not regions:
                continue
            key = (e.shape, e.dtype, e.chunk_shape, e.inner_chunk_shape, tuple(regions))
            if key not in cache:
                cache[key] = reads_of(e, regions)
            for k, v in cache[key].items():
                total[k] += v
            meta += zarr_bytes[e.key]
            meta_files += 1
        total["metadata_bytes"] = meta
        total["metadata_files"] = meta_files
        total["planned_bytes"] = result.process_read_bytes[q]
        total["process"] = q
        rows.append(total)
    return rows


def sampled(processes: int, limit: int) -> list[int]:
    if processes <= limit:
        return list(range(processes))
    picks = np.linspace(0, processes - 1, limit).round().astype(int)
    return sorted(set(int(p) for p in picks))


def time_plan(path, axes, processes, repeats: int):
    mesh = abstract_mesh(axes)
    times = []
    result = jax_ucp.plan(path, mesh=mesh, rules=RULES, processes=processes)  # warm: imports
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = jax_ucp.plan(path, mesh=mesh, rules=RULES, processes=processes)
        times.append(time.perf_counter() - t0)
    return result, times


def manifest_parse_time(path, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fmt.read_manifest_file(path)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --- the distributed import (jax-ucp convert --coordinator), computed --------------------------


def import_split(manifest: fmt.Manifest, processes: int, tmp: str, merge: bool) -> dict:
    """Process i of N takes every N-th parameter (``Share.pick`` over the importer's parameter
    order) with its mu/nu; process 0 also takes what is not per parameter (the step). Each
    reads and writes its parameters' bytes and writes one part manifest; process 0 alone merges
    the N parts into ucp.json (run here when ``merge``)."""
    by_param: dict[str, list] = {}
    order = []
    extra = []
    for e in manifest.entries:
        if e.key[0] in ("params",) or e.key[:2] in (("opt_state", "mu"), ("opt_state", "nu")):
            name = "/".join(e.key[1:] if e.key[0] == "params" else e.key[2:])
            if name not in by_param:
                by_param[name] = []
                order.append(name)
            by_param[name].append(e)
        else:
            extra.append(e)
    parts = []
    for i in range(processes):
        mine = [e for name in Share(i, processes).pick(order) for e in by_param[name]]
        if i == 0:
            mine += extra
        parts.append(mine)
    # entries: how a part's entries carry the importer's keys (one key per parameter group)
    part_bytes = [len(fmt.new_manifest(p).dumps().encode()) for p in parts]
    data = [sum(e.nbytes for e in p) for p in parts]
    out = {
        "processes": processes,
        "bytes_each_max": max(data),
        "bytes_each_mean": statistics.mean(data),
        "tensors_each_max": max(len(p) for p in parts),
        "part_manifest_bytes_max": max(part_bytes),
        "process0_reads_parts_bytes": sum(part_bytes),
    }
    if merge:
        shared = os.path.join(tmp, f"merge_{processes}")
        os.makedirs(shared)
        digests = []
        for i, p in enumerate(parts):
            text = fmt.new_manifest(_part_keys(p)).dumps().encode()
            with open(os.path.join(shared, writer_checkpoint.PART_FILE.format(i)), "wb") as f:
                f.write(text)
            digests.append(hashlib.sha256(text).hexdigest())
        t0 = time.perf_counter()
        writer_checkpoint._merge_parts(shared, digests, {"framework": "synthetic"})
        out["merge_seconds"] = time.perf_counter() - t0
        out["merged_ucp_json_bytes"] = os.path.getsize(os.path.join(shared, fmt.MANIFEST_FILE))
        shutil.rmtree(shared)
    return out


def _part_keys(entries):
    """An importer's entries: ``params/<name>``, ``opt_state/mu/<name>``, ... with the
    parameter's name as one key component (as the torch importers write), so the merge groups
    a parameter's entries by its last key component, as it does for a real import."""
    import dataclasses

    out = []
    for e in entries:
        if e.key[0] == "params":
            key = ("params", ".".join(e.key[1:]))
        elif e.key[:2] in (("opt_state", "mu"), ("opt_state", "nu")):
            key = (*e.key[:2], ".".join(e.key[2:]))
        else:
            out.append(e)
            continue
        out.append(
            dataclasses.replace(e, key=key, key_types=("key",) * len(key), dir=fmt.array_dir(key))
        )
    return out


# --- report ------------------------------------------------------------------------------------


def gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="where to build it (default: a temp dir)")
    parser.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument(
        "--inner-chunk-bytes",
        type=int,
        default=store.DEFAULT_INNER_CHUNK_BYTES,
        help="save's inner_chunk_bytes (default 4 MiB)",
    )
    parser.add_argument(
        "--save-fsdp", type=int, default=32, help="the save-time mesh's fsdp (× tensor=8)"
    )
    parser.add_argument(
        "--meshes", default=None, help="which target meshes, by position (e.g. 0,3; all)"
    )
    parser.add_argument("--skip-import", action="store_true", help="no import table")
    parser.add_argument("--sample", type=int, default=64, help="processes replayed per mesh")
    parser.add_argument("--repeats", type=int, default=3, help="plan timings per mesh (median)")
    parser.add_argument("--import-processes", default="1,8,64,512")
    parser.add_argument("--profile", action="store_true", help="cProfile the largest plan")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    load = [os.getloadavg()]
    tmp = tempfile.mkdtemp(prefix="ucp_plan_scale_", dir=args.dir)
    path = os.path.join(tmp, NAME)
    try:
        t0 = time.perf_counter()
        manifest, info, zarr_bytes = build(
            path,
            args.param_dtype,
            args.inner_chunk_bytes,
            (("fsdp", args.save_fsdp), ("tensor", 8)),
        )
        info["build_seconds"] = time.perf_counter() - t0
        fmt.read_manifest_file(path)  # strict reader: a valid manifest
        info["manifest_parse_seconds"] = manifest_parse_time(path, args.repeats)
        print(
            f"SYNTHETIC {NAME} ({info['param_dtype']} params + fp32 mu/nu): "
            f"{info['tensors']} tensors, {info['parameters'] / 1e9:.2f} B parameters, "
            f"{gb(info['tensor_bytes'])} GB of entries, {info['shard_files']} shard files (none "
            f"written), ucp.json {info['ucp_json_bytes'] / 1e6:.1f} MB (parsed in "
            f"{info['manifest_parse_seconds']:.2f} s), zarr.json {info['zarr_json_bytes'] / 1e6:.2f}"
            f" MB in all; saved from fsdp={args.save_fsdp} × tensor=8, inner chunks ≤ {args.inner_chunk_bytes} bytes"
        )
        meshes = []
        header = (
            f"{'mesh':30} {'dev':>5} {'proc':>5} {'plan s':>7} {'GB planned':>10} {'GB read max/mean':>17} "
            f"{'files max':>9} {'opens max':>9} {'requests max/mean':>18} {'meta MB':>8} "
            f"{'replayed':>8}"
        )
        print(header)
        chosen = MESHES
        if args.meshes:
            chosen = tuple(MESHES[int(i)] for i in str(args.meshes).split(","))
        for label, axes in chosen:
            devices = math.prod(s for _, s in axes)
            processes = devices // DEVICES_PER_PROCESS
            result, times = time_plan(path, axes, processes, args.repeats)
            sample = sampled(processes, args.sample)
            rows = replay(
                manifest, result, axes, processes, sample, zarr_bytes, info["ucp_json_bytes"]
            )
            for r in rows:  # whole inner chunks are read: never less than the plan's slices
                assert r["data_bytes"] >= r["planned_bytes"], (label, r)
            row = {
                "mesh": label,
                "devices": devices,
                "processes": processes,
                "plan_seconds": statistics.median(times),
                "plan_seconds_all": times,
                "replayed_processes": len(sample),
                "planned_read_bytes_max": result.process_read_bytes.highest(),
                "planned_read_bytes_min": result.process_read_bytes.lowest(),
            }
            for k in (
                "planned_bytes",
                "bytes",
                "shard_files",
                "opens",
                "requests",
                "metadata_bytes",
            ):
                values = [r[k] for r in rows]
                row[f"{k}_max"], row[f"{k}_mean"] = max(values), statistics.mean(values)
            row["metadata_files"] = rows[0]["metadata_files"]
            meshes.append(row)
            print(
                f"{label:30} {devices:5} {processes:5} {row['plan_seconds']:7.2f} "
                f"{gb(row['planned_bytes_max']):>10} {gb(row['bytes_max']):>8}/{gb(row['bytes_mean']):>8} {row['shard_files_max']:9} "
                f"{row['opens_max']:9} {row['requests_max']:>9}/{row['requests_mean']:<8.0f} "
                f"{row['metadata_bytes_max'] / 1e6:8.1f} {len(sample):4}/{processes}"
            )
        load.append(os.getloadavg())
        profile = None
        if args.profile:
            label, axes = MESHES[-2]
            prof = cProfile.Profile()
            prof.enable()
            jax_ucp.plan(
                path,
                mesh=abstract_mesh(axes),
                rules=RULES,
                processes=math.prod(s for _, s in axes) // DEVICES_PER_PROCESS,
            )
            prof.disable()
            stats = pstats.Stats(prof).sort_stats("cumulative")
            stats.print_stats(15)
            profile = label
        print("\nimport split across N processes (jax-ucp convert --coordinator), computed:")
        imports = []
        counts = [] if args.skip_import else str(args.import_processes).split(",")
        for n in (int(x) for x in counts):
            row = import_split(manifest, n, tmp, merge=True)
            imports.append(row)
            print(
                f"  N={n:4}: each reads and writes ≤ {gb(row['bytes_each_max'])} GB "
                f"(mean {gb(row['bytes_each_mean'])}), ≤ {row['tensors_each_max']} tensors, "
                f"part manifest ≤ {row['part_manifest_bytes_max'] / 1e6:.2f} MB; process 0 reads "
                f"{row['process0_reads_parts_bytes'] / 1e6:.1f} MB of parts and merges them into "
                f"ucp.json ({row['merged_ucp_json_bytes'] / 1e6:.1f} MB) in "
                f"{row['merge_seconds']:.2f} s"
            )
        load.append(os.getloadavg())
        print(f"\nload average (1, 5, 15 min) at start/after plans/end: {load}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "synthetic": True,
                        "checkpoint": NAME,
                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        "info": info,
                        "meshes": meshes,
                        "imports": imports,
                        "load_average": load,
                        "profiled": profile,
                        "command": " ".join(
                            ["python", "benchmarks/bench_plan_scale.py", *sys.argv[1:]]
                        ),
                    },
                    f,
                    indent=1,
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
