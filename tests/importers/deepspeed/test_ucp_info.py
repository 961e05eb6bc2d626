"""DeepSpeed universal_checkpoint_info -> UCP-language import rules, checked against a numpy
transcription of ds_to_universal's merge_tp_slices decision."""

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_ucp import language as L
from jax_ucp.importers.deepspeed.ucp_info import spec_from_ucp_info

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
        L.StrictnessError,
        match=r"averaged '\\\\d\+.post_attention_layernorm.weight'.*matched no tensor",
    ):
        strict.classify([n for n in NAMES if "post_attention" not in n])
    with pytest.raises(L.SpecError, match="parameter_with_sub_params"):
        spec_from_ucp_info({"parameter_with_sub_params": [{"patterns": ["x"]}]})
