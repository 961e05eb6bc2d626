"""Benchmark (simulation): one process of a 64-process job restoring a 70B megatron-core
``torch_dist`` checkpoint straight from its files: peak host memory, bytes read, time.

SYNTHETIC. The checkpoint (folder ``llama70b_torch_dist_tp8pp4dp2_sparse_synthetic``) has the
real file structure megatron-core's ``dist_checkpointing.save`` leaves: ``metadata.json``
(``sharded_backend: torch_dist``), ``common.pt`` (copied from the megatron-core-written fixture
``tests/fixtures/megatron/llama_distopt_bf16_tp2dp2``: optimizer param_groups,
``param_state_sharding_type: fully_reshardable``), a DCP ``.metadata`` (written here with the
project's torch-free pickle writer, ``torchfiles.pickle_format``: the classes and fields torch
pickles) and one ``__R_0.distcp`` per rank (64 ranks, megatron's TP-fastest order
``rank = pp * 16 + dp * 8 + tp``). Tensor bytes are in torch's raw DCP serialization and the
files are SPARSE (``truncate`` to size: holes read as zeros), so ~1 TB costs no disk.

What is built: Llama-3-70B shapes (80 layers, hidden 8192, MLP 28672, 64 heads / 8 KV groups of
128, vocab 128256 unpadded, untied), megatron-core names with the layer stack as dim 0 (one
chunk per layer and TP rank, fc1's gate and up halves each split over TP, as the fixture shows),
bf16 model weights, and the distributed optimizer's state in the ``fully_reshardable`` layout
(``optimizer.state.{param,exp_avg,exp_avg_sq}.<name>``, fp32 model-space tensors chunked like
the weights), TP 8 x PP 4 x DP 2: each chunk written by one DP replica (weights by dp 0,
optimizer state by dp 1). 14 bytes per parameter, ~988 GB. ``--layers`` builds fewer layers.

Measured, in a fresh child process per share: the source opened as ``jax_ucp.restore(SRC,
importing=...)`` opens it (``import_open``: the Megatron importer's plan, read in place, nothing
converted or written), then the restore's read engine (``restoring.engine.read_from``, default
``memory_budget``) asked for one process's slices: every tensor's rows ``[p*ceil(n/P),
(p+1)*ceil(n/P))`` of its first dimension (the layer stack, or vocab rows) as a ``rows=``
request, columns cut over 8 CPU devices where they divide. This stands in for a process of a
``P``-process job splitting the first dimension: JAX cannot hold a 512-device mesh with 8
addressable devices in one process, so the public ``restore`` with such a target cannot run
here. Each tensor's result is dropped once read (a real job keeps it on its accelerators).
Reported: peak RSS (``VmHWM``, reset after the open), ``/proc/self/io`` ``rchar`` and
``read_bytes`` (0 for holes) during the reads, the open's ``rchar`` (metadata), wall times,
and the share's bytes (its slices in the source dtypes).

    python benchmarks/bench_70b_memory.py --shares 64,32,16 --json docs/benchmark_70b_memory.json
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jax_ucp._src.torchfiles.pickle_format import (  # noqa: E402
    Call,
    Global,
    New,
    Pairs,
    dumps,
    torch_size,
)

NAME = "llama70b_torch_dist_tp8pp4dp2_sparse_synthetic"
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "megatron", "llama_distopt_bf16_tp2dp2")
LAYERS, HIDDEN, MLP, HEADS, KV_GROUPS, HEAD_DIM, VOCAB = 80, 8192, 28672, 64, 8, 128, 128256
TP, PP, DP = 8, 4, 2
OPT_STATES = ("param", "exp_avg", "exp_avg_sq")  # fully_reshardable's fp32 model-space tensors
_META = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_DTYPES = {"bfloat16": ("bfloat16", 2), "float32": ("float", 4)}


@dataclass(frozen=True)
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    pp: int
    tp: int


def model(layers: int = LAYERS, hidden: int = HIDDEN, mlp: int = MLP, vocab: int = VOCAB):
    """(megatron-core name, global shape, its chunks) of every model tensor: layer stacks as dim 0,
    one chunk per layer and TP rank (PP stage = layer // (layers / PP))."""
    qkv = (HEADS + 2 * KV_GROUPS) * HEAD_DIM * hidden // HIDDEN
    per_stage = max(1, -(-layers // PP))

    def stacked(shape, split):  # split: the TP-split dim of the stacked shape, or None
        out = []
        for layer in range(layers):
            pp = layer // per_stage
            if split is None:
                out.append(Chunk((layer, *[0] * len(shape)), (1, *shape), pp, 0))
                continue
            for tp in range(TP):
                if split == "fc1":  # gate and up halves, each split over TP
                    n = shape[0] // 2 // TP
                    for half in (0, shape[0] // 2):
                        out.append(Chunk((layer, half + tp * n, 0), (1, n, shape[1]), pp, tp))
                    continue
                n = shape[split - 1] // TP
                offs = [layer] + [0] * len(shape)
                offs[split] = tp * n
                sizes = [1, *shape]
                sizes[split] = n
                out.append(Chunk(tuple(offs), tuple(sizes), pp, tp))
        return ((layers, *shape), out)

    def rows(shape, pp):
        n = shape[0] // TP
        return (shape, [Chunk((tp * n, 0), (n, shape[1]), pp, tp) for tp in range(TP)])

    tensors = {
        "embedding.word_embeddings.weight": rows((vocab, hidden), 0),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": stacked((hidden,), None),
        "decoder.layers.self_attention.linear_qkv.weight": stacked((qkv, hidden), 1),
        "decoder.layers.self_attention.linear_proj.weight": stacked(
            (hidden, HEADS * HEAD_DIM * hidden // HIDDEN), 2
        ),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": stacked((hidden,), None),
        "decoder.layers.mlp.linear_fc1.weight": stacked((2 * mlp, hidden), "fc1"),
        "decoder.layers.mlp.linear_fc2.weight": stacked((hidden, mlp), 2),
        "decoder.final_layernorm.weight": ((hidden,), [Chunk((0,), (hidden,), PP - 1, 0)]),
        "output_layer.weight": rows((vocab, hidden), PP - 1),
    }
    return [(name, shape, chunks) for name, (shape, chunks) in tensors.items()]


def state(layers: int = LAYERS, **sizes):
    """(name, shape, dtype, chunks, dp rank writing them): bf16 weights (dp 0) and the
    distributed optimizer's fully_reshardable fp32 state (dp 1)."""
    out = []
    tensors = model(layers, **sizes)
    for name, shape, chunks in tensors:
        out.append((name, shape, "bfloat16", chunks, 0))
    for which in OPT_STATES:
        for name, shape, chunks in tensors:
            out.append((f"optimizer.state.{which}.{name}", shape, "float32", chunks, 1))
    return out


def _meta(cls: str, **fields) -> New:
    return New(Global(_META, cls), fields)


def _properties(torch_name: str) -> New:
    return _meta(
        "TensorProperties",
        dtype=Global("torch", torch_name),
        layout=Call(Global("torch.serialization", "_get_layout"), ("torch.strided",)),
        requires_grad=False,
        memory_format=Call(Global(_META, "_MEM_FORMAT_ENCODING"), (0,)),
        pin_memory=False,
    )


def build(out: str, layers: int = LAYERS, **sizes) -> dict:
    """Writes the synthetic checkpoint into ``out`` (created): sparse ``__R_0.distcp`` files, a
    ``.metadata``, ``metadata.json`` and the fixture's ``common.pt``. Returns its totals."""
    os.makedirs(out)
    ends: dict[int, int] = {}  # rank -> bytes of its file so far
    metadata, storage = {}, []
    total = 0
    for name, shape, dtype, chunks, dp in state(layers, **sizes):
        torch_name, itemsize = _DTYPES[dtype]
        entries = []
        for i, c in enumerate(chunks):
            rank = c.pp * TP * DP + dp * TP + c.tp
            length = int(np.prod(c.sizes)) * itemsize
            offset = ends.get(rank, 0)
            ends[rank] = offset + length
            total += length
            entries.append(
                _meta(
                    "ChunkStorageMetadata", offsets=torch_size(c.offsets), sizes=torch_size(c.sizes)
                )
            )
            index = _meta("MetadataIndex", fqn=name, offset=torch_size(c.offsets), index=i)
            info = New(
                Global(_FS, "_StorageInfo"),
                {"relative_path": f"__{rank}_0.distcp", "offset": offset, "length": length},
            )
            storage.append((index, info))
        metadata[name] = _meta(
            "TensorStorageMetadata",
            properties=_properties(torch_name),
            size=torch_size(shape),
            chunks=entries,
        )
    meta = _meta(
        "Metadata",
        state_dict_metadata=metadata,
        planner_data={name: (name,) for name in metadata},
        storage_data=Pairs(tuple(storage)),
        storage_meta=None,
        version="1.0.0",
    )
    for rank in range(TP * PP * DP):
        with open(os.path.join(out, f"__{rank}_0.distcp"), "wb") as f:
            f.truncate(ends.get(rank, 0))  # a hole: reads as zeros, costs no disk
    with open(os.path.join(out, ".metadata"), "wb") as f:
        f.write(dumps(meta))
    for name in ("metadata.json", "common.pt"):
        shutil.copyfile(os.path.join(FIXTURE, name), os.path.join(out, name))
    return {"tensor_bytes": total, "files": len(ends), "tensors": len(metadata)}


# ----------------------------------------------------------------- one process's restore


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (VmHWM, VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def share_requests(available, processes: int, process: int, mesh=None):
    """One ``engine.Request`` per tensor: rows ``[lo, hi)`` of its first dimension, the
    ``process``-th of ``processes`` contiguous blocks (``ceil(n / processes)`` rows; the last
    ones may hold fewer or none), columns cut over ``mesh``'s 8 devices where they divide, and
    the block's bytes in the source dtype."""
    import math

    from jax.sharding import NamedSharding, PartitionSpec

    from jax_ucp._src.restoring.model import Request

    out = []
    for key, found in available.items():
        shape = tuple(found.shape)
        if not shape:
            out.append((Request(key), found.dtype.itemsize))
            continue
        block = -(-shape[0] // processes)
        lo, hi = min(shape[0], process * block), min(shape[0], (process + 1) * block)
        if lo == hi:
            continue
        cut = mesh is not None and len(shape) >= 2 and shape[1] % mesh.size == 0
        sharding = NamedSharding(mesh, PartitionSpec(None, "tensor")) if cut else None
        nbytes = (hi - lo) * math.prod(shape[1:]) * found.dtype.itemsize
        out.append((Request(key, rows=(lo, hi), sharding=sharding), nbytes))
    return out


def measure(path: str, processes: int, process: int, memory_budget=None) -> dict:
    """One process's restore of its share of ``path``, in this process: results dropped as
    each tensor's slices arrive (on a real job they stay on its accelerators)."""
    t0, io0 = time.perf_counter(), _io()
    import jax

    from jax_ucp._src import store
    from jax_ucp._src.restoring import engine
    from jax_ucp._src.restoring.sources import import_open

    storage, importer = import_open.import_for(store.storage_for(path), None, None, warn=False)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("tensor",))
    with import_open.opened_import(storage.root, importer) as imported:
        opened = imported.opened
        values = {v.key: v for v in opened.values} if opened.values else {}
        requests = share_requests(opened.available, processes, process, mesh)
        t_open, io_open, rss_open = time.perf_counter(), _io(), _status("VmRSS")
        largest = hwm = overhead = 0
        for req, nbytes in requests:
            before = _status("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:  # VmHWM from here on
                f.write("5")
            result = engine.read_from(
                opened.source, [req], opened.available, values, memory_budget=memory_budget
            )
            jax.block_until_ready(result)
            largest = max(largest, nbytes)
            peak = _status("VmHWM")
            hwm, overhead = max(hwm, peak), max(overhead, peak - before - nbytes)
            del result
            # jaxlib drops a buffer adopted from numpy (``device_put(may_alias=True)``) only at
            # its next garbage pass (a gc callback): without one the last result stays resident
            gc.collect()
        t_end, io_end = time.perf_counter(), _io()
    return {
        "processes": processes,
        "process": process,
        "tensors": len(requests),
        "share_bytes": sum(n for _, n in requests),
        "largest_tensor_share": largest,
        "open_s": t_open - t0,
        "read_s": t_end - t_open,
        "open_rchar": io_open["rchar"] - io0["rchar"],
        "read_rchar": io_end["rchar"] - io_open["rchar"],
        "read_bytes": io_end["read_bytes"] - io_open["read_bytes"],
        "rss_after_open": rss_open,
        "peak_rss": hwm,
        "peak_above_open": hwm - rss_open,
        # the most one tensor's reads held beyond its result (its host-resident share)
        "peak_beyond_result": overhead,
    }


def child(path: str, processes: int, process: int, budget=None) -> dict:
    """``measure`` in a fresh Python process (its own VmHWM and /proc/self/io)."""
    here = os.path.dirname(os.path.abspath(__file__))
    call = f"b.measure({path!r}, {processes}, {process}, {budget!r})"
    code = f"import json, sys; sys.path.insert(0, {here!r}); import bench_70b_memory as b; "
    code += f"print('RESULT', json.dumps({call}))"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.split("RESULT ", 1)[1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="where the sparse checkpoint goes (a temp dir)")
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--shares", default="80,40", help="job sizes P: process 0 of P reads 1/P")
    p.add_argument("--process", type=int, default=0)
    p.add_argument("--memory-budget", default=None, help="restore memory_budget (256MiB)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    base = tempfile.mkdtemp(prefix="bench70b_", dir=a.dir)
    path = os.path.join(base, NAME)
    try:
        t = time.perf_counter()
        built = build(path, a.layers)
        built["build_s"] = time.perf_counter() - t
        built["metadata_bytes"] = sum(
            os.path.getsize(os.path.join(path, f))
            for f in (".metadata", "metadata.json", "common.pt")
        )
        print(json.dumps(built))
        rows = []
        for n in (int(s) for s in a.shares.split(",")):
            row = child(path, n, a.process, a.memory_budget)
            rows.append(row)
            gib = 2**30
            print(
                f"1/{n}: share {row['share_bytes'] / 1e9:.2f} GB, read "
                f"{row['read_rchar'] / 1e9:.2f} GB ({row['read_rchar'] / row['share_bytes']:.4f}x)"
                f", open {row['open_s']:.1f} s (rchar {row['open_rchar'] / 1e6:.1f} MB), read "
                f"{row['read_s']:.1f} s, peak RSS {row['peak_rss'] / gib:.2f} GiB (after open "
                f"{row['rss_after_open'] / gib:.2f}, largest tensor share "
                f"{row['largest_tensor_share'] / gib:.2f}, reads beyond their result "
                f"{row['peak_beyond_result'] / 2**20:.0f} MiB)",
                flush=True,
            )
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"checkpoint": built, "layers": a.layers, "rows": rows}, f, indent=1)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
