"""Many small tensors in one tree: save and restore time per tensor, jax_ucp vs Orbax.

Trees (float32, each leaf on one CPU device, restored onto the same device):
  * "10k × 16 KiB": 10,000 tensors of 64×64;
  * "mix 4 KiB–1 MiB": sizes log-uniform in [4 KiB, 1 MiB] (rows of 256 floats), as many as it
    takes to hold the bytes of the third tree;
  * "100 × 4 MiB": 100 tensors of 1024×1024 (the same bytes as the mix, few large tensors).
Contenders alternate within each round (jax_ucp default, Orbax ``StandardCheckpointer``
defaults, Orbax without compression); medians over rounds; page cache evicted before restores.

  python benchmarks/bench_many_tensors.py [--rounds 2] [--trees 10k,mix,large] [--json F]

``--manifest N`` measures reading instead (issue 41): a checkpoint of N tiny tensors named like
an MoE model's (``params/layers/{i}/experts/{j}/w{1,2,3}``, saved once, replicated on 8 CPU
devices, and cached under ``--dir``), then, each in a fresh process, wall time (start-up and imports included)
and peak RSS of ``jax_ucp.inspect``, ``jax-ucp inspect``, ``jax-ucp plan --mesh data=8`` and
``restore(select=<one tensor>)``:

  python benchmarks/bench_many_tensors.py --manifest 100000 [--rounds 1] [--dir /tmp/ucp_many]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import orbax.checkpoint as ocp
from bench_save_restore import du, evict

import jax_ucp


def host_trees(which: list[str]) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    trees = {}
    large_bytes = 100 * (4 << 20)
    if "10k" in which:
        trees["10k × 16 KiB"] = {
            f"t{i:05d}": rng.standard_normal((64, 64), dtype=np.float32) for i in range(10_000)
        }
    if "mix" in which:
        mix, total, i = {}, 0, 0
        while total < large_bytes:
            nbytes = int(np.exp(rng.uniform(np.log(4 << 10), np.log(1 << 20))))
            rows = max(4, min(nbytes, large_bytes - total) // 1024)  # 256 floats a row
            mix[f"t{i:05d}"] = rng.standard_normal((rows, 256), dtype=np.float32)
            total += rows * 1024
            i += 1
        trees["mix 4 KiB–1 MiB"] = mix
    if "large" in which:
        trees["100 × 4 MiB"] = {
            f"t{i:03d}": rng.standard_normal((1024, 1024), dtype=np.float32) for i in range(100)
        }
    return trees


def ucp_save(path, tree):
    jax_ucp.save(path, tree)


def ucp_restore(path, target):
    out = jax_ucp.restore(path, shardings={k: v.sharding for k, v in target.items()})
    jax.block_until_ready(out)
    return out


def orbax_save(path, tree):
    with ocp.StandardCheckpointer() as ck:
        ck.save(path, tree)
        ck.wait_until_finished()


def orbax_nc_save(path, tree):
    with ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_compression=False)) as ck:
        ck.save(path, args=ocp.args.PyTreeSave(tree))
        ck.wait_until_finished()


def orbax_restore(path, target):
    with ocp.StandardCheckpointer() as ck:
        out = ck.restore(path, target)
    jax.block_until_ready(out)
    return out


CONTENDERS = {
    "jax_ucp": (ucp_save, ucp_restore),
    "orbax default": (orbax_save, orbax_restore),
    "orbax no-compr": (orbax_nc_save, orbax_restore),
}


EXPERTS = 256  # DeepSeek-V3's routed experts per layer


def moe_names(n: int) -> list[tuple[str, tuple[int, ...]]]:
    """The first ``n`` (name, shape) of an MoE model's tensors, layer by layer: attention and
    norms, a router, then ``EXPERTS`` experts of w1, w2, w3 (tiny shapes: only the count
    matters)."""
    out: list[tuple[str, tuple[int, ...]]] = []
    layer = 0
    while len(out) < n:
        base = f"layers/{layer}"
        out += [(f"{base}/attn/{w}", (4, 4)) for w in ("q", "k", "v", "o")]
        out += [(f"{base}/{w}", (4,)) for w in ("attn_norm", "mlp_norm")]
        out.append((f"{base}/router", (4, 2)))
        for j in range(EXPERTS):
            out += [(f"{base}/experts/{j}/{w}", s) for w, s in MOE_W.items()]
        layer += 1
    return out[:n]


MOE_W = {"w1": (2, 4), "w2": (4, 2), "w3": (2, 4)}


def nested(flat: dict[str, object]) -> dict:
    """``{"a/b": x}`` as ``{"a": {"b": x}}``."""
    tree: dict = {}
    for name, leaf in flat.items():
        *parents, last = name.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = leaf
    return tree


def many_checkpoint(n: int, root: str) -> str:
    """The cached checkpoint of ``n`` MoE-named tensors under ``root`` (saved on first use)."""
    path = os.path.join(root, f"moe_{n}")
    if os.path.exists(os.path.join(path, "ucp.json")):
        return path
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(0)
    # replicated on a data=2 × model=4 mesh: each entry records its saved sharding, as a
    # model's saved from a mesh does (~800 bytes an entry of ucp.json)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    flat = {
        name: jax.device_put(rng.standard_normal(shape, dtype=np.float32), replicated)
        for name, shape in moe_names(n)
    }
    print(f"saving {n} tensors to {path} (once; cached) ...", flush=True)
    t0 = time.perf_counter()
    jax_ucp.save(path, {"params": nested(flat)})
    print(f"  saved in {time.perf_counter() - t0:.0f} s", flush=True)
    return path


def measured(code: str) -> tuple[float, float, int]:
    """Wall time, CPU time (user + system: steadier than wall time on a loaded host) and peak
    RSS of ``python -c code`` in a fresh process; raises with its output if it fails. The peak
    is the child's own VmHWM, read as it exits (``ru_maxrss`` would carry over this parent's,
    charged to the child at exec)."""
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    with tempfile.NamedTemporaryFile("r") as status, tempfile.TemporaryFile() as out:
        prelude = (
            "import atexit; atexit.register(lambda: open("
            f"{status.name!r}, 'w').write(open('/proc/self/status').read()))\n"
        )
        t0 = time.perf_counter()
        p = subprocess.Popen(
            [sys.executable, "-c", prelude + code], stdout=out, stderr=out, env=env
        )
        _, code_status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(code_status)
        if p.returncode:
            out.seek(0)
            raise RuntimeError(f"{code} failed ({p.returncode}):\n{out.read().decode()[-3000:]}")
        hwm = [line for line in status.read().splitlines() if line.startswith("VmHWM:")]
    return wall, usage.ru_utime + usage.ru_stime, int(hwm[0].split()[1]) * 1024


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def manifest_commands(path: str, one: str) -> dict[str, str]:
    """What ``--manifest`` measures, each Python code for a fresh process (the CLI as
    ``python -m jax_ucp.cli`` runs it)."""

    def cli(*args: str) -> str:
        argv = ["jax-ucp", *args]
        return f"import runpy, sys; sys.argv = {argv!r}; runpy.run_module('jax_ucp.cli', run_name='__main__')"

    return {
        "jax_ucp.inspect": f"import jax_ucp; jax_ucp.inspect({path!r})",
        "jax-ucp inspect": cli("inspect", path),
        "jax-ucp plan --mesh data=8": cli("plan", path, "--mesh", "data=8"),
        "restore(select=one)": "import re, jax, jax_ucp\n"
        f"out = jax_ucp.restore({path!r}, select=re.escape({one!r}))\n"
        "assert len(jax.tree.leaves(out)) == 1, out",
    }


def manifest_main(args) -> int:
    """``--manifest N``: reading a checkpoint of N tensors (see the module's docstring)."""
    n = args.manifest
    path = many_checkpoint(n, args.dir)
    size = os.path.getsize(os.path.join(path, "ucp.json"))
    names = moe_names(n)
    one = "params/" + names[len(names) // 2][0]
    print(f"{path}: {n} tensors, ucp.json {size / 1e6:.0f} MB; select {one!r}", flush=True)
    results: dict[str, list[tuple[float, float, int]]] = {}
    load = [os.getloadavg()]
    for r in range(args.rounds):
        for what, cmd in manifest_commands(path, one).items():
            results.setdefault(what, []).append(measured(cmd))
            wall, cpu, rss = results[what][-1]
            print(
                f"  round {r} {what:28s} {wall:6.2f} s (CPU {cpu:5.2f} s) {rss / 2**20:6.0f} MiB",
                flush=True,
            )
    load.append(os.getloadavg())
    med = statistics.median
    print(f"\n{'':28s} {'wall s':>7s} {'CPU s':>6s} {'peak RSS MB':>12s}   (goal < 5 s, < 500 MB)")
    for what, runs in results.items():
        wall, cpu, rss = (med(run[i] for run in runs) for i in range(3))
        print(f"{what:28s} {wall:7.2f} {cpu:6.2f} {rss / 1e6:12.0f}")
    print(
        f"(medians of {args.rounds}; each a fresh process, start-up and imports included; "
        f"load average {load[0][0]:.2f} before, {load[1][0]:.2f} after, {os.cpu_count()} CPUs)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                    "command": f"python benchmarks/bench_many_tensors.py --manifest {n} "
                    f"--rounds {args.rounds}",
                    "manifest_bytes": size,
                    "load_average": load,
                    "results": {
                        w: [{"wall_s": t, "cpu_s": c, "peak_rss": m} for t, c, m in runs]
                        for w, runs in results.items()
                    },
                },
                f,
                indent=1,
            )
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--manifest",
        type=int,
        default=0,
        metavar="N",
        help="measure inspect/plan/select-restore of a cached N-tensor checkpoint instead",
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--trees", default="10k,mix,large")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--dir", default="/tmp/ucp_many")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.manifest:
        return manifest_main(args)
    contenders = {c: CONTENDERS[c] for c in args.contenders.split(",")}
    dev = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(dev)
    hosts = host_trees(args.trees.split(","))
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    results = {}
    for tname, host in hosts.items():
        tree = jax.device_put(host, dev)
        jax.block_until_ready(tree)
        target = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in host.items()
        }
        nbytes = sum(v.nbytes for v in host.values())
        n = len(host)
        print(f"{tname}: {n} tensors, {nbytes / 2**20:.0f} MiB", flush=True)
        save_t = {c: [] for c in contenders}
        load_t = {c: [] for c in contenders}
        files = {}
        for r in range(args.rounds):
            order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
            for c in order:
                save_fn, load_fn = contenders[c]
                path = os.path.join(args.dir, c.replace(" ", "_"))
                shutil.rmtree(path, ignore_errors=True)
                os.sync()
                t0 = time.perf_counter()
                save_fn(path, tree)
                save_t[c].append(time.perf_counter() - t0)
                files[c] = (sum(len(f) for _, _, f in os.walk(path)), du(path))
                evict(path)
                t0 = time.perf_counter()
                out = load_fn(path, target)
                load_t[c].append(time.perf_counter() - t0)
                if args.check and r == 0:
                    for k in host:
                        assert np.array_equal(np.asarray(out[k]), host[k]), (c, k)
                del out
                gc.collect()
                shutil.rmtree(path, ignore_errors=True)
                print(
                    f"  round {r} {c:15s} save {save_t[c][-1]:6.2f}s restore {load_t[c][-1]:6.2f}s",
                    flush=True,
                )
        med = statistics.median
        results[tname] = {
            "tensors": n,
            "bytes": nbytes,
            "contenders": {
                c: {
                    "save_s": med(save_t[c]),
                    "restore_s": med(load_t[c]),
                    "save_ms_per_tensor": 1e3 * med(save_t[c]) / n,
                    "restore_ms_per_tensor": 1e3 * med(load_t[c]) / n,
                    "files": files[c][0],
                    "disk_bytes": files[c][1],
                    "all_save_s": save_t[c],
                    "all_restore_s": load_t[c],
                }
                for c in contenders
            },
        }
        del tree
        gc.collect()
    shutil.rmtree(args.dir, ignore_errors=True)
    print(
        f"\n{'tree':18s} {'contender':15s} {'save s':>7s} {'ms/tensor':>9s} {'restore s':>9s} "
        f"{'ms/tensor':>9s} {'save ×':>7s} {'restore ×':>9s} {'files':>6s}"
    )
    for tname, res in results.items():
        ref = res["contenders"].get("jax_ucp")
        for c, m in res["contenders"].items():
            sx = m["save_s"] / ref["save_s"] if ref else float("nan")
            rx = m["restore_s"] / ref["restore_s"] if ref else float("nan")
            print(
                f"{tname:18s} {c:15s} {m['save_s']:7.2f} {m['save_ms_per_tensor']:9.3f} "
                f"{m['restore_s']:9.2f} {m['restore_ms_per_tensor']:9.3f} {sx:7.2f} {rx:9.2f} "
                f"{m['files']:6d}"
            )
    print(
        "(save × / restore × = that contender's time / jax_ucp's: > 1 means jax_ucp is faster; "
        f"medians of {args.rounds} rounds)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                    "command": f"python benchmarks/bench_many_tensors.py --rounds {args.rounds} "
                    f"--trees {args.trees}",
                    "results": results,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
