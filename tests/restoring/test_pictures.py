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
from jax_ucp.errors import RequestError
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


@pytest.mark.parametrize(
    "shape, spec, axes, names",
    [
        ((8, 4), ("tp", None), [("data", 2)], ["'tp'", "data=2"]),  # an axis the mesh lacks
        ((8, 4), ("data", "data"), [("data", 2)], ["'data' twice"]),
        ((8, 4), ("data", None, None), [("data", 2)], ["3 entries", "2 dimensions"]),
        ((8, -1), ("data", None), [("data", 2)], ["dimension 1 is -1"]),
        ((8, 2.5), ("data", None), [("data", 2)], ["dimension 1 is 2.5"]),
        ((8, 4), ("data", None), [("data", 0)], ["mesh axis 'data' has size 0"]),
        ((8, 4), (None, None), [("data", 2), ("tp", -2)], ["mesh axis 'tp' has size -2"]),
        ((8, 4), (None, None), [("data", 2), ("data", 2)], ["'data' is named twice"]),
    ],
)
def test_a_picture_of_what_no_restore_can_do_is_an_error_naming_it(shape, spec, axes, names):
    """Before: a raw ValueError for the missing axis, and the negative dimension or the empty
    mesh axis drawn (``-1:-1``, or no device at all) without a word."""
    for draw in (pictures.device_slices, pictures.slice_map):
        with pytest.raises(RequestError) as e:
            draw(shape, spec, axes)
        assert all(n in str(e.value) for n in names), str(e.value)


def test_a_figure_of_4096_devices_is_summarised_past_the_bound(tmp_path):
    """4096 distinct slices are one coloured mesh (no artist or label per slice) and a plan
    on 4096 devices is one bar, each figure saying so; before: 4096 rectangles and labels
    (77 s) and 8192 bars."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    fig = pictures.slice_map((4096, 512), ("a", "b"), [("a", 64), ("b", 64)], figure=True)
    ax = fig.axes[0]
    assert len(ax.patches) == 0 and len(ax.texts) == 0 and len(ax.collections) == 1
    assert "4096 slices" in ax.get_title()
    small = pictures.slice_map((8, 16), ("a", "b"), [("a", 2), ("b", 4)], figure=True)
    assert len(small.axes[0].patches) == 8 and len(small.axes[0].texts) == 8
    jax_ucp.save(tmp_path / "c", {"w": np.ones((4096, 2), np.float32)})
    wide = jax_ucp.plan(tmp_path / "c", mesh=jax_ucp.abstract_mesh([("data", 4096)]))
    four = jax_ucp.plan(tmp_path / "c", mesh=jax_ucp.abstract_mesh([("data", 4)]))
    fig = pictures.bytes_chart({"wide": wide, "four": four}, figure=True)
    assert len(fig.axes[0].patches) == 2 * (1 + 4)
    assert "each of 4096 devices" in " ".join(t.get_text() for t in fig.axes[0].get_xticklabels())
