"""Torch DCP imports of real models restored through the shipped specs into
jax_ucp._src.models.TransformerLM: transformers' LlamaForCausalLM under FSDP2 (spec ``hf_llama``) and
torchtitan's own Llama3Model in torchtitan's checkpointer layout (spec ``torchtitan_llama``),
both written by tools/fixtures/make_torch_fixtures.py (2 gloo ranks, 3 AdamW steps). The logits
the frameworks computed in the run (``<name>.logits.npz``) are the reference; torch-free."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.language.views import rope_interleaved_to_half
from jax_ucp.errors import LanguageError
from jax_ucp.language import load_spec
from jax_ucp.models import LMConfig, TransformerLM
from tests.importers.torch.test_dcp import FIX, assert_matches_run, truth

pytestmark = pytest.mark.timeout(180)


def _titan_config() -> LMConfig:
    t = json.load(open(os.path.join(FIX, "torchtitan_llama3.config.json")))
    return LMConfig(
        vocab_size=t["vocab_size"],
        hidden_size=t["dim"],
        num_layers=t["n_layers"],
        num_attention_heads=t["n_heads"],
        num_query_groups=t["n_kv_heads"],
        ffn_hidden_size=t["hidden_dim"],
        normalization="RMSNorm",
        gated=True,
        bias=False,
        position="rope",
        rotary_base=t["theta"],
        eps=1e-5,  # torchtitan's RMSNorm default
    )


CASES = {
    "hf_llama_fsdp2": (
        "hf_llama",
        lambda: LMConfig.from_hf_llama(
            json.load(open(os.path.join(FIX, "hf_llama_fsdp2.config.json")))
        ),
    ),
    "torchtitan_llama3": ("torchtitan_llama", _titan_config),
}


def _logits(cfg: LMConfig, params, tokens) -> np.ndarray:
    params = jax.tree.map(jnp.asarray, params)
    return np.asarray(TransformerLM(cfg).apply({"params": params}, jnp.asarray(tokens)))


@pytest.mark.parametrize("name", sorted(CASES))
def test_real_model_checkpoint_gives_the_frameworks_logits(tmp_path, name):
    """convert -> restore(spec) -> TransformerLM: the logits the framework computed in the run,
    within 1e-5 (fp32); the import itself is bit-exact to the run's live state."""
    spec_name, config = CASES[name]
    cfg = config()
    out = jax_ucp.convert(os.path.join(FIX, name), tmp_path / "ucp")
    assert_matches_run(jax_ucp.restore(out), name)
    tree = jax_ucp.restore(out, spec=load_spec(spec_name, **cfg.head_settings))
    with np.load(os.path.join(FIX, name + ".logits.npz")) as z:
        tokens, want = z["tokens"], z["logits"]
    np.testing.assert_allclose(_logits(cfg, tree["params"], tokens), want, rtol=0, atol=1e-5)
    # optax.adam's state follows: TransformerLM-shaped moments, the step as its count
    adam = tree["opt_state"]["0"]
    shapes = jax.tree.map(np.shape, tree["params"])
    assert jax.tree.map(np.shape, adam["mu"]) == shapes
    assert jax.tree.map(np.shape, adam["nu"]) == shapes
    assert int(adam["count"]) == 3


def _per_head_half(w: np.ndarray, head_dim: int) -> np.ndarray:
    """transformers' permute (convert_llama_weights_to_hf), written independently."""
    rows, cols = w.shape
    heads = rows // head_dim
    return w.reshape(heads, head_dim // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def test_torchtitan_moments_follow_with_the_rope_permutation(tmp_path):
    """The Adam moments of wq/wk/wv land in attn/qkv/kernel exactly as the weights do: q and k
    rows per head to rotate-half order, then per query group [q heads, k, v], transposed."""
    cfg = _titan_config()
    out = jax_ucp.convert(os.path.join(FIX, "torchtitan_llama3"), tmp_path / "ucp")
    tree = jax_ucp.restore(out, spec=load_spec("torchtitan_llama", **cfg.head_settings))
    run = truth("torchtitan_llama3")
    hd, groups = cfg.head_dim, cfg.groups
    per = cfg.num_attention_heads // groups
    for state, key in (("exp_avg", "mu"), ("exp_avg_sq", "nu"), ("param", None)):
        parts = {
            p: run[f"{state}/layers.1.attention.qkv_linear.w{p}.weight"] for p in ("q", "k", "v")
        }
        q = _per_head_half(parts["q"], hd).reshape(groups, per * hd, -1)
        k = _per_head_half(parts["k"], hd).reshape(groups, hd, -1)
        v = parts["v"].reshape(groups, hd, -1)
        want = np.concatenate([q, k, v], axis=1).reshape(-1, cfg.hidden_size).T
        got = (tree["params"] if key is None else tree["opt_state"]["0"][key])["layers_1"]
        np.testing.assert_array_equal(got["attn"]["qkv"]["kernel"], want)
        w13 = [run[f"{state}/layers.1.feed_forward.w{i}.weight"].T for i in (1, 3)]
        np.testing.assert_array_equal(got["mlp"]["fc1"]["kernel"], np.concatenate(w13, axis=1))


@pytest.mark.timeout(30)
def test_rope_half_is_transformers_permutation_and_checks_heads():
    w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(48, 3)
    got = rope_interleaved_to_half(w, 0, 8).read().result()
    np.testing.assert_array_equal(got, _per_head_half(w, 8))
    with pytest.raises(LanguageError, match=r"axis 0 of size 48.*head_dim 5"):
        rope_interleaved_to_half(w, 0, 5)
    with pytest.raises(LanguageError, match=r"whole heads.*head_dim 7"):
        rope_interleaved_to_half(np.zeros((14, 2), np.float32), 0, 7)


def test_wrong_spec_names_the_uncovered_tensors(tmp_path):
    """hf_llama on torchtitan names is refused (strict), naming tensors, not half applied."""
    cfg = _titan_config()
    out = jax_ucp.convert(os.path.join(FIX, "torchtitan_llama3"), tmp_path / "ucp")
    with pytest.raises(LanguageError, match=r"no restore rule: params/tok_embeddings"):
        jax_ucp.restore(out, spec=load_spec("hf_llama", **cfg.head_settings))
