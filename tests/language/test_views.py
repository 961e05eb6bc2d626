"""Lazy TensorStore views of the UCP language: bit-exact against numpy, and lazy (no reads)."""

import numpy as np
import pytest
import tensorstore as ts
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_ucp._src.language import views
from jax_ucp.errors import LanguageError

FEW = settings(max_examples=15, deadline=None)


class CountingStore:
    """A virtual TensorStore over a numpy array that records every chunk it is asked for."""

    def __init__(self, data, chunk):
        self.data = data
        self.reads = []

        def read(domain, array, params):
            self.reads.append(tuple((d.inclusive_min, d.exclusive_max) for d in domain))
            array[...] = self.data[domain.index_exp]

        self.t = ts.virtual_chunked(
            read,
            dtype=ts.dtype(data.dtype.name),
            domain=ts.IndexDomain(shape=list(data.shape)),
            chunk_layout=ts.ChunkLayout(read_chunk_shape=list(chunk)),
        )

    def elements_read(self):
        return sum(int(np.prod([b - a for a, b in r])) for r in self.reads)


def read(t):
    return t.read().result()


def test_views_have_zero_origin_and_match_numpy():
    x = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    t = views.as_view(x)
    s = views.slice_axis(t, 2, 1, 3)
    assert tuple(s.domain.origin) == (0, 0, 0)
    np.testing.assert_array_equal(read(s), x[:, :, 1:3])
    np.testing.assert_array_equal(read(views.transpose(t)), x.T)
    np.testing.assert_array_equal(read(views.transpose(t, [1, 0, 2])), x.transpose(1, 0, 2))
    np.testing.assert_array_equal(read(views.take(t, 1, 2)), x[:, 2])
    np.testing.assert_array_equal(read(views.concat([t, t], 1)), np.concatenate([x, x], 1))
    np.testing.assert_array_equal(read(views.stack([t, t], 2)), np.stack([x, x], 2))
    np.testing.assert_array_equal(
        read(views.pad_axis(t, 0, 5)), np.pad(x, [(0, 3), (0, 0), (0, 0)])
    )


@FEW
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 3), st.integers(0, 2))
def test_split_dim_merge_dims_match_reshape(a, b, c, axis):
    shape = [c, c, c]
    shape[axis] = a * b
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    y = views.split_dim(views.as_view(x), axis, (a, -1))
    ref = x.reshape(shape[:axis] + [a, b] + shape[axis + 1 :])
    np.testing.assert_array_equal(read(y), ref)
    np.testing.assert_array_equal(read(views.merge_dims(y, axis)), x)


@FEW
@given(
    st.sampled_from([(6, 1), (6, 2), (6, 3), (6, 6), (4, 2), (12, 4), (12, 3)]), st.integers(1, 3)
)
def test_stages_group_regroup_ungroup(ls, new):
    L, S = ls
    x = np.random.default_rng(L).standard_normal((L, 3, 2)).astype(np.float32)
    g = views.group_stages(views.as_view(x), S)
    np.testing.assert_array_equal(read(g), x.reshape(S, L // S, 3, 2))
    np.testing.assert_array_equal(read(views.merge_dims(g, 0)), x)
    if L % new == 0:
        np.testing.assert_array_equal(
            read(views.regroup_stages(g, new)), x.reshape(new, L // new, 3, 2)
        )
    else:
        with pytest.raises(LanguageError, match=f"{L} layers.*{new} pipeline stages"):
            views.regroup_stages(g, new)


def test_regroup_error_message():
    g = views.as_view(np.zeros((2, 3, 4)))
    with pytest.raises(
        LanguageError,
        match=r"cannot regroup 6 layers .* into 4 pipeline stages: 6 is not divisible by 4",
    ):
        views.regroup_stages(g, 4)


@FEW
@given(
    st.sampled_from([(4, 4, 2), (4, 2, 3), (8, 2, 2), (6, 1, 4), (6, 3, 2)]),
    st.booleans(),
    st.integers(0, 1),
)
def test_qkv_split_merge_roundtrip_and_reference(heads, interleaved, axis):
    nh, ng, hd = heads
    qpg = nh // ng
    rows = ng * (qpg + 2) * hd
    shape = (rows, 5) if axis == 0 else (5, rows)
    x = np.random.default_rng(nh * ng).standard_normal(shape).astype(np.float32)
    q, k, v = views.split_qkv(views.as_view(x), axis, nh, ng, hd, interleaved=interleaved)
    # numpy reference
    xa = np.moveaxis(x, axis, 0)
    if interleaved:
        grp = xa.reshape(ng, (qpg + 2) * hd, -1)
        rq = grp[:, : qpg * hd].reshape(ng * qpg * hd, -1)
        rk = grp[:, qpg * hd : (qpg + 1) * hd].reshape(ng * hd, -1)
        rv = grp[:, (qpg + 1) * hd :].reshape(ng * hd, -1)
    else:
        rq, rk, rv = xa[: nh * hd], xa[nh * hd : (nh + ng) * hd], xa[(nh + ng) * hd :]
    for got, ref in ((q, rq), (k, rk), (v, rv)):
        np.testing.assert_array_equal(read(got), np.moveaxis(ref, 0, axis))
    back = views.merge_qkv(q, k, v, axis, nh, ng, hd, interleaved=interleaved)
    np.testing.assert_array_equal(read(back), x)


def test_qkv_wrong_size_is_an_error():
    with pytest.raises(LanguageError, match="expected 16"):
        views.split_qkv(views.as_view(np.zeros((12, 3))), 0, 4, 2, 2)


def test_views_are_lazy_and_read_only_needed_chunks():
    L, H = 8, 6
    data = np.arange(L * 3 * H * H, dtype=np.float32).reshape(L, 3 * H, H)
    src = CountingStore(data, (1, 3 * H, H))
    # stacked fused qkv [L, 3H, H] -> regroup into 4 stages -> split q/k/v -> transpose
    g = views.regroup_stages(views.group_stages(src.t, 2), 4)
    _q, k, _v = views.split_qkv(views.take(views.take(g, 0, 3), 0, 1), 0, 2, 2, 3)
    kt = views.transpose(k)
    assert src.reads == []  # building views reads nothing
    got = read(kt)
    layer = 3 * 2 + 1
    xg = data[layer].reshape(2, 3 * 3, H)
    np.testing.assert_array_equal(got, xg[:, 3:6].reshape(6, H).T)  # k rows of each group
    assert {r[0] for r in src.reads} == {(layer, layer + 1)}  # only that layer's chunk
    assert src.elements_read() <= 3 * H * H * 2  # one chunk (maybe read per piece)


def test_pad_and_slice_vocab():
    x = np.arange(10 * 2, dtype=np.float32).reshape(10, 2)
    p = views.pad_axis(views.as_view(x), 0, 16)
    np.testing.assert_array_equal(read(p)[:10], x)
    assert (read(p)[10:] == 0).all()
    np.testing.assert_array_equal(read(views.slice_axis(p, 0, 0, 10)), x)


def test_bfloat16_views_are_exact():
    import ml_dtypes

    x = np.random.default_rng(0).standard_normal((4, 6)).astype(ml_dtypes.bfloat16)
    t = views.transpose(views.split_dim(views.as_view(x), 1, (2, 3)), [1, 0, 2])
    assert read(t).dtype == x.dtype
    np.testing.assert_array_equal(
        read(t).view(np.uint16), x.reshape(4, 2, 3).transpose(1, 0, 2).view(np.uint16)
    )
