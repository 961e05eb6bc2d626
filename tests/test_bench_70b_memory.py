"""benchmarks/bench_70b_memory.py at a toy scale (no timing): its synthetic torch_dist is
detected and planned by the Megatron importer, and one process's share reads its bytes."""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest

_PATH = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "benchmarks", "bench_70b_memory.py"
)


def _bench():
    spec = importlib.util.spec_from_file_location("bench_70b_memory_under_test", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # ~2-5 s: the importer opened twice
def test_one_share_reads_its_bytes_synthetic(tmp_path):
    bench = _bench()
    path = str(tmp_path / bench.NAME)
    built = bench.build(path, 4, hidden=64, mlp=128, vocab=256)
    on_disk = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    assert on_disk > built["tensor_bytes"] and built["files"] == 64
    whole = bench.measure(path, 1, 0)
    # bf16 weights, fp32 masters and 2 moments, each byte once; the step count (int32) beside
    assert whole["share_bytes"] == built["tensor_bytes"] + 4
    half = bench.measure(path, 2, 1)
    assert half["tensors"] == whole["tensors"]  # every tensor's second half, the step count
    for row in (whole, half):
        assert row["share_bytes"] <= row["read_rchar"] <= row["share_bytes"] + 2**20, row
    assert abs(half["share_bytes"] * 2 - whole["share_bytes"]) < whole["share_bytes"] // 10


@pytest.mark.slow  # ~5-10 s: ~210 MB of holes read
def test_a_share_holds_no_more_than_its_result_synthetic(tmp_path):
    """A layer-stack row is read into its result's buffers in place: the reads' memory beyond
    the tensor's result stays a few MiB, not a whole row (32 MiB here: one layer of fc1 in
    fp32; before, a row was put together, then copied)."""
    bench = _bench()
    path = str(tmp_path / bench.NAME)
    bench.build(path, 2, hidden=1024, mlp=4096, vocab=256)
    row = bench.measure(path, 2, 0)
    assert row["largest_tensor_share"] == 2 * 4096 * 1024 * 4  # fc1's layer in fp32
    assert row["peak_beyond_result"] < row["largest_tensor_share"] // 2, row


@pytest.mark.slow  # ~5-15 s: the importer opened twice
def test_a_zero3_share_reads_its_rows_synthetic(tmp_path):
    """The ZeRO-3 layout is detected and imported; one process of 4 reads its rows of each
    parameter (its rank's partitions, CRC-checked), not every rank's partition joined."""
    bench = _bench()
    path = str(tmp_path / bench.ZERO3_NAME)
    built = bench.build_zero3(path, 2, ranks=4, hidden=64, mlp=128, vocab=256)
    assert built["files"] == 8
    whole = bench.measure(path, 1, 0)
    quarter = bench.measure(path, 4, 1)
    assert quarter["tensors"] == whole["tensors"] == 4 * built["tensors"] + 1
    assert abs(quarter["share_bytes"] * 4 - whole["share_bytes"]) < whole["share_bytes"] // 10
    assert whole["read_rchar"] >= whole["share_bytes"]
    assert quarter["read_rchar"] < whole["read_rchar"] // 2, (quarter, whole)


@pytest.mark.slow  # ~3-6 s: a save and an export in a child process
def test_the_sparse_ucp_exports_every_weight_synthetic(tmp_path):
    """The export benchmark's UCP checkpoint (saved by jax_ucp, then made sparse) is read
    through the strict reader (crc32c, digests) and exported whole: every HF name, every byte."""
    from safetensors import safe_open

    bench = _bench()
    built = bench.build_ucp(str(tmp_path / "ucp"), 2, hidden=64, mlp=128, vocab=256)
    assert built["on_disk"] < built["ucp_bytes"]  # holes
    row = bench.measure_export(str(tmp_path / "ucp"), str(tmp_path / "hf"))
    names = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        with safe_open(str(f), "np") as st:
            names.update({k: st.get_slice(k).get_shape() for k in st.keys()})  # noqa: SIM118
    assert names == {n: list(s) for n, s in bench.hf_llama(2, hidden=64, mlp=128, vocab=256)}
    assert (
        row["safetensors_bytes"]
        > built["tensor_bytes"]
        == sum(2 * int(np.prod(s)) for s in names.values())
    )
