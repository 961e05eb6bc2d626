"""Import-side kinds: split∘merge is the identity, merges match hand-built references, errors
name the tensor and the ranks."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_ucp._src import language as L
from jax_ucp.errors import LanguageError
from jax_ucp.language import (
    QKV,
    Averaged,
    Expert,
    Partitioned,
    PipelineTied,
    Replicated,
    SubParams,
    SwiGLU,
    Vocab,
    merge,
    split,
)

FEW = settings(max_examples=12, deadline=None)


def rnd(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def roundtrip(kind, full, n, settings=None):
    frags = split(kind, full, n, name="t", settings=settings)
    assert len(frags) == n
    got = merge(kind, frags, name="t", settings=settings)
    np.testing.assert_array_equal(got, full)
    lazy = merge(kind, frags, name="t", settings=settings, lazy=True)
    np.testing.assert_array_equal(lazy.read().result(), full)
    return frags


@FEW
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.integers(0, 1))
def test_partitioned_roundtrip(tp, a, b, dim):
    shape = [a * tp, b * tp]
    full = rnd(shape, tp)
    frags = roundtrip(Partitioned(dim=dim), full, tp)
    assert all(f.shape[dim] == shape[dim] // tp for f in frags)


def test_partitioned_uneven_and_shape_errors():
    full = rnd((7, 3))
    k = Partitioned(dim=0, sizes=(3, 4))
    roundtrip(k, full, 2)
    with pytest.raises(LanguageError, match=r"decoder.x: partitioned.*rank 1 has shape"):
        merge(Partitioned(dim=0), [rnd((2, 3)), rnd((2, 4))], name="decoder.x")


@FEW
@given(st.integers(1, 4), st.sampled_from([(), (3,), (2, 5)]))
def test_replicated_and_pipeline_tied_roundtrip(n, shape):
    full = rnd(shape, n)
    roundtrip(Replicated(), full, n)
    frags = split(PipelineTied(), full, n)
    np.testing.assert_array_equal(merge(PipelineTied(), frags), full)


def test_replicated_disagreement_names_tensor_and_ranks():
    a = rnd((4, 3))
    b = a.copy()
    b[2, 1] += 1
    with pytest.raises(
        LanguageError,
        match=r"emb\.w: replicated fragments disagree across TP ranks: "
        r"rank 0 vs rank\(s\) \[1, 3\].*index \(2, 1\)",
    ):
        merge("replicated", [a, b, a, b], name="emb.w")
    z = np.zeros(3, np.float32)
    nz = -z
    with pytest.raises(LanguageError):  # bit-exact: -0.0 differs from 0.0
        merge(Replicated(), [z, nz], name="n")
    nan = np.array([np.nan], np.float32)
    np.testing.assert_array_equal(merge(Replicated(), [nan, nan.copy()]), nan)


def test_pipeline_tied_disagreement_names_stages():
    a = rnd((6, 2))
    with pytest.raises(
        LanguageError, match=r"w: pipeline-tied copies disagree: stage 0 vs stage\(s\) \[1\]"
    ):
        merge(PipelineTied(), [a, a + 1], name="w")
    # with an inner TP kind: fragments[stage][tp]
    v = Vocab(vocab_size=5, divisible_by=2)
    per_stage = split(v, a[:5], 2)
    got = merge(PipelineTied(inner=v), [per_stage, per_stage])
    np.testing.assert_array_equal(got, a[:5])


def test_averaged_matches_torch_sum_over_len():
    frags = [rnd((3, 4), s) for s in range(3)]
    ref = ((0 + frags[0] + frags[1] + frags[2]) / np.float32(3)).astype(np.float32)
    got = merge(Averaged(), frags)
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(merge(Averaged(), split(Averaged(), frags[0], 2)), frags[0])


@FEW
@given(st.integers(1, 4), st.integers(1, 3), st.sampled_from([0, 1]))
def test_swiglu_roundtrip_and_layout(tp, f, dim):
    ffn = f * tp
    shape = [2 * ffn, 3] if dim == 0 else [3, 2 * ffn]
    full = rnd(shape, tp)
    frags = roundtrip(SwiGLU(dim=dim), full, tp)
    gate, up = np.split(full, 2, axis=dim)
    for r, fr in enumerate(frags):  # each rank holds [gate_r; up_r]
        g_r, u_r = np.split(fr, 2, axis=dim)
        np.testing.assert_array_equal(g_r, np.split(gate, tp, axis=dim)[r])
        np.testing.assert_array_equal(u_r, np.split(up, tp, axis=dim)[r])
    parts = L.split_parts(SwiGLU(dim=dim), full)
    np.testing.assert_array_equal(parts["gate"], gate)


def megatron_qkv(q_heads, k_heads, v_heads):
    """Full fused QKV from per-head [hd, hidden] blocks, Megatron's per-group interleaving."""
    nh, ng = len(q_heads), len(k_heads)
    qpg = nh // ng
    rows = []
    for g in range(ng):
        rows += q_heads[g * qpg : (g + 1) * qpg] + [k_heads[g], v_heads[g]]
    return np.concatenate(rows, 0)


@FEW
@given(
    st.sampled_from(
        [
            (4, 4, 2, 1),
            (4, 4, 2, 2),
            (4, 4, 2, 4),
            (8, 2, 3, 2),
            (8, 4, 2, 4),
            (6, 3, 2, 1),
            (12, 3, 2, 3),
            (4, 1, 4, 1),
        ]
    )
)
def test_qkv_gqa_interleaved(cfg):
    nh, ng, hd, tp = cfg
    hidden = 5
    qh = [rnd((hd, hidden), 100 + i) for i in range(nh)]
    kh = [rnd((hd, hidden), 200 + i) for i in range(ng)]
    vh = [rnd((hd, hidden), 300 + i) for i in range(ng)]
    full = megatron_qkv(qh, kh, vh)
    s = {"num_attention_heads": nh, "num_query_groups": ng, "head_dim": hd}
    # the way Megatron's TP splits it: each rank computes its own groups' heads
    per = ng // tp
    hand = [
        megatron_qkv(
            qh[r * per * (nh // ng) : (r + 1) * per * (nh // ng)],
            kh[r * per : (r + 1) * per],
            vh[r * per : (r + 1) * per],
        )
        for r in range(tp)
    ]
    np.testing.assert_array_equal(merge("qkv", hand, name="qkv", settings=s), full)
    frags = roundtrip({"kind": "qkv"}, full, tp, settings=s)
    for a, b in zip(frags, hand):
        np.testing.assert_array_equal(a, b)
    parts = L.split_parts("qkv", full, settings=s)
    np.testing.assert_array_equal(parts["q"], np.concatenate(qh, 0))
    np.testing.assert_array_equal(parts["k"], np.concatenate(kh, 0))
    np.testing.assert_array_equal(parts["v"], np.concatenate(vh, 0))
    assert (
        QKV(num_heads=nh, num_kv_heads=ng, head_dim=hd)
        .join(parts["q"], parts["k"], parts["v"])
        .tobytes()
        == full.tobytes()
    )


@FEW
@given(
    st.sampled_from([(8, 2, 2, 4), (6, 3, 2, 2), (6, 3, 2, 3), (4, 2, 3, 3), (8, 8, 1, 3)]),
    st.booleans(),
)
def test_qkv_uneven_per_rank_widths(cfg, interleaved):
    """Query groups that do not divide over TP: ranks hold different numbers of heads, and q
    and k/v parts have different widths."""
    nh, ng, hd, tp = cfg
    k = QKV(dim=0, num_heads=nh, num_kv_heads=ng, head_dim=hd, interleaved=interleaved)
    full = rnd((ng * (nh // ng + 2) * hd, 3), nh + ng + tp)
    frags = roundtrip(k, full, tp)
    widths = [f.shape[0] for f in frags]
    groups = L.head_split(ng, tp)
    assert widths == [g * (nh // ng + 2) * hd for g in groups]
    if not interleaved:
        # rank r holds [Q_r; K_r; V_r]
        q, kk, v = np.split(full, [nh * hd, (nh + ng) * hd])
        off_g = 0
        for r, g in enumerate(groups):
            qpg = nh // ng
            exp = np.concatenate(
                [
                    q[off_g * qpg * hd : (off_g + g) * qpg * hd],
                    kk[off_g * hd : (off_g + g) * hd],
                    v[off_g * hd : (off_g + g) * hd],
                ]
            )
            np.testing.assert_array_equal(frags[r], exp)
            off_g += g


def test_qkv_errors_name_tensor():
    k = QKV(num_heads=4, num_kv_heads=2, head_dim=2)
    with pytest.raises(LanguageError, match=r"layers.0.qkv: qkv fragments add up to 8 rows"):
        merge(k, [rnd((8, 3))], name="layers.0.qkv")
    with pytest.raises(LanguageError, match="unknown setting 'num_attention_heads'"):
        merge("qkv", [rnd((8, 3))], name="q")


@FEW
@given(
    st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3)), min_size=2, max_size=3),
    st.integers(1, 3),
)
def test_sub_params_roundtrip(parts, tp):
    sizes = tuple(a * tp for a, _ in parts)
    full = rnd((sum(sizes), 2), tp)
    roundtrip(SubParams(dim=0, sizes=sizes), full, tp)
    # explicit uneven per-rank sizes
    if tp == 2:
        rs = tuple((s - 1, 1) if s > 1 else (s, 0) for s in sizes)
        rs = tuple(zip(*rs))
        roundtrip(SubParams(dim=0, sizes=sizes, rank_sizes=rs), full, tp)


@FEW
@given(st.integers(1, 50), st.integers(1, 4), st.sampled_from([1, 8, 128]))
def test_vocab_strip_and_pad(vocab, tp, div):
    full = rnd((vocab, 3), vocab)
    k = Vocab(dim=0, vocab_size=vocab, divisible_by=div)
    frags = roundtrip(k, full, tp)
    padded = L.padded_vocab_size(vocab, div, tp)
    assert sum(f.shape[0] for f in frags) == padded and padded % (div * tp) == 0
    assert (np.concatenate(frags)[vocab:] == 0).all()
    # settings form
    got = merge({"kind": "vocab"}, frags, settings={"vocab_size": vocab})
    np.testing.assert_array_equal(got, full)
    with pytest.raises(LanguageError, match="fewer than vocab_size"):
        merge(Vocab(vocab_size=padded + 1), frags, name="emb")


@FEW
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 2))
def test_expert_stacked(ep, tp, nl):
    E, F, H = ep * nl, 2 * tp, 3
    inner = SwiGLU(dim=0)
    full = rnd((E, 2 * F, H), ep * 10 + tp)
    k = Expert(layout="stacked", dim=0, num_experts=E, inner=inner)
    locs = split(k, full, ep)
    frags = [k.split_tp(loc, tp) for loc in locs]
    np.testing.assert_array_equal(merge(k, frags), full)
    np.testing.assert_array_equal(merge(k, frags, lazy=True).read().result(), full)
    # per-EP-rank only (no TP)
    k2 = Expert(layout="stacked", num_experts=E)
    np.testing.assert_array_equal(merge(k2, split(k2, full, ep)), full)


@FEW
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 2))
def test_expert_grouped_gemm(ep, tp, nl):
    E, F, H = ep * nl, 2 * tp, 3
    w1 = rnd((H, E * 2 * F), ep + tp)  # [hidden, E * 2F], each expert's block [gate; up]
    k1 = Expert(layout="grouped", dim=1, num_experts=E, inner=SwiGLU(dim=1))
    frags = [k1.split_tp(loc, tp, num_local=nl) for loc in split(k1, w1, ep)]
    assert frags[0][0].shape == (H, nl * 2 * F // tp)
    np.testing.assert_array_equal(merge(k1, frags), w1)
    np.testing.assert_array_equal(merge(k1, frags, lazy=True).read().result(), w1)
    w2 = rnd((E * F, H), 7)
    k2 = Expert(layout="grouped", dim=0, num_experts=E, inner=Partitioned(dim=0))
    frags = [k2.split_tp(loc, tp, num_local=nl) for loc in split(k2, w2, ep)]
    np.testing.assert_array_equal(merge(k2, frags), w2)


def test_expert_per_expert_and_errors():
    E, ep = 4, 2
    full = rnd((E, 6, 3))
    k = Expert(layout="per_expert", num_experts=E, inner=Partitioned(dim=0))
    locs = split(k, full, ep)
    frags = [k.split_tp(loc, 3) for loc in locs]  # [ep][tp][local]
    frags = [[list(x) for x in zip(*f)] for f in frags]  # -> [ep][local][tp]
    np.testing.assert_array_equal(merge(k, frags), full)
    assert L.expert_global_index(1, 1, E, ep) == 3
    with pytest.raises(LanguageError, match=r"moe.w: 4 experts do not divide over 3 EP ranks"):
        merge(Expert(num_experts=4), [full[:1]] * 3, name="moe.w")
    with pytest.raises(
        LanguageError, match=r"EP rank 1 \(TP rank 0\) holds 1 experts on dim 0, expected 2"
    ):
        merge(Expert(num_experts=4), [full[:2], full[:1]], name="moe.w")


def test_kind_plain_forms_and_errors():
    assert L.kind_from_obj({"kind": "partitioned", "dim": 1}) == Partitioned(dim=1)
    assert (
        L.kind_from_obj({"kind": "expert", "layout": "grouped", "inner": {"kind": "swiglu"}}).inner
        == SwiGLU()
    )
    with pytest.raises(LanguageError, match="unknown kind 'partitoned'"):
        L.kind_from_obj("partitoned")
    with pytest.raises(LanguageError, match="kind 'partitioned' has no parameter 'axis'"):
        L.kind_from_obj({"kind": "partitioned", "axis": 1})
    assert Vocab().resolve({"vocab_size": 7}).vocab_size == 7
    assert Expert(num_experts="ep * 2").resolve({"ep": 3}).num_experts == 6
