"""Async saves reuse their private host copies: the pool of ``UCPCheckpointHandler.copy_pool``.

On CPU an async save copies every replica-0 shard (the caller may donate the arrays as soon as
``save()`` returns); from the second save on the copies go into the previous save's buffers,
donated to a jitted copy. These tests check that the reuse really happens (same memory), that
it never lets one save's data into another's files, that a save still writing keeps its buffers,
and that a donating train step right after a pooled save leaves the checkpoint exact.
"""

import asyncio
import os
import threading

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ucp
from jax_ucp._src.saving import plan as save_plan
from tests.ucp_testing import assert_bit_exact, mesh


def _host(seed):
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((64, 32)).astype(np.float32),
        "h": rng.standard_normal((32, 16)).astype(ml_dtypes.bfloat16),
        "i": rng.integers(-100, 100, (16, 8)).astype(np.int8),
        "r": rng.standard_normal((24,)).astype(np.float32),  # replicated
    }


SPECS = {"w": P("data", "model"), "h": P("model", None), "i": P(None, "data"), "r": P()}


def _on_mesh(host, m):
    """Arrays in buffers of the runtime's own (a jit's outputs), which a train step can donate."""
    shardings = {k: NamedSharding(m, SPECS[k]) for k in host}
    return jax.jit(lambda t: jax.tree.map(lambda a: a + 0, t), out_shardings=shardings)(host)


def _replica0_bytes(tree):
    return sum(
        s.data.nbytes for x in tree.values() for s in x.addressable_shards if not s.replica_id
    )


@pytest.fixture
def released(monkeypatch):
    """The buffer addresses of every save's copies, as each save hands them back to the pool."""
    seen = []
    original = save_plan.HostCopyPool.release

    def spy(self, copies):
        seen.append(sorted(c.unsafe_buffer_pointer() for c in copies))
        return original(self, copies)

    monkeypatch.setattr(save_plan.HostCopyPool, "release", spy)
    return seen


@pytest.mark.timeout(180)
def test_consecutive_saves_reuse_the_copies_and_stay_exact_under_donation(tmp_path, released):
    m = mesh((2, 4), ("data", "model"))
    handler = jax_ucp.UCPCheckpointHandler()
    hosts = [_host(seed) for seed in range(3)]
    overwrite = jax.jit(lambda t: jax.tree.map(lambda a: a * 0 + 7, t), donate_argnums=0)
    with ocp.AsyncCheckpointer(handler) as ckptr:
        for step, host in enumerate(hosts):
            state = _on_mesh(host, m)
            nbytes = _replica0_bytes(state)
            pointers = {
                k: [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]
                for k, x in state.items()
            }
            ckptr.save(tmp_path / str(step), args=jax_ucp.UCPSave(state))
            state = overwrite(state)  # donated right away: written in place while the save goes on
            in_place = [
                k
                for k, x in state.items()
                if [s.data.unsafe_buffer_pointer() for s in x.addressable_shards] == pointers[k]
            ]
            assert {"w", "h", "r"} <= set(in_place)  # else this test would show nothing
            if step == 0:
                assert (handler.copy_pool.reused_bytes, handler.copy_pool.fresh_bytes) == (
                    0,
                    nbytes,
                )
            else:  # every copy went into the previous save's buffers
                assert (handler.copy_pool.reused_bytes, handler.copy_pool.fresh_bytes) == (
                    nbytes,
                    0,
                )
            ckptr.wait_until_finished()
            assert handler.copy_pool.ready(timeout=120)
        assert released[1] == released[0] and released[2] == released[0]  # the same memory
    assert not handler.copy_pool.ready()  # closing the checkpointer dropped the pool
    for step, host in enumerate(hosts):  # no save's data in another's files
        back = jax_ucp.restore(tmp_path / str(step))
        for k, v in host.items():
            assert_bit_exact(back[k], v)


@pytest.mark.timeout(180)
def test_a_save_still_writing_keeps_its_copies_from_the_next_save(tmp_path, released, monkeypatch):
    m = mesh((2, 4), ("data", "model"))
    handler = jax_ucp.UCPCheckpointHandler()
    hosts = [_host(seed) for seed in (10, 11, 12)]
    nbytes = _replica0_bytes(_on_mesh(hosts[0], m))

    def save(step, host):
        path = tmp_path / str(step)
        os.makedirs(path)
        futures = asyncio.run(handler.async_save(path, args=jax_ucp.UCPSave(_on_mesh(host, m))))
        stats = (handler.copy_pool.reused_bytes, handler.copy_pool.fresh_bytes)
        return path, futures, stats

    def finish(path, futures):
        for f in futures:
            f.result()
        handler.finalize(path)

    path0, futures0, _ = save(0, hosts[0])
    finish(path0, futures0)
    assert handler.copy_pool.ready(timeout=120)

    gate = threading.Event()
    write_all = save_plan.write_all

    async def gated(*args, **kwargs):  # save 1 holds its copies until the gate opens
        await asyncio.to_thread(gate.wait, 120)
        return await write_all(*args, **kwargs)

    monkeypatch.setattr(save_plan, "write_all", gated)
    path1, futures1, stats1 = save(1, hosts[1])
    path2, futures2, stats2 = save(2, hosts[2])  # save 1 is still writing
    gate.set()
    finish(path1, futures1)
    finish(path2, futures2)
    assert stats1 == (nbytes, 0)  # save 1 took save 0's buffers
    assert stats2 == (0, nbytes)  # save 2 found none free: fresh copies
    # Saves 1 and 2 hand back in either order: save 1's copies are save 0's buffers, save 2's
    # share no memory with them.
    later = sorted(released[1:], key=lambda pointers: pointers != released[0])
    assert later[0] == released[0]
    assert not set(later[1]) & set(released[0])
    for step, host in enumerate(hosts):
        back = jax_ucp.restore(tmp_path / str(step))
        for k, v in host.items():
            assert_bit_exact(back[k], v)
    handler.close()
    assert not handler.copy_pool.ready()


@pytest.mark.timeout(180)
def test_another_tree_copies_afresh_and_replaces_the_pool(tmp_path, released):
    """Shapes that do not match the pool (another tree) get new buffers, never a wrong one."""
    m = mesh((2, 4), ("data", "model"))
    handler = jax_ucp.UCPCheckpointHandler()
    first = _host(20)
    other = {"w": np.arange(64 * 48, dtype=np.float32).reshape(64, 48)}
    with ocp.AsyncCheckpointer(handler) as ckptr:
        ckptr.save(tmp_path / "a", args=jax_ucp.UCPSave(_on_mesh(first, m)))
        ckptr.wait_until_finished()
        assert handler.copy_pool.ready(timeout=120)
        state = _on_mesh(other, m)
        ckptr.save(tmp_path / "b", args=jax_ucp.UCPSave(state))
        assert (handler.copy_pool.reused_bytes, handler.copy_pool.fresh_bytes) == (
            0,
            _replica0_bytes(state),
        )
        ckptr.wait_until_finished()
    assert_bit_exact(jax_ucp.restore(tmp_path / "a")["w"], first["w"])
    assert_bit_exact(jax_ucp.restore(tmp_path / "b")["w"], other["w"])


@pytest.mark.timeout(180)
def test_reuse_host_copies_false_keeps_no_copies_between_saves(tmp_path, released):
    m = mesh((2, 4), ("data", "model"))
    handler = jax_ucp.UCPCheckpointHandler(reuse_host_copies=False)
    hosts = [_host(30), _host(31)]
    with ocp.AsyncCheckpointer(handler) as ckptr:
        for step, host in enumerate(hosts):
            ckptr.save(tmp_path / str(step), args=jax_ucp.UCPSave(_on_mesh(host, m)))
            ckptr.wait_until_finished()
            assert not handler.copy_pool.ready(timeout=120)  # nothing kept
    assert released == []
    for step, host in enumerate(hosts):
        back = jax_ucp.restore(tmp_path / str(step))
        for k, v in host.items():
            assert_bit_exact(back[k], v)
