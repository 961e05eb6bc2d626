"""Scale benchmarks (issue 33): how time and host memory grow from 1 to 16 GB of checkpoint,
jax_ucp side by side with what a user would pick instead, each contender in the same run.

Parts (``--parts``; jax, dcp and hf by default):

* ``jax``: ``--sizes`` GB of float32 (64 MiB tensors, every one fully sharded) saved from a 2×4
  mesh and restored onto a 4×2 mesh with other PartitionSpecs: ``jax_ucp.save``/``restore`` vs
  Orbax ``StandardCheckpointer`` (defaults: OCDBT + zstd) vs Orbax with ``use_compression=False``.
  Each save and each restore runs in a fresh process (8 CPU devices), so its RssAnon is its own.
  Beside them the contender ``disk``: the physical limit, the same bytes written sequentially
  (8 MiB writes of incompressible data, one ``fdatasync``: ``dd bs=8M conv=fdatasync``) and read
  back sequentially from a cold cache (the same eviction as the others), as GB/s; the table
  gives every jax contender's GB/s as a % of the disk's in the same round set.
* ``dcp``: a torch DCP checkpoint written by 2 gloo ranks holding FSDP2-style sharded state
  (DTensors ``Shard(0)`` of a Llama-shaped model + AdamW ``exp_avg``/``exp_avg_sq``, fp32; the
  layer count scaled to the size) → ``jax_ucp.convert`` (default 256 MiB budget) vs
  ``dcp_to_torch_save`` + ``torch.load``, each in its own process.
* ``hf``: a Hugging Face folder, Llama-3-8B-shaped bf16 (4 shards + index; at 16 GB the real
  8B shapes, smaller sizes scale the layer count and the vocabulary by size/16) restored onto a
  2×4 mesh, Megatron-style TP on ``model`` (column-parallel split on dim 0, row-parallel on dim
  1) and FSDP on ``data`` (the other dim), norms replicated: ``jax_ucp.restore(folder)`` vs Orbax
  v1 ``ocp.load`` with ``CheckpointLayout.SAFETENSORS``.
* ``zero3``: a DeepSpeed ZeRO-3 bf16 checkpoint written by DeepSpeed (``tools/fixtures/
  ds_train.py``, 2 gloo ranks, one Adam step) → ``jax_ucp.convert`` vs ``ds_to_universal`` and
  ``jax_ucp.convert(importing=ImportOptions(weights_only=True))`` vs ``zero_to_fp32``.
* ``megatron``: a megatron-core torch_dist checkpoint with the distributed optimizer as
  ``dp_reshardable``, written by megatron-core (``tools/fixtures/make_megatron_fixtures.py``,
  DP=2, bf16) → ``jax_ucp.convert`` vs ``dcp_to_torch_save`` + ``torch.load``.
  (Both generators run niced; they are not measured. Their checkpoints are sized to ``--sizes``.)

``--rounds N`` runs every contender N times, rounds outermost; a record keeps the median seconds
and every round's seconds, UTC time and load.

Every read is from a cold page cache (the files' pages dropped with ``posix_fadvise`` after
``fdatasync``: ``bench_save_restore.evict``; ``/proc/sys/vm/drop_caches`` would drop the caches of
everyone sharing the host). Saves are timed to durable data (a ``sync`` after). Memory: RssAnon
sampled every 5 ms in the measured process (and, for the convert contenders, over the process
tree by ``rss.Peak``); "above the arrays" is the peak minus the baseline with the arrays in
memory (save) or minus the restored arrays (restore). Data are generated on the fly and deleted
after each size. A contender whose estimated peak does not fit in MemAvailable minus a margin is
recorded as skipped, with the figures, instead of risking the shared host (``--margin-gib``);
a skip never replaces an earlier measurement in the JSON.

    python benchmarks/bench_scale.py --sizes 1,4,16 [--parts jax,dcp,hf] [--rounds 2]
    python benchmarks/bench_scale.py --sizes 4 --parts zero3,megatron

Results are merged into docs/benchmark_scale.json (one record per part, size and contender) and
drawn as docs/benchmark_scale.png (``--plot-only`` redraws from the JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

from bench_memory import Sampler, status  # the same RssAnon sampler as bench_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(ROOT, "benchmarks")
DOCS = os.path.join(ROOT, "docs")
JSON = os.path.join(DOCS, "benchmark_scale.json")
PNG = os.path.join(DOCS, "benchmark_scale.png")
GB = 10**9
MiB = 2**20
GiB = 2**30
BUDGET = 256 * MiB  # jax_ucp's default memory budget

JAX_CONTENDERS = ("jax_ucp", "orbax default", "orbax no-compr", "disk")
HF_CONTENDERS = ("jax_ucp", "orbax v1")
DCP_CONTENDERS = ("jax_ucp.convert", "dcp_to_torch_save + torch.load")
ZERO3_CONTENDERS = ("jax_ucp.convert", "ds_to_universal", "jax_ucp.convert weights_only",
                    "zero_to_fp32")  # fmt: skip
MEGATRON_CONTENDERS = ("jax_ucp.convert", "dcp_to_torch_save + torch.load")
CONTENDERS = {"jax": JAX_CONTENDERS, "dcp": DCP_CONTENDERS, "hf": HF_CONTENDERS,
              "zero3": ZERO3_CONTENDERS, "megatron": MEGATRON_CONTENDERS}  # fmt: skip
# estimated peak host memory of one measurement: (multiple of the checkpoint's bytes, GiB on top),
# from the peaks measured at 1, 4 and 8 GB by this script (2026-11-23) plus ~10 %: jax_ucp and
# Orbax without compression save with their arrays + < 50 MiB, jax_ucp restores with its arrays +
# < 150 MiB, Orbax's default save peaks at the arrays + ~3 GiB at 4 and 8 GB alike, Orbax's
# restores at the arrays + 0.75x, Orbax v1's safetensors load at the arrays + ~0.3x + 0.4 GiB;
# a measurement runs only when this plus MARGIN fits in MemAvailable
NEED = {
    ("jax", "save", "jax_ucp"): (1.0, 0.8),
    ("jax", "save", "orbax default"): (1.0, 3.8),
    ("jax", "save", "orbax no-compr"): (1.0, 0.8),
    ("jax", "restore", "jax_ucp"): (1.0, 0.8),
    ("jax", "restore", "orbax default"): (1.85, 0.8),
    ("jax", "restore", "orbax no-compr"): (1.85, 0.8),
    ("jax", "save", "disk"): (0.0, 0.2),  # a 64 MiB buffer
    ("jax", "restore", "disk"): (0.0, 0.2),
    ("hf", "restore", "jax_ucp"): (1.0, 0.8),
    ("hf", "restore", "orbax v1"): (1.35, 1.2),
    ("dcp", "convert", "jax_ucp.convert"): (0.0, 0.5),
    ("dcp", "convert", "dcp_to_torch_save + torch.load"): (1.1, 1.0),
    # not measured before: guesses from what each holds (jax_ucp: its budget; ds_to_universal's
    # extract workers load whole rank files; zero_to_fp32 loads every rank's optimizer file and
    # builds the fp32 state dict; dcp_to_torch_save holds the whole state)
    ("zero3", "convert", "jax_ucp.convert"): (0.0, 0.8),
    ("zero3", "convert", "jax_ucp.convert weights_only"): (0.0, 0.8),
    ("zero3", "convert", "ds_to_universal"): (1.3, 1.0),
    ("zero3", "convert", "zero_to_fp32"): (1.4, 1.0),
    ("megatron", "convert", "jax_ucp.convert"): (0.0, 0.8),
    ("megatron", "convert", "dcp_to_torch_save + torch.load"): (1.2, 1.0),
}
MARGIN = 4 * GiB  # --margin-gib: room left for the other jobs on the host to grow


# ------------------------------------------------------------------------------ measurement


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def settle() -> None:
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def evict(path: str) -> None:
    sys.path.insert(0, HERE)
    from bench_save_restore import evict as _evict

    _evict(path)


# ------------------------------------------------------------------------------ shapes


def llama8b_shapes(gb: float) -> dict[str, tuple[int, ...]]:
    """Llama-3-8B (hidden 4096, 32 heads, 8 KV heads of 128, MLP 14336, vocab 128256, untied head,
    32 layers) with the layer count and the vocabulary scaled by ``gb``/16: 16.06 GB of bf16 at 16."""
    s = gb / 16
    h, kv, f = 4096, 1024, 14336
    v = max(64, round(128256 * s / 64) * 64)
    layers = max(1, round(32 * s))
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (h, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, h)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (f, h)
        shapes[p + "mlp.up_proj.weight"] = (f, h)
        shapes[p + "mlp.down_proj.weight"] = (h, f)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    return shapes


def dcp_shapes(gb: float) -> dict[str, tuple[int, ...]]:
    """A Llama-shaped model (hidden 2048, 16 heads, 4 KV heads, MLP 5632, vocab 32000) whose
    parameters + two fp32 AdamW moments make ~``gb`` GB (12 bytes per parameter); layers scaled
    to the size (16 GB ≈ 1.35B parameters). The vocabulary is 32000 at every size, so the largest
    tensor (the 250 MiB fp32 embedding) is the same and import memory compares across sizes; the
    head is untied where it fits and tied (no ``output.weight``) below ~2 GB: "1 GB" = one layer,
    1.33 GB."""
    h, kv, f, v = 2048, 512, 5632, 32000
    per_layer = 2 * h * h + 2 * kv * h + 3 * f * h + 2 * h
    params = gb * GB / 12
    untied = params - 2 * v * h - h >= per_layer
    layers = max(1, round((params - (2 if untied else 1) * v * h - h) / per_layer))
    shapes = {"tok_embeddings.weight": (v, h)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes[p + "attention_norm.weight"] = (h,)
        shapes[p + "attention.wq.weight"] = (h, h)
        shapes[p + "attention.wk.weight"] = (kv, h)
        shapes[p + "attention.wv.weight"] = (kv, h)
        shapes[p + "attention.wo.weight"] = (h, h)
        shapes[p + "ffn_norm.weight"] = (h,)
        shapes[p + "feed_forward.w1.weight"] = (f, h)
        shapes[p + "feed_forward.w3.weight"] = (f, h)
        shapes[p + "feed_forward.w2.weight"] = (h, f)
    shapes["norm.weight"] = (h,)
    if untied:
        shapes["output.weight"] = (v, h)
    return shapes


def random_bits(rng, n: int, dtype):
    """``n`` values of ``dtype`` (float32 / bfloat16) from random bits with the exponent's top bit
    cleared: finite, |x| < 2, incompressible like trained weights' mantissas; fast to make."""
    import numpy as np

    if np.dtype(dtype).itemsize == 4:
        return (rng.integers(0, 2**32, n, dtype=np.uint32) & 0xBFFFFFFF).view(dtype)
    return (rng.integers(0, 2**16, n, dtype=np.uint16) & 0xBFFF).view(dtype)


# ------------------------------------------------------------------------------ children


def _jax_setup():
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np

    return jax, np, np.array(jax.devices()[:8])


def child_jax(a) -> dict:
    jax, np, devs = _jax_setup()
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ucp

    n = max(1, round(a.gb * GB / (64 * MiB)))
    names = [f"w{i:03d}" for i in range(n)]
    shape = (4096, 4096)
    if a.child == "jax-save":
        mesh = Mesh(devs.reshape(2, 4), ("x", "y"))
        specs = [P("x", "y"), P("y", "x"), P(None, ("x", "y")), P(("x", "y"), None)]
        rng = np.random.default_rng(0)
        tree = {}
        for i, k in enumerate(names):
            host = rng.standard_normal(shape, dtype=np.float32) * 0.02  # compresses like weights
            tree[k] = jax.device_put(host, NamedSharding(mesh, specs[i % 4]))
            del host
        jax.block_until_ready(tree)
        arrays = sum(s.data.nbytes for x in tree.values() for s in x.addressable_shards)
    else:
        mesh = Mesh(devs.reshape(4, 2), ("x", "y"))
        specs = [P("y", "x"), P("x", "y"), P(("y", "x"), None), P(None, ("x", "y"))]
        shardings = {k: NamedSharding(mesh, specs[i % 4]) for i, k in enumerate(names)}
        evict(a.path)
    settle()
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    base = status()
    os.sync()
    sampler = Sampler()
    t0 = time.perf_counter()
    if a.child == "jax-save":
        if a.contender == "jax_ucp":
            jax_ucp.save(a.path, tree)
        elif a.contender == "orbax default":
            with ocp.StandardCheckpointer() as ck:
                ck.save(a.path, tree)
                ck.wait_until_finished()
        else:
            handler = ocp.PyTreeCheckpointHandler(use_compression=False)
            with ocp.AsyncCheckpointer(handler) as ck:
                ck.save(a.path, args=ocp.args.PyTreeSave(tree))
                ck.wait_until_finished()
        os.sync()  # durable
    else:
        if a.contender == "jax_ucp":
            out = jax_ucp.restore(a.path, shardings=shardings)
        else:
            target = {
                k: jax.ShapeDtypeStruct(shape, np.float32, sharding=shardings[k]) for k in names
            }
            with ocp.StandardCheckpointer() as ck:
                out = ck.restore(a.path, target)
        jax.block_until_ready(out)
        arrays = sum(s.data.nbytes for x in out.values() for s in x.addressable_shards)
        for k in names[:2]:  # the right layout came back
            assert out[k].sharding == shardings[k], k
    seconds = time.perf_counter() - t0
    peak = sampler.stop()
    end = status()
    above = peak - base["RssAnon"] - (arrays if a.child == "jax-restore" else 0)
    return {
        "seconds": seconds,
        "array_bytes": arrays,
        "checkpoint_bytes": du(a.path),
        "rss_anon_peak_above_arrays": above,
        "vm_hwm_increase": end["VmHWM"] - base["VmRSS"],
    }


def disk_io(op: str, path: str, nbytes: int) -> dict:
    """The disk's own sequential rate for ``nbytes``: written as one file with 8 MiB writes
    (incompressible, cycled from a 64 MiB buffer) and one ``fdatasync`` (``save``), or read
    back with 8 MiB reads after ``evict`` (``restore``). No memory is measured (a fixed buffer)."""
    import numpy as np

    chunk = 8 * MiB
    file = os.path.join(path, "data")
    if op == "save":
        os.makedirs(path, exist_ok=True)
        buf = random_bits(np.random.default_rng(0), 64 * MiB // 4, np.float32).view(np.uint8)
        view = memoryview(buf)
        os.sync()
        t0 = time.perf_counter()
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            done = 0
            while done < nbytes:
                off = done % buf.size
                done += os.write(fd, view[off : off + min(chunk, nbytes - done, buf.size - off)])
            os.fdatasync(fd)
        finally:
            os.close(fd)
    else:
        evict(path)
        out = bytearray(chunk)
        t0 = time.perf_counter()
        fd = os.open(file, os.O_RDONLY)
        try:
            done = 0
            while n := os.readv(fd, [out]):
                done += n
        finally:
            os.close(fd)
        assert done == nbytes, (done, nbytes)
    return {"seconds": time.perf_counter() - t0, "array_bytes": nbytes, "checkpoint_bytes": nbytes}


def hf_spec(name: str, shape):
    from jax.sharding import PartitionSpec as P

    if len(shape) == 1:
        return P()
    if any(r in name for r in ("o_proj", "down_proj")):  # row-parallel
        return P("data", "model")
    return P("model", "data")  # column-parallel (q/k/v, gate/up, embedding, lm_head)


def child_hf(a) -> dict:
    jax, np, devs = _jax_setup()
    import ml_dtypes
    from jax.sharding import Mesh, NamedSharding

    import jax_ucp

    bf16 = np.dtype(ml_dtypes.bfloat16)
    shapes = llama8b_shapes(a.gb)
    mesh = Mesh(devs.reshape(2, 4), ("data", "model"))
    abstract = {
        n: jax.ShapeDtypeStruct(s, bf16, sharding=NamedSharding(mesh, hf_spec(n, s)))
        for n, s in shapes.items()
    }
    if a.contender == "orbax v1":
        import orbax.checkpoint.experimental.v1 as ocp

        ctx = ocp.Context()
        ctx.checkpoint_layout = ocp.options.CheckpointLayout.SAFETENSORS
    evict(a.path)
    settle()
    open("/proc/self/clear_refs", "w").write("5")
    base = status()
    sampler = Sampler()
    t0 = time.perf_counter()
    if a.contender == "jax_ucp":
        out = jax_ucp.restore(a.path, target={"params": abstract})["params"]
    else:
        with ctx:
            out = ocp.load(a.path, abstract)
    jax.block_until_ready(out)
    seconds = time.perf_counter() - t0
    peak = sampler.stop()
    end = status()
    arrays = sum(s.data.nbytes for x in out.values() for s in x.addressable_shards)
    for n in list(shapes)[:3]:
        assert out[n].sharding == abstract[n].sharding and out[n].dtype == bf16, n
    return {
        "seconds": seconds,
        "array_bytes": arrays,
        "checkpoint_bytes": du(a.path),
        "rss_anon_peak_above_arrays": peak - base["RssAnon"] - arrays,
        "vm_hwm_increase": end["VmHWM"] - base["VmRSS"],
    }


def _dcp_rank(rank: int, world: int, port: int, out: str, gb: float, scratch: str) -> None:
    """One FSDP2 rank: its Shard(0) halves of the parameters and AdamW moments as DTensors over
    file-backed storage (so 16 GB of state does not need 16 GB of RAM), saved with DCP."""
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    shapes = dcp_shapes(gb)
    local = {n: (s[0] // world, *s[1:]) for n, s in shapes.items()}
    total = 3 * sum(int(np.prod(s)) for s in local.values())
    path = f"{scratch}.rank{rank}"
    rng = np.random.default_rng(rank)
    with open(path, "wb") as f:
        left = total
        while left:
            n = min(left, 16 * MiB)
            random_bits(rng, n, np.float32).tofile(f)
            left -= n
    flat = torch.from_file(path, shared=True, size=total, dtype=torch.float32)
    off = 0

    def take(name):
        nonlocal off
        s = local[name]
        n = int(np.prod(s))
        t = flat[off : off + n].view(s)
        off += n
        full = shapes[name]
        stride = tuple(int(np.prod(full[i + 1 :])) for i in range(len(full)))
        return DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=full, stride=stride)

    model, state = {}, {}
    for name in shapes:
        model[name] = take(name)
        state[name] = {"step": torch.tensor(1.0), "exp_avg": take(name), "exp_avg_sq": take(name)}
    group = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-4).param_groups[0]
    group = {k: v for k, v in group.items() if k != "params"} | {"params": list(shapes)}
    dcp.save(
        {"model": model, "optim": {"state": state, "param_groups": [group]}}, checkpoint_id=out
    )
    del model, state
    os.unlink(path)
    dist.destroy_process_group()


def child_dcp_gen(a) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    scratch = os.path.join(os.path.dirname(a.path), "scratch")
    mp.spawn(_dcp_rank, args=(2, port, a.path, a.gb, scratch), nprocs=2, join=True)
    shapes = dcp_shapes(a.gb)
    params = sum(int(__import__("math").prod(s)) for s in shapes.values())
    return {"checkpoint_bytes": du(a.path), "parameters": params, "tensors": 3 * len(shapes)}


STATUS = (
    "def _mem():\n"
    "    d = {}\n"
    "    for line in open('/proc/self/status'):\n"
    "        k, _, v = line.partition(':')\n"
    "        if k in ('VmHWM', 'RssAnon'):\n"
    "            d[k] = int(v.split()[0]) * 1024\n"
    "    return d\n"
)
JAX_UCP_CONVERT = STATUS + (
    "import sys, json\n"
    "import jax_ucp\n"
    "from jax_ucp.conversion import ImportOptions\n"
    "only = ImportOptions(weights_only=sys.argv[3:] == ['weights_only'])\n"
    "jax_ucp.convert(sys.argv[1], sys.argv[2], importing=only)\n"
    "print('MEM' + json.dumps(_mem()))\n"
)
TORCH_CONVERT = STATUS + (
    "import sys, json\n"
    "import torch\n"
    "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
    "dcp_to_torch_save(sys.argv[1], sys.argv[2])\n"
    "state = torch.load(sys.argv[2], weights_only=True)\n"
    "print('MEM' + json.dumps(_mem()))\n"
)


# ------------------------------------------------------------------------------ orchestration


def run_child(kind: str, contender: str, path: str, gb: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--contender", contender]
    cmd += ["--path", path, "--gb", str(gb)]
    env = dict(os.environ, PYTHONWARNINGS="ignore", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{kind} {contender} {gb} GB failed ({proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")  # fmt: skip
    return json.loads(lines[-1][len("RESULT ") :])


def convert_command(part: str, contender: str, src: str, dst: str) -> list[str]:
    """The command line of one convert contender (``src`` → ``dst``)."""
    py = [sys.executable]
    if contender.startswith("jax_ucp"):  # "jax_ucp.convert weights_only": the weights alone
        return py + ["-c", JAX_UCP_CONVERT, src, dst, *contender.split()[1:]]
    if contender == "ds_to_universal":  # the universal checkpoint: weights + optimizer state
        tag = open(os.path.join(src, "latest")).read().strip()
        return py + ["-m", "deepspeed.checkpoint.ds_to_universal", "--inject_missing_state",
                     "--input_folder", os.path.join(src, tag), "--output_folder", dst]  # fmt: skip
    if contender == "zero_to_fp32":  # consolidated fp32 weights only
        return py + ["-m", "deepspeed.utils.zero_to_fp32", src, dst]
    return py + ["-c", TORCH_CONVERT, src, dst]


def run_convert(part: str, contender: str, src: str, dst: str) -> dict:
    """One convert contender in its own process: seconds to durable output (exit + ``sync``) and
    to exit, peak RssAnon of the process tree (``rss.Peak``, 10 ms), the output's bytes."""
    sys.path.insert(0, HERE)
    import rss

    env = dict(os.environ, PYTHONWARNINGS="ignore", JAX_PLATFORMS="cpu", DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    evict(src)
    res = rss.run_measured(convert_command(part, contender, src, dst), env=env, cwd=ROOT)
    mem = [json.loads(x[3:]) for x in res["stdout"].splitlines() if x.startswith("MEM")]
    out = {
        "seconds": res["durable_s"],
        "seconds_to_exit": res["wall_s"],
        "rss_anon_peak": res["peak_rss_anon"],
        "output_bytes": du(dst) if os.path.isdir(dst) else os.path.getsize(dst),
    }
    if mem:
        out["vm_hwm"] = mem[0]["VmHWM"]
    return out


def key_of(rec: dict) -> tuple:
    return (rec["part"], rec["op"], rec["size_gb"], rec["contender"])


class Results:
    """docs/benchmark_scale.json: records keyed by (part, op, size, contender), merged across
    runs, written after every measurement so a long run leaves what it measured."""

    def __init__(self, path: str):
        self.path = path
        self.doc = {"records": []}
        self.rounds: dict = {}  # this run's measured rounds per key
        self.nrounds = 1
        if os.path.exists(path):
            with open(path) as f:
                self.doc = json.load(f)

    def add(self, rec: dict) -> None:
        self.doc["records"] = [r for r in self.doc["records"] if key_of(r) != key_of(rec)] + [rec]
        self.doc["host"] = {"cores": os.cpu_count(), "ram_gib": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GiB}  # fmt: skip
        with open(self.path, "w") as f:
            json.dump(self.doc, f, indent=1)


def data_bytes(rec: dict) -> int:
    """The bytes a rate is per: the arrays for save/restore of jax trees (Orbax's compressed files
    are smaller), the source checkpoint for an import or a safetensors restore."""
    return rec["array_bytes"] if rec["part"] == "jax" else rec["checkpoint_bytes"]


def rates(rec: dict) -> dict:
    """s/GB and GB/s of a record (recomputed, so records of older runs agree)."""
    b = data_bytes(rec) / GB
    return rec | {"bytes": b * GB, "s_per_gb": rec["seconds"] / b, "gb_per_s": b / rec["seconds"]}


def fits(part: str, op: str, contender: str, nbytes: float) -> tuple[bool, int, int]:
    factor, fixed = NEED[(part, op, contender)]
    need = int(factor * nbytes + fixed * GiB + MARGIN)
    avail = mem_available()
    return avail >= need, need, avail


def stamp(rec: dict) -> dict:
    rec["utc"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    rec["load"] = os.getloadavg()[0]
    return rec


def show(rec: dict) -> None:
    if rec.get("skipped"):
        print(f"  {rec['part']:4} {rec['op']:8} {rec['size_gb']:>4} GB {rec['contender']:32} "
              f"SKIPPED: {rec['skipped']}", flush=True)  # fmt: skip
        return
    mem = rec.get("rss_anon_peak_above_arrays", rec.get("rss_anon_peak"))
    mem = "       —" if mem is None else f"{mem / MiB:8.0f}"  # the disk: none measured
    print(f"  {rec['part']:4} {rec['op']:8} {rec['size_gb']:>4} GB {rec['contender']:32} "
          f"{rec['seconds']:8.1f} s  {rec['s_per_gb']:6.2f} s/GB  "
          f"{rec['gb_per_s']:6.3f} GB/s  RssAnon {mem} MiB  load {rec['load']:.1f}",
          flush=True)  # fmt: skip


MEMORY_KEYS = ("rss_anon_peak_above_arrays", "rss_anon_peak", "vm_hwm_increase", "vm_hwm")


def measure(results: Results, base: dict, fn, nbytes: int) -> None:
    """One round of one contender; with earlier rounds of the same key in this run, the record
    holds the median seconds (the mean of the middle two for an even count), every round's
    seconds, UTC time and load, and the largest memory peak of the rounds."""
    ok, need, avail = fits(base["part"], base["op"], base["contender"], nbytes)
    rec = dict(base)
    key = (base["part"], base["op"], base["size_gb"], base["contender"])
    done = results.rounds.setdefault(key, [])
    if not ok:
        rec["skipped"] = (
            f"needs ~{need / GiB:.1f} GiB (estimate), MemAvailable {avail / GiB:.1f} GiB"
        )
    else:
        try:
            rec.update(fn())
        except RuntimeError as e:
            rec["failed"] = str(e)[-1500:]
            print(rec["failed"], file=sys.stderr)
            rec["skipped"] = "failed (see 'failed')"
    stamp(rec)
    if not rec.get("skipped"):
        done.append(rec)
    earlier = next((r for r in results.doc["records"] if key_of(r) == key), None)
    if not done and earlier is not None and not earlier.get("skipped"):
        print(f"  ({key} skipped now: {rec['skipped']}; the earlier measurement stays)")
        return
    if done:  # a skipped round keeps the rounds measured before it
        rec = dict(done[-1])
        rec["seconds"] = statistics.median(r["seconds"] for r in done)
        for k in MEMORY_KEYS:
            if k in rec:
                rec[k] = max(r[k] for r in done)
        rec["rounds"] = [
            {"seconds": r["seconds"], "utc": r["utc"], "load": r["load"]} for r in done
        ]
        rec = rates(rec)
    results.add(rec)
    show(rec)


def disk_free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_disk(where: str, need: float) -> None:
    free = disk_free(where)
    print(f"  disk free {free / GB:.1f} GB (need ~{need / GB:.1f}); MemAvailable "
          f"{mem_available() / GiB:.1f} GiB", flush=True)  # fmt: skip
    if free < need + 5 * GB:
        raise SystemExit(f"not enough disk under {where}: {free / GB:.1f} GB free")


def part_jax(results: Results, work: str, gb: float, contenders) -> None:
    nbytes = max(1, round(gb * GB / (64 * MiB))) * 64 * MiB
    check_disk(work, 1.2 * nbytes)
    for _ in range(results.nrounds):  # rounds outermost: the contenders alternate under one load
        for c in contenders:
            path = os.path.join(work, "jax_" + c.replace(" ", "_"))
            for op in ("save", "restore"):
                base = {"part": "jax", "op": op, "size_gb": gb, "contender": c}
                if c == "disk":
                    fn = lambda: disk_io(op, path, nbytes)
                else:
                    fn = lambda: run_child(f"jax-{op}", c, path, gb)
                measure(results, base, fn, nbytes)
                if op == "save" and not os.path.isdir(path):
                    break
            shutil.rmtree(path, ignore_errors=True)


def no_folder() -> dict:
    raise RuntimeError("memory freed between the checks; no folder was written")


def part_hf(results: Results, work: str, gb: float, contenders) -> None:
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    shapes = llama8b_shapes(gb)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    nbytes = sum(int(np.prod(s)) * 2 for s in shapes.values())
    if not any(fits("hf", "restore", c, nbytes)[0] for c in contenders):  # no folder for nothing
        for c in contenders:
            base = {"part": "hf", "op": "restore", "size_gb": gb, "contender": c}
            measure(results, base, no_folder, nbytes)
        return
    check_disk(work, nbytes)
    folder = os.path.join(work, "hf")
    os.makedirs(folder)
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    names, weight_map, k, acc, part = list(shapes), {}, 1, 0, {}
    for i, n in enumerate(names):  # 4 shards of ~equal bytes, in order, as save_pretrained
        part[n] = random_bits(rng, int(np.prod(shapes[n])), bf16).reshape(shapes[n])
        acc += part[n].nbytes
        if acc >= k * nbytes / 4 or i == len(names) - 1:
            file = f"model-{k:05d}-of-00004.safetensors"
            save_file(part, os.path.join(folder, file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, file))
            part, k = {}, k + 1
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": nbytes}, "weight_map": weight_map}, f)
    os.sync()
    print(f"  wrote {folder}: {len(shapes)} tensors, {nbytes / GB:.2f} GB bf16 in {k - 1} "
          f"files ({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    del part
    for _ in range(results.nrounds):
        for c in contenders:
            base = {"part": "hf", "op": "restore", "size_gb": gb, "contender": c}
            measure(results, base, lambda: run_child("hf-restore", c, folder, gb), nbytes)
    shutil.rmtree(folder, ignore_errors=True)


def part_dcp(results: Results, work: str, gb: float, contenders) -> None:
    import math

    nbytes = int(sum(math.prod(s) for s in dcp_shapes(gb).values()) * 12)
    check_disk(work, 2.1 * nbytes)  # the ranks' scratch + the checkpoint, or it + the output
    src = os.path.join(work, "dcp")
    t0 = time.perf_counter()
    gen = run_child("dcp-gen", "-", src, gb)
    print(f"  wrote {src}: {gen['parameters'] / 1e9:.2f}B parameters, {gen['tensors']} tensors, "
          f"{gen['checkpoint_bytes'] / GB:.2f} GB ({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    convert_all(results, "dcp", gb, contenders, src, gen["checkpoint_bytes"])


def convert_all(results: Results, part: str, gb: float, contenders, src: str, nbytes: int) -> None:
    """Every convert contender on ``src`` (rounds outermost), each output deleted after; then
    ``src``."""
    work = os.path.dirname(src)
    for c in [c for _ in range(results.nrounds) for c in contenders]:
        dst = os.path.join(work, "full.pt" if "torch.load" in c else "out_" + c.replace(" ", "_"))
        base = {"part": part, "op": "convert", "size_gb": gb, "contender": c}
        meas = lambda: run_convert(part, c, src, dst) | {"checkpoint_bytes": nbytes}
        measure(results, base, meas, nbytes)
        if os.path.isdir(dst):
            shutil.rmtree(dst, ignore_errors=True)
        elif os.path.exists(dst):
            os.unlink(dst)
    shutil.rmtree(src, ignore_errors=True)


def ds_model(gb: float) -> dict:
    """tools/fixtures/ds_train.py's GPT (LayerNorm, GELU MLP 4x, learned positions, biases),
    hidden 1536, 12 heads, vocab 32000, untied head, the layer count the smallest that makes the
    ZeRO-3 bf16 checkpoint (fp32 masters + 2 Adam moments: 12 bytes per parameter) >= ``gb`` GB.
    The bf16 weights themselves are not in a ZeRO-3 checkpoint (params + masters + moments = 14
    bytes per parameter)."""
    w, v, seq = 1536, 32000, 16
    fixed = 2 * v * w + v + seq * w + 2 * w
    per_layer = 12 * w * w + 13 * w
    layers = max(1, math.ceil((gb * GB / 12 - fixed) / per_layer))
    return {"width": w, "vocab": v, "seq": seq, "heads": 12, "layers": layers,
            "parameters": fixed + layers * per_layer}  # fmt: skip


def mcore_model(gb: float) -> dict:
    """megatron-core Llama (``make_megatron_fixtures.py``'s MCORE_BENCH_SIZE: RMSNorm, SwiGLU
    4096, 24 heads in 4 query groups, RoPE) of hidden 1536, vocab 32000, untied, bf16 with fp32
    masters; the layer count the smallest that makes the ``dp_reshardable`` checkpoint (bf16
    weights + fp32 masters + 2 Adam moments: 14 bytes per parameter) >= ``gb`` GB."""
    h, v, f, kv = 1536, 32000, 4096, 4 * 64
    fixed = 2 * v * h + h
    per_layer = 2 * h * h + 2 * kv * h + 3 * f * h + 2 * h
    layers = max(1, math.ceil((gb * GB / 14 - fixed) / per_layer))
    return {"hidden": h, "vocab": v, "layers": layers, "parameters": fixed + layers * per_layer}


def generate(results, part: str, gb: float, contenders, cmd: list[str], env: dict, need: int):
    """Runs a generator (niced: it is not measured), or records every contender as skipped when
    its estimated peak ``need`` does not fit. True when it ran."""
    avail = mem_available()
    if avail < need + MARGIN:
        why = (f"generating the checkpoint needs ~{(need + MARGIN) / GiB:.1f} GiB (estimate, "
               f"with the {MARGIN / GiB:.0f} GiB margin), MemAvailable {avail / GiB:.1f} GiB")  # fmt: skip
        for c in contenders:
            rec = {"part": part, "op": "convert", "size_gb": gb, "contender": c, "skipped": why}
            earlier = next((r for r in results.doc["records"] if key_of(r) == key_of(rec)), None)
            if earlier is None or earlier.get("skipped"):  # never replaces a measurement
                results.add(stamp(rec))
            show(rec)
        return False
    sys.path.insert(0, HERE)
    import rss

    env = dict(os.environ, PYTHONWARNINGS="ignore", **env)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    res = rss.run_measured(["nice", "-n", "19", *cmd], env=env, cwd=ROOT)
    print(f"  generated in {res['wall_s']:.0f} s, peak RssAnon (all ranks) "
          f"{res['peak_rss_anon'] / GiB:.1f} GiB", flush=True)  # fmt: skip
    return True


def part_zero3(results: Results, work: str, gb: float, contenders) -> None:
    """A DeepSpeed ZeRO-3 bf16 checkpoint written by DeepSpeed itself (2 gloo ranks on CPU, one
    Adam step of ``tools/fixtures/ds_train.py``) → jax_ucp.convert vs ``ds_to_universal`` (the
    universal checkpoint: weights + optimizer state) vs ``zero_to_fp32`` (fp32 weights only)."""
    m = ds_model(gb)
    nbytes = 12 * m["parameters"]
    check_disk(work, 2.2 * nbytes)  # the checkpoint + the universal one (fp32 + 2 moments)
    out = os.path.join(work, "ds")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), os.path.join(ROOT, "tools/fixtures/ds_train.py"),
           "--out", out, "--stage", "3", "--dtype", "bf16", "--steps", "1", "--no-next", "--mb",
           "1", "--vocab", str(m["vocab"]), "--width", str(m["width"]), "--layers",
           str(m["layers"]), "--heads", str(m["heads"]), "--seq", str(m["seq"])]  # fmt: skip
    # per rank: the whole fp32 model (ds_train.py builds it before DeepSpeed partitions it), its
    # bf16 half, fp32 masters, moments and gradients of its half, and the save's copies: measured
    # 12.7-13.3 GiB over both ranks for a 4.24 GB checkpoint (~3.4x)
    if not generate(results, "zero3", gb, contenders, cmd, {"DS_ACCELERATOR": "cpu"},
                    int(3.4 * nbytes)):  # fmt: skip
        return
    src = os.path.join(out, "ckpt")
    size = du(src)
    print(f"  wrote {src}: {m['parameters'] / 1e6:.0f}M parameters ({m['layers']} layers), "
          f"{size / GB:.2f} GB", flush=True)  # fmt: skip
    convert_all(results, "zero3", gb, contenders, src, size)
    shutil.rmtree(out, ignore_errors=True)


def part_megatron(results: Results, work: str, gb: float, contenders) -> None:
    """A megatron-core torch_dist checkpoint with the distributed optimizer as ``dp_reshardable``
    (Megatron-LM's default), written by megatron-core itself (2 gloo ranks, DP=2, bf16, one Adam
    step on synthetic gradients, the fully parallel save; ``tools/fixtures/
    make_megatron_fixtures.py``) → jax_ucp.convert vs ``dcp_to_torch_save`` + ``torch.load``."""
    m = mcore_model(gb)
    nbytes = 14 * m["parameters"]
    check_disk(work, 2.2 * nbytes)
    src = os.path.join(work, "mcore")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "megatron-gen", "--path", src,
           "--gb", str(gb)]  # fmt: skip
    env = {"MCORE_BENCH_SIZE": "1", "MCORE_BENCH_HIDDEN": str(m["hidden"]),
           "MCORE_BENCH_LAYERS": str(m["layers"]), "MCORE_DISTOPT_SHARDING": "dp_reshardable",
           "MCORE_FULLY_PARALLEL": "1", "MCORE_DDP_BUCKET_SIZE": "40000000"}  # fmt: skip
    # per rank: fp32 init, bf16 weights, fp32 grad buffer, masters and moments of its half
    if not generate(results, "megatron", gb, contenders, cmd, env, int(2.4 * nbytes + GiB)):
        return
    size = du(src)
    print(f"  wrote {src}: {m['parameters'] / 1e6:.0f}M parameters ({m['layers']} layers), "
          f"{size / GB:.2f} GB", flush=True)  # fmt: skip
    convert_all(results, "megatron", gb, contenders, src, size)


def child_megatron_gen(a) -> dict:
    sys.path.insert(0, os.path.join(ROOT, "tools", "fixtures"))
    from pathlib import Path

    import make_megatron_fixtures as mf

    cfg = dict(kind="llama", tp=1, pp=1, ep=1, tied=False, world=2, bf16=True)
    mf.run_config(cfg, Path(a.path), "distopt")
    return {"checkpoint_bytes": du(a.path)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------------------ plot


def plot(path_json: str = JSON, path_png: str = PNG) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path_json) as f:
        recs = [rates(r) for r in json.load(f)["records"] if not r.get("skipped")]
    panels = [("jax", "save"), ("jax", "restore"), ("hf", "restore"), ("dcp", "convert"),
              ("zero3", "convert"), ("megatron", "convert")]  # fmt: skip
    fig, axes = plt.subplots(2, len(panels), figsize=(25, 7.5))
    for j, (part, op) in enumerate(panels):
        mine = [r for r in recs if r["part"] == part and r["op"] == op]
        others = iter(("tab:orange", "tab:green", "tab:red"))
        for c in sorted({r["contender"] for r in mine}, key=lambda c: not c.startswith("jax")):
            rs = sorted((r for r in mine if r["contender"] == c), key=lambda r: r["size_gb"])
            xs = [r["bytes"] / GB for r in rs]
            ours = c.startswith("jax_ucp")
            style = {"marker": "o" if ours else "s", "linestyle": "-" if ours else "--"}
            style["color"] = "tab:blue" if ours else next(others)
            axes[0, j].plot(xs, [r["s_per_gb"] for r in rs], label=c, **style)
            key = "rss_anon_peak" if op == "convert" else "rss_anon_peak_above_arrays"
            if all(key in r for r in rs):  # not the disk: no memory measured
                axes[1, j].plot(xs, [max(r[key], 0) / MiB for r in rs], label=c, **style)
        axes[0, j].set_ylim(bottom=0)
        axes[0, j].set_title(f"{part} {op}: seconds per GB")
        axes[1, j].set_title(
            f"{part} {op}: peak RssAnon (MiB)" + ("" if op == "convert" else " above arrays")
        )
        for ax in axes[:, j]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("checkpoint GB")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        axes[1, j].set_yscale("symlog", linthresh=100)
        axes[1, j].set_ylim(bottom=0)
    fig.suptitle("bench_scale.py: cost per GB and memory as the checkpoint grows (2 cores, shared)")
    fig.tight_layout()
    fig.savefig(path_png, dpi=100)
    print(f"wrote {path_png}")


# the jax_ucp contender each other contender is timed against (default: plain jax_ucp)
PAIRS = {"zero_to_fp32": "jax_ucp.convert weights_only"}


def ours_for(r: dict) -> str:
    if r["contender"] in PAIRS:
        return PAIRS[r["contender"]]
    return "jax_ucp" if r["part"] in ("jax", "hf") else "jax_ucp.convert"


def table(path_json: str = JSON) -> str:
    """The markdown table of docs/BENCHMARKS.md and the goals, from the JSON."""
    with open(path_json) as f:
        recs = [r if r.get("skipped") else rates(r) for r in json.load(f)["records"]]
    order = {"jax": 0, "dcp": 1, "hf": 2, "zero3": 3, "megatron": 4}
    recs.sort(key=lambda r: (order[r["part"]], r["op"] != "save", r["size_gb"], r["contender"]))
    ours = {key_of(r): r for r in recs if r["contender"].startswith("jax_ucp") and not r.get("skipped")}  # fmt: skip
    disks = {key_of(r)[:3]: r for r in recs if r["contender"] == "disk" and not r.get("skipped")}
    lines = [
        "| part | op | size | contender | GB | s (median) | rounds (s) | s/GB | GB/s | % of disk GB/s | peak RssAnon MiB | × jax_ucp time | UTC, load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in recs:
        head = f"| {r['part']} | {r['op']} | {r['size_gb']} | {r['contender']} |"
        if r.get("skipped"):
            lines.append(
                f"{head} — | — | — | — | — | | skipped: {r['skipped']} | | "
                f"{r['utc'][11:]}, {r['load']:.0f} |"
            )
            continue
        mem = r.get("rss_anon_peak_above_arrays", r.get("rss_anon_peak"))
        mem = "—" if mem is None else f"{mem / MiB:.0f}"  # the disk: none measured
        mine = ours.get((r["part"], r["op"], r["size_gb"], ours_for(r)))
        theirs = mine is not None and not r["contender"].startswith("jax_ucp")
        ratio = f"{r['seconds'] / mine['seconds']:.2f}" if theirs else ""
        disk = disks.get(key_of(r)[:3])
        of_disk = f"{100 * r['gb_per_s'] / disk['gb_per_s']:.0f} %" if disk else ""
        rounds = r.get("rounds") or [r]
        when = ", ".join(f"{x['utc'][11:]} ({x['load']:.0f})" for x in rounds)
        each = ", ".join(f"{x['seconds']:.1f}" for x in rounds)
        lines.append(
            f"{head} {r['bytes'] / GB:.2f} | {r['seconds']:.1f} | {each} | {r['s_per_gb']:.2f} | "
            f"{r['gb_per_s']:.3f} | {of_disk} | {mem} | {ratio} | {when} |"
        )
    lines.append("")
    for (part, op, size), d in sorted(disks.items()):
        mine = ours.get((part, op, size, "jax_ucp"))
        if mine is not None:
            way = "written + fdatasync" if op == "save" else "read cold"
            lines.append(
                f"- jax_ucp {part} {op} at {size} GB: {mine['gb_per_s']:.3f} GB/s = "
                f"{100 * mine['gb_per_s'] / d['gb_per_s']:.0f} % of the disk's {d['gb_per_s']:.3f} "
                f"GB/s (the same bytes {way}, sequentially; goal ≥ 80 %)"
            )
    groups: dict = {}
    for r in ours.values():
        groups.setdefault((r["part"], r["op"], r["contender"]), []).append(r)
    for (part, op, c), rs in groups.items():
        rs.sort(key=lambda r: r["size_gb"])
        key = "rss_anon_peak" if op == "convert" else "rss_anon_peak_above_arrays"
        lo, hi = rs[0], rs[-1]
        lin = f"{hi['s_per_gb'] / lo['s_per_gb']:.2f}" if lo is not hi else "—"
        lines.append(
            f"- {c} {part} {op}: s/GB at {hi['size_gb']} GB / at {lo['size_gb']} GB = {lin} "
            f"(goal ≤ 1.15); peak RssAnon{'' if op == 'convert' else ' above arrays'} "
            + " → ".join(f"{r[key] / MiB:.0f}" for r in rs)
            + " MiB at "
            + " / ".join(str(r["size_gb"]) for r in rs)
            + " GB"
        )
    return "\n".join(lines)


def main() -> int:
    global MARGIN
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,4,16", help="GB of checkpoint, comma-separated")
    ap.add_argument("--parts", default="jax,dcp,hf")
    ap.add_argument("--contenders", default=None, help="only these (comma-separated names)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds per contender (median kept)")
    ap.add_argument("--margin-gib", type=float, default=MARGIN / GiB,
                    help="MemAvailable to leave beside a measurement's estimated peak")  # fmt: skip
    ap.add_argument("--dir", default="/tmp/ucp_scale")
    ap.add_argument("--json", default=JSON)
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON")
    ap.add_argument("--table", action="store_true", help="print the markdown table from the JSON")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--contender", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--gb", type=float, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        fn = {"jax-save": child_jax, "jax-restore": child_jax, "hf-restore": child_hf,
              "dcp-gen": child_dcp_gen, "megatron-gen": child_megatron_gen}[a.child]  # fmt: skip
        print("RESULT " + json.dumps(fn(a)), flush=True)
        return 0
    png = os.path.splitext(a.json)[0] + ".png"
    if a.table:
        print(table(a.json))
        return 0
    if a.plot_only:
        plot(a.json, png)
        return 0
    MARGIN = int(a.margin_gib * GiB)
    # this process and every measurement it starts are the kernel's first choice when memory runs
    # out, so a wrong estimate costs this run, not the other jobs sharing the host
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    only = set(a.contenders.split(",")) if a.contenders else None
    pick = lambda cs: [c for c in cs if only is None or c in only]
    results = Results(a.json)
    results.nrounds = a.rounds
    results.doc["command"] = "python " + " ".join(sys.argv)
    for gb in [float(s) if "." in s else int(s) for s in a.sizes.split(",")]:
        for part in a.parts.split(","):
            work = os.path.join(a.dir, f"{part}_{gb}")
            shutil.rmtree(work, ignore_errors=True)
            os.makedirs(work)
            print(f"[{part} {gb} GB] {time.strftime('%H:%M:%S', time.gmtime())} UTC, load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
            try:
                parts = {"jax": part_jax, "dcp": part_dcp, "hf": part_hf, "zero3": part_zero3,
                         "megatron": part_megatron}  # fmt: skip
                parts[part](results, work, gb, pick(CONTENDERS[part]))
            finally:
                shutil.rmtree(work, ignore_errors=True)
    plot(a.json, png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
