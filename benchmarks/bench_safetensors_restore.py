"""Hugging Face safetensors -> sharded jax.Arrays on a 2x4 mesh (8 CPU devices), side by side:

* Orbax v1: ``ocp.load(folder, abstract)`` with ``checkpoint_layout=SAFETENSORS`` (Orbax 0.12's
  safetensors layout: each process reads the byte ranges its devices need);
* jax_ucp convert + restore: ``jax_ucp.convert(folder, ucp)`` (a full, durable copy) then
  ``jax_ucp.restore(ucp, target=...)``;
* jax_ucp direct: ``jax_ucp.restore(folder, target=...)`` (no copy on disk).

The folder is a ~0.5 GB bf16 Llama-like model (GQA, untied head) in two shards with
``model.safetensors.index.json``, written by the ``safetensors`` package. Two layouts:

* ``tp``: Megatron-style tensor parallelism on the ``model`` axis: column-parallel weights
  (q/k/v, gate/up, embedding, lm_head) split on dim 0, row-parallel (o_proj, down_proj) on dim 1,
  norms replicated (the ``data`` axis replicates everything);
* ``dim0``: every weight split on dim 0 over ``model``;
* ``hf_llama`` (opt-in): through the ``hf_llama`` spec onto the flax ``TransformerLM`` tree (q/k/v
  merged, gate|up concatenated, kernels transposed), the same TP split on ``[in, out]`` kernels;
  jax_ucp only (Orbax reads safetensors as they are).

Contenders alternate within each round; medians over rounds are printed with the ratios. The
input is in the page cache (``--cold``: evicted before every load, and the converted copy before
its restore). Every result is checked equal, element for element and sharding for sharding, to
Orbax's in the first round.

    python benchmarks/bench_safetensors_restore.py [--gb 0.5] [--rounds 5] [--cold] [--json out.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import datetime
import json
import shutil
import statistics
import tempfile
import time

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint.experimental.v1 as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

import jax_ucp
from jax_ucp.language import TensorInfo, compile_restore_plan, load_spec
from jax_ucp.models import LMConfig

BF16 = np.dtype(ml_dtypes.bfloat16)
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROW = ("o_proj", "down_proj")


def llama_shapes(gb: float) -> dict[str, tuple[int, ...]]:
    """Llama-like shapes (hidden 1024, 16 heads of 64, 4 KV heads, MLP 2816, vocab 32000) with
    as many layers as make ~``gb`` GB in bf16."""
    h, kv, f, v = 1024, 256, 2816, 32000
    shapes = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
    }
    fixed = 2 * v * h + h
    per_layer = 2 * h * h + 2 * kv * h + 3 * f * h + 2 * h
    layers = max(1, round((gb * 1e9 / 2 - fixed) / per_layer))
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (h, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, h)
        shapes[p + "mlp.gate_proj.weight"] = (f, h)
        shapes[p + "mlp.up_proj.weight"] = (f, h)
        shapes[p + "mlp.down_proj.weight"] = (h, f)
    return shapes


def write_folder(folder: str, shapes: dict) -> int:
    """Two shards and the index, as ``save_pretrained`` lays them out."""
    rng = np.random.default_rng(0)
    names = list(shapes)
    half = len(names) // 2
    weight_map, total = {}, 0
    for k, part in enumerate((names[:half], names[half:])):
        file = f"model-{k + 1:05d}-of-00002.safetensors"
        tensors = {}
        for n in part:
            tensors[n] = (rng.standard_normal(shapes[n], dtype=np.float32) * 0.02).astype(BF16)
            weight_map[n] = file
            total += tensors[n].nbytes
        save_file(tensors, os.path.join(folder, file))
        del tensors
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def spec_for(name: str, ndim: int, layout: str) -> P:
    if ndim == 1:
        return P()
    if layout == "dim0" or any(c in name for c in COLUMN):
        return P("model", None)
    assert any(r in name for r in ROW), name
    return P(None, "model")


def llama_spec(shapes):
    layers = sum(1 for n in shapes if n.endswith("q_proj.weight"))
    config = {"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4,
              "num_hidden_layers": layers, "intermediate_size": 2816, "vocab_size": 32000}  # fmt: skip
    return load_spec("hf_llama", **LMConfig.from_hf_llama(config).head_settings)


def flax_spec(name: str, shape) -> P:
    """Megatron TP on flax [in, out] kernels: column-parallel (qkv, fc1, lm_head) on dim 1,
    row-parallel (attn proj, fc2) and the embedding on dim 0."""
    if len(shape) == 1:
        return P()
    if "qkv" in name or "fc1" in name or "lm_head" in name:
        return P(None, "model")
    return P("model", None)


def nest(flat_tree: dict) -> dict:
    out: dict = {}
    for name, leaf in flat_tree.items():
        *path, last = name.split("/")
        node = out
        for c in path:
            node = node.setdefault(c, {})
        node[last] = leaf
    return out


def flat(tree, spec) -> dict:
    if spec is None:
        return tree["params"]
    return {
        "/".join(str(k.key) for k in path): x
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def evict(path: str) -> None:
    for d, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def ready(tree):
    jax.block_until_ready(tree)
    return tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--layouts", default="tp,dim0", help="tp, dim0, hf_llama (through the spec; no Orbax)"
    )
    ap.add_argument("--cold", action="store_true", help="evict the files before every load")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="st_bench_", dir=args.dir)
    folder = os.path.join(work, "hf")
    os.makedirs(folder)
    shapes = llama_shapes(args.gb)
    total = write_folder(folder, shapes)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    print(
        f"{len(shapes)} tensors, {total / 1e9:.3f} GB bf16 in 2 files; mesh {dict(mesh.shape)}; "
        f"{'cold' if args.cold else 'warm'} page cache; jax {jax.__version__}, "
        f"orbax {__import__('orbax.checkpoint').checkpoint.__version__}, {os.cpu_count()} cores"
    )
    ctx = ocp.Context()  # Orbax's documented way to load safetensors
    ctx.checkpoint_layout = ocp.options.CheckpointLayout.SAFETENSORS
    results = {}
    try:
        for layout in args.layouts.split(","):
            spec = llama_spec(shapes) if layout == "hf_llama" else None
            if spec is None:
                abstract = {
                    n: jax.ShapeDtypeStruct(
                        s, BF16, sharding=NamedSharding(mesh, spec_for(n, len(s), layout))
                    )
                    for n, s in shapes.items()
                }
                target = {"params": abstract}
            else:  # the flax TransformerLM tree the spec makes, Megatron TP on [in, out] kernels
                saved = {("params", n): TensorInfo(s, BF16) for n, s in shapes.items()}
                plans = compile_restore_plan(spec, saved)
                abstract = {
                    "/".join(k): jax.ShapeDtypeStruct(
                        p.shape, BF16, sharding=NamedSharding(mesh, flax_spec("/".join(k), p.shape))
                    )
                    for k, p in plans.items()
                }
                target = nest(abstract)
            ucp = os.path.join(work, "ucp")

            def orbax_v1():
                with ctx:
                    return ready(ocp.load(folder, abstract))

            def convert_restore():
                shutil.rmtree(ucp, ignore_errors=True)
                jax_ucp.convert(folder, ucp)
                if args.cold:
                    evict(ucp)
                return flat(ready(jax_ucp.restore(ucp, target=target, spec=spec)), spec)

            def direct():
                return flat(ready(jax_ucp.restore(folder, target=target, spec=spec)), spec)

            contenders = {
                "orbax_v1": orbax_v1,
                "convert_restore": convert_restore,
                "direct": direct,
            }
            if spec is not None:  # Orbax reads safetensors as they are: no renames/merges
                del contenders["orbax_v1"]
            times = {k: [] for k in contenders}
            for r in range(args.rounds):
                reference = None
                for name, fn in contenders.items():
                    if args.cold:
                        evict(folder)
                    t0 = time.perf_counter()
                    out = fn()
                    times[name].append(time.perf_counter() - t0)
                    if r == 0:  # every contender's arrays equal, with the asked shardings
                        if reference is None:
                            reference = out
                        for n, a in abstract.items():
                            x, y = out[n], reference[n]
                            assert x.sharding == a.sharding and x.dtype == BF16, (name, n)
                            for sx, sy in zip(x.addressable_shards, y.addressable_shards):
                                assert sx.index == sy.index, (name, n)
                                assert np.array_equal(
                                    np.asarray(sx.data).view(np.uint16),
                                    np.asarray(sy.data).view(np.uint16),
                                ), (name, n)
                    del out
            med = {k: statistics.median(v) for k, v in times.items()}
            results[layout] = {"median_s": med, "all_s": times}
            print(f"\n[{layout}] median of {args.rounds} rounds (s):")
            for k, v in med.items():
                print(f"  {k:16s} {v:7.3f}   ({', '.join(f'{t:.3f}' for t in times[k])})")
            ratios = (
                f"  ratios: direct vs convert_restore {med['convert_restore'] / med['direct']:.2f}x"
            )
            if "orbax_v1" in med:
                ratios += (
                    f", direct vs orbax_v1 {med['orbax_v1'] / med['direct']:.2f}x, "
                    f"convert_restore vs orbax_v1 {med['orbax_v1'] / med['convert_restore']:.2f}x"
                )
            print(ratios)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "date": datetime.date.today().isoformat(),
                    "gb": total / 1e9,
                    "cold": args.cold,
                    "rounds": args.rounds,
                    "results": results,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
