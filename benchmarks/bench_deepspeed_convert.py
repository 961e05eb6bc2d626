"""Benchmark: ``jax_ucp`` DeepSpeed import vs DeepSpeed's ``ds_to_universal`` on the same checkpoint.

Each converter runs as its command-line tool in its own process (``python -m jax_ucp.cli convert
deepspeed`` vs ``python -m deepspeed.checkpoint.ds_to_universal``), plus ``convert(format='deepspeed')``
called from Python (its in-process time is printed as "conversion itself"). Wall time and peak
memory of the whole process tree (ds_to_universal forks extraction/merge workers) are sampled
from /proc every 20 ms: peak RssAnon (anonymous memory: what a converter really allocates;
memory-mapped checkpoint pages are file-backed and reclaimable) and peak VmRSS.

Two wall times: until the process exits, and until its output is durable (exit + ``sync``).
jax_ucp fsyncs every file it writes (as Orbax/TensorStore do) before it exits; torch.save does
not, so ds_to_universal exits with its output still in the page cache. Every run starts after a
``sync`` and from a warm page cache of the input. Also reports the largest tensor and the
``RssAnon <= 2 x largest tensor + 0.5 GB`` goal.

    python benchmarks/bench_deepspeed_convert.py tests/fixtures/deepspeed/z2_bf16_dp2/ckpt
    python benchmarks/bench_deepspeed_convert.py /tmp/dsbench/gpt110m_z2_bf16_dp2/ckpt --rounds 5 --json out.json

Make a ~110M-parameter real checkpoint first (a few minutes on CPU):

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tools/fixtures/ds_train.py --out /tmp/dsbench/gpt110m \\
        --stage 2 --dtype bf16 --vocab 16001 --width 768 --layers 12 --heads 12 --seq 64 --mb 1 --steps 1 --no-next
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import rss  # noqa: E402


def run_measured(cmd: list[str], env: dict | None = None) -> dict:
    """Wall time (to exit, and to durable output) and peak (process tree) RssAnon / VmRSS of ``cmd``."""
    res = rss.run_measured(cmd, env=env, cwd=ROOT)
    for line in res.pop("stdout").splitlines():
        if line.startswith("CONVERT_S="):
            res["convert_s"] = float(line.split("=", 1)[1])
    return res


def largest_tensor_bytes(src: str) -> tuple[int, int]:
    sys.path.insert(0, ROOT)
    from jax_ucp._src.importers.deepspeed import DeepSpeedCheckpoint, open_deepspeed_checkpoint
    from jax_ucp._src.store.storage import LocalDirectory

    checkpoint = open_deepspeed_checkpoint(LocalDirectory(src))
    import math

    if isinstance(checkpoint, DeepSpeedCheckpoint):
        sizes = [math.prod(s) for s in checkpoint.shapes.values()]
    else:  # Megatron-DeepSpeed TP/PP: the consolidated size is the sum of the TP fragments (upper bound)
        sizes = [
            sum(
                math.prod(checkpoint.ranks[checkpoint.holders[n][0]][t].shapes[n])
                for t in range(checkpoint.tp)
            )
            for n in checkpoint.names
        ]
    return max(sizes) * 4, sum(sizes)


def raw_disk_write(nbytes: int, directory: str, files: int = 64, threads: int = 4) -> dict:
    """The disk's floor for this output size: ``nbytes`` written from memory, durably.

    4 threads write ``files`` files from one in-memory buffer (buffered writes, write-back started
    per file), then one ``sync``; no reading, no encoding. What a converter writing the same bytes
    cannot beat on this machine.
    """
    import concurrent.futures

    import numpy as np

    buf = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    per = nbytes // files
    os.makedirs(directory, exist_ok=True)
    os.sync()

    def one(i: int) -> None:
        fd = os.open(os.path.join(directory, str(i)), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            left = per
            while left:
                n = os.write(fd, buf[: min(left, buf.size)].data)
                left -= n
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, range(files)))
    os.sync()
    wall = time.perf_counter() - t0
    shutil.rmtree(directory)
    return {
        "wall_s": wall,
        "durable_s": wall,
        "peak_rss_anon": 0,
        "peak_vm_rss": 0,
        "out_bytes": per * files,
    }


def warm_page_cache(d: str) -> None:
    """Read every checkpoint file once so both converters start from the same (warm) cache."""
    for f in os.listdir(d):
        with open(os.path.join(d, f), "rb") as fh:
            while fh.read(1 << 24):
                pass


def _median_run(runs: list[dict]) -> dict:
    """Per-metric medians over rounds, plus every round's wall time."""
    import statistics

    out = {k: statistics.median(r[k] for r in runs) for k in runs[0] if all(k in r for r in runs)}
    out["rounds_wall_s"] = [round(r["wall_s"], 3) for r in runs]
    out["rounds_speed_basis"] = "median"
    return out


def tag_dir(src: str) -> str:
    latest = os.path.join(src, "latest")
    return os.path.join(src, open(latest).read().strip()) if os.path.isfile(latest) else src


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "checkpoints", nargs="+", help="DeepSpeed checkpoint folders (with 'latest') or tag folders"
    )
    ap.add_argument("--skip-ds", action="store_true", help="only run jax_ucp")
    ap.add_argument("--json", help="write results here")
    ap.add_argument(
        "--rounds",
        "--repeat",
        dest="rounds",
        type=int,
        default=1,
        help="alternating rounds (ours, then ds_to_universal); medians are reported "
        "(the machine is shared and noisy)",
    )
    a = ap.parse_args()
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    base = run_measured(
        [sys.executable, "-c", "import jax_ucp._src.importers.deepspeed, jax_ucp._src.writer"],
        env,
    )
    results = []
    for src in a.checkpoints:
        biggest, n_params = largest_tensor_bytes(src)
        tmp = tempfile.mkdtemp(prefix="bench_ds_")
        try:

            def once(name: str, cmd: list[str]) -> dict:
                out = os.path.join(tmp, name)
                shutil.rmtree(out, ignore_errors=True)
                warm_page_cache(tag_dir(src))
                r = run_measured(cmd + [out], env)
                r["out_bytes"] = sum(
                    os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs
                )
                shutil.rmtree(out)
                return r

            commands = {
                "jax_ucp CLI": [
                    sys.executable,
                    "-m",
                    "jax_ucp.cli",
                    "convert",
                    "--from",
                    "deepspeed",
                    src,
                ],
                "jax_ucp API": [
                    sys.executable,
                    "-c",
                    "import sys, time; from jax_ucp.conversion import convert; "
                    "t = time.perf_counter(); convert(sys.argv[1], sys.argv[2], format='deepspeed'); "
                    "print(f'CONVERT_S={time.perf_counter() - t}')",
                    src,
                ],
            }
            if not a.skip_ds:
                commands["ds_to_universal"] = [
                    sys.executable,
                    "-m",
                    "deepspeed.checkpoint.ds_to_universal",
                    "--inject_missing_state",
                    "--input_folder",
                    tag_dir(src),
                    "--output_folder",
                ]
            runs: dict[str, list[dict]] = {k: [] for k in commands}
            runs["raw disk write"] = []
            for i in range(a.rounds):  # alternate, so all see the same (noisy) machine
                for k, cmd in commands.items():
                    runs[k].append(once(k.replace(" ", "_"), cmd))
                runs["raw disk write"].append(
                    raw_disk_write(runs["jax_ucp CLI"][-1]["out_bytes"], os.path.join(tmp, "raw"))
                )
                print(
                    f"  round {i + 1}: "
                    + ", ".join(f"{k} {v[-1]['wall_s']:.2f} s" for k, v in runs.items()),
                    flush=True,
                )
            med = {k: _median_run(v) for k, v in runs.items()}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        in_bytes = sum(
            os.path.getsize(os.path.join(tag_dir(src), f)) for f in os.listdir(tag_dir(src))
        )
        goal = 2 * biggest + 0.5 * 2**30
        ours, api, ds = med["jax_ucp CLI"], med["jax_ucp API"], med.get("ds_to_universal")
        peak_ours = max(ours["peak_rss_anon"], api["peak_rss_anon"])
        r = {
            "checkpoint": src,
            "n_params": n_params,
            "checkpoint_bytes": in_bytes,
            "largest_tensor_fp32_bytes": biggest,
            "rounds": a.rounds,
            "results": med,
            "baseline_import_rss_anon": base["peak_rss_anon"],
            "rss_goal_bytes": goal,
            "rss_goal_met": peak_ours <= goal,
            "speedup_exit": (ds["wall_s"] / ours["wall_s"]) if ds else None,
            "speedup_durable": (ds["durable_s"] / ours["durable_s"]) if ds else None,
        }
        results.append(r)
        mb = 2**20
        print(
            f"\n{src}: {n_params:,} params, {in_bytes / mb:.0f} MiB on disk, largest tensor {biggest / mb:.1f} MiB"
        )
        print(f"  medians over {a.rounds} alternating round(s)")
        print(
            f"  {'':18}{'exit s':>8}{'durable s':>11}{'peak RssAnon MiB':>18}{'peak VmRSS MiB':>16}{'out MiB':>9}"
        )
        for k, v in med.items():
            print(
                f"  {k:18}{v['wall_s']:8.2f}{v['durable_s']:11.2f}{v['peak_rss_anon'] / mb:18.0f}"
                f"{v['peak_vm_rss'] / mb:16.0f}{v['out_bytes'] / mb:9.0f}"
            )
        print(
            f"  (jax_ucp conversion itself, in-process: {api.get('convert_s', float('nan')):.2f} s; "
            f"raw disk write = the same bytes from memory, 4 threads, one sync: the floor)"
        )
        raw = med["raw disk write"]
        r["api_vs_raw_disk"] = api["durable_s"] / raw["durable_s"]
        print(
            f"  jax_ucp from Python takes {r['api_vs_raw_disk']:.2f}x the time of the raw disk write"
        )
        if ds:
            print(
                f"  speed-up of the CLI vs ds_to_universal: {r['speedup_exit']:.1f}x to exit, "
                f"{r['speedup_durable']:.1f}x to durable output"
            )
        print(
            f"  RssAnon goal (2 x largest + 0.5 GiB) = {goal / mb:.0f} MiB: {'met' if r['rss_goal_met'] else 'NOT met'}"
            f" (a process that only imports the converter: {base['peak_rss_anon'] / mb:.0f} MiB)"
        )
    if a.json:
        json.dump(results, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
