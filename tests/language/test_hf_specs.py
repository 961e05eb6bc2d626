"""Hugging Face Llama names <-> jax_ucp._src.models.TransformerLM through the shipped specs
``hf_llama`` (import/restore) and ``flax_llama_to_hf`` (export)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jax_ucp
from jax_ucp.exporters import SafetensorsExport
from jax_ucp.language import load_spec
from jax_ucp.models import LMConfig, TransformerLM

pytestmark = pytest.mark.timeout(300)

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def _hf_names_synthetic(cfg: LMConfig) -> dict[str, np.ndarray]:
    """HF Llama tensors of the right shapes, random values (a synthetic stand-in for a model
    file; the torch-marked tests use one written by transformers)."""
    rng = np.random.default_rng(0)
    h, kv = cfg.hidden_size, cfg.groups * cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (cfg.ffn_hidden_size, h),
            p + "mlp.up_proj.weight": (cfg.ffn_hidden_size, h),
            p + "mlp.down_proj.weight": (h, cfg.ffn_hidden_size),
        }
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def _flax_shapes(cfg: LMConfig):
    import jax
    import jax.numpy as jnp

    tokens = jnp.zeros((1, 4), jnp.int32)
    abstract = jax.eval_shape(lambda: TransformerLM(cfg).init(jax.random.key(0), tokens))
    return jax.tree.map(lambda x: x.shape, abstract["params"])


def _converted_to_flax(tmp_path, tensors: dict, spec: str, cfg: LMConfig):
    """``tensors`` as an HF safetensors folder, converted and restored through ``spec``: the
    flax params, checked to have the shapes the model expects."""
    import jax

    (tmp_path / "hf").mkdir()
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    ckpt = jax_ucp.convert(str(tmp_path / "hf"), str(tmp_path / "ucp"))
    flax = jax_ucp.restore(ckpt, spec=load_spec(spec, **cfg.head_settings))["params"]
    assert jax.tree.map(np.shape, flax) == _flax_shapes(cfg)
    return flax


def _assert_same_tensors(path, tensors: dict) -> None:
    """The safetensors file at ``path`` holds exactly ``tensors``, bit for bit."""
    back = load_file(str(path))
    assert set(back) == set(tensors)
    for name, value in tensors.items():
        assert back[name].tobytes() == value.tobytes(), name


def test_hf_names_to_flax_and_back_is_bit_exact(tmp_path):
    """HF safetensors -> convert -> restore(spec=hf_llama): the flax tree TransformerLM expects
    (GQA q/k/v merged, gate/up fused); saved, then export(spec=flax_llama_to_hf): the original
    file's tensors, bit for bit."""

    cfg = LMConfig.from_hf_llama(HF_CONFIG)
    tensors = _hf_names_synthetic(cfg)
    flax = _converted_to_flax(tmp_path, tensors, "hf_llama", cfg)
    jax_ucp.save(str(tmp_path / "flax"), {"params": flax})
    spec = load_spec("flax_llama_to_hf", **cfg.head_settings)
    out = jax_ucp.export(
        str(tmp_path / "flax"), tmp_path / "out", SafetensorsExport(spec=spec, config=HF_CONFIG)
    )
    assert out.files == ["model.safetensors", "config.json"]
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == HF_CONFIG
    _assert_same_tensors(tmp_path / "out" / "model.safetensors", tensors)


def test_llama_config_checks():
    assert LMConfig.from_hf_llama(HF_CONFIG).head_settings == {
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "head_dim": 8,
    }
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        LMConfig.from_hf_llama({**HF_CONFIG, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="rope_scaling"):
        LMConfig.from_hf_llama({**HF_CONFIG, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    # transformers 5's config.json: RoPE's settings under rope_parameters
    rope = {"rope_type": "default", "rope_theta": 500000.0}
    assert LMConfig.from_hf_llama({**HF_CONFIG, "rope_parameters": rope}).rotary_base == 5e5
    with pytest.raises(ValueError, match=r"rope_parameters.*dynamic"):
        LMConfig.from_hf_llama({**HF_CONFIG, "rope_parameters": {**rope, "rope_type": "dynamic"}})


def _logits_through_jax_and_back(tmp_path, model_class, config, cfg, spec_in, spec_out):
    """transformers model -> save_pretrained -> convert -> restore(spec_in) into TransformerLM:
    transformers' logits within 1e-5; saved and exported with spec_out + config.json, then
    from_pretrained: the flax logits within 1e-5."""
    import jax
    import jax.numpy as jnp
    import torch

    torch.manual_seed(0)
    model = model_class(model_class.config_class(**config)).eval()
    model.save_pretrained(str(tmp_path / "hf"))
    tokens = np.random.default_rng(1).integers(0, config["vocab_size"], (2, 11))
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    ckpt = jax_ucp.convert(str(tmp_path / "hf"), str(tmp_path / "ucp"))
    flax = jax_ucp.restore(ckpt, spec=load_spec(spec_in, **cfg.head_settings))["params"]
    got = np.asarray(
        TransformerLM(cfg).apply({"params": jax.tree.map(jnp.asarray, flax)}, jnp.asarray(tokens))
    )
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    jax_ucp.save(str(tmp_path / "flax"), {"params": flax})
    jax_ucp.export(
        str(tmp_path / "flax"),
        tmp_path / "out",
        SafetensorsExport(
            spec=load_spec(spec_out, **cfg.head_settings),
            config=os.path.join(tmp_path, "hf", "config.json"),
        ),
    )
    again = model_class.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        back = again(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(back, got, rtol=0, atol=1e-5)


@pytest.mark.torch
@pytest.mark.parametrize("tied", [False, True])
def test_transformers_llama_logits_through_jax_and_back(tmp_path, tied):
    """A tiny random LlamaForCausalLM made by transformers (GQA), tied and untied."""
    import transformers

    config = {**HF_CONFIG, "tie_word_embeddings": tied}
    _logits_through_jax_and_back(
        tmp_path,
        transformers.LlamaForCausalLM,
        config,
        LMConfig.from_hf_llama(config),
        "hf_llama",
        "flax_llama_to_hf",
    )


GPT2_CONFIG = {
    "architectures": ["GPT2LMHeadModel"],
    "model_type": "gpt2",
    "vocab_size": 64,
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 16,
    "layer_norm_epsilon": 1e-5,
    "activation_function": "gelu_new",
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def _gpt2_names_synthetic(cfg: LMConfig) -> dict[str, np.ndarray]:
    """HF GPT-2 tensors of the right shapes, random values (synthetic; Conv1D is [in, out])."""
    rng = np.random.default_rng(2)
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    shapes = {
        "transformer.wte.weight": (cfg.vocab_size, h),
        "transformer.wpe.weight": (cfg.max_position_embeddings, h),
        "transformer.ln_f.weight": (h,),
        "transformer.ln_f.bias": (h,),
    }
    for i in range(cfg.num_layers):
        p = f"transformer.h.{i}."
        shapes |= {
            p + "ln_1.weight": (h,),
            p + "ln_1.bias": (h,),
            p + "ln_2.weight": (h,),
            p + "ln_2.bias": (h,),
            p + "attn.c_attn.weight": (h, 3 * h),
            p + "attn.c_attn.bias": (3 * h,),
            p + "attn.c_proj.weight": (h, h),
            p + "attn.c_proj.bias": (h,),
            p + "mlp.c_fc.weight": (h, f),
            p + "mlp.c_fc.bias": (f,),
            p + "mlp.c_proj.weight": (f, h),
            p + "mlp.c_proj.bias": (h,),
        }
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def test_gpt2_names_to_flax_and_back_is_bit_exact(tmp_path):

    cfg = LMConfig.from_hf_gpt2(GPT2_CONFIG)
    tensors = _gpt2_names_synthetic(cfg)
    flax = _converted_to_flax(tmp_path, tensors, "hf_gpt2", cfg)
    # c_attn [Q | K | V] became per-head [q_h, k_h, v_h]: head 1's q starts at 3 * head_dim
    c_attn = tensors["transformer.h.0.attn.c_attn.weight"]
    d = cfg.head_dim
    np.testing.assert_array_equal(
        flax["layers_0"]["attn"]["qkv"]["kernel"][:, 3 * d : 4 * d], c_attn[:, d : 2 * d]
    )
    jax_ucp.save(str(tmp_path / "flax"), {"params": flax})
    spec = load_spec("flax_gpt2_to_hf", **cfg.head_settings)
    jax_ucp.export(str(tmp_path / "flax"), tmp_path / "out", SafetensorsExport(spec=spec))
    _assert_same_tensors(tmp_path / "out" / "model.safetensors", tensors)


@pytest.mark.torch
def test_transformers_gpt2_logits_through_jax_and_back(tmp_path):
    """GPT2LMHeadModel (tied output, gelu_new) made by transformers: same checks as Llama's."""
    import transformers

    _logits_through_jax_and_back(
        tmp_path,
        transformers.GPT2LMHeadModel,
        GPT2_CONFIG,
        LMConfig.from_hf_gpt2(GPT2_CONFIG),
        "hf_gpt2",
        "flax_gpt2_to_hf",
    )


def test_scanned_flax_layers_export_under_hf_names(tmp_path):
    """A scanned model (layers stacked [L, ...] under ``layers/``, as nn.scan makes them) exports
    with the same spec: unstacked, split, transposed, bit-exact to the original HF tensors."""
    import jax

    cfg = LMConfig.from_hf_llama(HF_CONFIG)
    tensors = _hf_names_synthetic(cfg)
    flax = _converted_to_flax(tmp_path, tensors, "hf_llama", cfg)
    per_layer = [flax.pop(f"layers_{i}") for i in range(cfg.num_layers)]
    flax["layers"] = jax.tree.map(lambda *xs: np.stack(xs), *per_layer)
    jax_ucp.save(str(tmp_path / "scanned"), {"params": flax})
    spec = load_spec("flax_llama_to_hf", **cfg.head_settings)
    jax_ucp.export(str(tmp_path / "scanned"), tmp_path / "out", SafetensorsExport(spec=spec))
    _assert_same_tensors(tmp_path / "out" / "model.safetensors", tensors)


def test_a_spec_by_name_takes_its_settings_from_the_config_in_export_and_plan(tmp_path):
    """``jax-ucp export CKPT DST --spec flax_llama_to_hf --config config.json``: the head
    settings come from that config (they were asked for as missing); ``jax-ucp plan --spec
    hf_llama --config config.json`` plans the restore through the spec (its logical axes)."""
    from typer.testing import CliRunner

    from jax_ucp.cli import app

    cfg = LMConfig.from_hf_llama(HF_CONFIG)
    tensors = _hf_names_synthetic(cfg)
    (tmp_path / "hf").mkdir()
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    ckpt = jax_ucp.convert(str(tmp_path / "hf"), str(tmp_path / "ucp"))
    config = tmp_path / "config.json"
    config.write_text(json.dumps(HF_CONFIG))
    runner = CliRunner()
    planned = runner.invoke(
        app,
        [
            "plan",
            ckpt,
            "--mesh",
            "data=2,model=4",
            "--rules",
            "embed=data,mlp=model",
            "--spec",
            "hf_llama",
            "--config",
            str(config),
            "--json",
        ],
    )
    assert planned.exit_code == 0, planned.output
    rows = json.loads(planned.output)["tensors"]
    fc1 = next(r for r in rows if r["name"].endswith("layers_0/mlp/fc1/kernel"))
    assert "data" in str(fc1["spec"]) and "model" in str(fc1["spec"]), fc1
    flax = jax_ucp.restore(ckpt, spec=load_spec("hf_llama", **cfg.head_settings))["params"]
    jax_ucp.save(str(tmp_path / "flax"), {"params": flax})
    out = tmp_path / "out"
    done = runner.invoke(
        app,
        [
            "export",
            str(tmp_path / "flax"),
            str(out),
            "--spec",
            "flax_llama_to_hf",
            "--config",
            str(config),
        ],
    )
    assert done.exit_code == 0, done.output
    _assert_same_tensors(out / "model.safetensors", tensors)
    missing = runner.invoke(app, ["plan", ckpt, "--mesh", "data=8", "--config", str(config)])
    assert missing.exit_code != 0 and "--spec" in missing.output


@pytest.mark.parametrize(
    "config, says",
    [
        ({"hidden_size": 32}, "num_attention_heads"),
        ({"num_attention_heads": "four", "hidden_size": 32}, "as integers"),
        ({"num_attention_heads": 4, "num_key_value_heads": 3, "hidden_size": 32}, "multiple"),
        ({"num_attention_heads": 0, "hidden_size": 32}, "ZeroDivisionError|positive"),
        ({"num_attention_heads": 4, "hidden_size": 32, "head_dim": -8}, "positive"),
    ],
)
def test_a_hostile_config_gives_no_head_settings(config, says):
    """``--config`` for a spec's head settings is a user's file: anything but positive integers
    with the heads a multiple of the groups is refused naming the file."""
    from jax_ucp._src.language.settings import hf_head_settings
    from jax_ucp.errors import LanguageError

    with pytest.raises(LanguageError, match=f"cfg.json: .*({says})"):
        hf_head_settings(config, "cfg.json")
