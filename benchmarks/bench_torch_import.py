"""Benchmark: importing a torch DCP checkpoint (FSDP2, with AdamW state) with jax_ucp vs torch's
own consolidation, ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` followed by
``torch.load`` of the file it writes, side by side in one run (alternating rounds, medians).

Each side runs in its own subprocess started after a ``sync`` with the input in the page cache:
wall time to exit and to durable output (exit + ``sync``); memory: RssAnon of the process tree
sampled every 20 ms by this script (peak), and each child's own VmHWM (peak resident, file pages
included) and RssAnon at its end, read from /proc/self/status and printed by the child.

Make the checkpoint once with torch (2 gloo ranks on CPU, one AdamW step; ~134M parameters,
1.6 GB with the moments), then run the benchmark with the project's python:

    /work/venv-torch/bin/python benchmarks/bench_torch_import.py --generate /tmp/tbench
    python benchmarks/bench_torch_import.py --src /tmp/tbench/fsdp2_134m \\
        --torch-python /work/venv-torch/bin/python --rounds 3 --json docs/benchmark_torch_import.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

# vocab 32000, width 768, 12 layers, SwiGLU 2048: 134M parameters
SIZE = {"vocab": 32000, "dim": 768, "layers": 12, "hidden": 2048}

STATUS = (
    "def _mem():\n"
    "    d = {}\n"
    "    for line in open('/proc/self/status'):\n"
    "        k, _, v = line.partition(':')\n"
    "        if k in ('VmHWM', 'RssAnon'):\n"
    "            d[k] = int(v.split()[0]) * 1024\n"
    "    return d\n"
)

JAX_UCP_CHILD = STATUS + (
    "import sys, json\n"
    "import jax_ucp\n"
    "jax_ucp.convert(sys.argv[1], sys.argv[2])\n"
    "print('MEM' + json.dumps(_mem()))\n"
)

TORCH_CHILD = STATUS + (
    "import sys, json\n"
    "import torch\n"
    "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
    "dcp_to_torch_save(sys.argv[1], sys.argv[2])\n"
    "state = torch.load(sys.argv[2], weights_only=True)\n"
    "n = sum(1 for _ in state)\n"
    "print('MEM' + json.dumps(_mem()))\n"
)


# ------------------------------------------------------------------------------ generation


def _generate_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    s = SIZE

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d, h = s["dim"], s["hidden"]
            self.attention_norm = nn.RMSNorm(d)
            self.wqkv = nn.Linear(d, 3 * d, bias=False)
            self.wo = nn.Linear(d, d, bias=False)
            self.ffn_norm = nn.RMSNorm(d)
            self.w1 = nn.Linear(d, h, bias=False)
            self.w3 = nn.Linear(d, h, bias=False)
            self.w2 = nn.Linear(h, d, bias=False)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.wqkv(self.attention_norm(x)).view(b, t, 3, 12, d // 12).unbind(2)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            x = x + self.wo(o.transpose(1, 2).reshape(b, t, d))
            h = self.ffn_norm(x)
            return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(s["vocab"], s["dim"])
            self.layers = nn.ModuleList(Block() for _ in range(s["layers"]))
            self.norm = nn.RMSNorm(s["dim"])
            self.output = nn.Linear(s["dim"], s["vocab"], bias=False)

        def forward(self, ids):
            x = self.tok_embeddings(ids)
            for layer in self.layers:
                x = layer(x)
            return self.output(self.norm(x))

    torch.manual_seed(0)
    model = Model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, s["vocab"], (1, 16), generator=torch.Generator().manual_seed(rank))
    loss = F.cross_entropy(model(ids[:, :-1]).reshape(-1, s["vocab"]), ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"wrote {out}: {n / 1e6:.1f}M parameters")
    dist.destroy_process_group()


def generate(where: str) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = os.path.join(where, "fsdp2_134m")
    mp.spawn(_generate_rank, args=(2, port, out), nprocs=2, join=True)


# ------------------------------------------------------------------------------- benchmark


def run_side(cmd: list[str], env: dict) -> dict:
    """Run ``cmd`` (its last argument the output path) measured; parse the child's MEM line."""
    import rss

    res = rss.run_measured(cmd, env=env, cwd=ROOT)
    mem = next(
        json.loads(line[3:]) for line in res["stdout"].splitlines() if line.startswith("MEM")
    )
    return {
        "wall_s": res["wall_s"],
        "durable_s": res["durable_s"],
        "peak_rss_anon_sampled": res["peak_rss_anon"],
        "child_vm_hwm": mem["VmHWM"],
        "child_rss_anon_end": mem["RssAnon"],
    }


def warm(path: str) -> None:
    for d, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                while fh.read(1 << 24):
                    pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--generate", metavar="DIR", help="write the FSDP2 checkpoint (needs torch)")
    ap.add_argument("--src", help="the torch DCP checkpoint folder")
    ap.add_argument("--torch-python", default="/work/venv-torch/bin/python")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.generate:
        generate(a.generate)
        return
    if not a.src:
        ap.error("--src (or --generate DIR)")
    env = dict(os.environ, PYTHONWARNINGS="ignore", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(a.src) for f in fs)
    sides = {
        "jax_ucp.convert": [sys.executable, "-c", JAX_UCP_CHILD, a.src],
        "dcp_to_torch_save + torch.load": [a.torch_python, "-c", TORCH_CHILD, a.src],
    }
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    warm(a.src)
    for r in range(a.rounds):
        for name, cmd in sides.items():
            tmp = tempfile.mkdtemp(prefix="bench_torch_import_", dir=os.path.dirname(a.src))
            dst = os.path.join(tmp, "out" if name.startswith("jax") else "full.pt")
            try:
                res = run_side([*cmd, dst], env)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            runs[name].append(res)
            print(
                f"round {r + 1} {name:32} exit {res['wall_s']:6.2f} s  durable "
                f"{res['durable_s']:6.2f} s  peak RssAnon {res['peak_rss_anon_sampled'] >> 20:5d} "
                f"MiB  VmHWM {res['child_vm_hwm'] >> 20:5d} MiB",
                flush=True,
            )
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
    }
    ours, theirs = med["jax_ucp.convert"], med["dcp_to_torch_save + torch.load"]
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["python", *sys.argv]),
        "checkpoint_bytes": size,
        "rounds": a.rounds,
        "medians": med,
        "speedup_exit": theirs["wall_s"] / ours["wall_s"],
        "speedup_durable": theirs["durable_s"] / ours["durable_s"],
        "rss_anon_ratio": ours["peak_rss_anon_sampled"] / theirs["peak_rss_anon_sampled"],
        "runs": runs,
    }
    print(f"\ncheckpoint {size / 1e9:.2f} GB, medians of {a.rounds}:")
    for name, m in med.items():
        print(
            f"  {name:32} exit {m['wall_s']:6.2f} s  durable {m['durable_s']:6.2f} s  "
            f"peak RssAnon {m['peak_rss_anon_sampled'] / 2**20:7.0f} MiB  "
            f"VmHWM {m['child_vm_hwm'] / 2**20:7.0f} MiB"
        )
    print(
        f"  jax_ucp is {report['speedup_exit']:.2f}x faster to exit, "
        f"{report['speedup_durable']:.2f}x to durable output; its peak RssAnon is "
        f"{report['rss_anon_ratio']:.3f} of torch's"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
