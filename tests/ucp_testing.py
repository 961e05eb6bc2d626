"""Shared test helpers: bit-exact comparison, meshes, fresh Python processes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import zipfile

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh

import jax_ucp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bits(a) -> np.ndarray:
    """The raw bytes of an array, so NaN payloads and -0.0 compare exactly."""
    a = np.asarray(a)
    return np.ascontiguousarray(a).view(np.uint8) if a.size else np.zeros(0, np.uint8)


def assert_bit_exact(got, want, name=""):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert np.array_equal(bits(got), bits(want)), f"{name}: values differ"


def mesh(shape, names, devices=None) -> Mesh:
    devs = list(devices if devices is not None else jax.devices())[: int(np.prod(shape))]
    return Mesh(np.array(devs).reshape(shape), names)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: how a rank of a DeepSpeed CPU run sometimes dies natively on the 2-core host (its JIT-built
#: ops aborting: "terminate called without an active exception"): a crash of the framework, not
#: of the run, met by starting it once more (tools/fixtures/make_deepspeed_fixtures.py does too)
NATIVE_CRASHES = ("Signal 6 (SIGABRT)", "Signal 7 (SIGBUS)", "Signal 11 (SIGSEGV)")


def run_torchrun(script: str, *args: str, processes: int = 2, env=None, timeout: int = 1500):
    """``script`` under ``torch.distributed.run`` on a free port, DeepSpeed on CPU; a rank's
    native crash starts it once more (printed); a failure shows the launcher's last
    output (which rank died, and how)."""
    e = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **(env or {}))
    for attempt in (1, 2):
        command = [sys.executable, "-m", "torch.distributed.run"]
        command += ["--nproc_per_node", str(processes), "--master_port", str(free_port())]
        p = subprocess.run(
            [*command, script, *args], env=e, capture_output=True, text=True, timeout=timeout
        )
        if p.returncode == 0:
            return p
        if attempt == 1 and any(crash in p.stderr for crash in NATIVE_CRASHES):
            print(f"{script}: a rank died natively, started once more:\n{p.stderr[-3000:]}")
            continue
        raise AssertionError(
            f"{os.path.basename(script)} failed ({p.returncode}):\n"
            f"{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
        )
    raise AssertionError("unreachable")


def run_python(code: str, *, devices: int = 8, env=None, timeout=300, check=True):
    """Runs ``code`` in a fresh interpreter with ``devices`` CPU devices."""
    e = dict(os.environ)
    e["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    e["JAX_PLATFORMS"] = "cpu"
    # the repository only: tests/ holds packages named like real ones (tests/orbax/)
    e["PYTHONPATH"] = os.pathsep.join([REPO, e.get("PYTHONPATH", "")])
    e.update(env or {})
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=e,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and p.returncode != 0:
        raise AssertionError(f"subprocess failed ({p.returncode}):\n{p.stdout}\n{p.stderr[-4000:]}")
    return p


def run_workers(
    tmp_path, script: str, *args: str, processes: int = 2, devices: int = 2, timeout=150
):
    """Runs ``script`` as ``processes`` processes of one jax.distributed job on 127.0.0.1, each
    given ``index port *args``; returns ``(returncode, stdout, stderr)`` per process, none left
    running."""
    path = tmp_path / "worker.py"
    path.write_text(script)
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=REPO,
    )
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(path), str(i), port, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(processes)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


def run_cli(*args: str, env=None, timeout=240) -> subprocess.CompletedProcess:
    """``jax-ucp ARGS`` in a fresh process on the CPU (the default device count), with ``env``
    added to this one's."""
    full = dict(os.environ, JAX_PLATFORMS="cpu", **(env or {}))
    full.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, "-m", "jax_ucp.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full,
        cwd=REPO,
    )


def python_lines(fn, *args, **kwargs):
    """(what ``fn`` returned or raised, the number of lines of jax_ucp's Python code it ran): a
    bound on work that holds on a loaded host, unlike a bound in seconds."""
    import jax_ucp

    package = os.path.dirname(os.path.abspath(jax_ucp.__file__)) + os.sep
    count = 0

    def local(frame, event, arg):
        nonlocal count
        count += event == "line"
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(package) else None

    before = sys.gettrace()
    sys.settrace(calls)
    try:
        result = fn(*args, **kwargs)
    except Exception as e:  # the caller checks which error
        result = e
    finally:
        sys.settrace(before)
    return result, count


def copy_deepspeed_fixture(tmp_path, name: str) -> str:
    """A writable copy of tests/fixtures/deepspeed/<name>/ckpt (bad-input tests damage it)."""
    dst = tmp_path / name
    shutil.copytree(os.path.join(REPO, "tests", "fixtures", "deepspeed", name, "ckpt"), dst)
    return str(dst)


def assert_destination_untouched(dst) -> None:
    """A failed import left neither the destination nor a temporary directory beside it."""
    assert not os.path.exists(dst)
    leftovers = [p for p in os.listdir(os.path.dirname(dst)) if "tmp" in p]
    assert not leftovers, leftovers


def load_truth(path) -> dict[str, np.ndarray]:
    """A fixture's ``<name>.truth.npz`` (the run's live state), bf16 arrays (saved as their bits
    under ``<key>::bfloat16``) restored."""
    out = {}
    with np.load(path) as z:
        for key in z.files:
            value = z[key]
            if key.endswith("::bfloat16"):
                key, value = key[: -len("::bfloat16")], value.view(ml_dtypes.bfloat16)
            out[key] = value
    return out


def assert_convert_refused(src, dst, match: str, error=jax_ucp.UCPError, **options) -> None:
    """``convert(src, dst, **options)`` refused with an ``error`` matching ``match``, leaving
    neither ``dst`` nor a temporary folder beside it."""
    import pytest

    with pytest.raises(error, match=match):
        jax_ucp.convert(src, dst, **options)
    assert_destination_untouched(dst)


def assert_source_refused(src, dst, match: str, error=jax_ucp.SourceError) -> None:
    """``convert(src, dst)`` refused as :func:`assert_convert_refused` says, and a direct
    ``restore(src)`` refused alike: one import, one answer."""
    import pytest

    assert_convert_refused(src, dst, match, error)
    with pytest.raises(error, match=match):
        jax_ucp.restore(src)


def hf_torch_folder(tmp_path, shapes: dict, order: list[str], param_names: list[str] | None = None):
    """A Hugging Face style folder: ``pytorch_model.bin`` holding ``shapes`` (in that order) and
    an ``optimizer.bin`` of one Adam group whose index ``i`` holds the moments of ``order[i]``
    (exp_avg = the parameter + 1000 * (i + 1), so whose moment it is can be read off);
    ``param_names``: the group's param_names, when given."""
    from jax_ucp._src.torchfiles import torch_zip

    src = tmp_path / "src"
    src.mkdir()
    weights = {
        n: np.arange(np.prod(s), dtype=np.float32).reshape(s) + k
        for k, (n, s) in enumerate(shapes.items())
    }
    arrays = list(weights.values())
    model = {
        n: torch_zip.TensorSlot(i, a.shape, a.dtype) for i, (n, a) in enumerate(weights.items())
    }
    torch_zip.save_file(str(src / "pytorch_model.bin"), model, arrays)
    arrays, state = [], {}
    for i, name in enumerate(order):
        per = {}
        for k, scale in (("exp_avg", 1000), ("exp_avg_sq", 2000)):
            arrays.append(weights[name] + scale * (i + 1))
            per[k] = torch_zip.TensorSlot(len(arrays) - 1, arrays[-1].shape, arrays[-1].dtype)
        arrays.append(np.asarray(3.0, np.float32))
        per["step"] = torch_zip.TensorSlot(len(arrays) - 1, (), np.dtype(np.float32))
        state[i] = per
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "params": list(range(len(order)))}
    if param_names is not None:
        group["param_names"] = param_names
    torch_zip.save_file(
        str(src / "optimizer.bin"), {"state": state, "param_groups": [group]}, arrays
    )
    return src, weights


# Code for a fresh process: ``anon()``, its RssAnon; ``sampling()`` starts a thread sampling it
# every 2 ms and gives ``stop()``, which returns the peak.
RSS_SAMPLER = """
import threading, time

def anon():
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith('RssAnon:'):
                return int(line.split()[1]) * 1024

def sampling():
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon())
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()

    def stop():
        done.set()
        t.join()
        return max(peak[0], anon())

    return stop
"""

MEASURE_SCRIPT = (
    RSS_SAMPLER
    + """
import json, os, sys
import jax_ucp

base = anon()
stop = sampling()
if len(sys.argv) > 4 or os.environ.get("UCP_TEST_BASELINE_ORBAX"):
    import orbax.checkpoint  # imported by the export / Orbax import itself: in the baseline
    base = anon()
if len(sys.argv) > 4:
    from jax_ucp._src.exporters import options_for

    jax_ucp.export(sys.argv[1], sys.argv[2], options_for(sys.argv[4], memory_budget=sys.argv[3]))
else:
    jax_ucp.convert(sys.argv[1], sys.argv[2], memory_budget=sys.argv[3])
print('PEAK', json.dumps({'base': base, 'peak': stop()}))
"""
)


def peak_over_baseline(
    src, dst, budget: str, export_to: str | None = None, orbax_in_baseline: bool = False
) -> int:
    """RssAnon a fresh process's ``convert(src, dst, memory_budget=budget)`` (or ``export``
    to ``export_to``) peaks at, over the process after ``import jax_ucp`` (sampled every 2 ms
    from a thread); ``orbax_in_baseline``: after ``import orbax.checkpoint`` too (an export, or
    an importer that loads Orbax, counts it in the baseline)."""

    env = dict(os.environ, PYTHONPATH=REPO)
    if orbax_in_baseline:
        env["UCP_TEST_BASELINE_ORBAX"] = "1"
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            MEASURE_SCRIPT,
            str(src),
            str(dst),
            budget,
            *([export_to] * bool(export_to)),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("PEAK"))
    got = json.loads(line[4:])
    return got["peak"] - got["base"]


def tree_digest(path):
    """A digest of every file name and byte under ``path``: a failed call left it untouched."""
    h = hashlib.sha256()
    for d, _, fs in sorted(os.walk(path)):
        for f in sorted(fs):
            h.update(os.path.relpath(os.path.join(d, f), path).encode())
            with open(os.path.join(d, f), "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


# The small tree the damage tests save and then break (w spans many inner chunks)
TREE_W = np.arange(64 * 48, dtype=np.float32).reshape(64, 48) / 7
TREE_COUNT = np.asarray(1000, np.int32)


def save_small_tree(path, **kw):
    """Save params/w (TREE_W), params/b (int8), count (0-d) and step (a value) at ``path``."""
    import jax_ucp

    tree = {
        "params": {"w": TREE_W, "b": np.arange(6, dtype=np.int8)},
        "count": TREE_COUNT,
        "step": 5,
    }
    return jax_ucp.save(path, tree, inner_chunk_bytes=1024, **kw)


def fifo_damage(rel):
    """A damage: the file ``rel`` of a checkpoint replaced by a FIFO (a read would block)."""

    def damage(path):
        target = path / rel
        target.unlink()
        os.mkfifo(target)

    return damage


def remove_damage(rel):
    """A damage: the file ``rel`` of a checkpoint deleted."""

    def damage(path):
        (path / rel).unlink()

    return damage


FIXTURES = os.path.join(REPO, "tests", "fixtures")


def copy_fixture(tmp_path, rel, name: str = "src"):
    """A writable copy of tests/fixtures/<rel> at tmp_path/<name> (symlinks kept), to damage."""
    dst = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, rel), dst, symlinks=True)
    return dst


def move_out(path, outside):
    """``path`` moved to the folder ``outside`` (created) and replaced by a symlink to it."""
    outside.mkdir(exist_ok=True)
    target = outside / path.name
    shutil.move(path, target)
    path.symlink_to(target)
    return target


def restored_params(path) -> dict:
    """The ``params`` subtree of the checkpoint at ``path``, restored to host."""
    return jax_ucp.restore(path)["params"]


def tree_files(root, skip=()) -> dict[str, bytes]:
    """Every file below ``root`` (its path relative to ``root``) and its bytes, but those named
    in ``skip``: two checkpoints compared file for file."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            if n not in skip:
                with open(os.path.join(d, n), "rb") as f:
                    out[os.path.relpath(os.path.join(d, n), root)] = f.read()
    return out


def run_child(code: str, *args) -> str:
    """``code`` run by a fresh interpreter with ``args`` (large arrays stay out of pytest's
    process, whose peak RSS its children's ``ru_maxrss`` inherit across exec); its stdout."""
    env = dict(os.environ, PYTHONPATH=REPO)
    done = subprocess.run(
        [sys.executable, "-c", code, *(str(a) for a in args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def assert_one_error_line(out: str, *needles: str) -> str:
    """Exactly one ``error:`` line, holding every needle; no traceback, no TensorStore spec."""
    lines = [line for line in out.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, out
    assert "Traceback" not in out and "tensorstore_spec" not in out and "KvStore(" not in out, out
    # nothing but the progress bar of the tensors written before may precede it
    assert all(line.startswith("error:") or "━" in line for line in lines), out
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def save_and_name(path, tree) -> str:
    """Save ``tree`` at ``path`` and return the path as a string (a CLI argument)."""
    import jax_ucp

    jax_ucp.save(path, tree)
    return os.fspath(path)


class ThreadExchange:
    """``gather`` (``agreement.join``'s exchange) for threads standing in for the processes of
    a shared write or a commit; ``before(step)`` runs in a thread before it gathers."""

    def __init__(self, count: int):
        self.count, self.values, self.cond = count, {}, threading.Condition()

    def gather_of(self, index: int, before=None):
        def gather(step, value, wait=True):
            if before is not None:
                before(step)
            with self.cond:
                self.values[step, index] = value
                self.cond.notify_all()
                if not wait:
                    return []
                everyone = lambda: all((step, i) in self.values for i in range(self.count))
                assert self.cond.wait_for(everyone, timeout=30), f"no one else at {step}"
                return [self.values[step, i] for i in range(self.count)]

        return gather

    def run(self, work) -> list:
        """``work(i)`` in a thread per process; each one's result, or the error it raised."""
        results: list = [None] * self.count

        def run(i):
            try:
                results[i] = work(i)
            except Exception as e:
                results[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(self.count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        return results


def rewrite_zip_member(path, suffix: str, change) -> None:
    """The torch zip at ``path`` rewritten in place, the member ending in ``suffix`` replaced by
    ``change(bytes)`` (members stored, CRCs recomputed): a valid zip another tool could write."""
    with zipfile.ZipFile(path) as z:
        members = [(i.filename, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members:
            z.writestr(name, change(data) if name.endswith(suffix) else data)
