"""Benchmark: peak anonymous memory of every importer and exporter under ``memory_budget``.

Each conversion runs in a fresh process (``--child``) that samples its own /proc/self/status
RssAnon from a thread every 5 ms (``rss.Peak``) around ``jax_ucp.convert(src, dst,
memory_budget=B)`` or ``jax_ucp.export(ucp, dst, SafetensorsExport(memory_budget=B))`` (or another format's options), after importing
jax_ucp (the baseline; Orbax and JAX too for an Orbax source or target, whose import
loads them). Printed per case: the budget, the baseline, the peak RssAnon (absolute,
and over the baseline), the time, and whether peak <= budget + 64 MiB (issue 26 item 4; judged
on the absolute peak, the stricter reading). Input in the page cache; memory-mapped checkpoint
pages are file-backed (RssFile), not charged.

    python benchmarks/bench_import_memory.py --budget 64MiB,128MiB,256MiB \\
        --case safetensors=/tmp/h7/hf/gpt2_203m --case torch_save=/tmp/h7/hf/gpt2_203m_bin \\
        --case dcp=/tmp/tbench/fsdp2_134m --case deepspeed=/tmp/h7/ds/gpt110m/ckpt \\
        --case megatron=/tmp/h7/mg/llama_distopt_bf16_tp2dp2 ... --export --json out.json

A case is ``name=path`` (the format is detected); ``--export`` also exports the first case's
conversion to every target. ``--vocab-size`` is passed to Megatron cases. ``--budget`` takes a
comma-separated list (default 64, 128 and 256 MiB): every case runs at each, and a last table
gives peak RssAnon per case and budget against budget + 64 MiB.

The checkpoints (>= 100M parameters each; torch in /work/venv-torch):

    python benchmarks/bench_torch_import.py --generate /tmp/tbench          # torch DCP, 134M
    python -c "import transformers as t; m = t.GPT2LMHeadModel(t.GPT2Config(n_embd=1024,
        n_layer=12, n_head=16)); m.save_pretrained('/tmp/h7/hf/gpt2_203m');
        m.save_pretrained('/tmp/h7/hf/gpt2_203m_bin', safe_serialization=False,
        max_shard_size='10GB')"                                            # safetensors, .bin
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tools/fixtures/ds_train.py \
        --out /tmp/h7/ds/gpt110m --stage 2 --dtype bf16 --vocab 16001 --width 768 --layers 12 \
        --heads 12 --seq 64 --mb 1 --steps 1 --no-next                     # DeepSpeed ZeRO-2
        # (--stage 1 and --stage 3, the same otherwise: DeepSpeed ZeRO-1 and ZeRO-3)
    python -m deepspeed.checkpoint.ds_to_universal --input_folder \
        /tmp/h7/ds/gpt110m/ckpt/global_step1 --output_folder /tmp/h7/ds/universal \
        --inject_missing_state                                              # DeepSpeed universal
    MCORE_BENCH_SIZE=1 MCORE_DISTOPT_SHARDING=dp_reshardable MCORE_DDP_BUCKET_SIZE=40000000 \
        python tools/fixtures/make_megatron_fixtures.py --out /tmp/h7/mg llama_distopt_bf16_tp2dp2
    MCORE_BENCH_SIZE=1 python tools/fixtures/make_megatron_fixtures.py --out /tmp/h7/mgl \
        legacy_llama_tp2_synthetic                                          # Megatron legacy
    # Orbax: ocp.StandardCheckpointer().save('/tmp/h7/orbax_133m', tree), tree = a float32
    # (32000, 1024) embedding and 12 x {(1024, 4096), (4096, 1024)} (133M parameters), each
    # standard normal (numpy default_rng(0)): Orbax's defaults, one zstd chunk per array
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import rss  # noqa: E402

MiB = 1 << 20
SLACK = 64 * MiB
TARGETS = ("safetensors", "torch-dcp", "deepspeed-universal", "orbax")


def child(a) -> None:
    sys.path.insert(0, ROOT)
    import jax_ucp
    from jax_ucp._src.importers.registry import detect_format

    if a.target == "orbax" or (not a.target and detect_format(a.src) == "orbax"):
        # Orbax (and JAX, ~57 MiB) is imported by the export or import itself: in the baseline
        import orbax.checkpoint  # noqa: F401
    base = rss.status()["RssAnon"]
    t0 = time.perf_counter()
    with rss.Peak(interval=0.005) as peak:
        if a.target:
            from jax_ucp._src.exporters import options_for

            jax_ucp.export(a.src, a.dst, options_for(a.target, memory_budget=a.budget))
        else:
            from jax_ucp.conversion import MegatronOptions

            importing = MegatronOptions(vocab_size=a.vocab_size) if a.vocab_size else None
            jax_ucp.convert(a.src, a.dst, memory_budget=a.budget, importing=importing)
    print("RESULT" + json.dumps({"base": base, "peak": peak.anon, "s": time.perf_counter() - t0}))


def warm(path: str) -> None:
    for d, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                while fh.read(1 << 24):
                    pass


def measure(cmd: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        return {"error": (out.stdout + out.stderr)[-2000:]}
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[6:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--budget", default="64MiB,128MiB,256MiB", help="memory_budget(s), comma-separated"
    )
    ap.add_argument("--case", action="append", default=[], help="name=checkpoint path")
    ap.add_argument("--vocab-size", type=int)
    ap.add_argument("--export", action="store_true", help="export the first case to every target")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--dir", default=None, help="where outputs go (default: a temporary dir)")
    ap.add_argument("--json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--src", help=argparse.SUPPRESS)
    ap.add_argument("--dst", help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    from jax_ucp._src.format.sizes import parse_size

    budgets = [parse_size(b) for b in a.budget.split(",") if b]
    if a.child:
        return child(a)
    rows = []
    for budget in budgets:
        rows += run(a, budget)
    table(rows, budgets)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"budgets": budgets, "rows": rows}, f, indent=1)


def table(rows: list[dict], budgets: list[int]) -> None:
    """Peak RssAnon (MiB, absolute) per case and budget, and whether it is <= budget + 64 MiB."""
    cases = list(dict.fromkeys(r["case"] for r in rows))
    by = {(r["case"], r["budget"]): r for r in rows}
    head = " | ".join(f"{b / MiB:.0f} MiB (goal {(b + SLACK) / MiB:.0f})" for b in budgets)
    print(f"\n| case | {head} |\n|---|{'---|' * len(budgets)}")
    for case in cases:
        cells = []
        for b in budgets:
            r = by.get((case, b))
            if r is None:
                cells.append("")
            elif "error" in r:
                cells.append("failed")
            else:
                cells.append(f"{r['peak'] / MiB:.0f}, {'yes' if r['met'] else '**no**'}")
        print(f"| {case} | {' | '.join(cells)} |")


def run(a, budget: int) -> list[dict]:
    """Every case (and export) at one budget, each in a fresh process; one row each."""
    work = tempfile.mkdtemp(prefix="ucp_importmem_", dir=a.dir)
    me = [sys.executable, os.path.abspath(__file__), "--child", "--budget", str(budget)]
    rows: list[dict] = []
    print(f"\nmemory_budget {budget / MiB:.0f} MiB; load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"{'case':<28} {'budget':>8} {'base':>8} {'peak':>8} {'+base':>8} {'s':>7}  <= +64")
    try:
        first_ucp = None
        jobs = []
        for case in a.case:
            name, _, src = case.partition("=")
            jobs.append((f"import {name}", src, None))
        if a.export:
            jobs += [(f"export {t}", None, t) for t in a.targets.split(",") if t]
        for label, src, target in jobs:
            dst = os.path.join(work, label.replace(" ", "_"))
            cmd = [*me]
            if target is None:
                warm(src)
                cmd += ["--src", src, "--dst", dst]
                if a.vocab_size and "megatron" in label:
                    cmd += ["--vocab-size", str(a.vocab_size)]
            else:
                if first_ucp is None:
                    continue
                warm(first_ucp)
                cmd += ["--src", first_ucp, "--dst", dst, "--target", target]
            os.sync()
            r = measure(cmd)
            r.update(case=label, budget=budget, load=os.getloadavg()[0])
            rows.append(r)
            if "error" in r:
                print(f"{label:<28} FAILED: {r['error'][-600:]}", flush=True)
                continue
            r["met"] = r["peak"] <= budget + SLACK
            print(
                f"{label:<28} {budget / MiB:>8.0f} {r['base'] / MiB:>8.0f} {r['peak'] / MiB:>8.0f} "
                f"{(r['peak'] - r['base']) / MiB:>8.0f} {r['s']:>7.2f}  {'yes' if r['met'] else 'NO'}",
                flush=True,
            )
            if target is None and first_ucp is None:
                first_ucp = dst
            elif os.path.isdir(dst):
                shutil.rmtree(dst)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


if __name__ == "__main__":
    main()
