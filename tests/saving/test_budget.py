"""Saves within ``memory_budget`` (``jax_ucp._src.saving.budget``): bit-exact through
``ocp.CheckpointManager`` with a budget smaller than the state, the shards past the budget left on
the device (a donation or a delete after ``mngr.save`` returns cannot change what is written),
a shard larger than the budget refused by name, and the bound itself measured in a fresh process.
"""

import asyncio
import json
import threading

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ucp
from jax_ucp._src.saving import budget as budget_lib
from jax_ucp.errors import RequestError
from tests.ucp_testing import RSS_SAMPLER, assert_bit_exact, mesh, run_python, run_workers

KiB, MiB = 1 << 10, 1 << 20


def _host(seed):
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((256, 128)).astype(np.float32),  # 128 KiB, 16 KiB shards
        "h": rng.standard_normal((128, 64)).astype(ml_dtypes.bfloat16),  # 4 KiB shards
        "i": rng.integers(-100, 100, (64, 32)).astype(np.int8),
        "r": rng.standard_normal((1024,)).astype(np.float32),  # replicated, 4 KiB
    }


SPECS = {"w": P("data", "model"), "h": P("model", None), "i": P(None, "data"), "r": P()}


def _on_mesh(host, m):
    """Arrays in buffers of the runtime's own (a jit's outputs), which a train step can donate."""
    shardings = {k: NamedSharding(m, SPECS[k]) for k in host}
    return jax.jit(lambda t: jax.tree.map(lambda a: a + 0, t), out_shardings=shardings)(host)


@pytest.fixture
def gate(monkeypatch):
    """An event the commit's writes wait for (set: they go on): cleared around ``mngr.save``,
    the test's donation or delete surely comes before the commit reads a shard."""
    event = threading.Event()
    event.set()
    write_tensor = budget_lib.write_tensor

    async def gated(*a, **kw):
        await asyncio.to_thread(event.wait, 60)
        return await write_tensor(*a, **kw)

    monkeypatch.setattr(budget_lib, "write_tensor", gated)
    return event


@pytest.mark.timeout(180)
def test_async_manager_save_within_a_tiny_budget_restores_bit_exact(tmp_path, monkeypatch, gate):
    """A 20 KiB budget (the state's replica-0 shards: 150 KiB): ``mngr.save`` copies a prefix
    of the shards, the commit writes the rest batch by batch; a donating step and a delete
    right after ``mngr.save`` leave the checkpoint exact."""
    m = mesh((2, 4), ("data", "model"))
    made: list[budget_lib.BudgetedShards] = []
    original = budget_lib.BudgetedShards.__init__

    def spy(self, *a, **kw):
        original(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(budget_lib.BudgetedShards, "__init__", spy)
    in_flight: list[int] = []
    make_room = budget_lib.store.InFlightBytes.make_room

    def watch(self, nbytes):
        in_flight.append(self.bytes)
        yield from make_room(self, nbytes)

    monkeypatch.setattr(budget_lib.store.InFlightBytes, "make_room", watch)
    overwrite = jax.jit(lambda t: jax.tree.map(lambda a: a * 0 + 7, t), donate_argnums=0)
    hosts = [_host(seed) for seed in range(2)]
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
    with ocp.CheckpointManager(tmp_path, options=options) as mngr:
        for step, host in enumerate(hosts):
            state = _on_mesh(host, m)
            args = jax_ucp.UCPSave(state, memory_budget="20KiB")
            gate.clear()
            mngr.save(step, args=ocp.args.Composite(state=args))
            if step == 0:
                state = overwrite(state)  # a train step donating the state
                jax.block_until_ready(state)
            else:
                for x in state.values():
                    x.delete()
            gate.set()
            mngr.wait_until_finished()
    for b in made:
        assert b.budget == 20 * KiB
        assert 0 < b.copied_bytes <= 20 * KiB
        assert b.referenced_bytes > 100 * KiB  # most shards were left on the device
    assert max(in_flight) <= 20 * KiB
    for step, host in enumerate(hosts):
        got = jax_ucp.restore(tmp_path / str(step) / "state")
        for k, v in host.items():
            assert_bit_exact(got[k], v, k)
        target = _on_mesh(_host(9), m)
        got = jax_ucp.restore(tmp_path / str(step) / "state", target=target)
        for k, v in host.items():
            assert got[k].sharding == target[k].sharding
            assert_bit_exact(got[k], v, k)


def test_blocking_save_with_a_budget_matches_the_unbounded_save_file_for_file(tmp_path):
    state = _on_mesh(_host(3), mesh((2, 4), ("data", "model")))
    jax_ucp.save(tmp_path / "b", state, memory_budget=20000)
    jax_ucp.save(tmp_path / "u", state)
    want = jax_ucp.inspect(tmp_path / "u")
    got = jax_ucp.inspect(tmp_path / "b")
    assert [e.to_json() for e in got.entries] == [e.to_json() for e in want.entries]
    jax_ucp.save(tmp_path / "z", state, memory_budget=20000, compression="zstd")  # TensorStore
    for k, v in _host(3).items():
        assert_bit_exact(jax_ucp.restore(tmp_path / "b")[k], v, k)
        assert_bit_exact(jax_ucp.restore(tmp_path / "z")[k], v, k)


@pytest.mark.timeout(180)
def test_on_an_accelerator_a_donation_before_the_commit_fails_the_save_naming_the_tensor(
    tmp_path, monkeypatch, gate
):
    """The accelerator path (simulated: devices taken as not CPU): the shards past the budget
    stay ``jax.Array``s, copied to host by the commit; undisturbed the save is exact, a donation
    right after ``mngr.save`` is an error naming a tensor and its shard, and the step is never
    committed."""
    monkeypatch.setattr(budget_lib, "on_cpu", lambda data: False)
    m = mesh((2, 4), ("data", "model"))
    overwrite = jax.jit(lambda t: jax.tree.map(lambda a: a * 0 + 7, t), donate_argnums=0)
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
    with ocp.CheckpointManager(tmp_path, options=options) as mngr:
        state = _on_mesh(_host(5), m)
        mngr.save(0, args=ocp.args.Composite(state=jax_ucp.UCPSave(state, memory_budget="20KiB")))
        mngr.wait_until_finished()
        state = _on_mesh(_host(6), m)
        gate.clear()
        mngr.save(1, args=ocp.args.Composite(state=jax_ucp.UCPSave(state, memory_budget="20KiB")))
        state = overwrite(state)
        gate.set()
        with pytest.raises(Exception, match=r"Tensor '\w'.*shard \[.*deleted or donated"):
            mngr.wait_until_finished()
        assert mngr.all_steps() == [0]
    for k, v in _host(5).items():
        assert_bit_exact(jax_ucp.restore(tmp_path / "0" / "state")[k], v, k)


def test_a_shard_larger_than_the_budget_is_refused_by_name_before_anything_is_written(tmp_path):
    state = _on_mesh(_host(4), mesh((2, 4), ("data", "model")))
    with pytest.raises(RequestError, match=r"'w'.*\[0:128, 0:32\].*16\.0 KiB.*memory_budget"):
        jax_ucp.save(tmp_path / "x", state, memory_budget="10KiB")
    assert not (tmp_path / "x").exists()
    with pytest.raises(RequestError, match=r"UCPSave\.memory_budget.*'lots'"):
        jax_ucp.UCPSave(state, memory_budget="lots")


# A fresh process: 256 MiB of float32 on 8 CPU devices saved by an async CheckpointManager;
# prints the peak RssAnon over the process after the state was built, sampled every 2 ms.
_MEASURE = (
    RSS_SAMPLER
    + """
import json, os, sys
import jax, numpy as np, orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax_ucp

budget = None if sys.argv[2] == 'none' else sys.argv[2]
m = Mesh(np.array(jax.devices()).reshape(2, 4), ('data', 'model'))
specs = [P('data', 'model'), P('model', None), P(None, 'data'), P('data', None)]
def make(i):  # distinct values in every page (cheaper to make than random numbers)
    ramp = lambda: jax.numpy.arange(4096 * 4096, dtype=np.float32).reshape(4096, 4096) + i / 7
    return jax.jit(ramp, out_shardings=NamedSharding(m, specs[i % 4]))()

state = {f'w{i}': make(i) for i in range(4)}
jax.block_until_ready(state)
options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
mngr = ocp.CheckpointManager(sys.argv[1], options=options)
mngr.save(0, args=ocp.args.Composite(state=jax_ucp.UCPSave({'w': 1.0}, memory_budget=budget)))
mngr.wait_until_finished()  # Orbax's and the handler's start-up out of the measurement
base = anon()
stop = sampling()
mngr.save(1, args=ocp.args.Composite(state=jax_ucp.UCPSave(state, memory_budget=budget)))
mngr.wait_until_finished()
peak = stop()
mngr.close()
print('PEAK', json.dumps({'over': peak - base}))
"""
)


@pytest.mark.timeout(900)
def test_async_save_host_memory_stays_within_the_budget_in_a_fresh_process(tmpfs_path):
    """256 MiB of replica-0 shards (four 4096×4096 float32 on a 2×4 mesh, shards of 8 to 32 MiB)
    saved at a 64 MiB budget: RssAnon grows by at most budget + 64 MiB; without the budget the
    save's copies take the whole 256 MiB (the check that this test can fail). The checkpoints
    go to a tmpfs where there is one (``tmpfs_path``)."""
    over = {}
    for budget in ("64MiB", "none"):
        p = run_python(
            f"import sys; sys.argv = ['-', {str(tmpfs_path / budget)!r}, {budget!r}]\n" + _MEASURE,
            timeout=600,
        )
        line = next(x for x in p.stdout.splitlines() if x.startswith("PEAK"))
        over[budget] = json.loads(line[4:])["over"]
    print({k: f"{v / MiB:.0f} MiB" for k, v in over.items()})
    assert over["64MiB"] <= 128 * MiB, over["64MiB"] / MiB
    assert over["none"] > 192 * MiB, over["none"] / MiB
    got = jax_ucp.inspect(tmpfs_path / "64MiB" / "1" / "state")
    assert sorted(e.name for e in got.tensors) == [f"w{i}" for i in range(4)]


_TWO_PROCESSES = r"""
import sys
import jax, numpy as np, ml_dtypes, orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
pid, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid, initialization_timeout=120)
import jax_ucp
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
W = np.arange(256 * 384, dtype=np.float32).reshape(256, 384)
E = (np.arange(6 * 4) - 7).astype(ml_dtypes.bfloat16).reshape(6, 4)
def make(host, spec):
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda i: host[i])
tree = {"w": make(W, P("data", "model")), "e": make(E, P()), "c": make(W.T.copy(), P(None, "data")),
        "count": jax.device_put(np.int32(11), jax.local_devices()[0])}  # process-local
with ocp.AsyncCheckpointer(jax_ucp.UCPCheckpointHandler()) as ck:
    ck.save(path, args=jax_ucp.UCPSave(tree, memory_budget=200_000))  # shards: 96 / 192 KiB
    ck.wait_until_finished()
print("SAVED")
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_processes_save_within_a_budget(tmp_path):
    """2 processes × 2 CPU devices, an async save at a budget of about two shards: each process
    writes its shards batch by batch (later batches of an array attach to it, only the first
    batch of the primary creates it) and the primary commits every digest."""
    results = run_workers(tmp_path, _TWO_PROCESSES, str(tmp_path / "ckpt"))
    for code, out, err in results:
        assert code == 0 and "SAVED" in out, err[-3000:]
    got = jax_ucp.restore(tmp_path / "ckpt")
    w = np.arange(256 * 384, dtype=np.float32).reshape(256, 384)
    assert_bit_exact(got["w"], w, "w")
    assert_bit_exact(got["c"], w.T, "c")
    assert_bit_exact(got["e"], (np.arange(24) - 7).astype(ml_dtypes.bfloat16).reshape(6, 4), "e")
    assert_bit_exact(got["count"], np.int32(11), "count")
    assert not jax_ucp.verify(tmp_path / "ckpt")
