"""A safetensors restore goes through the one read engine, so ``replicated_read="once"`` reads
each replicated byte once across the processes of a jax.distributed job (2 processes x 2 CPU
devices on 127.0.0.1), as for a UCP checkpoint (tests/restoring/test_replicated.py)."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.ucp_testing import run_workers

WORKER = r"""
import json, os, sys
import jax, numpy as np
pid, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid, initialization_timeout=60, heartbeat_timeout_seconds=60)
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax_ucp
from jax_ucp._src import store
truth = np.load(path + ".truth.npz")
rep = NamedSharding(Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model")), P())
target = {"params": {k: jax.ShapeDtypeStruct(truth[k].shape, truth[k].dtype, sharding=rep)
                     for k in truth.files}}
report = {}
for how in ("once", "each"):
    before = store.bytes_read()
    out = jax_ucp.restore(path, target=target, replicated_read=how, memory_budget=32768)
    for k in truth.files:
        for shard in out["params"][k].addressable_shards:
            got = np.asarray(shard.data)
            assert got.dtype == truth[k].dtype and np.array_equal(got, truth[k]), (how, k)
    report[how] = store.bytes_read() - before
print("REPORT " + json.dumps(report), flush=True)
os._exit(0)
"""


@pytest.mark.timeout(300)
def test_two_processes_read_each_replicated_safetensors_byte_once(tmp_path):
    rng = np.random.default_rng(3)
    tensors = {
        "w": rng.standard_normal((256, 48)).astype(np.float32),
        "e": rng.integers(-9, 9, (1001, 7)).astype(np.int32),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    np.savez(str(path) + ".truth.npz", **tensors)
    data = sum(t.nbytes for t in tensors.values())
    results = run_workers(tmp_path, WORKER, str(path))
    reports = []
    for code, out, err in results:
        assert code == 0, f"{out}\n{err[-3000:]}"
        reports.append(json.loads(next(x for x in out.splitlines() if x.startswith("REPORT "))[7:]))
    each = [r["each"] for r in reports]
    once = [r["once"] for r in reports]
    assert all(b == data for b in each), (each, data)  # every byte, in each process
    assert sum(once) == data, (once, data)  # every byte once in all
    assert all(0.35 * data < b < 0.65 * data for b in once), (once, data)  # about half each
