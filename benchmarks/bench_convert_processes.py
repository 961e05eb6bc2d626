"""Benchmark: ``jax-ucp convert`` with 1, 2, 4 processes on the same checkpoint, side by side
(alternating rounds, medians), with DeepSpeed's own ``ds_to_universal`` for a DeepSpeed one.

Each command runs in its own process tree; wall time to exit and to durable output (exit +
``sync``), and memory sampled from /proc every 20 ms: the peak of the tree's summed RssAnon and
the largest single process's peak RssAnon (what each host of a multi-host conversion needs).
Every run starts after a ``sync`` with the input in the page cache.

    python benchmarks/bench_convert_processes.py --deepspeed /tmp/dsbench/gpt162m/ckpt \\
        --megatron /tmp/big/llama_distopt_bf16_tp2dp2 --vocab-size 32000 --rounds 3 \\
        --json docs/benchmark_convert_processes.json

Make the checkpoints first (a few minutes each on CPU):

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tools/fixtures/ds_train.py \\
        --out /tmp/dsbench/gpt162m --stage 2 --dtype bf16 --vocab 50257 --width 768 --layers 12 \\
        --heads 12 --seq 64 --mb 1 --steps 1 --no-next
    MCORE_BENCH_SIZE=1 MCORE_DISTOPT_SHARDING=dp_reshardable MCORE_DDP_BUCKET_SIZE=40000000 \\
        python tools/fixtures/make_megatron_fixtures.py --out /tmp/big llama_distopt_bf16_tp2dp2
    python -c "import transformers as t; t.GPT2LMHeadModel(t.GPT2Config(n_embd=1024,
        n_layer=12, n_head=16)).save_pretrained('/tmp/hf/gpt2_203m')"

and pass ``--safetensors /tmp/hf/gpt2_203m`` for a Hugging Face model (one model.safetensors).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import rss  # noqa: E402
from bench_deepspeed_convert import tag_dir  # noqa: E402


def run_measured(cmd: list[str], env: dict) -> dict:
    """Wall times and peak RssAnon (tree total, and the largest process) of ``cmd``."""
    res = rss.run_measured(cmd, env=env, cwd=ROOT)
    return {
        "wall_s": res["wall_s"],
        "durable_s": res["durable_s"],
        "peak_rss_anon_total": res["peak_rss_anon"],
        "peak_rss_anon_process": res["peak_rss_anon_process"],
    }


def warm(path: str) -> None:
    for d, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                while fh.read(1 << 24):
                    pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deepspeed", help="a DeepSpeed checkpoint folder (with 'latest')")
    ap.add_argument("--megatron", help="a Megatron checkpoint folder")
    ap.add_argument("--vocab-size", type=int, help="the Megatron checkpoint's vocab size")
    ap.add_argument("--safetensors", help="a Hugging Face model folder (model.safetensors)")
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-ds", action="store_true", help="without ds_to_universal")
    ap.add_argument("--json")
    a = ap.parse_args()
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cli = [sys.executable, "-m", "jax_ucp.cli", "convert"]
    sources = []
    if a.deepspeed:
        sources.append(("deepspeed", a.deepspeed, []))
    if a.megatron:
        extra = ["--vocab-size", str(a.vocab_size)] if a.vocab_size else []
        sources.append(("megatron", a.megatron, extra))
    if a.safetensors:
        sources.append(("safetensors", a.safetensors, []))
    report = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "results": []}
    for fmt, src, extra in sources:
        commands = {}
        for n in a.processes:
            flag = ["--processes", str(n)] if n > 1 else []
            commands[f"jax_ucp, {n} process{'es' if n > 1 else ''}"] = [
                *cli,
                fmt,
                src,
                "{out}",
                *extra,
                *flag,
            ]
        if fmt == "deepspeed" and not a.skip_ds:
            commands["ds_to_universal (defaults)"] = [
                sys.executable,
                "-m",
                "deepspeed.checkpoint.ds_to_universal",
                "--inject_missing_state",
                "--input_folder",
                tag_dir(src),
                "--output_folder",
                "{out}",
            ]
        tmp = tempfile.mkdtemp(prefix="bench_procs_")
        runs: dict[str, list[dict]] = {k: [] for k in commands}
        try:
            for i in range(a.rounds):
                for k, cmd in commands.items():
                    out = os.path.join(tmp, "out")
                    shutil.rmtree(out, ignore_errors=True)
                    warm(src)
                    runs[k].append(run_measured([c.replace("{out}", out) for c in cmd], env))
                print(
                    f"{fmt} round {i + 1}: "
                    + ", ".join(f"{k} {v[-1]['wall_s']:.2f} s" for k, v in runs.items()),
                    flush=True,
                )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
        one = med[next(iter(med))]["durable_s"]
        mb = 2**20
        print(f"\n{fmt}: {src} (medians of {a.rounds} alternating rounds)")
        print(
            f"  {'':28}{'exit s':>8}{'durable s':>11}{'vs 1 proc':>11}{'RssAnon total':>15}{'per process':>13}"
        )
        for k, v in med.items():
            print(
                f"  {k:28}{v['wall_s']:8.2f}{v['durable_s']:11.2f}{one / v['durable_s']:10.2f}x"
                f"{v['peak_rss_anon_total'] / mb:12.0f} MiB{v['peak_rss_anon_process'] / mb:9.0f} MiB"
            )
        report["results"].append({"format": fmt, "checkpoint": src, "medians": med, "runs": runs})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
