"""Specs: the TOML file form (round trip, validation errors that name the rule and line),
import-side matching and strictness, settings expressions."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_ucp._src import language as L
from jax_ucp.errors import LanguageError
from jax_ucp.language import (
    ImportRule,
    RestoreRule,
    Root,
    Spec,
    load_spec,
    spec_from_toml,
)
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
    with pytest.raises(LanguageError, match=match):
        L.spec_from_toml(mutate(USER_SPEC), source="x.toml")


def test_load_spec_unknown_name():
    with pytest.raises(LanguageError, match=r"unknown spec 'lama'.*shipped: .*llama"):
        L.load_spec("lama")
    with pytest.raises(LanguageError, match="not found"):
        L.load_spec("/nonexistent/x.toml")


def test_import_strictness_names_uncovered_tensor_and_unused_rule():
    spec = Spec(
        name="s",
        imports=[
            ImportRule(r"a\.\d+", "replicated"),
            ImportRule("never", "averaged", label="dead"),
        ],
    )
    with pytest.raises(LanguageError) as e:
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
    with pytest.raises(LanguageError, match="only integers, setting names"):
        L.settings.eval_int("__import__('os')", {})
    with pytest.raises(LanguageError, match="unknown setting 'zz'"):
        L.settings.eval_int("zz + 1", {"a": 1})
    with pytest.raises(LanguageError, match="divides by zero"):
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
    with pytest.raises(LanguageError, match="disagrees"):
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


# Hostile inputs, each built here: a clear error naming the file, or an exact import.


FIXTURES = os.path.join(REPO, "tests", "fixtures", "deepspeed")


MEGATRON_DS = "megatron_ds_tp2_dp2_z1_bf16_synthetic"


CATASTROPHIC = r"(\w+\.?)+\.never"  # exponential backtracking in Python's re on every name


@pytest.mark.timeout(30)
def test_catastrophic_pattern_in_a_spec_file_matches_in_bounded_time(tmp_path):
    toml = tmp_path / "hostile.toml"
    toml.write_text(
        f"[[import]]\npattern = '{CATASTROPHIC}'\nkind = 'replicated'\n"
        "[[import]]\npattern = '.*'\nkind = 'replicated'\n"
    )
    spec = load_spec(toml)
    name = "language_model.encoder.layers.0.self_attention.query_key_value.weight" * 20
    assert spec.match(name).index == 1  # the first rule does not match, the second does


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "pattern, message",
    [
        (r"(?<=x)w", r"bad regex '\(\?<=x\)w': invalid perl operator"),
        (r"(?P<a>x)(?P=a)", r"bad regex '\(\?P<a>x\)\(\?P=a\)'"),
        (r"x{,3}", r"write '\{0,n\}' instead of '\{,n\}'"),
        ("x" * 5000, r"5000 characters long; at most 4096"),
    ],
)
def test_spec_file_pattern_re2_cannot_run_names_file_and_rule(tmp_path, pattern, message):
    toml = tmp_path / "bad.toml"
    toml.write_text(f"name = 'bad'\n\n[[restore]]\npattern = '{pattern}'\n")
    with pytest.raises(LanguageError, match=rf"bad\.toml line 3: restore rule #1: .*{message}"):
        load_spec(toml)


@pytest.mark.timeout(30)
def test_also_patterns_round_trip_through_toml():
    """``also`` (the name must match these too) is part of the file form."""
    from jax_ucp.language import ImportRule, Spec, spec_to_toml

    spec = Spec(imports=[ImportRule("a.*", "replicated", also=("(?:.*b)",))], strict=False)
    back = spec_from_toml(spec_to_toml(spec))
    assert back.imports == spec.imports
    assert back.match("axb") is not None and back.match("axc") is None


DEEP_TOML = {
    "arrays nested 100k deep": "name = 'x'\nsettings = {a = "
    + "[" * 100_000
    + "]" * 100_000
    + "}\n",
    "inline tables nested 100k deep": "[settings]\na = " + "{b = " * 100_000 + "1" + "}" * 100_000,
    "a dotted key of 100k parts": "[settings]\n" + ".".join(["k"] * 100_000) + " = 1\n",
    "a table header of 100k parts": "[" + ".".join(["k"] * 100_000) + "]\n",
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(DEEP_TOML))
def test_deeply_nested_spec_file_is_refused_naming_it(tmp_path, case):
    toml = tmp_path / "deep.toml"
    toml.write_text(DEEP_TOML[case])
    with pytest.raises(LanguageError, match=r"deep\.toml line \d+: nested deeper than 64 levels"):
        load_spec(toml)


@pytest.mark.timeout(30)
def test_nesting_inside_strings_and_comments_is_not_counted():
    """Brackets and dots in regexes, strings and comments are text, not nesting."""
    deep = "[" * 100 + "." * 100
    text = (
        f"name = 'x' # {deep}\n"
        f'description = """{deep}\\""""\n'
        f"[[import]]\npattern = '{'[a]' * 100}.*'\nlabel = \"{deep}\"\nkind = 'replicated'\n"
    )
    spec = spec_from_toml(text, source="ok.toml")
    assert spec.description == deep + '"'
    assert spec.match("a" * 100 + "b") is not None


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "toml, message",
    [
        (
            "[[import]]\npattern = 'w'\nkind = 'partitioned'\ndim = '" + "1+" * 50_000 + "1'\n",
            r"big\.toml line 1: import rule #1: kind 'partitioned': parameter 'dim' holds a string "
            r"of 100001 characters; at most 1000",
        ),
        (
            "[[restore]]\npattern = 'w'\nops = [{op = 'transpose', perm = ['"
            + "1+" * 50_000
            + "1', '0']}]\n",
            r"big\.toml line 1: restore rule #1 op #1: op 'transpose': parameter 'perm' holds a "
            r"string of 100001 characters",
        ),
        (
            "[[restore]]\npattern = 'w'\ntarget = 'w_{" + "1+" * 50_000 + "1}'\n",
            r"big\.toml line 1: restore rule #1: w: target must be a template string of at most "
            r"4096 characters",
        ),
    ],
)
def test_huge_expression_in_a_spec_file_is_refused_naming_it(tmp_path, toml, message):
    path = tmp_path / "big.toml"
    path.write_text(toml)
    with pytest.raises(LanguageError, match=message):
        load_spec(path)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "expression, message",
    [
        ("1+" * 50_000 + "1", r"is 100001 characters long; at most 1000"),
        ("-" * 999 + "1", r"nests deeper than 64 levels"),
        ("1+" * 400 + "1", r"nests deeper than 64 levels"),
    ],
)
def test_expression_size_and_depth_are_bounded(expression, message):
    from jax_ucp._src.language.settings import eval_int

    with pytest.raises(LanguageError, match=rf"^rule: expression .*{message}"):
        eval_int(expression, {}, where="rule: ")
    assert eval_int("(" * 150 + "hidden * 4" + ")" * 150, {"hidden": 3}) == 12


@pytest.mark.timeout(30)
def test_spec_file_bigger_than_the_cap_is_refused_unread(tmp_path):
    path = tmp_path / "huge.toml"
    with open(path, "wb") as f:
        f.truncate((4 << 20) + 1)
    with pytest.raises(
        LanguageError, match=r"huge\.toml: more than 4194304 bytes; not a spec file"
    ):
        load_spec(path)


@pytest.mark.timeout(60)
def test_cli_reports_a_spec_error_like_other_errors(tmp_path):
    """A deep spec file given to ``jax-ucp convert`` is one clear line and exit 1, not a
    traceback (a RecursionError before)."""
    from typer.testing import CliRunner

    from jax_ucp.cli import app

    toml = tmp_path / "deep.toml"
    toml.write_text(DEEP_TOML["arrays nested 100k deep"])
    src = os.path.join(FIXTURES, MEGATRON_DS, "ckpt")
    r = CliRunner().invoke(
        app, ["convert", src, str(tmp_path / "out"), "--from", "deepspeed", "--spec", str(toml)]
    )
    assert r.exit_code == 1, r.output
    assert "error:" in r.output and "nested deeper than 64 levels" in r.output
    assert "Traceback" not in r.output
    assert not os.path.exists(tmp_path / "out")


def test_toml_roundtrip_keeps_quotes_backslashes_and_control_characters():
    """The emitter (tomli-w) must escape what a hand-written one could get wrong."""
    hostile = "a'b\"c\\d\ne\tf\x01g\u00e9"
    spec = Spec(
        name=hostile,
        description=hostile,
        settings={hostile: hostile},
        imports=[ImportRule(r"x\.(\d+)\.w", L.Replicated())],
    )
    assert L.spec_from_toml(L.spec_to_toml(spec)) == spec
