"""The shipped specs on real megatron-core checkpoints (tests/fixtures/megatron, consolidated by
torch's own DCP loader), without the importer: the mixtral spec's split layout and optimizer
roots on stacked experts. (Spec restore vs the reference logits, per fixture, is
tests/importers/megatron/test_import.py::test_shipped_spec_restore_gives_reference_logits.)"""

import pathlib

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src import language as L
from tests.ucp_testing import REPO

FIX = pathlib.Path(REPO) / "tests" / "fixtures" / "megatron"


def load(name):
    p = FIX / f"{name}.consolidated.npz"
    if not p.exists():
        pytest.skip(f"fixture {p} not present")
    z = np.load(p)
    return {k: z[k] for k in z.files if not k.startswith("__")}


def test_mixtral_spec_on_real_moe_checkpoint():
    w = load("moe_ep2")
    spec = L.load_spec("mixtral", mlp_layout="split")
    out = L.apply_spec_to_tree(spec, {"params": w, "opt_state": {"mu": w}})
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


@pytest.mark.timeout(120)
def test_a_shipped_spec_without_settings_says_which_to_pass(tmp_path):
    from safetensors.numpy import save_file

    h, f = 8, 16
    t = {"model.embed_tokens.weight": np.ones((10, h), np.float32)}
    t["model.norm.weight"] = np.ones(h, np.float32)
    t["lm_head.weight"] = np.ones((10, h), np.float32)
    for n in "qkvo":
        t[f"model.layers.0.self_attn.{n}_proj.weight"] = np.ones((h, h), np.float32)
    for n in ("gate", "up"):
        t[f"model.layers.0.mlp.{n}_proj.weight"] = np.ones((f, h), np.float32)
    t["model.layers.0.mlp.down_proj.weight"] = np.ones((h, f), np.float32)
    for n in ("input_layernorm", "post_attention_layernorm"):
        t[f"model.layers.0.{n}.weight"] = np.ones(h, np.float32)
    (tmp_path / "hf_synthetic").mkdir()
    save_file(t, str(tmp_path / "hf_synthetic" / "model.safetensors"))
    ckpt = jax_ucp.convert(tmp_path / "hf_synthetic", tmp_path / "ucp")
    with pytest.raises(
        jax_ucp.LanguageError,
        match=_re(
            "unknown setting 'num_attention_heads' (also written num_heads, heads, n_head): "
            "needed here and not given (names known here: i). Pass the model's settings with "
            "the spec: jax_ucp.language.load_spec(<spec name or file>, num_attention_heads=..."
        ),
    ):
        jax_ucp.restore(ckpt, spec="hf_llama")
    with pytest.raises(
        jax_ucp.LanguageError, match=r"'head_dim'.*derived from hidden_size and num_att"
    ):
        jax_ucp.restore(ckpt, spec=L.load_spec("hf_llama", num_heads=2))
    spec = L.load_spec("hf_llama", num_heads=2, num_kv_heads=2, hidden_size=h)
    assert sorted(jax_ucp.restore(ckpt, spec=spec)["params"]) == [
        "layers_0",
        "lm_head",
        "ln_f",
        "wte",
    ]


def _re(text: str) -> str:
    import re

    return re.escape(text)
