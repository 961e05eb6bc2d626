"""A torch source -> sharded jax.Arrays on a 2x4 mesh (8 CPU devices): the direct restore (issue
50) beside convert + restore and beside the framework's own offline route, at any size.

Sources (``--format``):

* ``dcp``: a Llama-like model's fp32 weights and AdamW moments as a torch DCP checkpoint of
  ``--gb`` GB, written here by jax_ucp's DCP writer one tensor at a time (the single-file layout
  ``dcp.save`` writes from one rank, each chunk a ``torch.save`` archive with its zip CRC-32;
  ``torch.distributed.checkpoint.load`` reads it); or ``--source DIR``;
* ``zero3``: a DeepSpeed ZeRO-3 checkpoint DeepSpeed wrote (``--source CKPT``, the folder
  holding ``latest``; make one with ``tools/fixtures/ds_train.py --stage 3``, below);
* ``torch_dist``: a megatron-core torch_dist checkpoint megatron-core wrote (``--source DIR``;
  ``tools/fixtures/make_megatron_bench_source.py``).

Contenders, each a fresh process, alternating order within each round:

* ``direct``: ``jax_ucp.restore(SRC, target=..., importing=ImportOptions())``: the source read in
  place through its import, nothing written;
* ``convert + restore``: ``jax_ucp.convert(SRC, UCP)`` (a full, durable copy) then
  ``jax_ucp.restore(UCP, target=...)``;
* ``offline``: the framework's own route: ``dcp_to_torch_save`` (torch DCP and torch_dist) or
  ``python -m deepspeed.checkpoint.ds_to_universal`` (ZeRO-3), then every tensor of its output
  ``torch.load``-ed (``weights_only=True``) and ``jax.device_put`` with the same sharding rule.

The target splits rows on ``data`` and columns on ``model`` where they divide. Per contender:
the time of the work itself (imports and the target excluded), bytes written
(``/proc/self/io`` ``write_bytes``, reaped children included), the process tree's peak RssAnon
during the work (sampled every 20 ms) minus the tensors restored and minus the process before
the work: the
working memory beside the result, to set against the restore's ``memory_budget`` (256 MiB by
default). Each round also measures the disk: ``write`` MB/s of 256 MiB written and fsynced
beside the source, ``read`` MB/s of it read back after ``posix_fadvise(DONTNEED)`` (on a
virtual disk the host may still cache it). The source is in the page cache as far as it fits
(``--cold``: evicted before each contender). The load average is printed beside each round. In
round 0 every contender digests what it restored (per-tensor CRC-32, outside the timing): direct
and convert + restore must be equal leaf for leaf; the offline route's multiset of tensor
digests is compared with direct's (its names are the framework's).

Run from the torch venv (torch for the offline routes, jax_ucp from the system site):

    python benchmarks/bench_direct_restore.py --format dcp --gb 1 --rounds 2 --json out.json
    python benchmarks/bench_direct_restore.py --format dcp --gb 16 --write /big/dcp16  # then:
    python benchmarks/bench_direct_restore.py --format dcp --source /big/dcp16 --rounds 1
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tools/fixtures/ds_train.py --out /tmp/z3 \\
        --stage 3 --dtype bf16 --vocab 16001 --width 1024 --layers 6 --heads 16 --seq 32 \\
        --mb 1 --steps 1 --no-next
    python benchmarks/bench_direct_restore.py --format zero3 --source /tmp/z3/ckpt
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import collections
import datetime
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
import zlib

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import rss  # noqa: E402

CONTENDERS = ("direct", "convert + restore", "offline")
OFFLINE = {"dcp": "dcp_to_torch_save + load", "torch_dist": "dcp_to_torch_save + load"}
OFFLINE["zero3"] = "ds_to_universal + load"


def llama_shapes(gb: float) -> dict[str, tuple[int, ...]]:
    """Llama-like weights (hidden 1024, 4 KV heads of 64, MLP 2816, vocab 8000) with as many
    layers as make ~``gb`` GB as fp32 weights + two fp32 moments."""
    h, kv, f, v = 1024, 256, 2816, 8000
    shapes = {"embed_tokens.weight": (v, h), "norm.weight": (h,), "lm_head.weight": (v, h)}
    fixed = 2 * v * h + h
    per_layer = 2 * h * h + 2 * kv * h + 3 * f * h + 2 * h
    layers = max(1, round((gb * 1e9 / 12 - fixed) / per_layer))
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "q_proj.weight": (h, h),
            p + "k_proj.weight": (kv, h),
            p + "v_proj.weight": (kv, h),
            p + "o_proj.weight": (h, h),
            p + "gate_proj.weight": (f, h),
            p + "up_proj.weight": (f, h),
            p + "down_proj.weight": (h, f),
        }
    return shapes


def write_dcp_source(folder: str, gb: float) -> None:
    """A torch DCP checkpoint of ~``gb`` GB at ``folder``: ``params``, ``opt_state.mu``,
    ``opt_state.nu``, written one tensor at a time (memory: one tensor)."""
    from jax_ucp._src.torchfiles import dcp

    shapes = llama_shapes(gb)
    groups = {("params",): 0.02, ("opt_state", "mu"): 1e-3, ("opt_state", "nu"): 1e-6}
    items = [
        dcp.DcpItem(".".join((*g, n)), (*g, n), shape, np.dtype(np.float32))
        for g in groups
        for n, shape in shapes.items()
    ]

    def arrays():
        rng = np.random.default_rng(0)
        for scale in groups.values():
            for shape in shapes.values():
                yield rng.standard_normal(shape, np.float32) * np.float32(scale)

    os.makedirs(folder)
    dcp.write_dcp(folder, items, arrays(), save_id="bench-direct-restore")


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(path) for n in ns)


def written() -> int:
    """Bytes this process (and its reaped children) made the kernel write."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("write_bytes")).split()[1])


def evict(path: str) -> None:
    paths = [os.path.join(d, n) for d, _, ns in os.walk(path) for n in ns]
    for p in paths if os.path.isdir(path) else [path]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk(scratch: str, mib: int = 256) -> tuple[float, float]:
    """(write MB/s fsynced, read MB/s after eviction) of ``mib`` MiB in ``scratch``."""
    path = os.path.join(scratch, "disk_probe")
    block = os.urandom(1 << 20)
    t = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    w = mib * (1 << 20) / (time.perf_counter() - t) / 1e6
    evict(path)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass
    r = mib * (1 << 20) / (time.perf_counter() - t) / 1e6
    os.remove(path)
    return w, r


# --- the child: one contender, one process ---------------------------------------------------


def spec_of(shape, mesh):
    from jax.sharding import PartitionSpec as P

    spec = [None] * len(shape)
    if shape and shape[0] % mesh.shape["data"] == 0:
        spec[0] = "data"
    if len(shape) > 1 and shape[-1] % mesh.shape["model"] == 0:
        spec[-1] = "model"
    return P(*spec)


def target_of(src: str, mesh):
    """The tree a direct restore of ``src`` gives, as ShapeDtypeStructs on ``mesh`` (from the
    manifest its import would write: nothing read but the source's metadata)."""
    import jax
    from jax.sharding import NamedSharding

    import jax_ucp

    tree: dict = {}
    for e in jax_ucp.inspect(src).entries:
        node = tree
        for k in e.key[:-1]:
            node = node.setdefault(k, {})
        if isinstance(e, jax_ucp.TensorEntry):
            sharding = NamedSharding(mesh, spec_of(e.shape, mesh))
            node[e.key[-1]] = jax.ShapeDtypeStruct(e.shape, np.dtype(e.dtype), sharding=sharding)
        else:
            node[e.key[-1]] = e.value
    return tree


def digest(x) -> tuple:
    """``x``'s shape, dtype and every shard's CRC-32 by its index: read shard by shard, as
    ``np.asarray(x)`` would keep a host copy of the whole array on it (16 GB restored became
    30 GB and the host ran out of memory)."""
    crcs = sorted(
        (str(s.index), zlib.crc32(np.ascontiguousarray(s.data).reshape(-1).view(np.uint8)))
        for s in x.addressable_shards
    )
    return tuple(x.shape), str(x.dtype), tuple(crcs)


def to_numpy(t):
    """A torch tensor's bytes as numpy (bf16 through int16: numpy has no bf16 of its own)."""
    import ml_dtypes
    import torch

    if t.dtype == torch.bfloat16:
        return t.detach().contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.detach().contiguous().numpy()


def torch_tensors(obj, prefix=""):
    """(name, tensor) of every tensor in a nested torch state dict."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from torch_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from torch_tensors(v, f"{prefix}.{i}")


def run_contender(name: str, fmt: str, src: str, scratch: str, check: bool) -> dict:
    import jax
    from jax.sharding import Mesh, NamedSharding

    import jax_ucp
    from jax_ucp.conversion import ImportOptions

    warnings.simplefilter("ignore")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    target = target_of(src, mesh)  # offline: the model's shapes (ds_to_universal flattens)
    if name == "offline":
        import torch  # noqa: F401  (imported before the clock, as jax is)
    baseline = rss.status().get("RssAnon", 0)
    out = os.path.join(scratch, "out")
    peak = rss.Peak(os.getpid(), interval=0.02).start()  # this process and its children
    before, t, use = written(), time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    if name == "direct":
        result = jax_ucp.restore(src, target=target, importing=ImportOptions())
    elif name == "convert + restore":
        result = jax_ucp.restore(jax_ucp.convert(src, out), target=target)
    else:
        result = offline(fmt, src, out, mesh, NamedSharding, target)
    leaves = [x for x in jax.tree.leaves(result) if isinstance(x, jax.Array)]
    jax.block_until_ready(leaves)
    seconds = time.perf_counter() - t
    end = resource.getrusage(resource.RUSAGE_SELF)  # this process's threads (offline: children
    peak.stop()  # not counted) before the digests below (np.asarray keeps a host copy)
    row = {
        "seconds": seconds,
        "cpu_s": end.ru_utime + end.ru_stime - use.ru_utime - use.ru_stime,
        "minor_faults": end.ru_minflt - use.ru_minflt,
        "written": written() - before,
        "peak_anon": peak.anon,
        "baseline_anon": baseline,
        "result_bytes": sum(x.nbytes for x in leaves),
        "tensors": len(leaves),
    }
    if check:
        if name == "offline":
            row["digests"] = sorted(repr(digest(x)) for x in leaves)
        else:
            row["digests"] = [repr(digest(x)) for x in leaves]
    shutil.rmtree(out, ignore_errors=True)
    return row


def offline(fmt: str, src: str, out: str, mesh, named, target) -> list:
    """The framework's own route, then its output loaded and placed on ``mesh`` (a ZeRO-3
    universal checkpoint holds each parameter flat: reshaped to the model's shape, which its
    user knows from the model; here from ``target``)."""
    import jax
    import torch

    def place(tensors):
        got = []
        for name, t in tensors:
            a = to_numpy(t)
            if fmt == "zero3":
                a = a.reshape(target["params"][name].shape)
            got.append(jax.device_put(a, named(mesh, spec_of(a.shape, mesh))))
        return got

    if fmt in ("dcp", "torch_dist"):
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        os.makedirs(out)
        file = os.path.join(out, "consolidated.pt")
        dcp_to_torch_save(src, file)
        state = torch.load(file, mmap=True, weights_only=True)
        return place(torch_tensors(state))
    tag = open(os.path.join(src, "latest")).read().strip()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            os.path.join(src, tag),
            "--output_folder",
            out,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ, DS_ACCELERATOR="cpu"),
    )
    got = []
    zero = os.path.join(out, "zero")
    for param in sorted(os.listdir(zero)):
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            file = os.path.join(zero, param, state + ".pt")
            if os.path.exists(file):
                obj = torch.load(file, weights_only=True)  # a tensor, or {"param": tensor}
                got += place([(param, obj["param"] if isinstance(obj, dict) else obj)])
    return got


# --- the parent ------------------------------------------------------------------------------


def measure(name: str, args, src: str, scratch: str, check: bool) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--run", name, "--format", args.format]
    cmd += ["--source", src, "--dir", scratch] + (["--check"] if check else [])
    got = rss.run_measured(cmd, env=dict(os.environ, DS_ACCELERATOR="cpu"))
    row = json.loads(got["stdout"].strip().splitlines()[-1])
    row["process_s"] = got["wall_s"]
    row["working_memory"] = row["peak_anon"] - row["result_bytes"] - row["baseline_anon"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", choices=("dcp", "zero3", "torch_dist"), default="dcp")
    ap.add_argument("--gb", type=float, default=1.0, help="dcp: the source's size to write")
    ap.add_argument("--source", help="an existing source (required for zero3 and torch_dist)")
    ap.add_argument("--write", metavar="DIR", help="dcp: only write a source of --gb GB at DIR")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="evict the source before each run")
    ap.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    ap.add_argument("--json")
    ap.add_argument("--dir", default=None, help="scratch folder (default: beside the source)")
    ap.add_argument("--run", choices=CONTENDERS, help=argparse.SUPPRESS)
    ap.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        row = run_contender(args.run, args.format, args.source, args.dir, args.check)
        print(json.dumps(row))
        return
    if args.write:
        write_dcp_source(args.write, args.gb)
        print(f"wrote {tree_bytes(args.write) / 1e9:.2f} GB at {args.write}")
        return
    if args.format != "dcp" and not args.source:
        raise SystemExit(f"--format {args.format} needs --source (see the docstring)")
    base = args.dir or os.path.dirname(os.path.abspath(args.source or "."))
    with tempfile.TemporaryDirectory(dir=base, prefix="bench_direct_") as scratch:
        src = args.source
        if src is None:
            src = os.path.join(scratch, "dcp")
            t = time.perf_counter()
            write_dcp_source(src, args.gb)
            print(f"wrote the DCP source in {time.perf_counter() - t:.0f} s")
        nbytes = tree_bytes(src)
        print(f"source: {args.format}, {nbytes / 1e9:.2f} GB, {src}")
        labels = {c: (OFFLINE[args.format] if c == "offline" else c) for c in args.contenders}
        rounds = []
        for r in range(args.rounds):
            w, rd = disk(scratch)
            row: dict = {"load": os.getloadavg()[0], "disk_write_mbs": w, "disk_read_mbs": rd}
            order = args.contenders if r % 2 == 0 else args.contenders[::-1]
            for name in order:
                if args.cold:
                    evict(src)
                row[name] = measure(name, args, src, scratch, check=r == 0)
            row["load_after"] = os.getloadavg()[0]
            if r == 0:
                check(row, args.contenders)
            for name in args.contenders:
                row[name].pop("digests", None)
            rounds.append(row)
            print(
                f"round {r}: load {row['load']:.1f}-{row['load_after']:.1f}, disk write "
                f"{w:.0f} MB/s, read {rd:.0f} MB/s"
            )
            for name in args.contenders:
                c = row[name]
                print(
                    f"  {labels[name]:26s} {c['seconds']:7.2f} s ({nbytes / c['seconds'] / 1e6:5.0f}"
                    f" MB/s of source), CPU {c['cpu_s']:.2f} s, {c['minor_faults'] / 1e3:.0f} k "
                    f"minor faults, {c['written'] / 1e9:6.2f} GB written, working memory "
                    f"{c['working_memory'] / 2**20:6.0f} MiB (peak RssAnon "
                    f"{c['peak_anon'] / 2**30:.2f} GiB, result {c['result_bytes'] / 2**30:.2f} GiB)"
                )
    med = {n: statistics.median(r[n]["seconds"] for r in rounds) for n in args.contenders}
    print(f"median of {args.rounds} rounds, source {nbytes / 1e9:.2f} GB:")
    for n in args.contenders:
        ratio = "" if n == "direct" else f"  direct {med[n] / med['direct']:.2f}x faster"
        print(f"  {labels[n]:26s} {med[n]:7.2f} s{ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "when": datetime.datetime.now(datetime.UTC).isoformat(),
                    "format": args.format,
                    "source_bytes": nbytes,
                    "cold": args.cold,
                    "labels": labels,
                    "rounds": rounds,
                    "median_seconds": med,
                },
                f,
                indent=1,
            )


def check(row: dict, contenders) -> None:
    """Round 0: direct == convert + restore leaf for leaf; the offline route's tensors, as a
    multiset of digests, against direct's (reported, not required: its tensors are the
    framework's)."""
    if "direct" in contenders and "convert + restore" in contenders:
        a, b = row["direct"]["digests"], row["convert + restore"]["digests"]
        if a != b:
            raise SystemExit("direct and convert + restore restored different values")
        print(f"  direct == convert + restore: {len(a)} tensors bit-equal")
    if "direct" in contenders and "offline" in contenders:
        a = collections.Counter(row["direct"]["digests"])
        b = collections.Counter(row["offline"]["digests"])
        row["offline_same"] = {
            "common": sum((a & b).values()),
            "direct_only": sum((a - b).values()),
        }
        row["offline_same"]["offline_only"] = sum((b - a).values())
        print(f"  offline vs direct tensors: {row['offline_same']}")


if __name__ == "__main__":
    main()
