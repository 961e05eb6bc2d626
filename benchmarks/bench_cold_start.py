"""A preempted job's cold start: the first restore in a fresh process, jax_ucp vs Orbax, and the
command line's start-up, each timed in fresh processes (contenders alternate within a round;
medians over rounds).

Restore: a linen-style state (params with logical axes + an optax AdamW state, ``--mib`` in
all) saved on a 2×4 mesh, restored in a fresh process onto a 2×2 mesh of 4 devices:
jax_ucp with no target (``restore(path, mesh=, rules=)``) against Orbax's
``StandardCheckpointer().restore(path, target)`` (the target's ``ShapeDtypeStruct``s built from
the known shapes). Each child reports the time from its first line to its imports done and to the
restored arrays ready; the parent also times the whole process (interpreter start included).

CLI: ``jax-ucp --version``, ``inspect``, ``verify``, ``plan`` and ``latest`` (when the command
exists) of the same checkpoint, wall time of the whole process, and whether it loaded JAX.

  python benchmarks/bench_cold_start.py [--rounds 3] [--mib 64] [--dir /tmp/ucp_cold]
      [--baseline-tree /path/to/another/checkout]   # its jax_ucp too, alternating, same load

Children run in ``--dir`` (the working directory comes first on ``sys.path``: run from a
checkout, a child would import that checkout whatever PYTHONPATH says).

Writes docs/benchmark_cold_start.json (with the host's load average before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RULES = [("embed", "fsdp"), ("mlp", "tp")]

# The child of one restore: prints one JSON line of its timings.
CHILD = r"""
import time
t0 = time.perf_counter()
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
which, path, shapes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((2, 2), ("fsdp", "tp"))
if which == "jax_ucp":
    import jax_ucp
    t_import = time.perf_counter()
    out = jax_ucp.restore(path, mesh=mesh, rules=[("embed", "fsdp"), ("mlp", "tp")])
else:
    import orbax.checkpoint as ocp
    t_import = time.perf_counter()
    specs = {"embed": "fsdp", "mlp": "tp"}
    def sds(item):
        shape, dtype, names = item
        spec = P(*(specs.get(n) for n in names)) if names else P()
        return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=NamedSharding(mesh, spec))
    import optax
    params = jax.tree.map(sds, shapes, is_leaf=lambda x: isinstance(x, list) and len(x) == 3)
    count = jax.ShapeDtypeStruct((), "int32", sharding=NamedSharding(mesh, P()))
    adam = optax.ScaleByAdamState(count=count, mu=params, nu=params)
    target = {"params": params, "opt_state": (adam, optax.EmptyState(), optax.EmptyState())}
    out = ocp.StandardCheckpointer().restore(path, target)
jax.block_until_ready(jax.tree.leaves(out))
t_done = time.perf_counter()
print("RESULT " + json.dumps({"import": t_import - t0, "restore": t_done - t_import,
                              "total": t_done - t0}))
"""


def make_state(mib: int):
    """A flax-like state: ``params`` (dense kernels named (embed, mlp) / (mlp, embed)) and an
    AdamW state, ~``mib`` MiB in all, on a 2×4 mesh."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"))
    layers = 8
    width = max(64, int((mib * 2**20 / 4 / 3 / layers / 2 / 4) ** 0.5) // 8 * 8)
    params, names = {}, {}
    for i in range(layers):
        for name, axes, shape in (("up", ("embed", "mlp"), (width, 4 * width)),):
            spec = P(*(dict(RULES)[a] for a in axes))
            key = jax.random.fold_in(jax.random.key(0), i)
            value = jax.device_put(
                jax.random.normal(key, shape, jnp.float32), NamedSharding(mesh, spec)
            )
            params[f"layer{i}"] = {name: nn.LogicallyPartitioned(value, axes)}
            names[f"layer{i}"] = {name: axes}
        down = jax.device_put(
            jnp.zeros((4 * width, width), jnp.float32), NamedSharding(mesh, P("tp", "fsdp"))
        )
        params[f"layer{i}"]["down"] = nn.LogicallyPartitioned(down, ("mlp", "embed"))
        names[f"layer{i}"]["down"] = ("mlp", "embed")
    plain = nn.meta.unbox(params)
    state = {"params": params, "opt_state": optax.adamw(1e-3).init(plain)}
    return state, plain, names


def shapes_of(plain, names):
    """[shape, dtype, logical names] per parameter: the Orbax child builds its target from them
    (the optimizer state's by optax's NamedTuples, as a user's code does)."""
    import jax

    def one(x, n):
        return [list(x.shape), str(x.dtype), list(n)]

    return jax.tree.map(one, plain, names, is_leaf=lambda x: isinstance(x, tuple))


def timed(cmd: list[str], env: dict, cwd: str) -> tuple[float, str]:
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=cwd)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise RuntimeError(f"{cmd}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return wall, r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--dir", default="/tmp/ucp_cold")
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "benchmark_cold_start.json"))
    ap.add_argument("--baseline-tree", help="another checkout whose jax_ucp is timed too")
    args = ap.parse_args()
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    load_before = os.getloadavg()
    print(f"load average {load_before[0]:.1f} on {os.cpu_count()} cores")

    import jax
    import orbax.checkpoint as ocp

    import jax_ucp

    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    state, plain, names = make_state(args.mib)
    ucp_path, orbax_path = f"{args.dir}/ucp", f"{args.dir}/orbax"
    jax_ucp.save(ucp_path, state)
    run_root = f"{args.dir}/run"  # a CheckpointManager root, for ``latest``
    with ocp.CheckpointManager(run_root) as mngr:
        mngr.save(1, args=ocp.args.Composite(state=jax_ucp.UCPSave(state)))
        mngr.wait_until_finished()
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(orbax_path, {"params": plain, "opt_state": state["opt_state"]})
    checkpointer.wait_until_finished()
    nbytes = sum(x.nbytes for x in jax.tree.leaves(plain)) * 3
    shapes = json.dumps(shapes_of(plain, names))
    trees = {"": REPO, **({"@baseline": args.baseline_tree} if args.baseline_tree else {})}
    envs = {
        tag: {**os.environ, "PYTHONPATH": tree + os.pathsep + os.environ.get("PYTHONPATH", "")}
        for tag, tree in trees.items()
    }
    env, cwd = envs[""], args.dir
    contenders = [("jax_ucp", ucp_path, ""), ("orbax", orbax_path, "")]
    contenders += [("jax_ucp", ucp_path, tag) for tag in trees if tag]

    restore: dict[str, list[dict]] = {which + tag: [] for which, _, tag in contenders}
    for r in range(args.rounds):
        for which, path, tag in contenders:
            wall, out = timed([sys.executable, "-c", CHILD, which, path, shapes], envs[tag], cwd)
            result = json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[7:])
            result["process"] = wall
            restore[which + tag].append(result)
            print(
                f"round {r} {which + tag:16} restore: "
                + ", ".join(f"{k} {v:.2f} s" for k, v in result.items())
            )

    cli = [sys.executable, "-m", "jax_ucp.cli"]
    commands = {
        "--version": ["--version"],
        "inspect": ["inspect", ucp_path],
        "verify": ["verify", ucp_path],
        "plan": [
            "plan",
            ucp_path,
            "--mesh",
            "fsdp=2,tp=2",
            "--rules",
            "embed=fsdp",
            "--rules",
            "mlp=tp",
        ],
    }
    probe = subprocess.run([*cli, "latest", "--help"], capture_output=True, env=env, cwd=cwd)
    if probe.returncode == 0:
        commands["latest"] = ["latest", run_root]
    wrapper = (
        "import sys, runpy\nsys.argv = ['jax-ucp', *sys.argv[1:]]\n"
        "try:\n    runpy.run_module('jax_ucp.cli', run_name='__main__')\n"
        "except SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
        "print('JAX-LOADED' if 'jax' in sys.modules else 'JAX-FREE')\nsys.exit(code)\n"
    )
    cli_times: dict[str, list[float]] = {name + tag: [] for name in commands for tag in trees}
    cli_jax: dict[str, bool] = {}
    for r in range(args.rounds):
        for name, argv in commands.items():
            for tag in trees:
                if name == "latest" and tag:
                    continue
                wall, _ = timed([*cli, *argv], envs[tag], cwd)
                cli_times[name + tag].append(wall)
                if r == 0:
                    _, out = timed([sys.executable, "-c", wrapper, *argv], envs[tag], cwd)
                    cli_jax[name + tag] = "JAX-LOADED" in out
        print(
            f"round {r} cli: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in cli_times.items() if v)
        )

    def med(rows, field):
        return statistics.median(x[field] for x in rows)

    report = {
        "bytes": nbytes,
        "rounds": args.rounds,
        "load_average_before": load_before[0],
        "load_average_after": os.getloadavg()[0],
        "cores": os.cpu_count(),
        "restore": {
            which: {f: med(rows, f) for f in ("import", "restore", "total", "process")}
            for which, rows in restore.items()
        },
        "restore_rounds": restore,
        "cli_seconds": {k: statistics.median(v) for k, v in cli_times.items() if v},
        "cli_rounds": cli_times,
        "cli_loads_jax": cli_jax,
    }
    print(json.dumps({k: report[k] for k in ("restore", "cli_seconds", "cli_loads_jax")}, indent=1))
    print(f"load average after: {report['load_average_after']:.1f}")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
