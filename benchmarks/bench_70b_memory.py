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

``--layout zero3`` builds instead a DeepSpeed ZeRO-3 bf16 checkpoint of the same shapes under
Hugging Face names (folder ``llama70b_zero3_dp64_bf16_sparse_synthetic``, ``build_zero3``): 64
DP ranks' ``zero_pp_rank_R_mp_rank_00_model_states.pt`` and
``bf16_zero_pp_rank_R_mp_rank_00_optim_states.pt``, torch.save archives whose storages are holes
(their CRC-32 that of zeros), 12 bytes per parameter (fp32 flat partitions and Adam's moments).

Measured, in a fresh child process per share: the source opened as ``jax_ucp.restore(SRC,
importing=...)`` opens it (``import_open``: the Megatron importer's plan, read in place, nothing
converted or written), then the restore's read engine (``restoring.engine.read_from``, default
``memory_budget``) asked for one process's slices: every tensor's rows ``[p*ceil(n/P),
(p+1)*ceil(n/P))`` of its first dimension (the layer stack, or vocab rows) as a ``rows=``
request, columns cut over 8 CPU devices where they divide. This stands in for a process of a
``P``-process job splitting the first dimension: JAX cannot hold a 512-device mesh with 8
addressable devices in one process, so the public ``restore`` with such a target cannot run
here. Each tensor's result is dropped once read (a real job keeps it on its accelerators).
Reported: peak RSS (``VmHWM``, reset before each tensor; jaxlib frees a dropped result's buffer
at its next gc pass, so one is run after each), the most one tensor's reads held beyond its
result (``peak_beyond_result``: the restore's own memory), ``/proc/self/io`` ``rchar`` and
``read_bytes`` (0 for holes) during the reads, the open's ``rchar`` (metadata), wall times,
and the share's bytes (its slices in the source dtypes).

    python benchmarks/bench_70b_memory.py --layers 8 --shares 8,4 --json docs/benchmark_70b_memory.json
    python benchmarks/bench_70b_memory.py --layout zero3 --layers 4 --shares 64,32
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


# ----------------------------------------------------------------- DeepSpeed ZeRO-3

ZERO3_NAME = "llama70b_zero3_dp64_bf16_sparse_synthetic"
ZERO3_FIXTURE = os.path.join(ROOT, "tests", "fixtures", "deepspeed", "z3_bf16_dp2", "ckpt")
ZERO3_RANKS = 64


def hf_llama(layers: int = LAYERS, hidden: int = HIDDEN, mlp: int = MLP, vocab: int = VOCAB):
    """(Hugging Face name, shape) of Llama-3-70B's parameters in ``named_parameters()`` order
    (what ZeRO-3's ``param_shapes`` lists and its flat partitions follow)."""
    kv = KV_GROUPS * HEAD_DIM * hidden // HIDDEN
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.k_proj.weight", (kv, hidden)),
            (p + "self_attn.v_proj.weight", (kv, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "mlp.gate_proj.weight", (mlp, hidden)),
            (p + "mlp.up_proj.weight", (mlp, hidden)),
            (p + "mlp.down_proj.weight", (hidden, mlp)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    return out + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


_ZERO_CRCS: dict[int, int] = {}


def _zeros_crc(n: int) -> int:
    """The zip CRC-32 of ``n`` zero bytes (a hole's), computed once per length."""
    import zlib

    if n not in _ZERO_CRCS:
        block, crc = bytes(64 << 20), 0
        for at in range(0, n, len(block)):
            crc = zlib.crc32(memoryview(block)[: min(len(block), n - at)], crc)
        _ZERO_CRCS[n] = crc
    return _ZERO_CRCS[n]


def _sparse_torch_save(path: str, obj, arrays) -> None:
    """``torch.save(obj)`` as the project's writer lays it out (``torchfiles.torch_zip``),
    every storage a hole: its zip member skipped over with ``seek``, its CRC-32 that of zeros
    (set on the member before zipfile writes its header)."""
    import zipfile

    from jax_ucp._src.torchfiles import pickle_format, torch_zip

    stem = os.path.basename(path).removesuffix(".pt")

    def member(name):
        return zipfile.ZipInfo(f"{stem}/{name}", date_time=(1980, 1, 1, 0, 0, 0))

    with open(path, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, True) as z:
        pickled = torch_zip._with_tensors(obj, stem)
        z.writestr(member("data.pkl"), pickle_format.dumps(pickled))
        z.writestr(member("byteorder"), "little")
        for i, (shape, dtype) in enumerate(arrays):
            n = int(np.prod(shape)) * np.dtype(dtype).itemsize
            with z.open(member(f"data/{i}"), "w", force_zip64=True) as m:
                if n:
                    f.seek(n, 1)  # a hole: reads as zeros, costs no disk
                    m._file_size, m._crc = n, _zeros_crc(n)
        z.writestr(member("version"), "3\n")


def build_zero3(out: str, layers: int = LAYERS, ranks: int = ZERO3_RANKS, **sizes) -> dict:
    """A DeepSpeed ZeRO-3 bf16 checkpoint of Llama-3-70B shapes saved by ``ranks`` DP ranks:
    ``latest``, and in ``global_step2/`` per rank its ``zero_pp_rank_R_mp_rank_00_model_states.pt``
    (empty bf16 module placeholders, ``param_shapes``) and
    ``bf16_zero_pp_rank_R_mp_rank_00_optim_states.pt`` (``fp32_flat_groups`` and Adam's flat
    ``exp_avg`` / ``exp_avg_sq``: ``ceil(numel / ranks)`` of every parameter, in order; the
    step), the objects' other fields as DeepSpeed 0.19.8 wrote them for
    ``tests/fixtures/deepspeed/z3_bf16_dp2``. Tensor bytes are holes. Returns its totals."""
    from jax_ucp._src.importers.deepspeed.files import load_deepspeed_file
    from jax_ucp._src.store.storage import LocalDirectory
    from jax_ucp._src.torchfiles.pickle_format import Global as G
    from jax_ucp._src.torchfiles.torch_zip import TensorSlot

    tag = os.path.join(out, "global_step2")
    os.makedirs(tag)
    with open(os.path.join(out, "latest"), "w") as f:
        f.write("global_step2")
    fixture = LocalDirectory(os.path.join(ZERO3_FIXTURE, "global_step2"))
    model0 = load_deepspeed_file(fixture, "zero_pp_rank_0_mp_rank_00_model_states.pt")
    optim0 = load_deepspeed_file(fixture, "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    params = hf_llama(layers, **sizes)
    flat = sum(-(-int(np.prod(shape)) // ranks) for _, shape in params)

    def ordered(pairs):
        return Call(G("collections", "OrderedDict"), (list(pairs),))

    import ml_dtypes

    slots = [TensorSlot(i, (0,), np.dtype(ml_dtypes.bfloat16)) for i in range(len(params))]
    shapes = ordered((n, Call(G("torch", "Size"), (tuple(s),))) for n, s in params)
    skip = ("module", "param_shapes", "dp_world_size")
    plain = {k: v for k, v in model0.items() if k not in skip}  # as the fixture's
    model = {
        "module": ordered((n, slot) for (n, _), slot in zip(params, slots)),
        "param_shapes": [shapes],
        "dp_world_size": ranks,
        **plain,
    }
    inner = optim0["optimizer_state_dict"]
    f32 = np.dtype(np.float32)
    optim = {
        "optimizer_state_dict": {
            "zero_stage": Call(G("deepspeed.runtime.zero.config", "ZeroStageEnum"), (3,)),
            "loss_scaler": New(
                G("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
                {"cur_scale": 1.0, "dynamic": False},
            ),
            "dynamic_loss_scale": False,
            "overflow": False,
            "partition_count": ranks,
            "optimizer_state_dict": {
                "state": {
                    0: {
                        "step": TensorSlot(0, (), f32),
                        "exp_avg": TensorSlot(1, (flat,), f32),
                        "exp_avg_sq": TensorSlot(2, (flat,), f32),
                    }
                },
                "param_groups": inner["optimizer_state_dict"]["param_groups"],
            },
            "fp32_flat_groups": [TensorSlot(3, (flat,), f32)],
        },
        "ds_config": optim0["ds_config"],
        "ds_version": optim0["ds_version"],
    }
    for rank in range(ranks):
        _sparse_torch_save(
            os.path.join(tag, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"),
            model,
            [(s.shape, s.dtype) for s in slots],
        )
        _sparse_torch_save(
            os.path.join(tag, f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"),
            optim,
            [((), f32), ((flat,), f32), ((flat,), f32), ((flat,), f32)],
        )
    return {"tensor_bytes": 12 * flat * ranks, "files": 2 * ranks, "tensors": len(params)}


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
    with import_open.opened_import(storage, importer) as imported:
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


def measure_export(ucp: str, dst: str, memory_budget=None) -> dict:
    """``jax_ucp.export`` of UCP checkpoint ``ucp`` to Hugging Face safetensors at ``dst`` by
    this process: peak RSS, bytes written (``wchar``) against the files' sizes, time."""
    import jax_ucp
    from jax_ucp.exporters import SafetensorsExport

    t0, io0, rss0 = time.perf_counter(), _io(), _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    jax_ucp.export(ucp, dst, SafetensorsExport(memory_budget=memory_budget))
    t1, io1, hwm = time.perf_counter(), _io(), _status("VmHWM")
    files = [os.path.join(d, f) for d, _, fs in os.walk(dst) for f in fs]
    return {
        "export_s": t1 - t0,
        "wchar": io1["wchar"] - io0["wchar"],
        "rchar": io1["rchar"] - io0["rchar"],
        "files_bytes": sum(os.path.getsize(f) for f in files),
        "safetensors_bytes": sum(os.path.getsize(f) for f in files if f.endswith(".safetensors")),
        "files": len(files),
        "rss_before": rss0,
        "peak_rss": hwm,
    }


def child(path: str, processes: int, process: int, budget=None, call=None) -> dict:
    """``measure`` (or ``call``) in a fresh Python process (its own VmHWM and /proc/self/io)."""
    here = os.path.dirname(os.path.abspath(__file__))
    call = call or f"b.measure({path!r}, {processes}, {process}, {budget!r})"
    code = f"import json, sys; sys.path.insert(0, {here!r}); import bench_70b_memory as b; "
    code += f"print('RESULT', json.dumps({call}))"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.split("RESULT ", 1)[1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="where the sparse checkpoint goes (a temp dir)")
    p.add_argument("--layout", choices=("megatron", "zero3"), default="megatron")
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--shares", default="80,40", help="job sizes P: process 0 of P reads 1/P")
    p.add_argument("--process", type=int, default=0)
    p.add_argument("--memory-budget", default=None, help="restore memory_budget (256MiB)")
    p.add_argument("--json", default=None)
    p.add_argument("--export", action="store_true", help="a UCP of the weights, exported to HF")
    a = p.parse_args(argv)
    if a.export:
        return export_main(a)
    base = tempfile.mkdtemp(prefix="bench70b_", dir=a.dir)
    zero3 = a.layout == "zero3"
    path = os.path.join(base, ZERO3_NAME if zero3 else NAME)
    try:
        t = time.perf_counter()
        built = (build_zero3 if zero3 else build)(path, a.layers)
        built["build_s"] = time.perf_counter() - t
        built["metadata_bytes"] = sum(  # on disk: the sparse files' non-hole blocks included
            os.stat(os.path.join(d, f)).st_blocks * 512
            for d, _, files in os.walk(path)
            for f in files
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
                out = {"layout": a.layout, "checkpoint": built, "layers": a.layers, "rows": rows}
                json.dump(out, f, indent=1)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def build_ucp(out: str, layers: int = LAYERS, **sizes) -> dict:
    """A UCP checkpoint of Llama-3-70B's bf16 weights under Hugging Face names (``params``, as
    an import of an HF model leaves them), written by ``jax_ucp.save`` (its real ``ucp.json``,
    ``zarr.json`` files, crc32c trailers, indexes and shard digests) from zero arrays (pages
    never touched: no memory), then made sparse (``cp --sparse=always``: the zero runs become
    holes). Returns its totals."""
    import ml_dtypes

    import jax_ucp

    params = {n: np.zeros(shape, ml_dtypes.bfloat16) for n, shape in hf_llama(layers, **sizes)}
    jax_ucp.save(out, {"params": params})
    for d, _, names in os.walk(os.path.join(out, "arrays")):
        for name in names:
            path = os.path.join(d, name)
            subprocess.run(["cp", "--sparse=always", path, path + ".s"], check=True)
            os.replace(path + ".s", path)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    return {
        "tensor_bytes": sum(v.nbytes for v in params.values()),
        "tensors": len(params),
        "ucp_bytes": size,
        "on_disk": sum(
            os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(out) for f in fs
        ),
    }


def export_main(a) -> None:
    """A sparse UCP checkpoint of the model's bf16 weights (``build_ucp``) exported to
    safetensors by one process, in a fresh child."""
    base = tempfile.mkdtemp(prefix="bench70b_", dir=a.dir)
    ucp = os.path.join(base, "ucp")
    try:
        t = time.perf_counter()
        built = {**build_ucp(ucp, a.layers), "build_s": time.perf_counter() - t}
        print(json.dumps(built), flush=True)
        call = f"b.measure_export({ucp!r}, {os.path.join(base, 'hf')!r}, {a.memory_budget!r})"
        row = {**built, **child(ucp, 1, 0, call=call)}
        gib, gb = 2**30, row["tensor_bytes"] / 1e9
        print(
            f"export: {row['safetensors_bytes'] / 1e9:.2f} GB of safetensors in {row['files']} "
            f"files, read {row['rchar'] / 1e9:.2f} GB ({row['rchar'] / row['tensor_bytes']:.4f}x "
            f"the tensors), wchar {row['wchar'] / 1e9:.2f} GB ({row['wchar'] / row['files_bytes']:.4f}x "
            f"the files), {row['export_s']:.1f} s ({row['export_s'] / gb:.1f} s/GB), peak RSS "
            f"{row['peak_rss'] / gib:.2f} GiB (before {row['rss_before'] / gib:.2f})",
            flush=True,
        )
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"layout": "export", "layers": a.layers, "rows": [row]}, f, indent=1)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
