"""A real Hugging Face Trainer + DeepSpeed checkpoint (``tests/fixtures/hf_trainer/``, written by
``tools/fixtures/make_hf_trainer_fixture.py``: transformers 5.23.0 Trainer, DeepSpeed 0.19.8 ZeRO-2,
DP=2 on CPU, a tiny random LlamaForCausalLM with GQA, two fp32 AdamW steps) through the shipped
``hf_llama`` spec: Hugging Face names in, the flax tree of ``jax_ucp.models`` out, with the Adam
moments following the weights."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jax_ucp
from jax_ucp.language import load_spec
from jax_ucp.models import LMConfig, TransformerLM
from tests.ucp_testing import REPO

pytestmark = pytest.mark.timeout(300)
SRC = os.path.join(REPO, "tests", "fixtures", "hf_trainer", "llama_z2_dp2", "checkpoint-2")


def _config() -> dict:
    with open(os.path.join(SRC, "config.json")) as f:
        return json.load(f)


def _bits(a) -> bytes:
    return np.ascontiguousarray(np.asarray(a)).tobytes()


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return jax_ucp.convert(SRC, str(tmp_path_factory.mktemp("hf_trainer") / "ucp"))


def test_trainer_deepspeed_checkpoint_imports_hf_names_bit_exact(imported):
    """The DeepSpeed fp32 masters under Hugging Face's names equal the model.safetensors the
    Trainer saved beside them, bit for bit; both moments and the step come along."""
    got = jax_ucp.restore(imported)
    weights = load_file(os.path.join(SRC, "model.safetensors"))
    assert sorted(got["params"]) == sorted(weights)
    for name, value in weights.items():
        assert _bits(got["params"][name]) == _bits(value), name
    assert sorted(got["opt_state"]) == ["count", "mu", "nu"]
    assert sorted(got["opt_state"]["mu"]) == sorted(weights)
    assert int(got["opt_state"]["count"]) == 2
    assert jax_ucp.inspect(imported).source["framework"] == "deepspeed"


def test_hf_llama_spec_gives_the_flax_tree_with_moments_following(imported, tmp_path):
    """restore(spec=hf_llama): params, and optax.adam's mu and nu (``opt_state/0``), are all
    TransformerLM-shaped trees; each moment
    tree is exactly what the same spec makes of those moments saved as a plain HF-named file
    (so a moment lands where its weight does: q/k/v merged, gate/up fused)."""
    cfg = LMConfig.from_hf_llama(_config())
    spec = load_spec("hf_llama", **cfg.head_settings)
    tree = jax_ucp.restore(imported, spec=spec)
    tokens = np.zeros((1, 4), np.int32)
    shapes = jax.eval_shape(lambda: TransformerLM(cfg).init(jax.random.key(0), tokens))["params"]
    want_shapes = jax.tree.map(np.shape, shapes)
    assert jax.tree.map(np.shape, tree["params"]) == want_shapes
    raw = jax_ucp.restore(imported)
    adam = tree["opt_state"]["0"]  # optax.adam's ScaleByAdamState, first in its chain
    assert int(adam["count"]) == 2
    for moment in ("mu", "nu"):
        assert jax.tree.map(np.shape, adam[moment]) == want_shapes
        folder = tmp_path / moment
        folder.mkdir()
        save_file(
            {k: np.asarray(v) for k, v in raw["opt_state"][moment].items()},
            str(folder / "model.safetensors"),
        )
        alone = jax_ucp.convert(str(folder), str(tmp_path / f"{moment}.ucp"))
        expected = jax_ucp.restore(alone, spec=spec)["params"]
        flat_got = jax.tree_util.tree_leaves_with_path(adam[moment])
        flat_want = dict(jax.tree_util.tree_leaves_with_path(expected))
        for path, value in flat_got:
            assert _bits(value) == _bits(flat_want[path]), (moment, jax.tree_util.keystr(path))


@pytest.mark.torch
def test_flax_logits_equal_transformers_on_the_trainer_checkpoint(imported):
    """transformers' own forward of checkpoint-2 (from_pretrained) vs TransformerLM on the tree
    restored through hf_llama: within 1e-5 (fp32)."""
    import jax.numpy as jnp
    import torch
    import transformers

    cfg = LMConfig.from_hf_llama(_config())
    model = transformers.LlamaForCausalLM.from_pretrained(SRC).eval()
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    params = jax_ucp.restore(imported, spec=load_spec("hf_llama", **cfg.head_settings))["params"]
    got = TransformerLM(cfg).apply(
        {"params": jax.tree.map(jnp.asarray, params)}, jnp.asarray(tokens)
    )
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5)
