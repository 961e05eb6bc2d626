"""The shipped specs on real megatron-core checkpoints (tests/fixtures/megatron, consolidated by
torch's own DCP loader): every tensor is covered, and the flax model restored through the spec
reproduces the reference logits."""

import pathlib

import jax
import numpy as np
import pytest

from jax_ucp import language as L

FIX = pathlib.Path(__file__).resolve().parent / "fixtures" / "megatron"


def load(name):
    p = FIX / f"{name}.consolidated.npz"
    if not p.exists():
        pytest.skip(f"fixture {p} not present")
    z = np.load(p)
    return {k: z[k] for k in z.files if not k.startswith("__")}


CASES = {
    "gpt_tp2": (
        "megatron_gpt",
        dict(
            normalization="LayerNorm",
            gated=False,
            bias=True,
            position="learned_absolute",
            ffn_hidden_size=64,
        ),
    ),
    "llama_tp2": (
        "llama",
        dict(
            normalization="RMSNorm",
            gated=True,
            bias=False,
            position="rope",
            num_query_groups=2,
            ffn_hidden_size=48,
        ),
    ),
}


@pytest.mark.parametrize("fixture", sorted(CASES))
def test_shipped_spec_restores_real_megatron_weights_to_matching_logits(fixture):
    models = pytest.importorskip("jax_ucp.models")
    spec_name, kw = CASES[fixture]
    w = load(fixture)
    spec = L.load_spec(spec_name)
    params = L.restore_tree(spec, {"params": w})["params"]  # strict: every tensor covered
    vocab = w["embedding.word_embeddings.weight"].shape[0]
    cfg = models.LMConfig(
        vocab_size=vocab,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
        tied=False,
        **kw,
    )
    ref = np.load(FIX / f"{fixture}.logits.npz")
    logits = models.TransformerLM(cfg).apply({"params": params}, ref["tokens"])
    np.testing.assert_allclose(np.asarray(logits), ref["logits"], atol=1e-5, rtol=0)
    # and the spec agrees with the model module's own hand-written mapping
    if hasattr(models, "from_megatron"):
        theirs = models.from_megatron(w, cfg)["params"]
        a = jax.tree_util.tree_leaves_with_path(params)
        b = dict(jax.tree_util.tree_leaves_with_path(theirs))
        assert len(a) == len(b)
        for path, leaf in a:
            np.testing.assert_array_equal(leaf, b[path])


def test_mixtral_spec_on_real_moe_checkpoint():
    w = load("moe_ep2")
    spec = L.load_spec("mixtral", mlp_layout="split")
    out = L.restore_tree(spec, {"params": w, "opt_state": {"mu": w}})
    fc1 = w["decoder.layers.mlp.experts.experts.linear_fc1.weight"]  # [L, E, 2F, H]
    F, last = fc1.shape[2] // 2, fc1.shape[0] - 1
    np.testing.assert_array_equal(
        out["params"][f"layers_{last}"]["moe"]["up"]["kernel"], fc1[last, :, F:].transpose(0, 2, 1)
    )
    np.testing.assert_array_equal(
        out["opt_state"]["0"]["mu"]["layers_0"]["moe"]["router"]["kernel"],
        w["decoder.layers.mlp.router.weight"][0].T,
    )
    fc2 = w["decoder.layers.mlp.experts.experts.linear_fc2.weight"]  # [L, E, H, F]
    np.testing.assert_array_equal(
        out["params"]["layers_0"]["moe"]["fc2"]["kernel"], fc2[0].transpose(0, 2, 1)
    )  # [E, F, H]
