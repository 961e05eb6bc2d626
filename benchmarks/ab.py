"""The project's own A/B: a git commit (BASE) against the working tree, each measurement a fresh
process whose ``PYTHONPATH`` picks the tree's ``jax_ucp``; the two alternate every round (who goes
first swaps), so both see the same load.

    python benchmarks/ab.py BASE [--rounds N] [--quick] [--work REV] [--dir /tmp] [--json F]

BASE's ``jax_ucp/`` is unpacked with ``git archive`` into a temporary folder (``--work REV``:
REV's too, in place of the working tree: two commits, unmoved by edits in progress). The measuring code
comes from ONE tree, this one's ``benchmarks/`` (BASE may lack a benchmark or its ``--child``
mode), run against each tree's ``jax_ucp``:

* ``first save 64 MiB``: ``bench_scale.py --child jax-save`` (one 64 MiB float32 tensor, fully
  sharded on 8 CPU devices, saved durably) in a fresh process: the first call's seconds (its lazy
  imports and set-up included) and the whole process's;
* ``first restore 64 MiB``: ``bench_scale.py --child jax-restore`` of that save (onto another
  mesh, from a cold page cache), the call and the whole process;
* ``cold start``: ``bench_cold_start.py``'s child, a preempted job's first restore
  (``restore(path, mesh=, rules=)`` of its 64 MiB linen-style params + AdamW state onto a 2x2
  mesh, page cache warm), the call and the whole process;
* ``save 1 GB`` / ``restore 1 GB``: ``bench_scale.py``'s children at 1 GB (15 tensors; the restore
  onto another mesh from a cold page cache);
* ``direct DCP restore 1 GB``: ``bench_direct_restore.py --run direct`` of a torch DCP
  checkpoint written once by that script's torch-free writer (``--write``);
* ``jax-ucp --version`` / ``jax-ucp inspect`` cold: the whole process (``python -m
  jax_ucp.cli``), as ``bench_cold_start.py`` times it; ``inspect`` of the 64 MiB checkpoint.

Both trees' ``jax_ucp`` are byte-compiled before each round (``compileall``, hash-checked
.pyc), so imports cost what they cost an installed package, not the compiling. Each tree
restores and inspects what its own save wrote (a format change between the two cannot
make one refuse the other's files). ``--quick``: the 64 MiB and CLI rows only, 3 rounds (under
2 minutes on the 2-core VM). A row that fails in a tree (BASE older than the feature) shows the
error instead of figures.

The table: each row's median for BASE and the working tree, the ratio work/base, the spread
(min-max of the rounds, both sides) and the verdict: ``regression beyond spread`` when the work
tree's fastest round is slower than BASE's slowest, ``improvement beyond spread`` the other way
round, else ``within noise`` (under 3 rounds: none). Noise alone gives n rounds each disjoint
ranges one way with probability 1/C(2n, n): 1/20 at 3 rounds, 1/252 at 5; the script prints it.
The load average is printed before, during and after: on a busy host repeat, or raise
``--rounds``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORK = os.path.dirname(HERE)
MiB = 2**20
GB = 10**9

QUICK_ROWS = (
    "first save 64 MiB (call)",
    "first save 64 MiB (process)",
    "first restore 64 MiB (call)",
    "first restore 64 MiB (process)",
    "cold start: restore linen + AdamW 64 MiB (call)",
    "cold start: restore linen + AdamW 64 MiB (process)",
    "jax-ucp --version (process)",
    "jax-ucp inspect (process)",
)
FULL_ROWS = QUICK_ROWS + (
    "save 1 GB (call)",
    "restore 1 GB (call)",
    "direct DCP restore 1 GB (call)",
)

# bench_cold_start's 64 MiB linen-style state (params + AdamW), saved on a 2x4 mesh
SAVE_COLD = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, {here!r})
from bench_cold_start import make_state
import jax_ucp
jax_ucp.save({path!r}, make_state(64)[0])
"""

# ------------------------------------------------------------------------------ the table


def verdict(base: list[float], work: list[float]) -> str:
    """Whether the two sets of rounds differ by more than their spread (the ranges disjoint).
    Noise alone makes n rounds each disjoint one way with probability 1/C(2n, n) (``chance``):
    1/6 at 2 rounds, so under 3 rounds there is no verdict."""
    if min(len(base), len(work)) < 3:
        return "too few rounds for a verdict"
    if min(work) > max(base):
        return "regression beyond spread"
    if max(work) < min(base):
        return "improvement beyond spread"
    return "within noise"


def chance(rounds: int) -> float:
    """The probability that noise alone gives ``rounds`` rounds each a verdict in one given
    direction (every ordering of the 2n times equally likely)."""
    return 1 / math.comb(2 * rounds, rounds)


def _seconds(x: float) -> str:
    return f"{x * 1000:.0f} ms" if x < 10 else f"{x:.1f} s"


def _spread(xs: list[float]) -> str:
    return f"{_seconds(min(xs))}–{_seconds(max(xs))}"


def table(
    results: dict[str, dict[str, list[float] | str]],
    base_name: str = "base",
    work_name: str = "work",
) -> str:
    """A markdown table from ``results[row]["base" | "work"]``: the rounds' seconds, or the
    error text of a tree where the row failed."""
    lines = [
        f"| row | {base_name} median | {work_name} median | work/base | "
        f"spread ({base_name}; {work_name}) "
        "| verdict |",
        "|---|---|---|---|---|---|",
    ]
    for row, sides in results.items():
        base, work = sides.get("base"), sides.get("work")
        if isinstance(base, list) and isinstance(work, list) and base and work:
            b, w = statistics.median(base), statistics.median(work)
            lines.append(
                f"| {row} | {_seconds(b)} | {_seconds(w)} | {w / b:.2f} | "
                f"{_spread(base)}; {_spread(work)} | {verdict(base, work)} |"
            )
            continue
        cells = []
        for side in (base, work):
            if isinstance(side, list) and side:
                cells.append(_seconds(statistics.median(side)))
            else:
                why = side if isinstance(side, str) and side else "not run"
                cells.append("failed: " + why.splitlines()[0][:80])
        lines.append(f"| {row} | {cells[0]} | {cells[1]} | — | — | not compared |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ measuring


def unpack(commit: str, into: str) -> str:
    """BASE's ``jax_ucp/`` at ``into`` (``git archive``); its full commit id."""
    full = subprocess.run(
        ["git", "-C", WORK, "rev-parse", "--verify", commit + "^{commit}"],
        capture_output=True,
        text=True,
    )
    if full.returncode != 0:
        raise SystemExit(f"BASE {commit!r}: not a commit of {WORK} ({full.stderr.strip()})")
    archive = subprocess.run(
        ["git", "-C", WORK, "archive", "--format=tar", full.stdout.strip(), "jax_ucp"],
        capture_output=True,
        check=True,
    )
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)
    return full.stdout.strip()


def env_for(tree: str) -> dict[str, str]:
    path = tree + os.pathsep + os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": path.rstrip(os.pathsep), "PYTHONWARNINGS": "ignore"}


def compile_tree(tree: str) -> None:
    """Byte-compiles the tree's ``jax_ucp`` as an installed package is, so children time imports
    and not compiling (this host sets ``PYTHONDONTWRITEBYTECODE``); the .pyc files checked by
    the source's hash, so one edited since is compiled again, never read stale."""
    cmd = [sys.executable, "-m", "compileall", "-q", "--invalidation-mode", "checked-hash"]
    subprocess.run([*cmd, os.path.join(tree, "jax_ucp")], check=True, stdout=subprocess.DEVNULL)


def check_tree(tree: str, env: dict[str, str], cwd: str) -> None:
    """The tree's ``jax_ucp`` is the one a child imports (not an installed copy)."""
    code = "import jax_ucp, os; print(os.path.realpath(jax_ucp.__file__))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd, check=True
    ).stdout.strip()
    if not out.startswith(os.path.realpath(tree) + os.sep):
        raise SystemExit(f"PYTHONPATH={tree}: a child imports jax_ucp from {out}, not the tree")


def result_of(stdout: str) -> dict:
    """A child's result: its ``RESULT {json}`` line (bench_scale), else its last JSON line."""
    lines = stdout.strip().splitlines()
    tagged = [x[7:] for x in lines if x.startswith("RESULT ")]
    return json.loads(tagged[-1] if tagged else lines[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("base", metavar="BASE", help="the git commit to compare the working tree with")
    ap.add_argument("--rounds", type=int, help="rounds (default 5; 3 with --quick)")
    ap.add_argument("--quick", action="store_true", help="the 64 MiB and CLI rows only")
    ap.add_argument("--work", metavar="REV", help="a commit in place of the working tree")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the scratch folder goes")
    ap.add_argument("--json", help="also write every round's seconds here")
    a = ap.parse_args()
    rounds = a.rounds if a.rounds is not None else (3 if a.quick else 5)
    if not 1 <= rounds <= 100:
        raise SystemExit(f"--rounds: expected 1 to 100, found {rounds}")
    sys.path.insert(0, HERE)
    from bench_cold_start import CHILD, timed  # the cold-start benchmark's child and timing

    rows = QUICK_ROWS if a.quick else FULL_ROWS
    scratch = tempfile.mkdtemp(prefix="ucp_ab_", dir=a.dir)
    try:
        os.makedirs(os.path.join(scratch, "base"))
        commit = unpack(a.base, os.path.join(scratch, "base"))
        trees = {"base": os.path.join(scratch, "base"), "work": WORK}
        work_name = "work"
        if a.work:
            os.makedirs(os.path.join(scratch, "work"))
            trees["work"] = os.path.join(scratch, "work")
            work_name = f"{a.work} ({unpack(a.work, trees['work'])[:12]})"
        envs = {side: env_for(tree) for side, tree in trees.items()}
        run_dir = os.path.join(scratch, "run")  # children's working directory: no checkout
        os.makedirs(run_dir)
        for side in trees:
            check_tree(trees[side], envs[side], run_dir)
        print(
            f"BASE {a.base} = {commit[:12]}, work = {work_name}: {trees['work']}; {rounds} rounds"
        )
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        results: dict[str, dict[str, list[float] | str]] = {
            r: {"base": [], "work": []} for r in rows
        }
        loads = [os.getloadavg()[0]]

        def record(row: str, side: str, measure) -> None:
            """One measurement of ``row`` in ``side``'s tree; a failure is kept as its text and
            the row is not run again in that tree."""
            if not isinstance(results[row][side], list):
                return
            try:
                got = measure()
            except (RuntimeError, subprocess.TimeoutExpired, ValueError, KeyError) as e:
                results[row][side] = str(e).strip() or type(e).__name__
                print(f"  {row} [{side}] failed: {str(e).strip().splitlines()[0][:200]}")
                return
            for name, seconds in got.items():
                cell = results[name][side]
                if isinstance(cell, list):
                    cell.append(seconds)

        scale = [sys.executable, os.path.join(HERE, "bench_scale.py")]

        def scale_child(mode: str, path: str, gb: float, env: dict, call: str, process: str):
            cmd = [*scale, "--child", mode, "--contender", "jax_ucp", "--path", path]
            wall, out = timed([*cmd, "--gb", str(gb)], env, run_dir)
            got = {call: result_of(out)["seconds"]}
            return got | ({process: wall} if process else {})

        def cold_restore(side: str, call: str, process: str) -> dict[str, float]:
            """bench_cold_start's child: the first restore in a fresh process."""
            cmd = [sys.executable, "-c", CHILD, "jax_ucp", os.path.join(scratch, side + "_cold")]
            wall, out = timed([*cmd, "{}"], envs[side], run_dir)  # "{}": shapes, Orbax's only
            return {call: result_of(out)["restore"], process: wall}

        for side in trees:  # the cold-start state, saved by each tree (not timed)
            path = os.path.join(scratch, side + "_cold")
            code = SAVE_COLD.format(here=HERE, path=path)
            timed([sys.executable, "-c", code], envs[side], run_dir)

        dcp_src = os.path.join(scratch, "dcp")
        if "direct DCP restore 1 GB (call)" in rows:
            t = time.perf_counter()
            write = [sys.executable, os.path.join(HERE, "bench_direct_restore.py")]
            timed([*write, "--write", dcp_src, "--gb", "1"], envs["work"], run_dir)
            print(f"wrote the 1 GB DCP source in {time.perf_counter() - t:.0f} s")
        small = 64 * MiB / GB
        for r in range(rounds):
            order = ["base", "work"] if r % 2 == 0 else ["work", "base"]
            for tree in trees.values():
                compile_tree(tree)  # again: the working tree may have been edited since
            for side in order:
                shutil.rmtree(os.path.join(scratch, side + "_64m"), ignore_errors=True)
            for side in order:
                p = os.path.join(scratch, side + "_64m")
                names = ("first save 64 MiB (call)", "first save 64 MiB (process)")
                record(
                    names[0], side, lambda: scale_child("jax-save", p, small, envs[side], *names)
                )
            for side in order:
                p = os.path.join(scratch, side + "_64m")
                names = ("first restore 64 MiB (call)", "first restore 64 MiB (process)")
                record(
                    names[0], side, lambda: scale_child("jax-restore", p, small, envs[side], *names)
                )
            for side in order:
                names = (
                    "cold start: restore linen + AdamW 64 MiB (call)",
                    "cold start: restore linen + AdamW 64 MiB (process)",
                )
                record(names[0], side, lambda: cold_restore(side, *names))
            cli = [sys.executable, "-m", "jax_ucp.cli"]
            for name, argv in (("--version", ["--version"]), ("inspect", ["inspect"])):
                row = f"jax-ucp {name} (process)"
                for side in order:
                    extra = [os.path.join(scratch, side + "_64m")] if name == "inspect" else []
                    cmd = [*cli, *argv, *extra]
                    record(row, side, lambda: {row: timed(cmd, envs[side], run_dir)[0]})
            if not a.quick:
                for side in order:
                    shutil.rmtree(os.path.join(scratch, side + "_1g"), ignore_errors=True)
                for mode, row in (("jax-save", "save 1 GB (call)"), ("jax-restore", "restore 1 GB (call)")):  # fmt: skip
                    for side in order:
                        p = os.path.join(scratch, side + "_1g")
                        record(row, side, lambda: scale_child(mode, p, 1.0, envs[side], row, ""))
                for side in order:
                    shutil.rmtree(os.path.join(scratch, side + "_1g"), ignore_errors=True)
                row = "direct DCP restore 1 GB (call)"
                direct = [sys.executable, os.path.join(HERE, "bench_direct_restore.py"), "--run"]
                direct += ["direct", "--format", "dcp", "--source", dcp_src, "--dir", run_dir]
                for side in order:
                    record(
                        row,
                        side,
                        lambda: {row: result_of(timed(direct, envs[side], run_dir)[1])["seconds"]},
                    )
            loads.append(os.getloadavg()[0])
            done = [
                f"{row} {side} {_seconds(c[-1])}"
                for row in rows
                for side, c in results[row].items()
                if isinstance(c, list) and len(c) == r + 1
            ]
            print(f"round {r} (order {'/'.join(order)}, load {loads[-1]:.1f}): " + ", ".join(done))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print()
    print(table(results, base_name=a.base, work_name=work_name))
    print()
    print(
        f"a verdict from noise alone: 1 in {1 / chance(rounds):.0f} per row and direction "
        f"at {rounds} rounds"
    )
    print(
        f"load average (1 min) over the run: {min(loads):.1f}–{max(loads):.1f} on "
        f"{os.cpu_count()} cores; {rounds} rounds, BASE {commit[:12]}"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "base": a.base,
                    "commit": commit,
                    "work": work_name,
                    "rounds": rounds,
                    "loads": loads,
                    "results": results,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
