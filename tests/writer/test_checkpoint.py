"""The importers' write path: a stream of host tensors, one at a time, committed atomically."""

import os

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts

import jax_ucp
from jax_ucp.orbax.manager_step import write_manager_step
from jax_ucp.writer import HostItem, write_host_checkpoint
from tests.ucp_testing import assert_bit_exact


def test_stream_written_one_at_a_time_with_roles_and_provenance(tmp_path, monkeypatch):
    pulled = []

    def items():
        for i in range(3):
            pulled.append(i)
            yield HostItem(
                key=("params", f"layer.{i}.weight"),
                value=np.full((4, 3), i, ml_dtypes.bfloat16),
                role="param",
                provenance={"files": [f"rank{i}.pt"]},
            )
        yield HostItem(
            key=("opt_state", "mu", "layer.0.weight"),
            value=np.zeros((4, 3), np.float32),
            role="opt_state",
            sub_role="mu",
        )
        yield HostItem(
            key=("opt_state", "count"), value=np.int32(7), role="opt_state", sub_role="count"
        )
        yield HostItem(key=("meta", "vocab"), value=50257)
        yield HostItem(key=("lazy",), value=ts.array(np.arange(6, dtype=np.int16)))

    out = write_host_checkpoint(tmp_path / "out", items(), source={"framework": "test"})
    m = jax_ucp.inspect(out)
    by = {e.name: e for e in m.entries}
    assert by["params/layer.1.weight"].role == "param"
    assert by["params/layer.1.weight"].provenance == {"files": ["rank1.pt"]}
    assert (by["opt_state/mu/layer.0.weight"].role, by["opt_state/mu/layer.0.weight"].sub_role) == (
        "opt_state",
        "mu",
    )
    assert by["opt_state/count"].sub_role == "count"
    assert m.source == {"framework": "test"}
    assert by["lazy"].role == "other"  # the writer records roles, it does not guess them
    back = jax_ucp.restore(out)
    assert_bit_exact(back["params"]["layer.2.weight"], np.full((4, 3), 2, ml_dtypes.bfloat16))
    assert back["meta"]["vocab"] == 50257
    assert_bit_exact(back["lazy"], np.arange(6, dtype=np.int16))


def test_pipelined_writer_bounds_bytes_in_flight(tmp_path):
    """Pipelining never holds more than the byte cap (plus one tensor) of pending writes."""
    import asyncio

    from jax_ucp import writer as tensor_writes

    async def run():
        w = tensor_writes.PipelinedWriter(tmp_path, max_bytes=3 * 4096, max_tensors=64)
        opts = tensor_writes.SaveOptions()
        for i in range(10):
            p = tensor_writes.prepare_host_tensor(
                (f"t{i}",), ("key",), np.full(1024, i, np.float32), opts, primary=True
            )
            await w.add(p)
            assert w.bytes_in_flight <= 3 * 4096 and w.tensors_in_flight <= 3
        await w.flush()
        assert w.tensors_in_flight == 0

    asyncio.run(run())
    for i in range(10):
        import zarr

        assert (zarr.open(str(tmp_path / "arrays" / f"t{i}"), mode="r")[:] == i).all()


def test_failing_stream_leaves_destination_untouched(tmp_path):
    write_host_checkpoint(tmp_path / "out", iter([HostItem(("a",), np.ones(2))]))

    def bad():
        yield HostItem(("b",), np.ones(2))
        raise RuntimeError("source file truncated")

    with pytest.raises(RuntimeError, match="truncated"):
        write_host_checkpoint(tmp_path / "out", bad(), force=True)
    assert list(jax_ucp.restore(tmp_path / "out")) == ["a"]
    with pytest.raises(RuntimeError, match="truncated"):
        write_host_checkpoint(tmp_path / "new", bad())
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_stream_as_manager_step(tmp_path):
    out = write_manager_step(
        tmp_path / "run", iter([HostItem(("params", "w"), np.ones(3))]), step=100
    )
    assert out == str(tmp_path / "run" / "100" / "state")
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        assert mngr.latest_step() == 100
        got = mngr.restore(100, args=ocp.args.Composite(state=jax_ucp.UCPRestore()))
    assert_bit_exact(got.state["params"]["w"], np.ones(3))
    with pytest.raises(FileExistsError, match="step 100"):
        write_manager_step(
            tmp_path / "run", iter([HostItem(("params", "w"), np.zeros(3))]), step=100
        )
    write_manager_step(
        tmp_path / "run", iter([HostItem(("params", "w"), np.zeros(3))]), step=100, force=True
    )
    assert sorted(os.listdir(tmp_path / "run")) == ["100"]
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        assert mngr.all_steps() == [100]
        got = mngr.restore(100, args=ocp.args.Composite(state=jax_ucp.UCPRestore()))
    assert_bit_exact(got.state["params"]["w"], np.zeros(3))


def test_standalone_write_creates_parents_and_force_never_replaces_a_plain_file(tmp_path):
    out = write_host_checkpoint(
        tmp_path / "a" / "b" / "ckpt/", iter([HostItem(("x",), np.ones(2))])
    )
    assert out == str(tmp_path / "a" / "b" / "ckpt")
    (tmp_path / "f").write_text("not a checkpoint")
    with pytest.raises(FileExistsError, match="force=True"):
        write_host_checkpoint(tmp_path / "f", iter([HostItem(("x",), np.ones(2))]))
    with pytest.raises(jax_ucp.UCPError, match="not a checkpoint directory"):
        write_host_checkpoint(tmp_path / "f", iter([HostItem(("x",), np.zeros(2))]), force=True)
    assert (tmp_path / "f").read_text() == "not a checkpoint"  # the user's file is untouched
    assert sorted(os.listdir(tmp_path)) == ["a", "f"]
