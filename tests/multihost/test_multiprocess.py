"""The real multi-host path: 2 processes × 2 CPU devices via jax.distributed on 127.0.0.1."""

import json
import os
import subprocess
import sys

import numpy as np

import jax_ucp
from tests.ucp_testing import REPO, assert_bit_exact, free_port

WORKER = r"""
import json, os, sys
import jax, numpy as np, ml_dtypes
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
pid, nproc, port, mode, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc,
                           process_id=pid, initialization_timeout=120)
import jax_ucp
assert jax.process_count() == nproc
devs = np.array(jax.devices())  # global, ordered by process
mesh = Mesh(devs.reshape(2, -1), ("data", "model"))
W = np.arange(256 * 384, dtype=np.float32).reshape(256, 384)
E = (np.arange(6 * 4) - 7).astype(ml_dtypes.bfloat16).reshape(6, 4)
def make(host, spec):
  s = NamedSharding(mesh, spec)
  return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])
if mode == "save":
  tree = {"params": {"w": make(W, P("data", "model")), "e": make(E, P()),
                     "c": make(W.T.copy(), P(None, "data"))}, "step": 11,
          # process-local (each host has its own copy on its first device): written once
          "count": jax.device_put(np.int32(11), jax.local_devices()[0])}
  from jax_ucp._src.saving import plan as save_plan
  written, write_tensor = [], save_plan.write_tensor
  async def recording_write_tensor(root, p, **kw):  # observe what this process writes
    written.extend((p.entry.name, [[s.start, s.stop] for s in idx]) for idx, _ in p.writes)
    return await write_tensor(root, p, **kw)
  save_plan.write_tensor = recording_write_tensor
  with ocp.Checkpointer(jax_ucp.UCPCheckpointHandler()) as ck:
    ck.save(path, args=jax_ucp.UCPSave(tree))
  print("WRITTEN " + json.dumps(written))
else:
  sh = {"params": {"w": NamedSharding(mesh, P("data", None)), "e": NamedSharding(mesh, P("data")),
                   "c": NamedSharding(mesh, P("model", "data"))}}
  from jax_ucp._src import store
  before = store.bytes_read()  # TensorStore's reads and store.shard_file's
  out = jax_ucp.restore(path, shardings=sh)
  print("BYTES_READ", store.bytes_read() - before)
  for name, host in (("w", W), ("e", E), ("c", W.T)):
    a = out["params"][name]
    for s in a.addressable_shards:
      assert np.array_equal(np.asarray(s.data).view(np.uint8), np.ascontiguousarray(host[s.index]).view(np.uint8)), name
  print("RESTORED OK")
"""


def _launch(mode, path, nproc=2, devices_per_proc=2):
    port = free_port()
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_proc}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=REPO,
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(i), str(nproc), str(port), mode, str(path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(nproc)
    ]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, f"{mode} worker failed:\n{out}\n{err[-4000:]}"
        outs.append(out)
    return outs


def test_two_process_save_then_restore_in_one_and_two(tmp_path):
    path = tmp_path / "ckpt"
    outs = _launch("save", path)
    written = [
        json.loads(next(line for line in o.splitlines() if line.startswith("WRITTEN "))[8:])
        for o in outs
    ]
    # Each process wrote only its own replica-0 shards; together they cover each tensor once.
    sets = [{(n, tuple(map(tuple, idx))) for n, idx in w} for w in written]
    assert sets[0] and sets[1] and not (sets[0] & sets[1])
    names = [n for s in sets for n, _ in s]
    assert names.count("params/w") == 4  # 2×2 shards of w, each written once
    assert names.count("params/e") == 1  # replicated: only replica 0 (process 0) writes it
    assert names.count("params/c") == 2
    assert names.count("count") == 1
    files = sorted(
        os.path.relpath(os.path.join(d, f), path / "arrays")
        for d, _, fs in os.walk(path / "arrays")
        for f in fs
        if f != "zarr.json" and not d.endswith("count")
    )
    assert files == [
        "params.c/c/0/0",
        "params.c/c/0/1",
        "params.e/c/0/0",
        "params.w/c/0/0",
        "params.w/c/0/1",
        "params.w/c/1/0",
        "params.w/c/1/1",
    ]
    # One process (this one, 8 devices) reads it back…
    back = jax_ucp.restore(path)
    W = np.arange(256 * 384, dtype=np.float32).reshape(256, 384)
    assert_bit_exact(back["params"]["w"], W)
    assert_bit_exact(back["params"]["c"], W.T)
    assert back["step"] == 11
    assert_bit_exact(back["count"], np.int32(11))
    # …and two processes read it onto another layout, each reading only its devices' slices.
    outs = _launch("restore", path)
    assert all("RESTORED OK" in o for o in outs)
    total = sum(
        os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path / "arrays") for f in fs
    )
    per_process = [
        int(next(line for line in o.splitlines() if line.startswith("BYTES_READ")).split()[1])
        for o in outs
    ]
    # w and c are split in half between the processes; e [6, 4] is split over "data" too.
    assert all(0 < b < 0.75 * total for b in per_process), (per_process, total)
