#!/usr/bin/env python3
"""Elastic training resume with jax_ucp: continue a JAX run on a resized mesh, loss curve intact.

A GPT (flax) with optax AdamW trains on a synthetic next-token task on a data × fsdp × tp mesh
of 8 CPU devices, saving every K steps asynchronously through ``ocp.CheckpointManager`` +
``jax_ucp.UCPSave``. The run is killed (SIGKILL) at step T and resumed from its latest
checkpoint, each time in a FRESH process with another device count / mesh:

  (a) 4 devices, another mesh shape      (b) 2 devices
  (c) 8 devices, another dp/tp split     (d) 2 processes × 2 devices (jax.distributed, gloo)
  (e) control: 8 devices, the original mesh (must match the baseline bit for bit)
  (f) 4 devices, and the model changes layout in the same restore: per-layer -> scanned
      (nn.scan, [L, ...]) and fused QKV -> separate q/k/v, through the UCP language

while a baseline runs the same N steps uninterrupted on the original mesh. The global batch is
fixed and the data position is saved in the checkpoint. Each resumed process checks that the
state it restored is bit-exact with what was saved (sha256 of every leaf, recorded at save
time), then trains to step N; the driver prints per-step losses against the baseline with the
maximum deviation and writes a PNG of the curves (``--plot``, or into ``--workdir``). Without
``--workdir`` it works in a temporary directory that it removes at the end.

  python examples/elastic_resume.py                  # default size: ~6-10 minutes on 2 busy cores
  python examples/elastic_resume.py --small          # the test size (2 layers, width 32): ~1 minute
  python examples/elastic_resume.py --help

Internal: ``python examples/elastic_resume.py worker JOB.json`` runs one training process.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# name -> (mesh shape over ("data", "fsdp", "tp"), processes, devices per process, description)
TRAIN_MESH = (2, 2, 2)
VARIANTS = {
    "a": ((1, 1, 4), 1, 4, "4 devices, tp=4"),
    "b": ((2, 1, 1), 1, 2, "2 devices, dp=2"),
    "c": ((4, 1, 2), 1, 8, "8 devices, dp=4 tp=2"),
    "d": ((2, 1, 2), 2, 2, "2 processes x 2 devices, dp=2 (across processes) tp=2"),
    # control: the same mesh as the killed run; must reproduce the baseline bit for bit
    "e": (TRAIN_MESH, 1, 8, "8 devices, same mesh (control)"),
    # elastic + a structure change in the same restore, through the UCP language
    "f": ((1, 2, 2), 1, 4, "4 devices, scanned layers + separate q/k/v (UCP spec)"),
}
# variants that resume into another parameter layout of the same model (GPTConfig fields)
LAYOUTS = {"f": {"layout": "scanned", "fused_qkv": False}}


@dataclasses.dataclass
class Setup:
    """Everything a worker needs (JSON-serialisable)."""

    layers: int = 4
    width: int = 128
    heads: int = 4
    ffn: int = 512
    vocab: int = 128
    seq: int = 64
    batch: int = 32  # global batch, fixed for every mesh
    steps: int = 120  # N: total optimizer steps
    save_every: int = 10  # K
    interrupt_at: int = 25  # T: the run is killed here (resumes from the latest save <= T)
    lr: float = 3e-3
    warmup: int = 10
    seed: int = 0

    @classmethod
    def small(cls) -> Setup:
        return cls(
            layers=2,
            width=32,
            heads=4,
            ffn=128,
            vocab=64,
            seq=16,
            batch=16,
            steps=16,
            save_every=4,
            interrupt_at=6,
        )

    def model(self):
        from elastic_model import GPTConfig

        return GPTConfig(
            vocab=self.vocab,
            d_model=self.width,
            n_layers=self.layers,
            n_heads=self.heads,
            d_ff=self.ffn,
            seq_len=self.seq,
        )

    def resume_step(self) -> int:
        return (self.interrupt_at // self.save_every) * self.save_every


# ====================================================================================== worker


def worker(job: dict) -> None:
    """One training process: role train (killed at T) | baseline | resume (a variant)."""
    nproc, pid = job.get("num_processes", 1), job.get("process_id", 0)
    import jax

    if job.get("compile_cache"):
        jax.config.update("jax_compilation_cache_dir", job["compile_cache"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if nproc > 1:
        # CPU collectives across processes (the flag's name in JAX 0.10; gloo is also its default).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{job['port']}",
            num_processes=nproc,
            process_id=pid,
            initialization_timeout=120,
        )
    import elastic_model as M
    import orbax.checkpoint as ocp

    import jax_ucp

    t_start = time.time()
    s = Setup(**job["setup"])
    role = job["role"]
    cfg = s.model()  # the model as trained and saved
    new_cfg = dataclasses.replace(cfg, **job.get("layout", {}))  # the model this process runs
    tx = M.make_optimizer(lr=s.lr, warmup=s.warmup, total=s.steps)
    mesh = M.make_mesh(tuple(job["mesh"]))
    assert jax.device_count() == mesh.devices.size, (jax.device_count(), job["mesh"])
    abstract = M.abstract_state(new_cfg, tx, mesh)
    train_step = M.make_train_step(new_cfg, tx, mesh, abstract)
    res: dict[str, Any] = {
        "role": role,
        "name": job.get("name", role),
        "mesh": list(job["mesh"]),
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "losses": {},
    }
    out_path = job["out"]

    def dump():
        if pid == 0:
            with open(out_path + ".tmp", "w") as f:
                json.dump(res, f)
            os.replace(out_path + ".tmp", out_path)

    mngr = None
    if job.get("save_dir"):
        mngr = ocp.CheckpointManager(
            job["save_dir"],
            options=ocp.CheckpointManagerOptions(max_to_keep=3, enable_async_checkpointing=True),
        )

    if role == "resume":
        t0 = time.time()
        with ocp.CheckpointManager(job["resume_dir"]) as src:
            step0 = src.latest_step()
            target = {
                "params": abstract["params"],
                "opt_state": abstract["opt_state"],
                "step": 0,
                "data": {"seed": 0, "position": 0},
            }
            # another layout: a UCP-language spec turns the saved tensors into the new ones as lazy
            # views at restore (moments follow the parameter rules)
            spec = M.layout_spec(cfg, new_cfg) if new_cfg != cfg else None
            out = src.restore(
                step0,
                args=ocp.args.Composite(
                    state=jax_ucp.UCPRestore(target=target, spec=spec), meta=ocp.args.JsonRestore()
                ),
            )
        res["restore_seconds"] = time.time() - t0
        state = {"params": out.state["params"], "opt_state": out.state["opt_state"]}
        saved_fp = out.meta["fingerprint"]
        if spec is None:
            got_fp = M.fingerprint(state)
        else:  # back to the saved layout in plain numpy, then compare bit for bit
            got_fp = M.fingerprint(M.convert_flat(M.flat_host(state), new_cfg, cfg))
        res["restored_from"] = step0
        res["restored_leaves"] = len(got_fp)
        res["bit_exact"] = got_fp == saved_fp
        res["mismatched_leaves"] = sorted(
            k for k in set(saved_fp) | set(got_fp) if saved_fp.get(k) != got_fp.get(k)
        )
        res["shardings_ok"] = all(
            a.sharding == b.sharding
            for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(abstract))
        )
        assert out.state["step"] == step0 == out.meta["step"], (out.state["step"], step0)
        start, position, seed = (
            out.state["step"],
            out.state["data"]["position"],
            out.state["data"]["seed"],
        )
        res["data_position"] = position
    else:
        state = M.init_state(cfg, tx, mesh, seed=s.seed)
        start, position, seed = 0, 0, s.seed

    t_train = time.time()
    for step in range(start, s.steps):
        if role == "train" and step == s.interrupt_at:
            # Preempted: finish the in-flight async save (so the resume point is deterministic),
            # record what we have and die without any cleanup.
            mngr.wait_until_finished()
            res["killed_at"] = step
            res["train_seconds"] = time.time() - t_train
            dump()
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        host = M.batch_at(seed, position, s.batch, s.seq, s.vocab)
        state, loss = train_step(state, M.device_batch(host, mesh))
        position += 1
        res["losses"][str(step)] = M.scalar(loss)
        if step == start:
            res["first_step_seconds"] = time.time() - t_train  # compile (or compilation-cache load)
        if mngr is not None and (step + 1) % s.save_every == 0:
            fp = M.fingerprint(state)  # what is being saved, to check the restore bit by bit
            tree = {**state, "step": step + 1, "data": {"seed": seed, "position": position}}
            mngr.save(
                step + 1,
                args=ocp.args.Composite(
                    state=jax_ucp.UCPSave(tree),
                    meta=ocp.args.JsonSave(
                        {
                            "step": step + 1,
                            "fingerprint": fp,
                            "mesh": list(job["mesh"]),
                            "processes": jax.process_count(),
                        }
                    ),
                ),
            )
    res["train_seconds"] = time.time() - t_train
    if mngr is not None:
        mngr.wait_until_finished()
        res["saved_steps"] = list(mngr.all_steps())
        mngr.close()
    res["seconds"] = time.time() - t_start
    dump()


# ====================================================================================== driver


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(job: dict, devices: int, workdir: str, timeout: float, expect_kill=False) -> dict:
    """Runs one worker job in fresh processes (one per JAX process) with ``devices`` CPU devices."""
    nproc = job.get("num_processes", 1)
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([HERE, REPO, env.get("PYTHONPATH", "")])
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if nproc > 1:
        job = dict(job, port=_free_port())
    procs, logs = [], []
    for pid in range(nproc):
        jpath = os.path.join(workdir, f"job_{job['name']}_{pid}.json")
        with open(jpath, "w") as f:
            json.dump(dict(job, process_id=pid), f)
        log = open(os.path.join(workdir, f"log_{job['name']}_{pid}.txt"), "w")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "worker", jpath],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    deadline = time.time() + timeout
    ok_code = -signal.SIGKILL if expect_kill else 0
    try:
        while any(p.poll() is None for p in procs):
            # one process of a multi-process job failing leaves the others waiting in a collective
            failed = any(p.returncode is not None and p.returncode != ok_code for p in procs)
            if failed or time.time() > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                for p in procs:
                    p.wait()
                if not failed:
                    raise RuntimeError(
                        f"{job['name']}: timed out after {timeout:.0f}s; see "
                        f"{workdir}/log_{job['name']}_*.txt"
                    )
                break
            time.sleep(0.1)
    finally:
        for log in logs:
            log.close()
    # report the process that failed first, not one we killed because of it
    for pid, p in sorted(enumerate(procs), key=lambda x: x[1].returncode == -signal.SIGKILL):
        if p.returncode != ok_code:
            with open(os.path.join(workdir, f"log_{job['name']}_{pid}.txt")) as f:
                tail = f.read()[-6000:]
            raise RuntimeError(f"{job['name']} (process {pid}) exited with {p.returncode}:\n{tail}")
    with open(job["out"]) as f:
        res = json.load(f)
    res["losses"] = {int(k): v for k, v in res["losses"].items()}
    return res


def run_experiment(
    setup: Setup,
    workdir: str,
    *,
    variants=("a", "b", "c", "d", "e", "f"),
    jobs: int = 2,
    timeout: float = 900,
    compile_cache: str | None = None,
    log=print,
) -> dict:
    """Train (killed at T) + baseline on 8 devices, then every variant resumed in fresh processes.

    Returns {"setup", "train", "baseline", "variants": {name: result + "deviation"}}.
    """
    os.makedirs(workdir, exist_ok=True)
    ckpt = os.path.join(workdir, "ckpt_train")
    cache = compile_cache or os.path.join(workdir, "jax_cache")
    base = {"setup": dataclasses.asdict(setup), "compile_cache": cache}

    def job(name, role, mesh, **kw):
        return dict(
            base,
            name=name,
            role=role,
            mesh=list(mesh),
            out=os.path.join(workdir, f"result_{name}.json"),
            **kw,
        )

    t0 = time.time()
    with cf.ThreadPoolExecutor(max(1, jobs)) as ex:
        # The killed run goes first alone: the baseline (same mesh, same program) then loads its
        # compiled train step from the persistent compilation cache instead of compiling it again.
        train = _spawn(
            job("train", "train", TRAIN_MESH, save_dir=ckpt), 8, workdir, timeout, expect_kill=True
        )
        f_base = ex.submit(_spawn, job("baseline", "baseline", TRAIN_MESH), 8, workdir, timeout)
        log(
            f"[{time.time() - t0:6.1f}s] train on 8 devices {TRAIN_MESH} killed at step "
            f"{train['killed_at']}\n          committed checkpoints: {sorted(os.listdir(ckpt))}"
        )
        futs = {}
        for v in variants:
            mesh, nproc, ndev, _ = VARIANTS[v]
            j = job(
                v,
                "resume",
                mesh,
                resume_dir=ckpt,
                num_processes=nproc,
                save_dir=os.path.join(workdir, f"ckpt_{v}"),
                layout=LAYOUTS.get(v, {}),
            )
            futs[v] = ex.submit(_spawn, j, ndev, workdir, timeout)
        baseline = f_base.result()
        log(
            f"[{time.time() - t0:6.1f}s] baseline on 8 devices {TRAIN_MESH}: {len(baseline['losses'])} steps"
        )
        results = {}
        for v, f in futs.items():
            r = f.result()
            log(
                f"[{time.time() - t0:6.1f}s] ({v}) {VARIANTS[v][3]}\n"
                f"          resumed from step {r['restored_from']}, restored state bit-exact: "
                f"{r['bit_exact']}"
            )
            results[v] = r
    for r in results.values():
        r["deviation"] = {s: abs(r["losses"][s] - baseline["losses"][s]) for s in r["losses"]}
        r["max_deviation"] = max(r["deviation"].values())
        r["max_rel_deviation"] = max(
            abs(r["losses"][s] / baseline["losses"][s] - 1) for s in r["losses"]
        )
        r["continued_steps"] = len(r["losses"])
        r["matches_baseline_bitwise"] = all(
            r["losses"][s] == baseline["losses"][s] for s in r["losses"]
        )
    pre = [s for s in train["losses"]]
    train["matches_baseline_bitwise"] = all(
        train["losses"][s] == baseline["losses"][s] for s in pre
    )
    return {
        "setup": dataclasses.asdict(setup),
        "train": train,
        "baseline": baseline,
        "variants": results,
        "seconds": time.time() - t0,
    }


def format_table(result: dict, every: int = 1) -> str:
    """The report, within 80 columns: per step the baseline loss and each variant's |Δ| from
    it (the variants' own losses are in --json), then one line per run."""
    base, vs = result["baseline"]["losses"], result["variants"]
    names = list(vs)
    r0 = min(min(v["losses"]) for v in vs.values()) if vs else 0
    lines = []
    hdr = f"{'step':>5} {'baseline':>12}" + "".join(f" {'|Δ| (' + n + ')':>9}" for n in names)
    lines += [hdr, "-" * len(hdr)]
    steps = sorted(s for s in base if s >= r0)
    for i, s in enumerate(steps):
        if every > 1 and i % every and s != steps[-1]:
            continue
        row = f"{s:>5} {base[s]:>12.7f}"
        for n in names:
            got = vs[n]["losses"].get(s)
            row += f" {abs(got - base[s]):>9.2e}" if got is not None else f" {'':>9}"
        lines.append(row)
    lines.append("|Δ|: |loss - baseline| of each variant resumed from the checkpoint")
    lines.append("")
    lines.append(
        f"{'run':<7} {'p×d':<4} {'mesh d,f,t':<10} {'from':>4} {'steps':>5} {'exact':>5} "
        f"{'max |Δloss|':>11} {'max rel':>8} {'=base':>5}"
    )
    t = result["train"]
    lines.append(
        f"{'train':<7} {'1×8':<4} {_mesh(t['mesh']):<10} {0:>4} {len(t['losses']):>5} "
        f"{'-':>5} {'-':>11} {'-':>8} {t['matches_baseline_bitwise']!s:>5}"
    )
    for n, v in vs.items():
        pd = f"{v['processes']}×{v['devices'] // v['processes']}"
        lines.append(
            f"{'(' + n + ')':<7} {pd:<4} {_mesh(v['mesh']):<10} {v['restored_from']:>4} "
            f"{v['continued_steps']:>5} {v['bit_exact']!s:>5} {v['max_deviation']:>11.2e} "
            f"{v['max_rel_deviation']:>8.1e} {v['matches_baseline_bitwise']!s:>5}"
        )
    lines.append(
        f"train: killed at step {t['killed_at']}; its steps identical to the baseline's: "
        f"{t['matches_baseline_bitwise']}. exact: the restored state's fingerprint equals the "
        f"saved one; =base: every continued loss equals the baseline's bit for bit."
    )
    for n in names:
        lines.append(f"({n}) {VARIANTS[n][3]}" if n in VARIANTS else f"({n})")
    return "\n".join(_fold(line, 80) for line in lines)


def _mesh(shape) -> str:
    return ",".join(map(str, shape))


def _fold(line: str, width: int) -> str:
    """A prose line wrapped at spaces to ``width`` (table rows are built narrower)."""
    import textwrap

    return "\n".join(textwrap.wrap(line, width, subsequent_indent="  ")) if line else line


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base, train, vs = result["baseline"]["losses"], result["train"], result["variants"]
    fig, (ax1, ax2) = plt.subplots(
        2, 1, figsize=(8, 6.5), dpi=90, sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    xs = sorted(base)
    ax1.plot(
        xs,
        [base[s] for s in xs],
        color="black",
        lw=2.5,
        alpha=0.35,
        label="baseline (8 dev, uninterrupted)",
    )
    ts_ = sorted(train["losses"])
    ax1.plot(
        ts_,
        [train["losses"][s] for s in ts_],
        color="black",
        lw=1,
        label=f"run killed at step {train['killed_at']}",
    )
    markers = dict(a="o", b="s", c="^", d="D", e="x", f="v")
    for n, v in vs.items():
        ss = sorted(v["losses"])
        ax1.plot(
            ss,
            [v["losses"][s] for s in ss],
            lw=0.8,
            marker=markers.get(n, "."),
            ms=3,
            markevery=max(1, len(ss) // 15),
            label=f"({n}) {VARIANTS[n][3]}",
        )
        ax2.plot(
            ss,
            [v["deviation"][s] for s in ss],
            lw=0.8,
            marker=markers.get(n, "."),
            ms=3,
            markevery=max(1, len(ss) // 15),
            label=f"({n}) max {v['max_deviation']:.1e}",
        )
    r = min(min(v["losses"]) for v in vs.values()) if vs else 0
    for ax in (ax1, ax2):
        ax.axvline(r, color="grey", ls=":", lw=1)
    ax1.set_ylabel("training loss")
    ax1.set_title("Elastic resume with jax_ucp: resumed runs vs uninterrupted baseline")
    ax1.legend(fontsize=7)
    import numpy as np

    ulp = float(np.spacing(np.float32(np.median(list(base.values())))))
    ax2.axhline(ulp, color="grey", lw=0.8, ls="--")
    ax2.text(
        xs[0],
        ulp * 1.3,
        f"1 ulp of fp32 at loss {np.median(list(base.values())):.2f}",
        fontsize=7,
        color="grey",
    )
    ax2.set_yscale("symlog", linthresh=1e-8)
    ax2.set_ylim(bottom=0)
    ax2.set_ylabel("|loss - baseline|")
    ax2.set_xlabel(f"step (dotted: resumed from checkpoint at step {r})")
    ax2.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    try:  # a palette PNG is a third of the size (the figure goes into the docs)
        from PIL import Image

        with Image.open(path) as im:
            im.convert("RGB").quantize(colors=64).save(path, optimize=True)
    except Exception:  # the plain PNG is fine too
        pass


def load_result(path: str) -> dict:
    """A result written with --json (step keys back to int)."""
    with open(path) as f:
        r = json.load(f)
    for part in [r["train"], r["baseline"], *r["variants"].values()]:
        for k in ("losses", "deviation"):
            if k in part:
                part[k] = {int(s): v for s, v in part[k].items()}
    return r


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["worker"]:
        sys.path[:0] = [HERE, REPO]
        with open(argv[1]) as f:
            worker(json.load(f))
        return 0
    d = Setup()
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--small", action="store_true", help="test size: 2 layers, width 32, 16 steps")
    for f in dataclasses.fields(Setup):
        ap.add_argument(
            "--" + f.name.replace("_", "-"),
            type=type(f.default),
            default=None,
            help=f"(default {getattr(d, f.name)}; --small: {getattr(Setup.small(), f.name)})",
        )
    ap.add_argument("--variants", default="abcdef", help="which resumes to run")
    ap.add_argument(
        "--workdir", default=None, help="checkpoints, logs, results (default: a temp dir)"
    )
    ap.add_argument(
        "--plot",
        default=None,
        help="write the loss curves as a PNG here (default: elastic_resume.png in --workdir if "
        "given; none when the work dir is temporary)",
    )
    ap.add_argument("--json", default=None, help="write all results as JSON here")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes run in parallel")
    ap.add_argument("--table-every", type=int, default=0, help="print every n-th step (0: auto)")
    ap.add_argument(
        "--tolerance",
        type=float,
        default=1e-5,
        help="exit 1 if a variant's max |Δloss| exceeds this or a restore is not bit-exact",
    )
    ap.add_argument(
        "--from-json", default=None, help="no training: print and plot a saved --json result"
    )
    a = ap.parse_args(argv)
    if a.from_json:
        result = load_result(a.from_json)
        n = result["setup"]["steps"] - Setup(**result["setup"]).resume_step()
        print(format_table(result, a.table_every or max(1, n // 25)))
        if a.plot:
            plot(result, a.plot)
            print(f"plot: {a.plot}")
        return 0
    setup = Setup.small() if a.small else Setup()
    for f in dataclasses.fields(Setup):
        v = getattr(a, f.name)
        if v is not None:
            setattr(setup, f.name, v)
    if setup.interrupt_at < setup.save_every or setup.interrupt_at >= setup.steps:
        ap.error("need save_every <= interrupt_at < steps")
    import tempfile

    temporary = a.workdir is None  # ours to remove, except the plot and JSON the user keeps
    workdir = a.workdir or tempfile.mkdtemp(prefix="elastic_resume_")
    print(_fold(f"setup: {setup}", 80))
    print(f"workdir: {workdir}")
    try:
        result = run_experiment(setup, workdir, variants=tuple(a.variants), jobs=a.jobs)
    finally:
        if temporary:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    if a.plot is None and not temporary:
        a.plot = os.path.join(workdir, "elastic_resume.png")
    n = setup.steps - setup.resume_step()
    every = a.table_every or max(1, n // 25)
    print()
    print(format_table(result, every))
    print(f"\ntotal {result['seconds']:.0f}s")
    if a.plot:
        plot(result, a.plot)
        print(f"plot: {a.plot}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    bad = [
        n
        for n, v in result["variants"].items()
        if not v["bit_exact"]
        or v["max_deviation"] > a.tolerance
        or (n == "e" and not v["matches_baseline_bitwise"])
    ]
    if bad or not result["train"]["matches_baseline_bitwise"]:
        print(f"FAILED: {bad or 'train != baseline'}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
