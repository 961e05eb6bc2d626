"""DeepSpeed universal_checkpoint_info -> UCP-language import rules, checked against a numpy
transcription of ds_to_universal's merge_tp_slices decision."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_ucp
from jax_ucp import language as L
from jax_ucp._src.importers.deepspeed.ucp_info import spec_from_ucp_info
from tests.importers.deepspeed.test_import import DS_FIXTURES, TAG, _copy, _rewrite

INFO = {
    "original_vocab_size": 50,
    "padded_vocab_size": 64,
    "vocabulary_parameter_patterns": [
        r"tied_modules.embed.word_embeddings.weight",
        r"\d+.word_embeddings.weight",
    ],
    "pipeline_replicated_parameter_patterns": [
        r"tied_modules.embed.word_embeddings.weight",
        r"tied_modules.embed.position_embeddings.weight",
    ],
    "tp_replicated_parameter_patterns": [
        r"tied_modules.embed.position_embeddings.weight",
        r"\d+.input_layernorm.weight",
        r"\d+.input_layernorm.bias",
        r"\d+.self_attention.dense.bias",
        r"\d+.mlp.dense_4h_to_h.bias",
        r"\d+.weight",
        r"\d+.bias",
    ],
    "parameter_to_average_patterns": [r"\d+.post_attention_layernorm.weight"],
    "parameter_with_row_parallelism_patterns": [
        r"\d+.mlp.dense_4h_to_h.weight",
        r"\d+.self_attention.dense.weight",
    ],
    "parameter_with_2_sub_params_cat_dim_0": [r"\d+.mlp.dense_h_to_4h.weight"],
    "parameter_with_sub_params": [
        {
            "patterns": [r"\d+.self_attention.query_key_value.weight"],
            "shape": [[16, 8, 8], 6],
            "partition_dim": 0,
        }
    ],
}


def ds_reference(info, name, slices):
    """numpy transcription of deepspeed.checkpoint.ds_to_universal.merge_tp_slices."""
    m = lambda ps: any(re.match(p, name) for p in ps)
    if m(info["tp_replicated_parameter_patterns"]):
        assert all(np.array_equal(slices[0], s) for s in slices[1:])
        param = slices[0]
    elif m(info["parameter_to_average_patterns"]):
        param = sum(slices) / len(slices)
    elif m(info["parameter_with_2_sub_params_cat_dim_0"]):
        ch = [np.split(s, 2, 0) for s in slices]
        param = np.concatenate(
            [np.concatenate([c[0] for c in ch]), np.concatenate([c[1] for c in ch])]
        )
    elif any(re.match(p, name) for e in info["parameter_with_sub_params"] for p in e["patterns"]):
        e = info["parameter_with_sub_params"][0]
        d, tp = e["partition_dim"], len(slices)
        out, off = [], 0
        for size in e["shape"][d]:
            out.append(
                np.concatenate(
                    [np.take(s, range(off, off + size // tp), axis=d) for s in slices], d
                )
            )
            off += size // tp
        param = np.concatenate(out, d)
    else:
        param = np.concatenate(
            slices, 1 if m(info["parameter_with_row_parallelism_patterns"]) else 0
        )
    if m(info["vocabulary_parameter_patterns"]):
        param = param[: info["original_vocab_size"], :]
    return param


NAMES = {  # name -> full shape
    "tied_modules.embed.word_embeddings.weight": (64, 6),
    "tied_modules.embed.position_embeddings.weight": (10, 6),
    "3.input_layernorm.weight": (6,),
    "3.post_attention_layernorm.weight": (6,),
    "3.self_attention.query_key_value.weight": (32, 6),
    "3.self_attention.query_key_value.bias": (32,),
    "3.self_attention.dense.weight": (6, 16),
    "3.self_attention.dense.bias": (6,),
    "3.mlp.dense_h_to_4h.weight": (24, 6),
    "3.mlp.dense_4h_to_h.weight": (6, 12),
    "5.weight": (6,),
}


@settings(max_examples=10, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.integers(0, 1000))
def test_rules_reproduce_ds_to_universal(tp, seed):
    spec = spec_from_ucp_info(INFO)
    rng = np.random.default_rng(seed)
    m = spec.classify(NAMES)
    for name, shape in NAMES.items():
        kind = m[name].kind
        if isinstance(kind, L.PipelineTied):
            assert name.startswith("tied_modules")
            kind = kind.inner
        full = rng.standard_normal(shape).astype(np.float32)
        if isinstance(kind, L.Replicated):
            slices = [full] * tp
        elif isinstance(kind, L.Averaged):
            slices = [rng.standard_normal(shape).astype(np.float32) for _ in range(tp)]
        else:
            slices = L.split(
                kind,
                full[:50] if isinstance(kind, L.Vocab) else full,
                tp,
                name=name,
                settings=spec.settings,
            )
        got = L.merge(kind, slices, name=name, settings=spec.settings)
        ref = ds_reference(INFO, name, slices)
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        assert got.tobytes() == ref.tobytes(), name


def test_spec_from_info_settings_and_strictness():
    spec = spec_from_ucp_info(INFO)
    assert spec.settings["vocab_size"] == 50 and spec.settings["padded_vocab_size"] == 64
    assert spec.match("tied_modules.embed.word_embeddings.weight").kind.inner.vocab_size == 50
    strict = spec_from_ucp_info(INFO, strict=True)
    with pytest.raises(
        jax_ucp.LanguageError,
        match=r"averaged '\\\\d\+.post_attention_layernorm.weight'.*matched no tensor",
    ):
        strict.classify([n for n in NAMES if "post_attention" not in n])
    with pytest.raises(jax_ucp.LanguageError, match="parameter_with_sub_params"):
        spec_from_ucp_info({"parameter_with_sub_params": [{"patterns": ["x"]}]})


# Hostile inputs, each built here: a clear error naming the file, or an exact import.


MEGATRON_DS = "megatron_ds_tp2_dp2_z1_bf16_synthetic"


MP0 = "mp_rank_00_model_states.pt"


CATASTROPHIC = r"(\w+\.?)+\.never"  # exponential backtracking in Python's re on every name


def _add_ucp_info_pattern(src, key: str, pattern: str) -> None:
    def edit(nodes, arrays):
        nodes["universal_checkpoint_info"].setdefault(key, []).append(pattern)

    _rewrite(src / TAG / MP0, edit)


@pytest.mark.timeout(60)
def test_catastrophic_pattern_in_universal_checkpoint_info_imports_exactly(tmp_path):
    """A pattern that backtracks exponentially in Python's re matches in linear time on RE2: it
    matches nothing here, so the import is the original's, bit for bit."""
    src = _copy(tmp_path, MEGATRON_DS)
    _add_ucp_info_pattern(src, "tp_replicated_parameter_patterns", CATASTROPHIC)
    _add_ucp_info_pattern(src, "vocabulary_parameter_patterns", CATASTROPHIC)
    jax_ucp.convert(src, tmp_path / "hostile")
    jax_ucp.convert(os.path.join(DS_FIXTURES, MEGATRON_DS, "ckpt"), tmp_path / "original")
    got, want = jax_ucp.restore(tmp_path / "hostile"), jax_ucp.restore(tmp_path / "original")
    for tree in ("params", "model_params"):
        assert sorted(got[tree]) == sorted(want[tree])
        for name in want[tree]:
            np.testing.assert_array_equal(got[tree][name], want[tree][name])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "pattern, reason",
    [
        (r"(?=language)language_model\..*", r"invalid perl operator: \(\?="),
        (r"(language)\1", r"invalid escape sequence: \\1"),
    ],
)
def test_pattern_re2_cannot_run_is_an_error_naming_file_and_pattern(tmp_path, pattern, reason):
    src = _copy(tmp_path, MEGATRON_DS)
    _add_ucp_info_pattern(src, "parameter_with_row_parallelism_patterns", pattern)
    with pytest.raises(jax_ucp.UCPError) as e:
        jax_ucp.convert(src, tmp_path / "out")
    message = str(e.value)
    assert message.startswith(str(src / TAG / MP0) + ": universal_checkpoint_info.")
    assert "parameter_with_row_parallelism_patterns" in message
    assert repr(pattern) in message
    assert re_search(reason, message)
    assert not os.path.exists(tmp_path / "out")


def re_search(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, text) is not None
