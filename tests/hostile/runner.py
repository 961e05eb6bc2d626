"""The parent: runs one child per input kind over a list of mutation indices, with a deadline
per mutation; a child that hangs is killed (its process group) and one that dies by a signal
or an exit is named, then a new child goes on with the remaining indices. Every failure comes
back with its reproducer: the seed, the mutation's description and the command that replays it."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

from tests.hostile.inputs import REPO

#: seconds one mutation may take before it counts as a hang (the first one also builds and
#: reads the intact copy)
MUTATION_TIMEOUT = 30.0
STARTUP_TIMEOUT = 120.0


@dataclasses.dataclass
class Result:
    kind: str
    seed: int
    index: int
    mutation: str = "?"
    source: str = "?"
    labels: dict = dataclasses.field(default_factory=dict)
    findings: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return bool(self.findings)

    def reproducer(self) -> str:
        return (
            f"python3 -m tests.hostile --kind {self.kind} --seed {self.seed} --index {self.index}"
        )

    def report(self) -> str:
        lines = [f"[{self.kind} seed {self.seed} #{self.index}] {self.source}: {self.mutation}"]
        lines += [f"    {what}: {detail}" for what, detail in self.findings]
        lines.append(f"    replay: {self.reproducer()}")
        return "\n".join(lines)


def run_kind(
    kind: str,
    seed: int,
    indices: list[int],
    *,
    long: bool = False,
    timeout=MUTATION_TIMEOUT,
    python: str = sys.executable,
    fork: bool = False,
) -> list[Result]:
    """Every mutation ``indices`` of ``kind`` under ``seed``, judged; children are restarted
    after a hang or a crash (that mutation is the failure).

    Args:
        kind: an input kind (``inputs.KINDS``) or a canary.
        seed: the seed; with the kind and an index it names one mutation.
        indices: the mutations to run.
        long: the long run's entry points too (``verify --against`` of every import...).
        timeout: seconds one mutation may take before it counts as a hang.
        python: the interpreter of the children (the long run may take one with torch, so
            ``verify --against`` a torch source can read it).
        fork: each child forked from a server that imported jax, orbax and jax_ucp once
            (``tests/zygote.py``; this interpreter's), not started afresh: the same child, its
            bounds and its protocol, without the seconds of imports per kind.
    """
    results: list[Result] = []
    remaining = list(indices)
    with tempfile.TemporaryDirectory(prefix=f"hostile-{kind}-") as work:
        while remaining:
            done = _one_child(kind, seed, remaining, work, long, timeout, python, fork)
            results += done
            ran = {r.index for r in done}
            if not ran:  # the child could not even start: say so once, for all
                results.append(Result(kind, seed, remaining[0], findings=[("harness-error",
                               "the child did not start")]))  # fmt: skip
                ran = {remaining[0]}
            remaining = [i for i in remaining if i not in ran]
    return results


#: what the fork server imports: the entry points' modules (the children import them lazily)
PRELOAD = ("numpy", "jax", "jax.numpy", "tensorstore", "orbax.checkpoint", "safetensors.numpy",
           "jax_ucp", "jax_ucp.cli", "typer.testing", "tests.hostile.inputs", "tests.hostile.oracle",
           "tests.hostile.mutations", "tests.hostile.spy")  # fmt: skip


def _one_child(kind, seed, indices, work, long, timeout, python, fork) -> list[Result]:
    os.makedirs(os.path.join(work, "child"), exist_ok=True)
    cmd = [python, "-m", "tests.hostile.child", kind, str(seed),
           ",".join(map(str, indices)), os.path.join(work, "child")]  # fmt: skip
    if long:
        cmd.append("--long")
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    env["PYTHONHASHSEED"] = "0"
    stderr = open(os.path.join(work, "stderr.txt"), "w+b")
    if fork and python == sys.executable:
        from tests import zygote

        server = zygote.server(PRELOAD, env)
        proc = zygote.popen(server, cmd[1:], cwd=REPO, env=env, stderr=stderr.fileno())
    else:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr, start_new_session=True
        )
    assert proc.stdout is not None
    results: list[Result] = []
    current: Result | None = None
    deadline = time.monotonic() + STARTUP_TIMEOUT
    buf = b""
    first = True
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                if current is not None:
                    current.findings.append(("hang", f"no answer within {timeout:.0f} s"))
                    results.append(current)
                return results
            ready, _, _ = select.select([proc.stdout], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            if not chunk:
                rc = proc.wait()
                if current is not None:
                    stderr.seek(0)
                    tail = stderr.read()[-1500:].decode(errors="replace")
                    how = f"signal {-rc}" if rc < 0 else f"exit {rc}"
                    current.findings.append(("crash", f"the child died ({how}): {tail}"))
                    results.append(current)
                return results
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if not line.startswith(b'{"event"'):
                    continue  # not the child's record (it sends only these)
                rec = json.loads(line)
                if rec["event"] == "start":
                    current = Result(kind, seed, rec["index"])
                    deadline = time.monotonic() + (timeout + 60 if first else timeout)
                    first = False
                elif rec["event"] == "mutated" and current is not None:
                    current.mutation, current.source = rec["mutation"], rec["source"]
                    deadline = time.monotonic() + timeout  # the intact copy's run is done
                elif rec["event"] == "done" and current is not None:
                    current.mutation = rec.get("mutation", current.mutation)
                    current.labels = rec.get("labels", {})
                    current.findings = [tuple(f) for f in rec.get("findings", [])]
                    current.seconds = rec.get("seconds", 0.0)
                    results.append(current)
                    current = None
    finally:
        stderr.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
