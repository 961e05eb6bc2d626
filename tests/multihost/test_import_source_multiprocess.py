"""A direct restore of a torch DCP checkpoint (the FSDP2 fixture: each tensor in two row chunks,
one per rank file) in a real 2-process job (jax.distributed on 127.0.0.1, 4 CPU devices each,
one data=2 x model=4 mesh): each process reads only the rows its devices hold, about half of
the source's bytes (counted at ``os.preadv`` / ``os.pread``, the only way jax_ucp reads a file),
and every shard equals the single-process restore's slice; with ``replicated_read="once"`` a
restore of every tensor to host reads a share in each process (all-gathered), under half too;
nothing is written."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import jax_ucp
from tests.ucp_testing import REPO, run_workers

pytestmark = pytest.mark.timeout(300)
SRC = os.path.join(REPO, "tests", "fixtures", "torch", "fsdp2_fp32")

WORKER = r"""
import json, os, sys, threading
pid, port, src = int(sys.argv[1]), sys.argv[2], sys.argv[3]
counted, lock = [0], threading.Lock()
preadv, pread = os.preadv, os.pread
def counting_preadv(fd, buffers, offset, *a):
    n = preadv(fd, buffers, offset, *a)
    with lock:
        counted[0] += n
    return n
def counting_pread(fd, n, offset):
    b = pread(fd, n, offset)
    with lock:
        counted[0] += len(b)
    return b
os.preadv, os.pread = counting_preadv, counting_pread
import jax
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid, initialization_timeout=120)
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax_ucp
from jax_ucp.conversion import ImportOptions
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
assert {d.process_index for d in mesh.devices[pid]} == {pid}
shapes = json.loads(sys.argv[4])
def placed(shape):
    spec = [None] * len(shape)
    if shape and shape[0] % 2 == 0:
        spec[0] = "data"
    if len(shape) > 1 and shape[-1] % 4 == 0:
        spec[-1] = "model"
    return NamedSharding(mesh, P(*spec))
shardings = {}
for name, shape in shapes.items():
    node = shardings
    *parents, leaf = name.split("/")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = placed(shape)
before = counted[0]
out = jax_ucp.restore(src, shardings=shardings, importing=ImportOptions())
read = counted[0] - before
before = counted[0]
once = jax_ucp.restore(src, importing=ImportOptions(), replicated_read="once")  # host, shared
read_once = counted[0] - before
whole = jax_ucp.restore(src)  # every byte, on the host: the single-process answer
for name in shapes:
    a, w, o = out, whole, once
    for p in name.split("/"):
        a, w, o = a[p], w[p], o[p]
    np.testing.assert_array_equal(o, w)
    for s in a.addressable_shards:
        assert np.array_equal(np.asarray(s.data), w[s.index]), name
print("READ " + json.dumps([read, read_once]))
"""


def test_each_process_reads_only_its_rows_of_a_torch_dcp_checkpoint(tmp_path):
    whole = jax_ucp.restore(SRC)
    shapes = {
        f"{top}/{name}": list(np.shape(v))
        for top in ("params", "opt_state")
        for name, v in _leaves(whole[top])
        if np.ndim(v)
    }
    assert len(shapes) > 10
    results = run_workers(tmp_path, WORKER, SRC, json.dumps(shapes), devices=4, timeout=240)
    reads = []
    for code, out, err in results:
        assert code == 0, err[-3000:]
        read, read_once = json.loads(out.split("READ ", 1)[1].splitlines()[0])
        reads += [read, read_once]
    tensor_bytes = sum(
        os.path.getsize(os.path.join(SRC, f)) for f in os.listdir(SRC) if f.endswith(".distcp")
    )
    for read in reads:  # its half of the chunks and the metadata, not both ranks' files
        assert 0 < read < 0.75 * tensor_bytes, (reads, tensor_bytes)
    assert sorted(os.listdir(tmp_path)) == ["worker.py"]  # nothing else written


def _leaves(node, prefix=""):
    for k, v in node.items():
        name = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, dict):
            yield from _leaves(v, name)
        else:
            yield name, v
