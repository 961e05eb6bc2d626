"""Export by the spec a user imported with, run backwards (``language.inverse``): for every
family the project imports, the family's flax tree goes out under the family's Hugging Face names
and comes back bit for bit; the config.json is written from the model's settings (an
``LMConfig``) or the import's record, and a config of another family is refused. Torch-free;
tests/exporters/test_by_spec_torch.py has transformers load each export."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.errors import LanguageError, RequestError
from jax_ucp._src.exporters import SafetensorsExport
from jax_ucp._src.importers.safetensors_weights import TEXT_MODELS
from jax_ucp._src.language import apply_spec_to_tree, flatten_nested, load_spec, spec_from_dict
from jax_ucp._src.language.inverse import invert_spec
from jax_ucp._src.models.hf_config import hf_config
from jax_ucp._src.models.hf_families import FAMILIES
from jax_ucp._src.models.transformer import hf_model
from tests.models.test_hf_families import FAMILIES as TINY
from tests.models.test_hf_families import _config


def random_tree(family: str, seed: int = 0) -> tuple:
    """The family's tiny ``LMConfig``, its spec's name and a random flax tree of its shapes."""
    import jax
    import jax.numpy as jnp

    from jax_ucp.models import TransformerLM

    cfg, spec = hf_model(_config(family))
    tokens = jax.ShapeDtypeStruct((1, 4), jnp.int32)
    shapes = jax.eval_shape(TransformerLM(cfg).init, jax.random.key(0), tokens)["params"]
    rng = np.random.default_rng(seed)
    tree = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), shapes)
    return cfg, spec, jax.tree.map(np.asarray, tree)


def test_every_family_has_its_spec_and_the_spec_names_it():
    """The family table and the specs agree on which model_type each spec maps."""
    for family in FAMILIES.values():  # a multimodal one's spec: its text model's
        text = f"{family.model_type}_text" if family.model_type in TEXT_MODELS else None
        assert (text or family.model_type) in load_spec(family.spec).model_types, family
    assert sorted(TINY) == sorted(FAMILIES)


#: families whose spec has no way back: Kimi K2.5's layers are named layers (the released
#: checkpoints) or blocks (transformers 5.24's save_pretrained), one alternation
NO_INVERSE = {"kimi_k25"}


@pytest.mark.parametrize("family", sorted(set(TINY) - NO_INVERSE))
def test_the_family_spec_backwards_then_forwards_gives_the_tree_bit_for_bit(family):
    """In memory: the flax tree -> the spec run backwards (Hugging Face names, every one matched
    by the import spec, strictly) -> the import spec -> the same tree, every bit."""
    cfg, name, tree = random_tree(family)
    spec = load_spec(name, **cfg.head_settings)
    hf = apply_spec_to_tree(invert_spec(spec), {"params": tree})
    assert all("/" not in k for k in hf["params"])  # one dotted name each
    back = flatten_nested(apply_spec_to_tree(spec, hf))
    want = flatten_nested({"params": tree})
    assert back.keys() == want.keys()
    for key, value in want.items():
        assert back[key].dtype == value.dtype and np.array_equal(back[key], value), key


@pytest.mark.parametrize("family", sorted(set(TINY) - NO_INVERSE))
def test_the_config_written_from_the_models_settings_reads_back_as_the_model(family):
    """Every family's tiny model: the config.json written from its ``LMConfig`` (no config
    given) is one the family's reader turns back into the same model and spec."""
    cfg, name = hf_model(_config(family))
    written = hf_config(cfg, load_spec(name).model_types)
    assert hf_model(written) == (cfg, name)


@pytest.mark.parametrize("family", ["phi3", "qwen3_moe", "gpt2"])
def test_export_then_import_is_bit_exact_and_writes_the_models_config(family, tmp_path):
    """On disk: saved flax tree -> export(spec=<the import's spec>, config=LMConfig) -> convert
    -> restore(spec=<the same name>, heads from the config the import recorded) == the tree;
    the config.json written reads back as the model."""
    cfg, name, tree = random_tree(family, seed=1)
    ckpt = jax_ucp.save(str(tmp_path / "ck"), {"params": tree})
    out = jax_ucp.export(ckpt, tmp_path / "hf", SafetensorsExport(spec=name, config=cfg))
    assert "config.json" in out.files
    with open(tmp_path / "hf" / "config.json") as f:
        written = json.load(f)
    assert written["model_type"] == family and hf_model(written) == (cfg, name)
    ucp = jax_ucp.convert(tmp_path / "hf", tmp_path / "ucp")
    back = flatten_nested(jax_ucp.restore(ucp, spec=name))
    want = flatten_nested({"params": tree})
    assert back.keys() == want.keys()
    for key, value in want.items():
        assert np.array_equal(np.asarray(back[key]), value), key
    # exported again from the import (Hugging Face names already): its config written back
    again = jax_ucp.export(ucp, tmp_path / "hf2", SafetensorsExport())
    with open(tmp_path / "hf2" / "config.json") as f:
        assert json.load(f) == written
    assert again.tensors == out.tensors


def test_a_config_of_another_family_is_refused_naming_both(tmp_path):
    """A Phi-3 tree exported with the Llama spec and Phi-3's config (the silent mix-up that
    left qkv_proj random in transformers) is refused, as is a config whose architectures are
    another family's; nothing is written."""
    cfg, _, tree = random_tree("phi3")
    ckpt = jax_ucp.save(str(tmp_path / "ck"), {"params": tree})
    phi3 = hf_config(cfg, ["phi3"])
    with pytest.raises(RequestError, match=r"model_type 'phi3'.*'hf_llama'.*llama, mistral"):
        jax_ucp.export(ckpt, tmp_path / "a", SafetensorsExport(spec="hf_llama", config=phi3))
    with pytest.raises(RequestError, match=r"model_type 'phi3'.*'hf_llama'"):
        spec = load_spec("flax_llama_to_hf", **cfg.head_settings)
        jax_ucp.export(ckpt, tmp_path / "b", SafetensorsExport(spec=spec, config=phi3))
    mixed = {**phi3, "architectures": ["LlamaForCausalLM"]}
    with pytest.raises(RequestError, match=r"architectures \['LlamaForCausalLM'\].*'phi3'"):
        jax_ucp.export(ckpt, tmp_path / "c", SafetensorsExport(spec="hf_phi3", config=mixed))
    assert not any(os.path.exists(tmp_path / d) for d in "abc")


def test_a_family_without_an_inverse_is_refused_naming_its_rule(tmp_path):
    """Kimi K2.5's flax tree is not exported: the export names the rule it cannot reverse."""
    cfg, name, tree = random_tree("kimi_k25")
    ckpt = jax_ucp.save(str(tmp_path / "ck"), {"params": tree})
    with pytest.raises(LanguageError, match=r"rule #\d+ pattern 'language_model.*not literal"):
        jax_ucp.export(ckpt, tmp_path / "hf", SafetensorsExport(spec=name, config=cfg))
    assert not os.path.exists(tmp_path / "hf")


def test_a_rule_without_an_inverse_refuses_naming_it():
    """An op that loses data (slice) and a pattern with an optional group have no way back:
    the inversion names the rule."""
    sliced = spec_from_dict(
        {
            "name": "cut",
            "restore": [
                {"pattern": "w", "target": "x"},
                {"pattern": "v", "target": "y", "ops": [{"op": "slice", "stop": 2}]},
            ],
        }
    )
    with pytest.raises(LanguageError, match=r"restore rule #2 pattern 'v'.*op 'slice'"):
        invert_spec(sliced)
    with pytest.raises(LanguageError, match=r"restore rule #\d+.*not literal text"):
        invert_spec(load_spec("megatron_gpt"))


def test_deepspeed_universal_by_spec_writes_the_torch_names_deepspeed_loads(tmp_path):
    """A DeepSpeed run imported, restored as a flax tree with its spec, saved from JAX and
    exported with the same spec: every zero/<param>/*.pt file is the one the import's own
    export writes, byte for byte (DeepSpeed's load_universal reads zero/<its parameter's
    name>/; tests/exporters/test_export.py has DeepSpeed itself load such an export)."""
    import filecmp

    from jax_ucp._src.exporters import DeepSpeedUniversalExport
    from tests.exporters.test_export import DS
    from tests.importers.deepspeed.test_nextstep import GPT_SPEC

    ucp = jax_ucp.convert(os.path.join(DS, "z2_fp32_dp2", "ckpt"), tmp_path / "ucp")
    jax_ucp.export(ucp, tmp_path / "a", DeepSpeedUniversalExport())
    flax = jax_ucp.save(str(tmp_path / "flax"), jax_ucp.restore(ucp, spec=GPT_SPEC))
    assert "h_0" in jax_ucp.restore(flax)["params"]  # flax key paths saved
    jax_ucp.export(flax, tmp_path / "b", DeepSpeedUniversalExport(spec=GPT_SPEC))
    zero = os.path.join("global_step2_universal", "zero")
    names = sorted(os.listdir(tmp_path / "a" / zero))
    assert "wte.weight" in names and sorted(os.listdir(tmp_path / "b" / zero)) == names
    for name in names:
        a, b = tmp_path / "a" / zero / name, tmp_path / "b" / zero / name
        files = sorted(os.listdir(a)) if os.path.isdir(a) else [""]
        assert files == (sorted(os.listdir(b)) if os.path.isdir(b) else [""])
        for f in files:
            assert filecmp.cmp(a / f, b / f, shallow=False), (name, f)


def test_deepspeed_universal_of_a_family_tree_takes_the_hf_names(tmp_path):
    """A Llama flax tree with optax Adam moments, exported with the hf_llama spec: the folders
    DeepSpeed's loader opens for a LlamaForCausalLM (zero/model.embed_tokens.weight/...), each
    moment mapped as its weight (q/k/v split out of the fused kernel), the step recorded."""
    from jax_ucp._src.exporters import DeepSpeedUniversalExport
    from jax_ucp._src.torchfiles import torch_zip

    cfg, name, tree = random_tree("llama")
    import jax

    mu = jax.tree.map(lambda x: 2 * x, tree)
    state = {"mu": mu, "nu": tree, "count": np.asarray(7, np.int32)}
    ck = jax_ucp.save(str(tmp_path / "ck"), {"params": tree, "opt_state": {"0": state}})
    spec = load_spec(name, **cfg.head_settings)
    out = jax_ucp.export(ck, tmp_path / "ds", DeepSpeedUniversalExport(spec=spec))
    zero = tmp_path / "ds" / "global_step7_universal" / "zero"
    hf = apply_spec_to_tree(invert_spec(spec), {"params": tree})["params"]
    assert sorted(os.listdir(zero)) == sorted([*hf, "optimizer_state.pt"])
    q = "model.layers.1.self_attn.q_proj.weight"
    for state, factor in (("fp32", 1), ("exp_avg", 2), ("exp_avg_sq", 1)):
        saved = torch_zip.load_torch_file(str(zero / q / f"{state}.pt"))
        np.testing.assert_array_equal(np.asarray(saved["param"]), factor * hf[q])
    step = torch_zip.load_torch_file(str(zero / q / "step.pt"))
    assert float(np.asarray(step)) == 7.0 and out.tensors == 3 * len(hf)
