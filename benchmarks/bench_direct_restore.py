"""A torch DCP checkpoint -> sharded jax.Arrays on a 2x4 mesh (8 CPU devices), two routes:

* convert + restore: ``jax_ucp.convert(dcp, ucp)`` (a full, durable copy) then
  ``jax_ucp.restore(ucp, target=...)``;
* direct: ``jax_ucp.restore(dcp, target=..., importing=ImportOptions())`` (issue 50: the
  source read in place through its import, nothing written).

The source is a Llama-like model's fp32 weights and AdamW moments (``params``, ``mu``, ``nu``:
~``--gb`` GB) as a torch DCP checkpoint, written without torch by jax_ucp's DCP writer (the
single-file layout ``dcp.save`` writes from one rank; each chunk a ``torch.save`` archive with
its zip CRC-32). The target splits rows on ``data`` and columns on ``model`` where they divide.

Contenders alternate within each round; medians over rounds. Each round also measures the
disk: ``write`` MB/s of 256 MiB written and fsynced in the scratch folder, ``read`` MB/s of it
read back after ``posix_fadvise(DONTNEED)``. Bytes each contender writes are
``/proc/self/io``'s ``write_bytes`` (what reaches the block layer, counted when pages are
dirtied). The load average is printed beside each round. The source is in the page cache
(``--cold``: evicted before each contender). Every result is checked equal to the other route's
in the first round.

    python benchmarks/bench_direct_restore.py [--gb 0.5] [--rounds 3] [--cold] [--json out.json]
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
import warnings

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ucp
from jax_ucp.conversion import ImportOptions
from jax_ucp.exporters import TorchDcpExport


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


def write_source(folder: str, gb: float) -> int:
    """The DCP checkpoint at ``folder``; its bytes."""
    rng = np.random.default_rng(0)
    shapes = llama_shapes(gb)

    def tensors(scale):
        return {n: (rng.standard_normal(s, np.float32) * scale) for n, s in shapes.items()}

    tree = {"params": tensors(0.02), "opt_state": {"mu": tensors(1e-3), "nu": tensors(1e-6)}}
    with tempfile.TemporaryDirectory(dir=os.path.dirname(folder)) as ucp:
        jax_ucp.save(f"{ucp}/u", tree)
        jax_ucp.export(f"{ucp}/u", folder, TorchDcpExport())
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))


def sharded(tree, mesh):
    def one(x):
        if not isinstance(x, np.ndarray) or not x.ndim:
            return x
        spec = [None] * x.ndim
        if x.shape[0] % mesh.shape["data"] == 0:
            spec[0] = "data"
        if x.ndim > 1 and x.shape[-1] % mesh.shape["model"] == 0:
            spec[-1] = "model"
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P(*spec)))

    return jax.tree.map(one, tree)


def written() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("write_bytes")).split()[1])


def evict(path: str) -> None:
    for d, _, names in os.walk(path):
        for n in names:
            fd = os.open(os.path.join(d, n), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk(scratch: str, mib: int = 256) -> tuple[float, float]:
    """(write MB/s fsynced, cold read MB/s) of ``mib`` MiB in ``scratch``."""
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


def ready(tree):
    jax.block_until_ready(jax.tree.leaves(tree))
    return tree


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--dir", default=None, help="scratch folder (default: a temporary one)")
    args = ap.parse_args()
    if args.gb > 1.0:
        raise SystemExit("--gb at most 1.0 on this shared machine")
    warnings.simplefilter("ignore")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        src = os.path.join(scratch, "dcp")
        nbytes = write_source(src, args.gb)
        print(f"source: torch DCP, {nbytes / 1e9:.2f} GB, {len(os.listdir(src))} files")
        target = sharded(jax_ucp.restore(src, importing=ImportOptions()), mesh)

        def convert_restore():
            ucp = os.path.join(scratch, "ucp")
            try:
                ckpt = jax_ucp.convert(src, ucp)
                if args.cold:
                    evict(ucp)
                return ready(jax_ucp.restore(ckpt, target=target))
            finally:
                shutil.rmtree(ucp, ignore_errors=True)

        def direct():
            return ready(jax_ucp.restore(src, target=target, importing=ImportOptions()))

        contenders = {"convert + restore": convert_restore, "direct": direct}
        rounds = []
        for r in range(args.rounds):
            w, rd = disk(scratch)
            row = {"load": os.getloadavg()[0], "disk_write_mbs": w, "disk_read_mbs": rd}
            results = {}
            for name, run in contenders.items() if r % 2 == 0 else reversed(contenders.items()):
                if args.cold:
                    evict(src)
                before, t = written(), time.perf_counter()
                results[name] = run()
                row[name] = time.perf_counter() - t
                row[name + " written"] = written() - before
            if r == 0:
                for a, b in zip(*(jax.tree.leaves(v) for v in results.values())):
                    assert a.sharding == b.sharding
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            del results
            row["load_after"] = os.getloadavg()[0]
            rounds.append(row)
            print(
                f"round {r}: load {row['load']:.1f}-{row['load_after']:.1f}, disk write "
                f"{w:.0f} MB/s read {rd:.0f} MB/s; convert + restore "
                f"{row['convert + restore']:.2f} s ({row['convert + restore written'] / 1e6:.0f} "
                f"MB written), direct {row['direct']:.2f} s ({row['direct written'] / 1e6:.0f} MB "
                f"written): {row['convert + restore'] / row['direct']:.2f}x"
            )
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    ratio = statistics.median(r["convert + restore"] / r["direct"] for r in rounds)
    print(
        f"median: convert + restore {med['convert + restore']:.2f} s, direct "
        f"{med['direct']:.2f} s, {ratio:.2f}x (goal >= 1.8x); direct wrote "
        f"{med['direct written']:.0f} bytes"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "when": datetime.datetime.now(datetime.UTC).isoformat(),
                    "source_bytes": nbytes,
                    "cold": args.cold,
                    "rounds": rounds,
                    "median_ratio": ratio,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
