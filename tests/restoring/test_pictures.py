"""Pictures of a restore plan (``restoring.pictures``): the device × slice map of a tensor
equals JAX's own placement on a concrete mesh, without allocating the array; text always, a
matplotlib figure when asked."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ucp
from jax_ucp.restoring import pictures
from tests.ucp_testing import mesh


@pytest.mark.parametrize(
    "spec", [("fsdp", "tp"), ("tp", None), (None, ("fsdp", "tp")), (("tp", "fsdp"),), ()]
)
def test_device_slices_equal_jax_placement(spec):
    shape = (16, 8)
    m = mesh((2, 4), ("fsdp", "tp"))
    want = NamedSharding(m, P(*spec)).devices_indices_map(shape)
    got = pictures.device_slices(shape, spec, [("fsdp", 2), ("tp", 4)])
    for i, device in enumerate(m.devices.reshape(-1)):
        expect = tuple(s.indices(n)[:2] for s, n in zip(want[device], shape))
        assert got[i] == expect, (spec, i)


def test_slice_map_text_and_figure():
    text = pictures.slice_map((8, 16), ("fsdp", None), [("fsdp", 2), ("tp", 4)], name="w")
    assert "w [8, 16] as P('fsdp', None) on fsdp=2 × tp=4" in text
    assert "0:4 × 0:16" in text and "devices 0-3" in text
    replicated = pictures.slice_map((8, 16), None, [("data", 4)], name="w")
    assert "whole (replicated)" in replicated and "devices 0-3" in replicated
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    fig = pictures.slice_map((8, 16), ("fsdp", "tp"), [("fsdp", 2), ("tp", 4)], figure=True)
    assert len(fig.axes[0].patches) == 8


def test_bytes_chart_stacks_replicated_bytes(tmp_path):
    m = mesh((2, 4), ("fsdp", "tp"))
    w = jax.device_put(np.ones((8, 16), np.float32), NamedSharding(m, P("fsdp", "tp")))
    jax_ucp.save(tmp_path / "c", {"w": w, "b": np.zeros(16, np.float32)})
    saved = jax_ucp.plan(tmp_path / "c", mesh=jax_ucp.abstract_mesh([("fsdp", 2), ("tp", 4)]))
    other = jax_ucp.plan(tmp_path / "c", mesh=jax_ucp.abstract_mesh([("data", 4)]))
    assert pictures.bytes_by_device(saved) == (8, 64, 64)  # w: 512 B / 8; b: 64 B host-whole
    assert pictures.bytes_by_device(other) == (4, 0, 576)
    text = pictures.bytes_chart({"saved": saved, "4 devices": other})
    assert "4 devices: 4 devices × (0 B sharded + 576 B replicated)" in text
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    fig = pictures.bytes_chart({"saved": saved, "4 devices": other}, figure=True)
    assert len(fig.axes[0].patches) == 2 * (8 + 4)
