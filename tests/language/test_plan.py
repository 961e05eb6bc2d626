"""Restore-side plans: structure changes as lazy, exact views; moments follow parameters;
strictness; shipped Megatron specs onto flax trees."""

import jax
import numpy as np
import optax
import pytest
import tensorstore as ts
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from jax_ucp import language as L
from jax_ucp.errors import LanguageError
from jax_ucp.language import (
    RestoreRule,
    Root,
    Spec,
    TensorInfo,
    compile_restore_plan,
)


def rnd(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def keystr(k):
    if isinstance(k, jax.tree_util.DictKey):
        return str(k.key)
    if isinstance(k, jax.tree_util.GetAttrKey):
        return k.name
    if isinstance(k, jax.tree_util.SequenceKey):
        return str(k.idx)
    raise TypeError(k)


def flat(tree):
    """Key tuples the way jax_ucp flattens pytrees (dict keys, NamedTuple fields, indices)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(keystr(k) for k in path): np.asarray(v) for path, v in leaves}


def run(spec, arrays, **kw):
    plan = compile_restore_plan(
        spec, {k: TensorInfo(v.shape, v.dtype) for k, v in arrays.items()}, **kw
    )
    return plan, L.apply_restore_plan(plan, arrays)


def train_state(params):
    return {"params": params, "opt_state": optax.adam(1e-3).init(params)}


def scanned_params(Lyr=4, H=8, nh=2):
    return {
        "embed": rnd((11, H), 1),
        "layers": {
            "attn": {"qkv": {"kernel": rnd((Lyr, H, 3 * H), 2)}},
            "mlp": {"fc1": {"kernel": rnd((Lyr, H, 2 * 16), 3)}, "norm": rnd((Lyr, H), 4)},
        },
    }


UNSTACK = Spec(
    restore=[
        RestoreRule(r"layers/(?P<rest>.*)", "layers_{i}/{rest}", ops=["unstack"]),
        RestoreRule(r"embed"),
    ]
)
STACK = Spec(
    restore=[
        RestoreRule(
            r"layers_(?P<i>\d+)/(?P<rest>.*)", "layers/{rest}", ops=[{"op": "stack", "over": "i"}]
        ),
        RestoreRule(r"embed"),
    ]
)


def test_scanned_to_per_layer_and_back_with_optax_moments():
    state = flat(train_state(scanned_params()))
    assert ("opt_state", "0", "mu", "layers", "attn", "qkv", "kernel") in state
    plan, out = run(UNSTACK, state)
    for i in range(4):
        for root in (("params",), ("opt_state", "0", "mu"), ("opt_state", "0", "nu")):
            np.testing.assert_array_equal(
                out[root + (f"layers_{i}", "attn", "qkv", "kernel")],
                state[root + ("layers", "attn", "qkv", "kernel")][i],
            )
    assert out[("opt_state", "0", "count")] == state[("opt_state", "0", "count")]
    assert plan[("params", "layers_2", "mlp", "norm")].ops == ("unstack[2]",)
    _, back = run(STACK, out)
    assert back.keys() == state.keys()
    for k in state:
        np.testing.assert_array_equal(back[k], state[k])


def test_stack_missing_layer_is_an_error():
    arrays = {("params", f"layers_{i}", "w"): rnd((2,)) for i in (0, 1, 3)}
    with pytest.raises(
        LanguageError, match=r"restore rule #1.*'i' values must be 0..2 without gaps"
    ):
        run(STACK.__class__(restore=STACK.restore[:1]), arrays)


def test_pipeline_regroup_and_error():
    Lyr = 6
    w = rnd((2, 3, 5, 4))  # [stages=2, 3 layers per stage, ...]
    arrays = {("params", "stages", "w"): w, ("opt_state", "mu", "stages", "w"): w + 1}
    for new in (1, 3, 6):
        spec = Spec(
            settings={"pp": new},
            restore=[
                RestoreRule(r"stages/(?P<r>.*)", "stages/{r}", ops=[{"op": "regroup_stages"}])
            ],
        )
        _, out = run(spec, arrays)
        np.testing.assert_array_equal(
            out[("params", "stages", "w")], w.reshape(new, Lyr // new, 5, 4)
        )
        np.testing.assert_array_equal(
            out[("opt_state", "mu", "stages", "w")], (w + 1).reshape(new, Lyr // new, 5, 4)
        )
    flat_spec = Spec(
        restore=[RestoreRule(r"stages/(?P<r>.*)", "layers/{r}", ops=["ungroup_stages"])]
    )
    _, out = run(flat_spec, arrays)
    np.testing.assert_array_equal(out[("params", "layers", "w")], w.reshape(6, 5, 4))
    bad = Spec(settings={"pp": 4}, restore=[RestoreRule(r"stages/.*", ops=["regroup_stages"])])
    with pytest.raises(
        LanguageError,
        match=r"params/stages/w: cannot regroup 6 layers .* into 4 "
        "pipeline stages: 6 is not divisible by 4",
    ):
        run(bad, arrays)


def test_fused_qkv_to_separate_and_back():
    nh, ng, hd, H = 4, 2, 2, 6
    qkv = rnd((H, ng * (nh // ng + 2) * hd))  # flax [in, out], Megatron interleaved columns
    tree = {"params": {"attn": {"qkv": {"kernel": qkv}}}}
    tree["opt_state"] = optax.adam(1.0).init(tree["params"])
    arrays = flat(tree)
    s = dict(num_attention_heads=nh, num_query_groups=ng, head_dim=hd)
    split = Spec(
        settings=s,
        restore=[
            RestoreRule(
                r"attn/qkv/kernel", "attn/{part}/kernel", ops=[{"op": "split_qkv", "axis": 1}]
            )
        ],
    )
    _, out = run(split, arrays)
    ref = L.split_parts(L.QKV(dim=1), qkv, settings=s)
    for p in "qkv":
        np.testing.assert_array_equal(out[("params", "attn", p, "kernel")], ref[p])
        assert ("opt_state", "0", "nu", "attn", p, "kernel") in out
    merge = Spec(
        settings=s,
        restore=[
            RestoreRule(
                r"attn/(?P<part>[qkv])/kernel",
                "attn/qkv/kernel",
                ops=[{"op": "merge_qkv", "axis": 1}],
            )
        ],
    )
    _, back = run(merge, out)
    for k in arrays:
        np.testing.assert_array_equal(back[k], arrays[k])


def test_swiglu_fc1_to_gate_up_and_back():
    fc1 = rnd((3, 6, 10))  # scanned [L, in, 2F]
    arrays = {("params", "mlp", "fc1"): fc1}
    s1 = Spec(
        restore=[
            RestoreRule(
                r"mlp/fc1",
                "mlp_{i}/{part}",
                ops=["unstack", {"op": "split", "axis": 1, "parts": ["gate", "up"]}],
            )
        ]
    )
    _, out = run(s1, arrays)
    np.testing.assert_array_equal(out[("params", "mlp_2", "up")], fc1[2, :, 5:])
    s2 = Spec(
        restore=[
            RestoreRule(
                r"mlp_(?P<i>\d+)/(?P<part>gate|up)",
                "mlp/fc1",
                ops=[{"op": "concat", "axis": 1}, {"op": "stack", "over": "i"}],
            )
        ]
    )
    _, back = run(s2, out)
    np.testing.assert_array_equal(back[("params", "mlp", "fc1")], fc1)


def test_strictness_errors_name_tensors_and_rules():
    arrays = {("params", "a"): rnd((2,)), ("params", "b"): rnd((2,)), ("other", "x"): rnd((1,))}
    spec = Spec(restore=[RestoreRule("a", "A"), RestoreRule("zzz", "Z", label="typo rule")])
    with pytest.raises(LanguageError) as e:
        run(spec, arrays)
    msg = str(e.value)
    assert (
        "params/b" in msg and "restore rule #2 (typo rule) pattern 'zzz' matched no tensor" in msg
    )
    plan, out = run(spec, arrays, strict=False)  # relaxed: uncovered keys pass through
    assert set(out) == {("params", "A"), ("params", "b"), ("other", "x")}
    assert plan[("params", "b")].rule == "identity"
    relaxed = Spec(
        restore=[RestoreRule("a", "A"), RestoreRule("b"), RestoreRule("zzz", required=False)]
    )
    run(relaxed, arrays)


def test_target_collision_and_template_errors():
    arrays = {("params", "a"): rnd((2,)), ("params", "b"): rnd((2,))}
    with pytest.raises(LanguageError, match="both map to params/same"):
        run(Spec(restore=[RestoreRule("[ab]", "same")]), arrays)
    with pytest.raises(LanguageError, match="unknown setting 'nope'"):
        run(Spec(restore=[RestoreRule("[ab]", "x_{nope}")]), arrays)


def test_roots_move_opt_state_into_optax_chain():
    arrays = {
        ("params", "w"): rnd((2, 3)),
        ("opt_state", "mu", "w"): rnd((2, 3), 1),
        ("opt_state", "nu", "w"): rnd((2, 3), 2),
        ("opt_state", "count"): np.int32(7),
    }
    spec = Spec(
        restore=[RestoreRule("w", "dense/kernel", ops=["transpose"])], roots=L.optax_chain_roots()
    )
    _, out = run(spec, arrays)
    assert set(out) == {
        ("params", "dense", "kernel"),
        ("opt_state", "0", "mu", "dense", "kernel"),
        ("opt_state", "0", "nu", "dense", "kernel"),
        ("opt_state", "0", "count"),
    }
    np.testing.assert_array_equal(
        out[("opt_state", "0", "nu", "dense", "kernel")], arrays[("opt_state", "nu", "w")].T
    )
    # a root with a wildcard and a template target
    r = Root("opt_state/*/mu", "moments/{1}/m")
    assert r.match(("opt_state", "3", "mu", "x")) == (3, ["3"])
    assert r.target_prefix(("opt_state", "3", "mu", "x"), 3, ["3"], {}) == ("moments", "3", "m")


def test_plan_is_lazy_and_reads_only_needed_chunks():
    Lyr, H = 6, 4
    data = rnd((Lyr, H, 3 * H))
    reads = []

    def rd(domain, array, params):
        reads.append(domain[0].inclusive_min)
        array[...] = data[domain.index_exp]

    src = ts.virtual_chunked(
        rd,
        dtype=ts.float32,
        domain=ts.IndexDomain(shape=list(data.shape)),
        chunk_layout=ts.ChunkLayout(read_chunk_shape=[1, H, 3 * H]),
    )
    spec = Spec(
        settings=dict(num_heads=2, head_dim=2),
        restore=[
            RestoreRule(
                r"layers/qkv",
                "layers_{i}/{part}",
                ops=["unstack", {"op": "split_qkv", "axis": 1}, "transpose"],
            )
        ],
    )
    plan = compile_restore_plan(
        spec, {("params", "layers", "qkv"): TensorInfo(data.shape, np.float32)}
    )
    v = plan[("params", "layers_4", "k")].build({("params", "layers", "qkv"): src})
    assert reads == [] and v.shape == (4, H)
    np.testing.assert_array_equal(
        v[1:3].read().result(),
        L.split_parts(
            L.QKV(dim=1), data[4], settings=dict(num_heads=2, head_dim=2, num_kv_heads=2)
        )["k"].T[1:3],
    )
    assert set(reads) == {4}


# ------------------------------------------------------------------- shipped Megatron specs


def megatron_legacy(Lyr, H, F, V, nh, ng, hd, *, gpt=True, seed=0):
    rng = np.random.default_rng(seed)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)
    d = {
        "embedding.word_embeddings.weight": r(V, H),
        "decoder.final_layernorm.weight": r(H),
        "output_layer.weight": r(V, H),
    }
    if gpt:
        d.update(
            {"embedding.position_embeddings.weight": r(16, H), "decoder.final_layernorm.bias": r(H)}
        )
    qkv_rows = ng * (nh // ng + 2) * hd
    for i in range(Lyr):
        p = f"decoder.layers.{i}."
        d.update(
            {
                p + "input_layernorm.weight": r(H),
                p + "self_attention.linear_qkv.weight": r(qkv_rows, H),
                p + "self_attention.linear_proj.weight": r(H, nh * hd),
                p + "pre_mlp_layernorm.weight": r(H),
                p + "mlp.linear_fc2.weight": r(H, F),
            }
        )
        if gpt:
            d.update(
                {
                    p + "input_layernorm.bias": r(H),
                    p + "self_attention.linear_qkv.bias": r(qkv_rows),
                    p + "self_attention.linear_proj.bias": r(H),
                    p + "pre_mlp_layernorm.bias": r(H),
                    p + "mlp.linear_fc1.weight": r(F, H),
                    p + "mlp.linear_fc1.bias": r(F),
                    p + "mlp.linear_fc2.bias": r(H),
                }
            )
        else:
            d[p + "mlp.linear_fc1.weight"] = r(2 * F, H)
    return d


def stacked(legacy, Lyr):
    """torch_dist layout: decoder.layers.N.x -> decoder.layers.x [L, ...]."""
    out = {k: v for k, v in legacy.items() if not k.startswith("decoder.layers.")}
    names = {k.split(".", 3)[3] for k in legacy if k.startswith("decoder.layers.")}
    for n in names:
        out["decoder.layers." + n] = np.stack(
            [legacy[f"decoder.layers.{i}.{n}"] for i in range(Lyr)]
        )
    return out


def as_checkpoint(d):
    arrays = {("params", k): v for k, v in d.items()}
    arrays.update({("opt_state", "mu", k): v + 1 for k, v in d.items()})
    arrays.update({("opt_state", "nu", k): v * 2 for k, v in d.items()})
    arrays[("opt_state", "count")] = np.int32(3)
    return arrays


def test_shipped_specs_load_and_roundtrip_toml():
    assert {"megatron_gpt", "llama", "mixtral"} <= set(L.list_specs())
    for name in L.list_specs():
        s = L.load_spec(name)
        assert L.spec_from_toml(L.spec_to_toml(s)) == s


def test_megatron_gpt_legacy_and_stacked_map_to_the_same_flax_tree():
    Lyr, H, F, V, nh = 2, 8, 32, 50, 2
    leg = megatron_legacy(Lyr, H, F, V, nh, nh, H // nh)
    spec = L.load_spec("megatron_gpt", num_attention_heads=nh, hidden_size=H)
    _, a = run(spec, as_checkpoint(leg))
    _, b = run(spec, as_checkpoint(stacked(leg, Lyr)))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    np.testing.assert_array_equal(
        a[("params", "layers_1", "mlp", "fc1", "kernel")],
        leg["decoder.layers.1.mlp.linear_fc1.weight"].T,
    )
    np.testing.assert_array_equal(
        a[("opt_state", "0", "mu", "layers_1", "attn", "qkv", "kernel")],
        leg["decoder.layers.1.self_attention.linear_qkv.weight"].T + 1,
    )
    np.testing.assert_array_equal(a[("params", "lm_head", "kernel")], leg["output_layer.weight"].T)
    assert a[("opt_state", "0", "count")] == 3
    # the import side classifies every legacy name
    m = spec.classify(leg)
    assert m["decoder.layers.0.self_attention.linear_proj.weight"].kind == L.Partitioned(dim=-1)


def test_llama_gqa_swiglu_mapping():
    Lyr, H, F, V, nh, ng, hd = 2, 8, 12, 40, 4, 2, 2
    leg = megatron_legacy(Lyr, H, F, V, nh, ng, hd, gpt=False)
    spec = L.load_spec(
        "llama",
        num_attention_heads=nh,
        num_query_groups=ng,
        head_dim=hd,
        qkv_layout="split",
        mlp_layout="split",
    )
    _plan, a = run(spec, as_checkpoint(leg))
    _, b = run(spec, as_checkpoint(stacked(leg, Lyr)))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    qkv = leg["decoder.layers.1.self_attention.linear_qkv.weight"]
    parts = L.split_parts("qkv", qkv, settings=spec.settings)
    for p in "qkv":
        np.testing.assert_array_equal(a[("params", "layers_1", "attn", p, "kernel")], parts[p].T)
    assert a[("params", "layers_1", "attn", "q", "kernel")].shape == (H, nh * hd)
    assert a[("params", "layers_1", "attn", "k", "kernel")].shape == (H, ng * hd)
    fc1 = leg["decoder.layers.0.mlp.linear_fc1.weight"]
    np.testing.assert_array_equal(a[("params", "layers_0", "mlp", "gate", "kernel")], fc1[:F].T)
    np.testing.assert_array_equal(a[("params", "layers_0", "mlp", "up", "kernel")], fc1[F:].T)
    np.testing.assert_array_equal(
        a[("opt_state", "0", "nu", "layers_0", "mlp", "up", "kernel")], 2 * fc1[F:].T
    )
    # default (fused) layout
    _, f = run(L.load_spec("llama"), as_checkpoint(leg))
    np.testing.assert_array_equal(f[("params", "layers_0", "mlp", "fc1", "kernel")], fc1.T)
    np.testing.assert_array_equal(f[("params", "layers_1", "attn", "qkv", "kernel")], qkv.T)
    # import side: TP-split each tensor with its kind and merge it back
    s = dict(spec.settings, vocab_size=V)
    for name, m in spec.with_settings(vocab_size=V).classify(leg).items():
        frags = L.split(m.kind, leg[name], 2, name=name, settings=s)
        np.testing.assert_array_equal(L.merge(m.kind, frags, name=name, settings=s), leg[name])


@pytest.mark.parametrize("gpt", [True, False])
def test_shipped_specs_produce_the_flax_model_tree(gpt):
    models = pytest.importorskip("jax_ucp.models")
    Lyr, H, F, V, nh, ng = 2, 8, 12, 40, 4, (4 if gpt else 2)
    cfg = models.LMConfig(
        vocab_size=V,
        hidden_size=H,
        num_layers=Lyr,
        num_attention_heads=nh,
        ffn_hidden_size=F,
        num_query_groups=ng,
        max_position_embeddings=16,
        **({} if gpt else dict(normalization="RMSNorm", gated=True, bias=False, position="rope")),
    )
    variables = jax.eval_shape(
        models.TransformerLM(cfg).init, jax.random.PRNGKey(0), np.zeros((1, 4), np.int32)
    )
    want = {
        tuple(keystr(k) for k in path): v.shape
        for path, v in jax.tree_util.tree_flatten_with_path(variables["params"])[0]
    }
    leg = megatron_legacy(Lyr, H, F, V, nh, ng, H // nh, gpt=gpt)
    _, out = run(
        L.load_spec("megatron_gpt" if gpt else "llama"), {("params", k): v for k, v in leg.items()}
    )
    got = {k[1:]: v.shape for k, v in out.items()}
    assert got == want


def test_mixtral_expert_layouts_agree():
    Lyr, H, F, E = 2, 4, 6, 4
    rng = np.random.default_rng(0)
    fc1 = rng.standard_normal((Lyr, E, 2 * F, H)).astype(np.float32)
    fc2 = rng.standard_normal((Lyr, E, H, F)).astype(np.float32)
    base = megatron_legacy(Lyr, H, F, 30, 2, 1, 2, gpt=False)
    base = {k: v for k, v in base.items() if ".mlp.linear_fc" not in k}
    for i in range(Lyr):
        base[f"decoder.layers.{i}.mlp.router.weight"] = rng.standard_normal((E, H)).astype(
            np.float32
        )
    seq, grouped, stk = dict(base), dict(base), stacked(base, Lyr)
    for i in range(Lyr):
        for e in range(E):
            seq[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight"] = fc1[i, e]
            seq[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight"] = fc2[i, e]
        # megatron-core's GroupedMLP uses weight1 [H, E*2F] as weight1.view(E, H, 2F): expert e's
        # [H, 2F] kernel is the e-th block of the row-major buffer, not a column block.
        grouped[f"decoder.layers.{i}.mlp.experts.weight1"] = np.stack(
            [fc1[i, e].T for e in range(E)]
        ).reshape(H, E * 2 * F)
        grouped[f"decoder.layers.{i}.mlp.experts.weight2"] = np.concatenate(
            [fc2[i, e].T for e in range(E)], 0
        )
    stk["decoder.layers.mlp.experts.experts.linear_fc1.weight"] = fc1
    stk["decoder.layers.mlp.experts.experts.linear_fc2.weight"] = fc2
    spec = L.load_spec(
        "mixtral", num_attention_heads=2, num_query_groups=1, head_dim=2, num_experts=E
    )
    outs = [run(spec, as_checkpoint(d))[1] for d in (seq, grouped, stk)]
    for o in outs[1:]:
        assert o.keys() == outs[0].keys()
        for k in o:
            np.testing.assert_array_equal(o[k], outs[0][k])
    o = outs[0]
    np.testing.assert_array_equal(
        o[("params", "layers_1", "moe", "fc1", "kernel")], fc1[1].transpose(0, 2, 1)
    )
    np.testing.assert_array_equal(
        o[("params", "layers_1", "moe", "fc2", "kernel")], fc2[1].transpose(0, 2, 1)
    )
    split = spec.with_settings(mlp_layout="split")
    outs = [run(split, as_checkpoint(d))[1] for d in (seq, grouped, stk)]
    for o in outs:
        np.testing.assert_array_equal(
            o[("params", "layers_1", "moe", "gate", "kernel")], fc1[1, :, :F].transpose(0, 2, 1)
        )
        np.testing.assert_array_equal(
            o[("params", "layers_1", "moe", "up", "kernel")], fc1[1, :, F:].transpose(0, 2, 1)
        )
    np.testing.assert_array_equal(
        o[("params", "layers_0", "moe", "router", "kernel")],
        base["decoder.layers.0.mlp.router.weight"].T,
    )


def test_spec_without_restore_rules_is_identity_but_moves_roots():
    arrays = {
        ("params", "w"): rnd((2,)),
        ("opt_state", "mu", "w"): rnd((2,)),
        ("opt_state", "count"): np.int32(1),
    }
    spec = Spec(imports=[L.ImportRule(".*", "replicated")], roots=L.optax_chain_roots())
    _, out = run(spec, arrays)
    assert set(out) == {("params", "w"), ("opt_state", "0", "mu", "w"), ("opt_state", "0", "count")}


def test_bfloat16_and_string_dtypes_in_plans():
    import ml_dtypes

    class Entry:  # what a manifest entry looks like: shape + dtype name
        shape, dtype = (4, 6), "bfloat16"

    spec = Spec(restore=[RestoreRule("w", ops=["transpose"])])
    plan = compile_restore_plan(spec, {("params", "w"): Entry()})
    p = plan[("params", "w")]
    assert p.shape == (6, 4) and p.dtype == np.dtype(ml_dtypes.bfloat16)
    x = rnd((4, 6)).astype(ml_dtypes.bfloat16)
    got = p.build({("params", "w"): ts.array(x)}).read().result()
    assert (
        got.dtype == x.dtype
        and got.view(np.uint16).tobytes() == x.T.copy().view(np.uint16).tobytes()
    )


@hsettings(max_examples=10, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.integers(1, 6))
def test_stages_and_layers_roundtrip_through_plans(per, stages, new):
    """[S, L/S, ...] -> regroup(new) or error -> ungroup -> unstack -> stack: bit-exact."""
    Lyr = per * stages
    w = rnd((stages, per, 3), Lyr)
    arrays = {("params", "blocks", "w"): w, ("opt_state", "0", "nu", "blocks", "w"): w * 3}
    regroup = Spec(settings={"pp": new}, restore=[RestoreRule("blocks/w", ops=["regroup_stages"])])
    if Lyr % new:
        with pytest.raises(LanguageError, match=f"cannot regroup {Lyr} layers"):
            run(regroup, arrays)
        return
    _, out = run(regroup, arrays)
    np.testing.assert_array_equal(
        out[("opt_state", "0", "nu", "blocks", "w")], (w * 3).reshape(new, Lyr // new, 3)
    )
    flat_layers = Spec(
        restore=[RestoreRule("blocks/w", "layers_{i}/w", ops=["ungroup_stages", "unstack"])]
    )
    _, per_layer = run(flat_layers, out)
    assert len(per_layer) == 2 * Lyr
    back = Spec(
        settings={"pp": stages},
        restore=[
            RestoreRule(
                r"layers_(?P<i>\d+)/w",
                "blocks/w",
                ops=[{"op": "stack", "over": "i"}, "group_stages"],
            )
        ],
    )
    _, again = run(back, per_layer)
    for k in arrays:
        np.testing.assert_array_equal(again[k], arrays[k])
