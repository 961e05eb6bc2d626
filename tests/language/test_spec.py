"""Specs: the TOML file form (round trip, validation errors that name the rule and line),
import-side matching and strictness, settings expressions."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_ucp import language as L
from jax_ucp.language import ImportRule, RestoreRule, Root, Spec, SpecError, StrictnessError
from tests.ucp_testing import REPO

FEW = settings(max_examples=15, deadline=None)

USER_SPEC = r"""
name = "tiny"
strict = true

[settings]
num_layers = 4
pp = 2
num_heads = 4
num_kv_heads = 2

[[import]]
pattern = 'layers\.\d+\.qkv'
kind = "qkv"
head_dim = 2

[[import]]
pattern = 'layers\.\d+\.proj'
kind = "partitioned"
dim = 1

[[import]]
pattern = 'emb'
kind = "vocab"
vocab_size = 10
divisible_by = 4

[[restore]]
pattern = 'layers\.(\d+)\.qkv'
target = "layers_{1}/attn/qkv/kernel"
ops = ["transpose"]

[[restore]]
pattern = 'layers\.(?P<i>\d+)\.proj'
target = "blocks/proj"
ops = [{op = "transpose"}, {op = "stack", over = "i"}, {op = "group_stages", stages = "pp"}]
"""


def test_user_toml_spec_loads_and_works(tmp_path):
    p = tmp_path / "tiny.toml"
    p.write_text(USER_SPEC)
    spec = L.load_spec(p, pp=4)
    assert spec.settings["num_attention_heads"] == 4 and spec.settings["pp"] == 4
    names = (
        {f"layers.{i}.qkv": None for i in range(4)}
        | {f"layers.{i}.proj": None for i in range(4)}
        | {"emb": None}
    )
    m = spec.classify(names)
    assert m["layers.0.qkv"].kind == L.QKV(head_dim=2, num_heads=4, num_kv_heads=2)
    assert m["emb"].kind.vocab_size == 10
    arrays = {("params", f"layers.{i}.proj"): np.full((3, 5), i, np.float32) for i in range(4)}
    arrays |= {("params", f"layers.{i}.qkv"): np.zeros((16, 3), np.float32) for i in range(4)}
    plan = L.compile_restore_plan(
        spec, L.saved_infos({"params": {k[1]: v for k, v in arrays.items()}})
    )
    out = L.apply_restore_plan(plan, arrays)
    assert out[("params", "blocks", "proj")].shape == (4, 1, 5, 3)
    assert out[("params", "blocks", "proj")][3, 0, 0, 0] == 3
    assert out[("params", "layers_2", "attn", "qkv", "kernel")].shape == (3, 16)


def test_toml_roundtrip_of_every_kind_and_op():
    spec = Spec(
        name="all",
        description="every kind and op",
        strict=False,
        settings={"num_heads": 4, "vocab_size": 33, "flag": True, "ratio": 0.5, "layout": "x"},
        roots=(
            Root("params"),
            Root("opt_state/**/mu", "m/{1}"),
            Root("opt_state/count", "c", params=False),
        ),
        imports=[
            ImportRule("a", L.Replicated(check=False)),
            ImportRule("b", L.Averaged()),
            ImportRule("c", L.Partitioned(dim=1, sizes=(2, 3))),
            ImportRule("d", L.SubParams(dim=0, sizes=(4, 2), rank_sizes=((3, 1), (1, 1)))),
            ImportRule("e", L.SwiGLU(dim=1)),
            ImportRule("f", L.QKV(interleaved=False, head_dim=8)),
            ImportRule("g", L.Vocab(divisible_by="tp * 64")),
            ImportRule("h", L.PipelineTied(inner=L.Vocab())),
            ImportRule(
                r"i\.'quoted'",
                L.Expert(layout="grouped", dim=1, inner=L.SwiGLU(dim=1)),
                required=False,
                when={"layout": ["x", "y"]},
                label="experts",
            ),
        ],
        restore=[
            RestoreRule(
                "r",
                "t/{i}",
                ops=[
                    "transpose",
                    {"op": "transpose", "perm": [1, 0]},
                    {"op": "split_dim", "axis": 1, "sizes": [2, -1]},
                    {"op": "merge_dims", "axis": 1},
                    {"op": "group_stages", "stages": 2},
                    {"op": "ungroup_stages"},
                    {"op": "regroup_stages", "stages": "pp"},
                    {"op": "slice", "axis": 0, "stop": "vocab_size"},
                    {"op": "pad", "multiple": 8},
                    {"op": "unstack", "var": "i", "if_unbound": True},
                    {"op": "split", "parts": ["a", "b"], "sizes": [1, 2]},
                    {"op": "split_qkv", "interleaved": False},
                    {"op": "stack", "over": "j"},
                    {"op": "concat", "parts": ["a", "b"], "over": "p"},
                    {"op": "merge_qkv", "axis": 1},
                ],
                required=False,
                when={"flag": True},
                label='tab\there "q"',
            )
        ],
    )
    text = L.spec_to_toml(spec)
    back = L.spec_from_toml(text)
    assert back == spec
    assert L.spec_to_toml(back) == text


@pytest.mark.parametrize(
    "mutate,match",
    [
        (
            lambda t: t.replace('kind = "partitioned"', 'kind = "partitoned"'),
            r"x\.toml line 16: import rule #2: unknown kind 'partitoned'",
        ),
        (
            lambda t: t.replace("dim = 1", "axis = 1"),
            r"x\.toml line 16: import rule #2: kind 'partitioned' has no parameter 'axis'",
        ),
        (
            lambda t: t.replace(r"pattern = 'emb'", r"pattern = 'emb('"),
            r"x\.toml line 21: import rule #3: .*bad regex 'emb\('",
        ),
        (
            lambda t: t.replace('ops = ["transpose"]', 'ops = ["transpos"]'),
            r"x\.toml line 27: restore rule #1 op #1: unknown op 'transpos'",
        ),
        (
            lambda t: t.replace('over = "i"}', 'over = "i", bogus = 1}'),
            r"x\.toml line 32: restore rule #2 op #2: op 'stack' has no parameter 'bogus'",
        ),
        (
            lambda t: t.replace('target = "blocks/proj"', 'targte = "blocks/proj"'),
            r"x\.toml line 32: restore rule #2 .*unknown key\(s\) \['targte'\]",
        ),
        (
            lambda t: t + "\n[[import]]\nkind = 'replicated'\n",
            r"x\.toml line 37: import rule #4: missing 'pattern'",
        ),
        (lambda t: "bogus = 1\n" + t, r"unknown top-level key\(s\) \['bogus'\]"),
        (lambda t: t.replace("strict = true", "strict = tru"), r"x\.toml: invalid TOML"),
    ],
)
def test_toml_errors_name_rule_and_line(mutate, match):
    with pytest.raises(SpecError, match=match):
        L.spec_from_toml(mutate(USER_SPEC), source="x.toml")


def test_load_spec_unknown_name():
    with pytest.raises(SpecError, match="unknown spec 'lama'.*shipped: .*llama"):
        L.load_spec("lama")
    with pytest.raises(SpecError, match="not found"):
        L.load_spec("/nonexistent/x.toml")


def test_import_strictness_names_uncovered_tensor_and_unused_rule():
    spec = Spec(
        name="s",
        imports=[
            ImportRule(r"a\.\d+", "replicated"),
            ImportRule("never", "averaged", label="dead"),
        ],
    )
    with pytest.raises(StrictnessError) as e:
        spec.classify(["a.0", "a.1", "b.weight"])
    msg = str(e.value)
    assert "b.weight" in msg and "import rule #2 (dead) pattern 'never' matched no tensor" in msg
    m = spec.classify(["a.0", "b.weight"], strict=False)
    assert set(m) == {"a.0"} and spec.match("b.weight") is None
    relaxed = Spec(
        imports=[ImportRule(r".*", "replicated"), ImportRule("never", "averaged", required=False)]
    )
    relaxed.classify(["x"])


def test_first_match_wins_and_when():
    spec = Spec(
        settings={"layout": "stacked"},
        imports=[
            ImportRule(r"w", L.Partitioned(dim=1), when={"layout": "per_layer"}),
            ImportRule(r"w", L.Partitioned(dim=0)),
            ImportRule(r".*", L.Replicated()),
        ],
    )
    assert spec.match("w").kind == L.Partitioned(dim=0)
    assert spec.with_settings(layout="per_layer").match("w").kind == L.Partitioned(dim=1)
    assert spec.match("other").kind == L.Replicated()
    spec.classify(["w", "other"])  # the inactive rule is not strict-checked


@FEW
@given(st.integers(0, 50), st.integers(1, 8), st.integers(1, 5))
def test_expressions(a, b, c):
    env = {"a": a, "b": b, "num_heads": c}
    assert L.settings.eval_int("a * b + num_heads // 2 - (a % b)", env) == a * b + c // 2 - (a % b)
    assert L.settings.eval_int("heads", env) == c  # alias
    assert L.settings.render("x_{a}_{a + b}_{{lit}}", env) == f"x_{a}_{a + b}_{{lit}}"


def test_expression_errors():
    with pytest.raises(SpecError, match="only integers, setting names"):
        L.settings.eval_int("__import__('os')", {})
    with pytest.raises(SpecError, match="unknown setting 'zz'"):
        L.settings.eval_int("zz + 1", {"a": 1})
    with pytest.raises(SpecError, match="divides by zero"):
        L.settings.eval_int("1 // a", {"a": 0})


def test_derived_settings():
    d = L.Spec(
        settings={
            "heads": 8,
            "hidden": 64,
            "vocab_size": 50257,
            "make_vocab_size_divisible_by": 128,
            "tp": 2,
        }
    ).env
    assert d["num_query_groups"] == 8 and d["head_dim"] == 8 and d["padded_vocab_size"] == 50432
    with pytest.raises(SpecError, match="disagrees"):
        L.Spec(settings={"heads": 8, "num_attention_heads": 4})


def test_every_toml_example_in_the_docs_parses():
    import pathlib
    import re as _re

    doc = pathlib.Path(REPO) / "docs" / "LANGUAGE.md"
    blocks = _re.findall(r"```toml\n(.*?)```", doc.read_text(), flags=_re.S)
    assert len(blocks) >= 8
    for b in blocks:
        L.spec_from_toml(b, source="LANGUAGE.md")


def test_megatron_lm_names_map_like_megatron_core():
    rng = np.random.default_rng(0)
    H, F, V = 8, 16, 20
    core, old = {}, {}
    pairs = [
        (
            "embedding.word_embeddings.weight",
            "language_model.embedding.word_embeddings.weight",
            (V, H),
        ),
        (
            "embedding.position_embeddings.weight",
            "language_model.embedding.position_embeddings.weight",
            (12, H),
        ),
        ("decoder.final_layernorm.weight", "language_model.encoder.final_layernorm.weight", (H,)),
        ("decoder.final_layernorm.bias", "language_model.encoder.final_layernorm.bias", (H,)),
    ]
    for i in range(2):
        for c, o, s in [
            ("input_layernorm.weight", "input_layernorm.weight", (H,)),
            ("input_layernorm.bias", "input_layernorm.bias", (H,)),
            (
                "self_attention.linear_qkv.weight",
                "self_attention.query_key_value.weight",
                (3 * H, H),
            ),
            ("self_attention.linear_qkv.bias", "self_attention.query_key_value.bias", (3 * H,)),
            ("self_attention.linear_proj.weight", "self_attention.dense.weight", (H, H)),
            ("self_attention.linear_proj.bias", "self_attention.dense.bias", (H,)),
            ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", (H,)),
            ("pre_mlp_layernorm.bias", "post_attention_layernorm.bias", (H,)),
            ("mlp.linear_fc1.weight", "mlp.dense_h_to_4h.weight", (F, H)),
            ("mlp.linear_fc1.bias", "mlp.dense_h_to_4h.bias", (F,)),
            ("mlp.linear_fc2.weight", "mlp.dense_4h_to_h.weight", (H, F)),
            ("mlp.linear_fc2.bias", "mlp.dense_4h_to_h.bias", (H,)),
        ]:
            pairs.append((f"decoder.layers.{i}.{c}", f"language_model.encoder.layers.{i}.{o}", s))
    for c, o, s in pairs:
        core[("params", c)] = old[("params", o)] = rng.standard_normal(s).astype(np.float32)
    a = L.apply_spec_to_tree(L.load_spec("megatron_gpt"), L.unflatten_nested(core))
    b = L.apply_spec_to_tree(L.load_spec("megatron_lm_gpt"), L.unflatten_nested(old))
    fa, fb = L.flatten_nested(a), L.flatten_nested(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_array_equal(fa[k], fb[k])
    m = L.load_spec("megatron_lm_gpt").classify([k[1] for k in old])
    assert m["language_model.encoder.layers.1.self_attention.dense.weight"].kind == L.Partitioned(
        dim=1
    )
    assert m["language_model.encoder.layers.1.self_attention.dense.bias"].kind == L.Replicated()
