"""Conversion across processes (``convert(..., distributed=True)``, ``jax-ucp convert
--processes N``): every process of a jax.distributed job on 127.0.0.1 reads and writes its share
of the parameters into one directory; process 0 commits once. The result equals the
single-process conversion bit for bit, entry for entry; a failure in any process leaves the
destination untouched."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

import jax_ucp
from tests.ucp_testing import REPO, free_port

pytestmark = pytest.mark.timeout(300)
DS = os.path.join(REPO, "tests", "fixtures", "deepspeed")
MEGATRON = os.path.join(REPO, "tests", "fixtures", "megatron")


def _leaves(path):
    return dict(jax.tree_util.tree_leaves_with_path(jax_ucp.restore(path)))


def _assert_same_checkpoint(single, shared):
    a, b = _leaves(single), _leaves(shared)
    assert a.keys() == b.keys()
    for key in a:
        x, y = np.asarray(a[key]), np.asarray(b[key])
        assert x.dtype == y.dtype and x.shape == y.shape, key
        assert x.tobytes() == y.tobytes(), jax.tree_util.keystr(key)
    ma, mb = jax_ucp.inspect(single), jax_ucp.inspect(shared)
    assert [e.name for e in ma.tensors] == [e.name for e in mb.tensors]  # same order
    assert ma.source == mb.source
    assert jax_ucp.verify(shared) == []
    parent, name = os.path.split(shared)
    assert [d for d in os.listdir(parent) if d.startswith(name + ".")] == []  # nothing left


def _cli(*args, timeout=240):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, "-m", "jax_ucp.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


@pytest.mark.parametrize(
    "fmt, src, extra",
    [
        ("deepspeed", os.path.join(DS, "z3_bf16_dp3", "ckpt"), []),
        ("deepspeed", os.path.join(DS, "megatron_ds_tp2_pp2_dp2_z1_bf16_synthetic", "ckpt"), []),
        (
            "megatron",
            os.path.join(MEGATRON, "mcore_versions", "0.16.1", "gpt_distopt_tp2pp2_dp_reshardable"),
            ["--vocab-size", "61"],
        ),
        (
            "megatron",
            os.path.join(MEGATRON, "legacy_gpt_distopt_pp2dp2_synthetic"),
            ["--vocab-size", "61"],
        ),
    ],
    ids=["zero3", "megatron-deepspeed", "torch_dist-dp_reshardable", "legacy-distrib_optim"],
)
def test_cli_processes_equal_a_single_process(tmp_path, fmt, src, extra):
    single = str(tmp_path / "single")
    jax_ucp.convert(src, single, format=fmt, **({"vocab_size": 61} if extra else {}))
    shared = str(tmp_path / "shared")
    r = _cli("convert", fmt, src, shared, *extra, "--processes", "3")
    assert r.returncode == 0, r.stdout + r.stderr
    _assert_same_checkpoint(single, shared)


WORKER = r"""
import os, sys
import jax
pid, n, port, src, dst = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=n,
                           process_id=pid, initialization_timeout=120)
import jax_ucp
from jax_ucp.format import safetensors as safetensors_hf
if os.environ.get("FAIL_PROCESS") == str(pid):
    def broken(self, name):
        raise OSError(f"disk gone while reading {name}")
    safetensors_hf.SafetensorsFile.tensor = broken
try:
    out = jax_ucp.convert(src, dst, distributed=True, force=True, barrier_timeout=120)
    print("OK", out)
except Exception as e:
    print("FAILED", type(e).__name__, e)
    sys.exit(3)
"""


def _run_job(tmp_path, src, dst, n=2, fail=None):
    port = str(free_port())
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    if fail is not None:
        env["FAIL_PROCESS"] = str(fail)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(i), str(n), port, src, dst],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=REPO,
        )
        for i in range(n)
    ]
    return [(p.wait(timeout=240), p.stdout.read()) for p in procs]


def _safetensors(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {f"layer.{i}.w": rng.standard_normal((64, 48)).astype(np.float32) for i in range(7)}
    src = tmp_path / "hf"
    src.mkdir()
    save_file(tensors, str(src / "model.safetensors"))
    return str(src)


def test_python_api_distributed_and_a_failing_process(tmp_path):
    """convert(distributed=True) from each process of a jax.distributed job equals the
    single-process result; then, replacing it (force=True), process 1 fails while reading: both
    processes raise (process 0 naming process 1's error), and the committed checkpoint is
    untouched, no temporary directory left."""
    src = _safetensors(tmp_path)
    single = str(tmp_path / "single")
    jax_ucp.convert(src, single)
    shared = str(tmp_path / "shared")
    results = _run_job(tmp_path, src, shared)
    assert all(code == 0 for code, _ in results), results
    _assert_same_checkpoint(single, shared)
    before = jax_ucp.inspect(shared).save_id
    results = _run_job(tmp_path, src, shared, fail=1)
    assert [code for code, _ in results] == [3, 3], results
    assert "process 1: OSError: disk gone" in results[0][1]
    assert "disk gone" in results[1][1]
    assert jax_ucp.inspect(shared).save_id == before
    assert [d for d in os.listdir(tmp_path) if d.startswith("shared.")] == []  # no temporary
    assert jax_ucp.verify(shared) == []


def test_leftover_of_a_killed_shared_import_is_removed(tmp_path):
    """A killed shared import leaves its temporary directory, named after its primary process;
    the next one (holding the save lock) removes it, as its primary is gone, and commits only
    its own files."""
    src = _safetensors(tmp_path)
    shared = str(tmp_path / "shared")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer runs
    stale = f"{shared}.ucp-tmp-{socket.gethostname()}.{gone.pid}.1"
    os.makedirs(os.path.join(stale, "arrays", "stale"))
    with open(os.path.join(stale, "ucp.part-1.json"), "w") as f:
        f.write("{}")
    results = _run_job(tmp_path, src, shared)
    assert all(code == 0 for code, _ in results), results
    assert not os.path.exists(stale)
    assert not os.path.exists(os.path.join(shared, "arrays", "stale"))
    assert sorted(jax_ucp.restore(shared)["params"]) == [f"layer.{i}.w" for i in range(7)]
