"""ZeRO-3 bf16, weights only: ``convert(importing=ImportOptions(weights_only=True))`` vs DeepSpeed's
``zero_to_fp32``, and what dropping the derived bf16 ``model_params`` would buy (issue 52).

A ZeRO-3 checkpoint holds no bf16 weights: jax_ucp's import writes the fp32 masters as
``params`` and derives ``model_params`` = bf16(master) beside them; ``zero_to_fp32`` writes the
fp32 masters alone. Contenders, each a fresh process, alternating within every round, from a
warm page cache of the input:

  * ``zero_to_fp32``: ``python -m deepspeed.utils.zero_to_fp32 CKPT OUT`` (torch venv);
  * ``jax_ucp weights_only``: ``jax_ucp.convert(CKPT, OUT, importing=ImportOptions(weights_only=True))``;
  * ``jax_ucp no model_params``: the same with the ``model_params`` items filtered out of the
    import's stream (an experiment, not an option: what the bytes not written are worth).

Reports bytes written (the output folder's size: deterministic), wall time (to exit, and to
exit + ``sync``: durable) and CPU time
(user + system of the process and its children), medians, and the load average.

    python benchmarks/bench_zero3_weights_only.py /tmp/ds/z3/ckpt --rounds 3 \\
        [--torch-python /work/venv-torch/bin/python]

Make a small real checkpoint first (DeepSpeed on CPU, 2 ranks; ~30M parameters, 333 MB):

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tools/fixtures/ds_train.py --out /tmp/ds/z3 \\
        --stage 3 --dtype bf16 --vocab 16001 --width 512 --layers 4 --heads 8 --seq 32 --mb 1 \\
        --steps 1 --no-next
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONVERT = (
    "import sys\n"
    "import jax_ucp\n"
    "if sys.argv[3:] == ['drop']:\n"
    "    from jax_ucp._src.importers.deepspeed import zero\n"
    "    real = zero.iter_zero_items\n"
    "    zero.iter_zero_items = lambda *a: (i for i in real(*a) "
    "if tuple(i.key[:1]) != ('model_params',))\n"
    "from jax_ucp.conversion import ImportOptions\n"
    "jax_ucp.convert(sys.argv[1], sys.argv[2], importing=ImportOptions(weights_only=True))\n"
)


def run(cmd: list[str], env: dict) -> dict:
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = p.stdout.read() if p.stdout else b""
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"{cmd} failed:\n{out.decode()[-3000:]}")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime}


def du(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def warm(path: str) -> None:
    for d, _, fs in os.walk(path):
        for f in fs:
            with open(os.path.join(d, f), "rb") as fh:
                while fh.read(8 << 20):
                    pass


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--torch-python", default="/work/venv-torch/bin/python")
    ap.add_argument("--json")
    args = ap.parse_args()
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    src = args.checkpoint
    contenders = {
        "zero_to_fp32": lambda out: [
            args.torch_python, "-m", "deepspeed.utils.zero_to_fp32", src, out
        ],
        "jax_ucp weights_only": lambda out: [sys.executable, "-c", CONVERT, src, out],
        "jax_ucp no model_params": lambda out: [sys.executable, "-c", CONVERT, src, out, "drop"],
    }  # fmt: skip
    results: dict[str, list[dict]] = {k: [] for k in contenders}
    load0 = os.getloadavg()
    tmp = tempfile.mkdtemp(prefix="bench_z3_")
    try:
        for r in range(args.rounds):
            names = list(contenders) if r % 2 == 0 else list(contenders)[::-1]
            for name in names:
                out = os.path.join(tmp, "out")
                shutil.rmtree(out, ignore_errors=True)
                warm(src)
                subprocess.run(["sync"], check=True)
                t0 = time.perf_counter()
                res = run(contenders[name](out), env)
                subprocess.run(["sync"], check=True)  # zero_to_fp32 does not fsync; jax_ucp does
                res["durable_s"] = time.perf_counter() - t0
                res["out_bytes"] = du(out)
                res["load"] = os.getloadavg()[0]
                results[name].append(res)
                print(
                    f"round {r} {name:24s} {res['wall_s']:6.2f} s (+sync {res['durable_s']:6.2f} s)  CPU {res['cpu_s']:6.2f} s  "
                    f"{res['out_bytes'] / 1e6:7.1f} MB written  load {res['load']:.1f}",
                    flush=True,
                )
                shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    load1 = os.getloadavg()
    med = statistics.median
    base = med(r["wall_s"] for r in results["zero_to_fp32"])
    base_cpu = med(r["cpu_s"] for r in results["zero_to_fp32"])
    print(f"\n{src}: medians of {args.rounds}, load {load0[0]:.1f} → {load1[0]:.1f}")
    for name, runs in results.items():
        wall, cpu = med(r["wall_s"] for r in runs), med(r["cpu_s"] for r in runs)
        print(
            f"{name:24s} {wall:6.2f} s ({base / wall:4.2f}× zero_to_fp32)  CPU {cpu:6.2f} s "
            f"({base_cpu / cpu:4.2f}×)  {runs[0]['out_bytes'] / 1e6:7.1f} MB written"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                    "command": f"python benchmarks/bench_zero3_weights_only.py {src} "
                    f"--rounds {args.rounds}",
                    "load_average": [load0, load1],
                    "results": results,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
