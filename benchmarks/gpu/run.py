"""The first accelerator figures (issue 59, item 5): one command, one GPU, at most ~8 minutes.

Measured on the device JAX finds (``jax.devices()[0]``; a 1×1 ``data``×``model`` mesh), at a size
ladder (``--sizes``, GB) capped by the GPU's memory, the disk and the host's memory:

* ``save``: the same tree (float32 4096×4096 tensors made on the GPU, normal × 0.02 so Orbax's
  zstd has something to compress) saved to local disk by, alternating within each round:
  ``CheckpointManager`` (async) with ``jax_ucp.UCPSave`` (``bench_async_stall.manager_save``),
  ``jax_ucp.save`` (blocking), Orbax ``StandardCheckpointer`` (defaults: OCDBT + zstd, async) and
  Orbax ``PyTreeCheckpointHandler(use_compression=False)`` in an ``AsyncCheckpointer``; beside
  them ``jax.device_get`` of the tree, the device-to-host copy every save must at least make.
  Per save: the stall (until ``save`` returns: what a training loop waits), the whole save
  (until ``wait_until_finished``) and durable (+ ``os.sync()``), peak host RssAnon;
* ``restore``: the last round's checkpoints read back from a cold page cache onto the GPU:
  ``jax_ucp.restore(shardings=)`` vs ``StandardCheckpointer.restore`` of Orbax's two;
* ``dcp``: a torch DCP checkpoint (a Llama-like model's weights + two AdamW moments, written by
  jax_ucp's DCP writer in ``dcp.save``'s single-rank layout) restored onto the GPU, cold:
  ``jax_ucp.restore(src, target=, importing=ImportOptions())`` (read in place, nothing written)
  vs torch's ``dcp.load`` into CPU tensors + ``jax.device_put`` of each.

Every restore is checked in its first round: each tensor's fingerprint (the wrapping uint32 sum
of its bits, on the device) against the saved tree's (save/restore) or the torch route's
(dcp, as a multiset). Each part runs in a child process (the parent never touches the GPU);
a rung is run only when the time it is predicted to take, scaled from the rung before, fits
``--budget-s`` (then with fewer rounds where that fits), and a child past the budget is stopped:
what it measured stays. Medians of the rounds; the table is printed and written with the JSON
under ``--out`` (default ``$OUT``, else ``./gpu_out``).

    python3 benchmarks/gpu/run.py                      # 1, 4, 16 GB, 3 rounds, 450 s
    python3 benchmarks/gpu/run.py --cpu-smoke --torch-python /work/venv-torch/bin/python

Without a GPU it says so and runs the same code at the ``--cpu-smoke`` sizes on the CPU.
benchmarks/gpu/README.md: the wheels the device machine needs and the one command to run there.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
ROOT = os.path.dirname(BENCH)
sys.path[:0] = [ROOT, BENCH]

from bench_scale import disk_free, mem_available, random_bits  # noqa: E402  # pyright: ignore[reportMissingImports]

GB = 10**9
GiB = 2**30
MiB = 2**20
SMOKE_SIZES = "0.016,0.064"
SAVES = ("jax_ucp UCPSave (manager, async)", "jax_ucp.save", "orbax default", "orbax no-compr",
         "jax.device_get (D2H only)")  # fmt: skip
RESTORES = ("jax_ucp.restore", "orbax default", "orbax no-compr")
DCPS = ("jax_ucp.restore (direct)", "torch dcp.load + device_put")
OURS = {"save": SAVES[0], "restore": RESTORES[0], "dcp": DCPS[0]}


def emit(kind: str, obj) -> None:
    """One line the parent reads (``ROW``: a measurement, ``INFO``: facts, ``PHASE``: timings)."""
    print(f"{kind} {json.dumps(obj)}", flush=True)


# ------------------------------------------------------------------------------ the children


def child_probe(a) -> None:
    """What this process runs on: versions, JAX's backend and device, torch and its CUDA."""
    from importlib import metadata

    info: dict = {"python": sys.version.split()[0], "executable": sys.executable}
    for dist in ("jax", "jaxlib", "orbax-checkpoint", "tensorstore", "numpy", "torch"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            info[dist] = metadata.version(dist)
    if a.what == "jax":
        import jax

        dev = jax.devices()[0]
        stats = dev.memory_stats() or {}
        info |= {
            "backend": jax.default_backend(),
            "platform": dev.platform,
            "device_kind": dev.device_kind,
            "device_count": jax.device_count(),
            "device_memory_limit": stats.get("bytes_limit"),
            "device_bytes_in_use": stats.get("bytes_in_use"),
        }
    if a.what == "torch":
        try:
            import torch  # pyright: ignore[reportMissingImports]

            info["torch_cuda"] = torch.cuda.is_available()
            if info["torch_cuda"]:
                info["torch_device"] = torch.cuda.get_device_name(0)
        except ImportError as e:
            info["torch_error"] = str(e)
    emit("INFO", info)


def fingerprint_fn():
    import jax
    import jax.numpy as jnp

    @jax.jit
    def fp(x):
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
        return jnp.sum(bits, dtype=jnp.uint32)

    return lambda x: (tuple(x.shape), str(x.dtype), int(fp(x)))


def device_peak(dev) -> int | None:
    stats = dev.memory_stats()
    return None if not stats else stats.get("peak_bytes_in_use")


class Rounds:
    """The rounds of one phase, alternating order, stopped before ``deadline`` once the last
    round says the next would not fit (at least one round always runs); ``final`` is set on the
    round known to be the last before it runs (its checkpoints are the ones kept)."""

    def __init__(self, n: int, deadline: float, names):
        self.n, self.deadline, self.names = n, deadline, list(names)
        self.final = n == 1

    def __iter__(self):
        last = None
        for r in range(self.n):
            now = time.time()
            if last is not None and now + last > self.deadline:
                emit("INFO", {"note": f"time guard: stopped after {r} of {self.n} rounds"})
                return
            self.final = r == self.n - 1 or (last is not None and now + 2 * last > self.deadline)
            t = time.perf_counter()
            yield r, (self.names if r % 2 == 0 else self.names[::-1])
            last = time.perf_counter() - t
            if self.final:
                return


def timed(fn):
    """``fn()``'s result, seconds and the peak host RssAnon above the start (sampled 10 ms)."""
    import rss  # pyright: ignore[reportMissingImports]

    gc.collect()
    base = rss.status().get("RssAnon", 0)
    with rss.Peak() as peak:
        t0 = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t0
    return out, seconds, peak.anon - base


def child_jax(a) -> None:
    """The save and restore parts at one size, in one process (the tree made once, on the
    device): every save contender per round, then every restore of the last round's saves."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from bench_async_stall import copy_device_get, manager_save  # pyright: ignore[reportMissingImports]
    from bench_save_restore import evict  # pyright: ignore[reportMissingImports]
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ucp

    t_setup = time.perf_counter()
    dev = jax.devices()[0]
    sharding = NamedSharding(Mesh(np.array([[dev]]), ("data", "model")), P("data", "model"))
    shape = (a.side, a.side)
    n = max(1, round(a.gb * GB / (a.side * a.side * 4)))
    make = jax.jit(lambda k: jax.random.normal(k, shape) * 0.02, out_shardings=sharding)
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    tree = {f"w{i:04d}": make(keys[i]) for i in range(n)}
    jax.block_until_ready(tree)
    nbytes = sum(x.nbytes for x in tree.values())
    fp = fingerprint_fn()
    saved = {k: fp(x) for k, x in tree.items()}
    work = a.dir
    mngr = ocp.CheckpointManager(
        os.path.join(work, "manager"),
        options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True, create=True),
    )
    standard = ocp.StandardCheckpointer()
    no_compr = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
    paths = {name: os.path.join(work, f"save{i}") for i, name in enumerate(SAVES)}

    def save(name: str, step: int, t) -> tuple[float, float, int]:
        """(stall, whole save, peak host RssAnon) of one save of ``t``."""
        path = paths[name]
        if name == SAVES[0]:
            stall, total, peak = manager_save(mngr, step, t, jax_ucp.UCPSave)
            return stall, total, peak
        if name == "jax_ucp.save":
            _, total, peak = timed(lambda: jax_ucp.save(path, t))
            return total, total, peak
        if name == "jax.device_get (D2H only)":
            out, total, peak = timed(lambda: copy_device_get(t))
            del out
            return total, total, peak
        ck = standard if name == "orbax default" else no_compr
        marks = []

        def run():
            t0 = time.perf_counter()
            if ck is standard:
                standard.save(path, t)
            else:
                no_compr.save(path, args=ocp.args.PyTreeSave(t))
            marks.append(time.perf_counter() - t0)
            ck.wait_until_finished()

        _, total, peak = timed(run)
        return marks[0], total, peak

    def where(name: str, step: int) -> str:
        return os.path.join(str(mngr.directory), str(step)) if name == SAVES[0] else paths[name]

    def clear(name: str, step: int) -> None:
        shutil.rmtree(where(name, step), ignore_errors=True)

    # warm-up, untimed: every contender once on a small tree (imports, compiles, thread pools)
    small = {"a": make(keys[0])[: a.side // 4], "b": make(keys[0])}
    for name in SAVES:
        save(name, 0, small)
        clear(name, 0)
    emit("PHASE", {"part": "save", "setup_s": time.perf_counter() - t_setup})
    emit("INFO", {"tensors": n, "bytes": nbytes, "device_peak_after_tree": device_peak(dev)})

    kept = {"jax_ucp.save": RESTORES[0], "orbax default": RESTORES[1],
            "orbax no-compr": RESTORES[2]}  # fmt: skip
    rounds = Rounds(a.rounds, a.deadline_save, SAVES)
    for r, order in rounds:
        t_round = time.perf_counter()
        for name in order:
            clear(name, r + 1)
            os.sync()  # earlier dirty pages are not charged to this save
            stall, total, peak = save(name, r + 1, tree)
            t = time.perf_counter()
            os.sync()
            durable = total + time.perf_counter() - t
            on_disk = du(where(name, r + 1)) if os.path.isdir(where(name, r + 1)) else None
            emit("ROW", {"part": "save", "contender": name, "round": r, "stall_s": stall,
                         "whole_s": total, "durable_s": durable, "host_peak": peak,
                         "bytes": nbytes, "on_disk": on_disk})  # fmt: skip
            if not (rounds.final and name in kept):  # the disk holds 3 checkpoints at most
                clear(name, r + 1)
        emit("PHASE", {"part": "save", "round_s": time.perf_counter() - t_round})
    sources = {kept[name]: paths[name] for name in kept}
    for name in kept:  # the rounds stopped before the one meant to keep them
        if not os.path.isdir(paths[name]):
            emit("INFO", {"note": f"{name}: saved again (untimed) for the restores"})
            save(name, 0, tree)
    mngr.close()
    standard.close()
    no_compr.close()
    del tree, small
    gc.collect()

    # restore: the last round's checkpoints, from a cold page cache, onto the device
    names = sorted(saved)
    abstract = {k: jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding) for k in names}
    with ocp.StandardCheckpointer() as reader:

        def restore(name: str):
            if name == RESTORES[0]:
                return jax_ucp.restore(sources[name], shardings=dict.fromkeys(names, sharding))
            return reader.restore(sources[name], abstract)

        for r, order in Rounds(a.rounds, a.deadline, RESTORES):
            t_round = time.perf_counter()
            for name in order:
                if not a.warm:
                    evict(sources[name])

                def run(name=name):
                    out = restore(name)
                    jax.block_until_ready(out)
                    return out

                out, seconds, peak = timed(run)
                if r == 0:
                    check_restored(name, out, saved, sharding, fp)
                emit("ROW", {"part": "restore", "contender": name, "round": r,
                             "seconds": seconds, "host_peak": peak, "bytes": nbytes})  # fmt: skip
                del out
                gc.collect()
            emit("PHASE", {"part": "restore", "round_s": time.perf_counter() - t_round})
    emit("INFO", {"device_peak": device_peak(dev)})
    for path in paths.values():
        shutil.rmtree(path, ignore_errors=True)


def check_restored(name: str, out: dict, saved: dict, sharding, fp) -> None:
    """``out`` holds the saved values, on the device asked for: else the run stops."""
    if sorted(out) != sorted(saved):
        raise SystemExit(f"{name}: restored {len(out)} tensors, saved {len(saved)}")
    for k, x in out.items():
        if x.sharding != sharding or fp(x) != saved[k]:
            raise SystemExit(f"{name}: tensor {k} differs from the saved one ({x.sharding})")


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def small_llama_shapes(gb: float) -> dict[str, tuple[int, ...]]:
    """``bench_direct_restore.llama_shapes`` at a quarter of its width (hidden 256, vocab
    1000): the --cpu-smoke sizes (its smallest is 0.33 GB)."""
    h, kv, f, v = 256, 64, 704, 1000
    shapes = {"embed_tokens.weight": (v, h), "norm.weight": (h,), "lm_head.weight": (v, h)}
    per_layer = 2 * h * h + 2 * kv * h + 3 * f * h + 2 * h
    for i in range(max(1, round((gb * GB / 12 - 2 * v * h - h) / per_layer))):
        p = f"layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "q_proj.weight": (h, h),
                   p + "k_proj.weight": (kv, h), p + "v_proj.weight": (kv, h),
                   p + "o_proj.weight": (h, h), p + "post_attention_layernorm.weight": (h,),
                   p + "gate_proj.weight": (f, h), p + "up_proj.weight": (f, h),
                   p + "down_proj.weight": (h, f)}  # fmt: skip
    return shapes


def write_dcp(folder: str, shapes: dict) -> None:
    """A torch DCP checkpoint of ``params``, ``opt_state.mu``, ``opt_state.nu`` of ``shapes``
    (``bench_direct_restore.write_dcp_source``'s layout), incompressible float32 made fast
    (``bench_scale.random_bits``), one tensor in memory at a time."""
    import math

    import numpy as np

    from jax_ucp._src.torchfiles import dcp

    groups = (("params",), ("opt_state", "mu"), ("opt_state", "nu"))
    items = [
        dcp.DcpItem(".".join((*g, n)), (*g, n), s, np.dtype(np.float32))
        for g in groups
        for n, s in shapes.items()
    ]
    rng = np.random.default_rng(0)
    arrays = (
        random_bits(rng, math.prod(s), np.float32).reshape(s)
        for _ in groups
        for s in shapes.values()
    )
    os.makedirs(folder)
    dcp.write_dcp(folder, items, arrays, save_id="benchmarks-gpu")


def child_dcp(a) -> None:
    """A torch DCP source restored onto the device: jax_ucp's direct restore vs ``dcp.load``
    into CPU tensors (what a torch user holds: the model's state dict) + ``jax.device_put``."""
    import jax
    import numpy as np

    dev = jax.devices()[0]  # JAX's backend up before torch loads its CUDA libraries
    import torch  # pyright: ignore[reportMissingImports]
    import torch.distributed.checkpoint as tdcp  # pyright: ignore[reportMissingImports]
    from bench_direct_restore import (  # pyright: ignore[reportMissingImports]
        evict,
        llama_shapes,
        spec_of,
        target_of,
        to_numpy,
    )
    from jax.sharding import Mesh, NamedSharding
    from torch.distributed.checkpoint.metadata import (  # pyright: ignore[reportMissingImports]
        TensorStorageMetadata,
    )

    import jax_ucp
    from jax_ucp.conversion import ImportOptions

    t_setup = time.perf_counter()
    mesh = Mesh(np.array([[dev]]), ("data", "model"))
    fp = fingerprint_fn()

    def torch_state(src: str) -> dict:
        meta = tdcp.FileSystemReader(src).read_metadata().state_dict_metadata
        return {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
                for k, m in meta.items() if isinstance(m, TensorStorageMetadata)}  # fmt: skip

    def direct(src: str, target) -> list:
        out = jax_ucp.restore(src, target=target, importing=ImportOptions())
        return [x for x in jax.tree.leaves(out) if isinstance(x, jax.Array)]

    def torch_route(src: str, state: dict) -> list:
        tdcp.load(state, storage_reader=tdcp.FileSystemReader(src))
        return [
            jax.device_put(to_numpy(t), NamedSharding(mesh, spec_of(tuple(t.shape), mesh)))
            for t in state.values()
        ]

    warm = os.path.join(a.dir, "warm")
    write_dcp(warm, small_llama_shapes(0.001))
    jax.block_until_ready(direct(warm, target_of(warm, mesh)))
    jax.block_until_ready(torch_route(warm, torch_state(warm)))
    shutil.rmtree(warm)
    src = os.path.join(a.dir, "dcp")
    shapes = small_llama_shapes(a.gb) if a.small else llama_shapes(a.gb)
    write_dcp(src, shapes)
    nbytes = du(src)
    target = target_of(src, mesh)
    emit("PHASE", {"part": "dcp", "setup_s": time.perf_counter() - t_setup})
    emit("INFO", {"dcp_tensors": 3 * len(shapes), "dcp_bytes": nbytes})
    got = {}
    for r, order in Rounds(a.rounds, a.deadline, DCPS):
        t_round = time.perf_counter()
        for name in order:
            state = torch_state(src) if name == DCPS[1] else None
            if not a.warm:
                evict(src)

            def run(name=name, state=state):
                out = direct(src, target) if state is None else torch_route(src, state)
                jax.block_until_ready(out)
                return out

            out, seconds, peak = timed(run)
            if r == 0:
                got[name] = collections.Counter(fp(x) for x in out)
                if any(x.devices() != {dev} for x in out):
                    raise SystemExit(f"{name}: a tensor is not on {dev}")
            emit("ROW", {"part": "dcp", "contender": name, "round": r, "seconds": seconds,
                         "host_peak": peak, "bytes": nbytes})  # fmt: skip
            del out, state
            gc.collect()
        if r == 0 and got[DCPS[0]] != got[DCPS[1]]:
            raise SystemExit("the direct restore and torch's dcp.load gave different tensors")
        if r == 0:
            emit("INFO", {"note": f"dcp: {sum(got[DCPS[0]].values())} tensors equal both ways"})
        emit("PHASE", {"part": "dcp", "round_s": time.perf_counter() - t_round})
    shutil.rmtree(src, ignore_errors=True)


# ------------------------------------------------------------------------------ the parent


def unmet_requirements() -> list[str]:
    """jax_ucp's dependencies (pyproject.toml) this python lacks or has too old: the device
    image holds the JAX stack and torch, the rest travels as wheels (README.md)."""
    import tomllib
    from importlib import metadata

    from packaging.requirements import Requirement

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    unmet = []
    for dep in map(Requirement, deps):
        try:
            have = metadata.version(dep.name)
        except metadata.PackageNotFoundError:
            unmet.append(f"{dep} (not installed)")
            continue
        if not dep.specifier.contains(have, prereleases=True):
            unmet.append(f"{dep} (found {have})")
    return unmet


def fs_type(path: str) -> str:
    """The file system ``path`` is on (its longest mount point in /proc/mounts)."""
    best, kind = "", "?"
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            _, mount, typ, *_ = line.split()
            if os.path.abspath(path).startswith(mount) and len(mount) > len(best):
                best, kind = mount, typ
    return kind


def nvidia_smi() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    q = "name,driver_version,memory.total,memory.free"
    proc = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    return proc.stdout.strip() or proc.stderr.strip()


class Child:
    """One child process: its ``ROW``/``INFO``/``PHASE`` lines collected, the rest echoed,
    stopped at ``kill_at`` (epoch seconds; what it printed stays)."""

    def __init__(self, python: str, argv: list[str], env: dict, kill_at: float, log: str):
        self.rows: list = []
        self.info: dict = {}
        self.phases: list = []
        self.notes: list[str] = []
        self.killed = False
        cmd = [python, os.path.abspath(__file__), *argv]
        t0 = time.perf_counter()
        with open(log, "ab") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                    env=env, cwd=ROOT)  # fmt: skip
            timer = threading.Timer(max(1.0, kill_at - time.time()), self._kill, (proc,))
            timer.start()
            assert proc.stdout is not None
            for line in proc.stdout:
                self._line(line.rstrip("\n"))
            self.rc = proc.wait()
            timer.cancel()
        self.wall_s = time.perf_counter() - t0
        self.error = None  # what a failed child left in the log (its rows so far stay)
        if self.rc and not self.killed:
            with open(log, errors="replace") as f:
                self.error = f"{' '.join(argv[:4])} failed ({self.rc}):\n{f.read()[-3000:]}"
            print(self.error, flush=True)

    def _kill(self, proc) -> None:
        self.killed = True
        print("  time guard: the budget is spent, child stopped", flush=True)
        proc.kill()

    def _line(self, line: str) -> None:
        kind, _, rest = line.partition(" ")
        if kind == "ROW":
            row = json.loads(rest)
            self.rows.append(row)
            extra = f" stall {row['stall_s']:7.3f} s" if "stall_s" in row else ""
            secs = row.get("durable_s", row.get("seconds"))
            print(f"  {row['part']:7} r{row['round']} {row['contender']:34}{extra} "
                  f"{secs:8.3f} s  host +{row['host_peak'] / MiB:6.0f} MiB", flush=True)  # fmt: skip
        elif kind == "INFO":
            info = json.loads(rest)
            if "note" in info:
                self.notes.append(info.pop("note"))
                print(f"  {self.notes[-1]}", flush=True)
            self.info |= info
        elif kind == "PHASE":
            self.phases.append(json.loads(rest))
        elif line.strip():
            print(f"  | {line}", flush=True)


def child_env(platforms: str) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore", JAX_PLATFORMS=platforms)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # the device's memory as the run uses it
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["PYTHONPATH"] = os.pathsep.join([ROOT, BENCH, env.get("PYTHONPATH", "")])
    return env


def probe(python: str, what: str, env: dict, log: str) -> dict:
    child = Child(python, ["--child", "probe", "--what", what], env, time.time() + 120, log)
    if child.error or child.killed:
        raise RuntimeError(child.error or "the probe took over 120 s")
    return child.info


def caps(a, info: dict, work: str) -> dict[str, float]:
    """The largest size (GB) the device's memory, the disk and the host's memory allow: the
    device holds the tree or one restore (×1.25 room), the disk the three checkpoints kept for
    the restores (×3.2) or the DCP source, the host one copy of the tree beside Orbax's (×2.5)."""
    out = {"disk": (disk_free(work) - 2 * GB) / 3.2 / GB}
    out["host"] = (mem_available() - 8 * GiB) / 2.5 / GB
    if info.get("device_memory_limit"):
        out["device"] = info["device_memory_limit"] / 1.25 / GB
    return out


def predict(spent: dict, gb: float, prev: float, rounds: int) -> float:
    """Seconds a rung of ``gb`` takes with ``rounds`` rounds, from the rung of ``prev`` GB: the
    processes' start and imports as they were, the setup and each round scaled by the size."""
    return spent["fixed"] + gb / prev * (spent["setup"] + rounds * spent["round"])


def spent_of(children: list) -> dict:
    """Of a rung: seconds of the setups (the tree, the DCP source, the warm-ups), of one round
    (every part's median round summed), and the rest of the children's wall time (starts,
    imports, clean-up)."""
    setup = sum(p.get("setup_s", 0) for c in children for p in c.phases)
    by_part: dict = collections.defaultdict(list)
    for c in children:
        for p in c.phases:
            if "round_s" in p:
                by_part[p["part"]].append(p["round_s"])
    rounds = sum(sum(v) for v in by_part.values())
    fixed = max(0.0, sum(c.wall_s for c in children) - setup - rounds)
    return {
        "fixed": fixed,
        "setup": setup,
        "round": sum(statistics.median(v) for v in by_part.values()),
    }


def summarize(rows: list) -> list[dict]:
    """Medians per (part, size, contender), with the ratio to jax_ucp's."""
    groups: dict = collections.defaultdict(list)
    for r in rows:
        groups[(r["part"], r["size_gb"], r["contender"])].append(r)
    out = []
    for (part, size, name), rs in groups.items():
        med = lambda k, rs=rs: statistics.median(r[k] for r in rs)
        s = {"part": part, "size_gb": size, "contender": name, "rounds": len(rs),
             "bytes": rs[0]["bytes"], "host_peak_mib": max(r["host_peak"] for r in rs) / MiB}  # fmt: skip
        if part == "save":
            s["on_disk_bytes"] = rs[-1].get("on_disk")
            s |= {"stall_s": med("stall_s"), "whole_s": med("whole_s"),
                  "durable_s": med("durable_s"), "each_durable_s": [r["durable_s"] for r in rs]}  # fmt: skip
            s["seconds"] = s["durable_s"]
        else:
            s |= {"seconds": med("seconds"), "each_s": [r["seconds"] for r in rs]}
        s["gb_per_s"] = s["bytes"] / GB / s["seconds"]
        out.append(s)
    for s in out:
        ours = next((o for o in out if o["part"] == s["part"] and o["size_gb"] == s["size_gb"]
                     and o["contender"] == OURS[s["part"]]), None)  # fmt: skip
        if ours is not None and s is not ours and "D2H" not in s["contender"]:
            s["x_jax_ucp"] = s["seconds"] / ours["seconds"]
            if s["part"] == "save":
                s["stall_x_jax_ucp"] = s["stall_s"] / ours["stall_s"]
    order = {"save": 0, "restore": 1, "dcp": 2}
    return sorted(out, key=lambda s: (order[s["part"]], s["size_gb"]))


def table(summary: list[dict]) -> str:
    lines = [
        "| part | GB | contender | rounds | stall s | × | whole s | durable / restore s | GB/s "
        "| × jax_ucp | host peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        stall = f"{s['stall_s']:.3f}" if "stall_s" in s else ""
        sx = f"{s['stall_x_jax_ucp']:.2f}" if "stall_x_jax_ucp" in s else ""
        whole = f"{s['whole_s']:.3f}" if "whole_s" in s else ""
        x = f"{s['x_jax_ucp']:.2f}" if "x_jax_ucp" in s else ""
        lines.append(
            f"| {s['part']} | {s['bytes'] / GB:.3g} | {s['contender']} | {s['rounds']} | {stall} "
            f"| {sx} | {whole} | {s['seconds']:.3f} | {s['gb_per_s']:.2f} | {x} "
            f"| {s['host_peak_mib']:.0f} |"
        )
    lines += [
        "",
        "stall: until save() returns (jax_ucp.save and device_get block: stall = whole); whole: "
        "until wait_until_finished; durable: + os.sync(); ×: the contender's time ÷ jax_ucp's "
        "(UCPSave in the manager for save, jax_ucp.restore for restore and dcp), > 1 = jax_ucp "
        "faster; host peak: RssAnon above the start. Medians of the rounds.",
    ]
    return "\n".join(lines)


def ladder(a, smoke: bool, cap: float) -> tuple[list[float], list[str]]:
    """The sizes to run (GB) and why any was dropped or lowered to ``cap``."""
    sizes = [float(x) for x in (SMOKE_SIZES if smoke else a.sizes).split(",")]
    keep, notes = [], []
    for gb in sizes:
        if gb <= cap:
            keep.append(gb)
        elif cap >= 1.5 * (keep[-1] if keep else 0) and cap >= 0.25:
            keep.append(float(int(cap)) if cap >= 2 else round(cap, 2))
            notes.append(f"{gb:g} GB lowered to {keep[-1]:g} GB (the cap)")
            break
        else:
            notes.append(f"{gb:g} GB dropped: over the cap of {cap:.1f} GB")
            break
    return keep, notes


def report_host(work: str) -> dict:
    with open("/proc/meminfo") as f:
        total = int(next(x for x in f if x.startswith("MemTotal")).split()[1]) * 1024
    return {"cpus": os.cpu_count(), "mem_total_gib": total / GiB,
            "mem_available_gib": mem_available() / GiB, "work_dir": work,
            "work_fs": fs_type(work), "disk_free_gb": disk_free(work) / GB,
            "nvidia_smi": nvidia_smi()}  # fmt: skip


def parent(a) -> int:
    t0 = time.time()
    deadline = t0 + a.budget_s
    out = a.out or os.environ.get("OUT") or os.path.join(os.getcwd(), "gpu_out")
    os.makedirs(out, exist_ok=True)
    log = os.path.join(out, "children_stderr.log")
    open(log, "w").close()
    doc: dict = {"command": " ".join(["python3", *sys.argv]), "started_utc": utc()}
    unmet = unmet_requirements()
    doc["unmet_requirements"] = unmet
    if any(u.endswith("(not installed)") for u in unmet):
        write(out, doc, "")
        print(f"{sys.executable} lacks jax_ucp's requirements: {'; '.join(unmet)}. "
              "benchmarks/gpu/README.md says which wheels to carry.")  # fmt: skip
        return 2
    if unmet:
        print(f"warning: older than pyproject.toml asks: {'; '.join(unmet)}", flush=True)
    work = a.dir
    if fs_type(os.path.dirname(work) or "/") in ("tmpfs", "ramfs"):
        work = os.path.join(ROOT, ".gpu_bench_work")  # memory is no local disk
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    host = report_host(work)
    try:
        info = probe(sys.executable, "jax", child_env("cpu" if a.cpu_smoke else ""), log)
    except RuntimeError as e:  # no JAX backend at all: nothing to measure
        doc["error"] = str(e)
        write(out, doc, "")
        print(f"JAX did not start: {e}")
        return 3
    try:
        got = probe(a.torch_python, "torch", child_env("cpu"), log)
        info |= {k: v for k, v in got.items() if k.startswith("torch")}
    except RuntimeError as e:
        info["torch_error"] = str(e)[-500:]
    info["torch_python"] = a.torch_python
    gpu = info.get("backend") not in (None, "cpu")
    smoke = a.cpu_smoke or not gpu
    doc |= {"host": host, "runtime": info, "smoke": smoke}
    print(f"host: {host}\nruntime: {info}", flush=True)
    if not gpu and not a.cpu_smoke:
        print("no accelerator: JAX's backend is cpu; running the --cpu-smoke sizes", flush=True)
    cap = caps(a, info, work)
    sizes, notes = ladder(a, smoke, min(cap.values()))
    a.notes = notes
    if "torch_error" in info and "dcp" in a.parts:
        a.parts = a.parts.replace("dcp", "")
        notes.append(f"dcp part left out: {a.torch_python} has no torch (--torch-python)")
        print(notes[-1], flush=True)
    doc |= {"caps_gb": cap, "ladder_gb": sizes, "notes": notes}
    print(f"caps (GB): {cap}; ladder: {sizes} {notes}", flush=True)
    env = child_env("cpu" if smoke else "")
    rows: list = []
    prev = None
    try:
        for gb in sizes:
            rounds = a.rounds
            if prev is not None:
                left = deadline - time.time()
                fits = [
                    r for r in range(a.rounds, 0, -1) if predict(prev[1], gb, prev[0], r) < left
                ]
                if not fits:
                    msg = (f"time guard: {gb:g} GB predicted {predict(prev[1], gb, prev[0], 1):.0f} s"
                           f" with one round, {left:.0f} s left: the ladder stops")  # fmt: skip
                    print(msg, flush=True)
                    doc["notes"].append(msg)
                    break
                rounds = fits[0]
                doc["notes"].append(f"{gb:g} GB: predicted {predict(prev[1], gb, prev[0], rounds):.0f} s "
                                    f"with {rounds} rounds, {left:.0f} s left")  # fmt: skip
            print(f"[{gb:g} GB] {utc()}, {rounds} rounds, {deadline - time.time():.0f} s left",
                  flush=True)  # fmt: skip
            children = run_rung(a, gb, rounds, smoke, env, deadline, work, log)
            for c in children:
                rows += [r | {"size_gb": gb} for r in c.rows]
                doc.setdefault("child_info", {}).setdefault(str(gb), {}).update(c.info)
                doc["notes"] += [f"{gb:g} GB: {n}" for n in c.notes]
            if any(c.killed for c in children):
                doc["notes"].append(f"{gb:g} GB: stopped by the time guard")
                break
            if any(c.error for c in children):
                doc["notes"] += [f"{gb:g} GB: {c.error}" for c in children if c.error]
                break
            prev = (gb, spent_of(children))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        doc["rows"] = rows
        doc["summary"] = summarize(rows)
        doc["wall_s"] = time.time() - t0
        md = table(doc["summary"])
        head = (f"{info.get('device_kind', '?')} ({info.get('backend', '?')} backend, "
                f"jax {info.get('jax')}, orbax {info.get('orbax-checkpoint')}, torch "
                f"{info.get('torch')}){' — CPU smoke' if smoke else ''}, {utc()}, "
                f"{doc['wall_s']:.0f} s, disk {host['work_fs']}")  # fmt: skip
        write(out, doc, f"{head}\n\n{md}\n")
        print(f"\n{head}\n\n{md}\n\nwritten: {out}/gpu_bench.json, {out}/gpu_bench.md")
    return 0


def run_rung(a, gb, rounds, smoke, env, deadline, work, log) -> list:
    """The jax child (save, restore) then the dcp child at ``gb`` GB: the jax child's saves
    stop in time to leave its restores and the dcp child their share of what is left."""
    side = 512 if smoke else 4096
    common = ["--gb", str(gb), "--side", str(side), "--dir", work]
    common += (["--warm"] if a.warm else []) + (["--small"] if smoke else [])
    left = deadline - time.time()
    dcp_share = 0.35 if "dcp" in a.parts else 0.0
    save_by = time.time() + left * (1 - dcp_share) * 0.6
    jax_by = time.time() + left * (1 - dcp_share)
    children = []
    if "jax" in a.parts:
        argv = ["--child", "jax", *common, "--rounds", str(rounds),
                "--deadline-save", str(save_by), "--deadline", str(jax_by)]  # fmt: skip
        children.append(Child(sys.executable, argv, env, deadline, log))
        if children[-1].killed or children[-1].error:
            return children
    if "dcp" in a.parts:
        argv = ["--child", "dcp", *common, "--rounds", str(rounds), "--deadline", str(deadline)]
        child = Child(a.torch_python, argv, env, deadline, log)
        children.append(child)
        if child.error:  # the save and restore figures stand; no dcp on later rungs
            a.parts = a.parts.replace("dcp", "")
            why = "no torch" if "No module named 'torch'" in child.error else "failed"
            a.notes.append(f"dcp part: {why} in {a.torch_python} (--torch-python): "
                           f"{child.error[-300:]}")  # fmt: skip
            child.error = None
    return children


def utc() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def write(out: str, doc: dict, md: str) -> None:
    with open(os.path.join(out, "gpu_bench.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(out, "gpu_bench.md"), "w") as f:
        f.write(md)


def main() -> int:
    ap = argparse.ArgumentParser(description="jax_ucp on one GPU: save stall, restore, DCP")
    ap.add_argument("--sizes", default="1,4,16", help="GB, ascending, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per part (median kept)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="wall seconds for the ladder")
    ap.add_argument("--parts", default="jax,dcp", help="jax (save + restore), dcp")
    ap.add_argument("--cpu-smoke", action="store_true", help=f"on the CPU at {SMOKE_SIZES} GB")
    ap.add_argument("--torch-python", default=sys.executable, help="the python with torch")
    ap.add_argument("--dir", default="/tmp/jax_ucp_gpu_bench", help="scratch on local disk")
    ap.add_argument("--out", default=None, help="JSON + table here (default $OUT, ./gpu_out)")
    ap.add_argument("--warm", action="store_true", help="restore from the page cache, not cold")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--what", default="jax", help=argparse.SUPPRESS)
    ap.add_argument("--gb", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--side", type=int, default=4096, help=argparse.SUPPRESS)
    ap.add_argument("--small", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    ap.add_argument("--deadline-save", type=float, default=float("inf"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rounds < 1 or a.budget_s <= 0:
        ap.error(f"--rounds must be >= 1 and --budget-s > 0, got {a.rounds} and {a.budget_s}")
    if a.child:
        {"probe": child_probe, "jax": child_jax, "dcp": child_dcp}[a.child](a)
        return 0
    return parent(a)


if __name__ == "__main__":
    sys.exit(main())
