"""Exports read by row slabs (``ucp_source.read_rows`` through ``exporters.source``): every slab is
the tensor's rows, and an export under a budget smaller than any tensor writes the same bytes as
the default one, for each format that streams."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import jax_ucp
from jax_ucp._src import store
from jax_ucp._src.exporters import options_for
from jax_ucp._src.restoring.sources import ucp_source
from tests.ucp_testing import tree_files


@pytest.fixture
def ckpt(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((300, 7)).astype(np.float32)
    tree = {
        "params": {"w": w, "b": rng.standard_normal(5).astype(np.float32)},
        "opt_state": {
            "mu": {"w": w * 2, "b": np.ones(5, np.float32)},
            "nu": {"w": w * w, "b": np.ones(5, np.float32)},
            "count": np.asarray(3, np.int32),
        },
    }
    path = str(tmp_path / "ck")
    jax_ucp.save(path, tree, inner_chunk_bytes=1024)  # inner chunks of a few rows of w
    return path, tree


def test_read_rows_yields_the_rows_of_the_tensor(ckpt):
    path, tree = ckpt
    manifest = store.read_manifest(path)
    available = ucp_source.available_tensors(manifest)
    key = ("params", "w")
    inner = available[key].sources[0].inner_chunk_shape[0]
    assert 1 < inner < 300
    for max_bytes in (1, 100, 28 * inner, 28 * 80, 1 << 20):
        slabs = list(
            ucp_source.read_rows(path, manifest, key, available=available, max_bytes=max_bytes)
        )
        assert all(s.nbytes <= max_bytes or len(s) == 1 for s in slabs)
        np.testing.assert_array_equal(np.concatenate(slabs), tree["params"]["w"])
    ranges = ucp_source.row_ranges(available[key], np.dtype(np.float32), 28 * (2 * inner + 1))
    assert ranges[:2] == [(0, 2 * inner), (2 * inner, 4 * inner)]  # whole inner chunks
    cast = list(
        ucp_source.read_rows(
            path, manifest, key, available=available, dtype=ml_dtypes.bfloat16, max_bytes=7 * 6 * 10
        )
    )
    assert {len(s) for s in cast[:-1]} == {10}  # stored + converted bytes count
    np.testing.assert_array_equal(
        np.concatenate(cast), tree["params"]["w"].astype(ml_dtypes.bfloat16)
    )
    (count,) = ucp_source.read_rows(
        path, manifest, ("opt_state", "count"), available=available, max_bytes=1
    )
    assert count.shape == () and int(count) == 3


@pytest.mark.parametrize(
    "to, kwargs",
    [
        ("safetensors", {"select": "", "dtype": "bfloat16"}),
        ("torch-dcp", {}),
        ("deepspeed-universal", {}),
    ],
)
def test_an_export_under_a_tiny_budget_writes_the_default_bytes(tmp_path, ckpt, to, kwargs):
    path, _ = ckpt
    small = jax_ucp.export(path, tmp_path / "small", options_for(to, memory_budget=256, **kwargs))
    default = jax_ucp.export(path, tmp_path / "default", options_for(to, **kwargs))
    assert small.files == default.files
    got, want = (
        tree_files(small.path, skip=(".jax_ucp_export.json",)),
        tree_files(default.path, skip=(".jax_ucp_export.json",)),
    )
    assert sorted(got) == sorted(want) and got == want
