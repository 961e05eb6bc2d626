"""The importers' write path: a stream of host tensors, one at a time, committed atomically."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import threading

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts

import jax_ucp
from jax_ucp._src.multihost.agreement import MultiProcessError
from jax_ucp._src.orbax.manager_step import write_manager_step
from jax_ucp._src.writer import HostItem, write_host_checkpoint, write_shared_checkpoint
from tests.ucp_testing import REPO, ThreadExchange, assert_bit_exact


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

    from jax_ucp._src import writer as tensor_writes

    async def run():
        w = tensor_writes.PipelinedWriter(tmp_path, max_bytes=3 * 4096, max_tensors=64)
        opts = tensor_writes.ArrayOptions()
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
    with pytest.raises(jax_ucp.SaveConflictError, match="force=True"):
        write_host_checkpoint(tmp_path / "f", iter([HostItem(("x",), np.ones(2))]))
    with pytest.raises(jax_ucp.UCPError, match=r"/f\b.*not a checkpoint"):
        write_host_checkpoint(tmp_path / "f", iter([HostItem(("x",), np.zeros(2))]), force=True)
    assert (tmp_path / "f").read_text() == "not a checkpoint"  # the user's file is untouched
    assert sorted(os.listdir(tmp_path)) == ["a", "f"]


# write_shared_checkpoint: each process writes its tensors; only what every process reported
# is committed.


def _beside(tmp_path, name) -> list[str]:
    return sorted(d for d in os.listdir(tmp_path) if d.startswith((name + ".", "." + name + ".")))


def _shared_write(dest, keys_of, before_of=lambda i: None):
    """Process i (a thread) writes ``keys_of(i)``; each thread's result or error."""
    exchange = ThreadExchange(2)

    def items_of(i):
        for k in keys_of(i):  # "step": a JSON scalar, no array
            value = 7 if k == "step" else np.full((4, 3), len(k), np.float32)
            yield HostItem(("params", k), value, role="param")

    return exchange.run(
        lambda i: write_shared_checkpoint(
            dest, items_of(i), index=i, count=2, gather=exchange.gather_of(i, before_of(i))
        )
    )


@pytest.mark.timeout(60)
def test_every_process_makes_its_part_durable_before_reporting_it(tmp_path, monkeypatch):
    """On a shared file system the primary's syncfs flushes its own host only: each process
    syncs what it wrote (its file system, from its host) before it reports the part written."""
    from jax_ucp._src.store.storage import local

    synced: set[int] = set()
    real = local.sync_filesystem

    def sync_filesystem(path):
        synced.add(threading.get_ident())
        real(path)

    monkeypatch.setattr(local, "sync_filesystem", sync_filesystem)
    unsynced: list[int] = []

    def before_of(i):
        def before(step):
            if step == "written" and threading.get_ident() not in synced:
                unsynced.append(i)

        return before

    dest = tmp_path / "ck"
    results = _shared_write(dest, lambda i: [f"w{i}"], before_of)
    assert results == [str(dest), str(dest)]
    assert unsynced == []
    assert sorted(jax_ucp.restore(dest)["params"]) == ["w0", "w1"]


@pytest.mark.timeout(60)
def test_shared_write_commits_only_the_parts_its_processes_reported(tmp_path):
    """The primary merges a part only if it is byte for byte the one its process reported
    (sha256 exchanged with its "done"): a part changed after it was reported is an error in
    both processes naming it, and nothing is committed or left behind."""
    dest = str(tmp_path / "out")

    def change_after_reporting(i):
        def before(step):
            if i == 1 and step == "written":  # its sha256 is in the value it is posting
                (part,) = glob.glob(dest + ".ucp-tmp-*/ucp.part-1.json")
                with open(part, "a") as f:
                    f.write(" ")

        return before

    keys = [["a", "c"], ["b", "d"]]
    results = _shared_write(dest, keys.__getitem__, change_after_reporting)
    assert isinstance(results[0], MultiProcessError), results
    assert re.fullmatch(
        r".*/out\.ucp-tmp-[^/]*/ucp\.part-1\.json: not the part process 1 reported "
        r"\(sha256 [0-9a-f]{64}, found [0-9a-f]{64}\)",
        str(results[0]),
    ), results[0]
    assert isinstance(results[1], MultiProcessError)
    assert str(results[1]).startswith(
        f"{dest}: not committed; it failed in process 0: MultiProcessError: "
    )
    assert not os.path.lexists(dest) and _beside(tmp_path, "out") == []
    results = _shared_write(dest, keys.__getitem__)  # the same, untouched: committed
    assert results == [dest, dest]
    assert sorted(jax_ucp.restore(dest)["params"]) == ["a", "b", "c", "d"]


@pytest.mark.timeout(60)
def test_shared_write_refuses_a_tensor_written_by_two_processes(tmp_path):
    dest = str(tmp_path / "out")
    """An entry in two processes' parts (their shares overlap) is refused by the merge: a
    tensor's second writer already fails (its array exists), a JSON value has no file."""
    keys = [["a", "step"], ["b", "step"]]
    results = _shared_write(dest, keys.__getitem__)
    assert isinstance(results[0], MultiProcessError)
    assert str(results[0]).endswith(
        "ucp.part-1.json: 'params/step' written by process 0 and process 1"
    ), results[0]
    assert str(results[1]).startswith(f"{dest}: not committed; it failed in process 0: ")
    assert not os.path.lexists(dest) and _beside(tmp_path, "out") == []


@pytest.mark.parametrize("fixture", ["deepspeed/z2_bf16_dp2/ckpt", "megatron/gpt_tp2"])
def test_import_path_needs_neither_jax_nor_orbax(tmp_path, fixture):
    """A conversion is host-only: it must not pay JAX's and Orbax's import (~1 s)."""
    code = (
        "import sys; from jax_ucp.conversion import convert; convert(sys.argv[1], sys.argv[2]); "
        "import jax_ucp.cli; print(sorted(m for m in ('jax', 'orbax.checkpoint', 'torch') if m in sys.modules))"
    )
    src = os.path.join(REPO, "tests", "fixtures", *fixture.split("/"))
    out = subprocess.run(
        [sys.executable, "-c", code, src, str(tmp_path / "ucp")],
        env=dict(os.environ, PYTHONPATH=REPO),
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    assert "params" in jax_ucp.restore(tmp_path / "ucp")


def test_host_write_from_inside_a_running_event_loop(tmp_path):
    """Notebooks run an event loop: the standalone write must not call asyncio.run on it."""
    import asyncio

    from jax_ucp._src.writer import HostItem, write_host_checkpoint

    async def main():
        return write_host_checkpoint(tmp_path / "c", iter([HostItem(("x",), np.arange(4.0))]))

    out = asyncio.run(main())
    assert_bit_exact(jax_ucp.restore(out)["x"], np.arange(4.0))
