"""Hugging Face model families through ``verify --against SRC --logits``: transformers' own model
of each family, built offline from a tiny config with random weights and ``save_pretrained``,
converted, and its logits computed by ``TransformerLM`` from the converted weights through the
family's shipped spec (``jax_ucp._src.models.hf_families``); and a config field the family does
not compute refused naming it."""

from __future__ import annotations

import json
import os
import shutil

import pytest

import jax_ucp
from jax_ucp._src.logits import compare_logits, source_logits
from jax_ucp._src.models.transformer import hf_model

_TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)

#: Llama 3.1's RoPE scaling, sized so that the tiny head's wavelengths fall in all three ranges
_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 1e4,
}

#: yarn RoPE (GPT-OSS, DeepSeek V3, Qwen's long context): the tiny head's correction range
#: (from beta_fast / beta_slow) falls inside its 8 frequencies
_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 2048,
    "rope_theta": 1e4,
}
#: yarn's optional fields, each case a different attention factor / correction range
_YARN_CASES = {
    "defaults": {},
    "untruncated-mscale": {"truncate": False, "mscale": 1.0, "mscale_all_dim": 0.5},
    "attention-factor-betas": {"attention_factor": 1.3, "beta_fast": 16, "beta_slow": 2},
}

#: DeepSeek V3's tiny config (Kimi K2.5's text model too)
_DEEPSEEK_V3 = dict(
    _TINY,
    num_hidden_layers=3,
    num_key_value_heads=4,
    first_k_dense_replace=1,  # layer 0 dense, 1 and 2 MoE
    q_lora_rank=16,
    kv_lora_rank=12,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=3,
    moe_intermediate_size=16,
    n_shared_experts=2,
    routed_scaling_factor=2.5,
    rope_parameters={**_YARN, "mscale": 1.0, "mscale_all_dim": 0.8},
)

#: Qwen3.5's and Qwen3-Next's tiny config: Gated DeltaNet in layers 0, 2 and 3 (2 key heads
#: of 32 dims, 4 value heads of 12), gated full attention in layer 1, half of each head rotated
_GATED_DELTA_NET = dict(
    _TINY,
    num_hidden_layers=4,
    head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    linear_conv_kernel_dim=3,
    linear_key_head_dim=32,  # long keys, nearly orthogonal: fp32 rounding stays ~1e-6
    linear_value_head_dim=12,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
)
_QWEN_EXPERTS = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
)

#: Gemma 4's tiny dense config: two layer types of their own head_dim / kv heads (the global
#: layers' v their k projection), proportional RoPE, the last two layers sharing the first two's
#: k / v (their MLP twice as wide), per-layer inputs of 8 dims; its MoE case adds the experts
_GEMMA4 = dict(
    _TINY,
    num_hidden_layers=4,
    head_dim=8,  # small heads: softmax scale 1 over normed q / k makes scores of order head_dim
    global_head_dim=16,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    sliding_window=5,
    layer_types=["sliding_attention", "full_attention"] * 2,
    vocab_size_per_layer_input=96,
    hidden_size_per_layer_input=8,
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,
    final_logit_softcapping=3.0,
    pad_token_id=0,  # the defaults lie outside the tiny vocabulary
    bos_token_id=1,
    eos_token_id=2,
)
#: Gemma 4's variants beside its FAMILIES config: the MoE block beside every MLP, no kv sharing,
#: no per-layer inputs, v projections of its own, a proportional RoPE with a factor
_GEMMA4_CASES = {
    "moe": dict(
        num_hidden_layers=2,  # fewer layers: the fp32 noise of 2 x 4-sharded sums stays < 1e-5
        layer_types=["sliding_attention", "full_attention"],
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=0,
        attention_k_eq_v=False,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=16,
        rope_parameters={
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.5,
                "factor": 2.0,
                "rope_theta": 1e5,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e3},
        },
    ),
}

#: family -> (config class, model class, config kwargs, a field the model does not compute
#: as {field: value} merged into config.json, what the refusal names)
FAMILIES = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(_TINY, tie_word_embeddings=True, rope_parameters=_LLAMA3),
        {"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}},
        r"rope_parameters\.rope_type 'longrope'",
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(_TINY, sliding_window=5, head_dim=16),
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
        r"rope_parameters\.rope_type 'dynamic'",
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(_TINY, use_sliding_window=True, sliding_window=6, max_window_layers=1),
        {"layer_types": ["full_attention", "chunked_attention"]},
        r"layer_types",
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(_TINY, head_dim=16),
        {"attention_bias": True},
        r"attention_bias True",
    ),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(
            vocab_size=96,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
        ),
        {"scale_attn_by_inverse_layer_idx": True},
        r"scale_attn_by_inverse_layer_idx True",
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(_TINY, partial_rotary_factor=0.5, sliding_window=7, pad_token_id=0),
        {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
        r"rope_parameters\.rope_type 'longrope'",
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            _TINY,
            head_dim=16,
            query_pre_attn_scalar=12,
            sliding_window=4,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
        {"hidden_activation": "relu"},
        r"hidden_activation 'relu'",
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            _TINY,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=3.0,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e3},
            },
        ),
        {"use_bidirectional_attention": True},
        r"use_bidirectional_attention True",
    ),
    "gemma4_text": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        _GEMMA4,
        {"use_bidirectional_attention": "all"},
        r"use_bidirectional_attention 'all'",
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(_TINY, num_local_experts=4, num_experts_per_tok=2),
        {"hidden_act": "gelu"},
        r"hidden_act 'gelu'",
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            _TINY,
            num_hidden_layers=3,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            mlp_only_layers=[1],
        ),
        {"rope_scaling": {"rope_type": "dynamic", "factor": 8.0}},
        r"rope_scaling\.rope_type 'dynamic'",
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            _TINY,
            num_hidden_layers=3,
            head_dim=16,
            use_sliding_window=True,
            sliding_window=5,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        ),
        {"attention_bias": True},
        r"attention_bias True",
    ),
    "llama4_text": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            _TINY,
            num_hidden_layers=4,
            head_dim=16,
            intermediate_size=16,
            intermediate_size_mlp=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            interleave_moe_layer_step=2,
            attention_chunk_size=5,
            floor_scale=3,
            attn_scale=0.5,
            rope_parameters={**_LLAMA3, "high_freq_factor": 1.0},  # Llama 4 Scout's form
        ),
        {"rope_parameters": {"rope_type": "dynamic", "factor": 8.0, "rope_theta": 5e5}},
        r"rope_parameters\.rope_type 'dynamic'",
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            _TINY,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=5,
            swiglu_limit=0.5,  # below the tiny model's activations: the clamp is exercised
            rope_parameters={**_YARN, "truncate": False, "rope_theta": 15e4},
        ),
        {"layer_types": ["full_attention", "chunked_attention"]},
        r"layer_types",
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        _DEEPSEEK_V3,
        {"attention_bias": True},
        r"attention_bias True",
    ),
    "deepseek_v32": (
        "DeepseekV32Config",
        "DeepseekV32ForCausalLM",
        # the indexer keeps 5 of the logits test's 16 keys: its top-k choice decides the logits
        dict(_DEEPSEEK_V3, index_topk=5, index_head_dim=16, index_n_heads=8),
        {"index_head_dim": 4},
        r"index_head_dim 4: expected at least qk_rope_head_dim 8",
    ),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(
            _TINY,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.25,
            logits_scaling=2.0,
        ),
        {"mlp_bias": True},
        r"mlp_bias True",
    ),
    "olmo2": (
        "Olmo2Config",
        "Olmo2ForCausalLM",
        dict(_TINY, pad_token_id=0, eos_token_id=0),
        {"rope_parameters": {"rope_type": "longrope", "factor": 2.0, "rope_theta": 1e4}},
        r"rope_parameters\.rope_type 'longrope'",
    ),
    "olmo3": (
        "Olmo3Config",
        "Olmo3ForCausalLM",
        dict(
            _TINY,
            num_hidden_layers=4,  # layers 0-2 windowed, 3 global (yarn on it only)
            sliding_window=5,
            pad_token_id=0,
            eos_token_id=0,
            rope_parameters={
                "full_attention": _YARN,
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
        r"rope_parameters .*keys it by layer type",
    ),
    "smollm3": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(
            _TINY,
            num_hidden_layers=4,  # layer 1 NoPE and windowed, the others RoPE and global
            no_rope_layers=[1, 0, 1, 1],
            use_sliding_window=True,
            sliding_window=5,
            pad_token_id=0,  # the defaults (128000...) lie outside the tiny vocabulary
            bos_token_id=1,
            eos_token_id=2,
        ),
        {"no_rope_layers": [1, 2, 1, 1]},
        r"no_rope_layers \[1, 2, 1, 1\]",
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            _TINY,
            num_hidden_layers=3,
            head_dim=16,
            attention_bias=True,
            use_qk_norm=True,
            first_k_dense_replace=1,  # layer 0 dense, 1 and 2 MoE
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=3,
            moe_intermediate_size=16,
            n_shared_experts=2,
            routed_scaling_factor=2.5,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.5,
            },
        ),
        {"n_group": 3},
        r"n_group 3",
    ),
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        dict(
            _TINY,
            num_hidden_layers=4,  # layer 0 dense, 1 and 3 MoE, 2 dense (moe_layer_interval 2)
            head_dim=16,
            tie_word_embeddings=False,
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=16,
            moe_num_shared_experts=2,
            moe_layer_interval=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        ),
        {"use_bias": True},
        r"use_bias True",
    ),
    "minimax_m2": (
        "MiniMaxM2Config",
        "MiniMaxM2ForCausalLM",
        dict(
            _TINY,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            rotary_dim=8,  # the released checkpoints' form of partial rotary (0.5 here)
            bos_token_id=1,  # the defaults (200034...) lie outside the tiny vocabulary
            eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        ),
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
        r"rope_parameters\.rope_type 'dynamic'",
    ),
    "kimi_k25": (
        "Kimi_K25Config",
        "Kimi_K25ForConditionalGeneration",
        dict(
            text_config=dict(
                _DEEPSEEK_V3,
                model_type="kimi_k2",  # the released config's name of DeepSeek V3's
                rope_parameters={**_YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
            ),
            vision_config=dict(
                num_hidden_layers=1,
                hidden_size=16,
                intermediate_size=16,
                num_attention_heads=2,
                pos_emb_height=4,
                pos_emb_width=4,
                pos_emb_time=2,
            ),
            projection_hidden_size=16,
            tie_word_embeddings=False,
        ),
        {"text_config": {"model_type": "qwen3"}},
        r"text_config 'qwen3'",
    ),
    "qwen3_5_text": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        _GATED_DELTA_NET,
        {"attention_bias": True},
        r"attention_bias True",
    ),
    "qwen3_5_moe_text": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        dict(_GATED_DELTA_NET, **_QWEN_EXPERTS, intermediate_size=None),
        {"linear_num_value_heads": 3},
        r"linear_num_value_heads 3: is no multiple of 2 key heads",
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(_GATED_DELTA_NET, **_QWEN_EXPERTS, mlp_only_layers=[1]),  # layer 1 dense
        {"layer_types": ["linear_attention", "sliding_attention"] * 2},
        r"layer_types",
    ),
    "stablelm": (
        "StableLmConfig",
        "StableLmForCausalLM",
        dict(_TINY, use_qkv_bias=True),
        {"use_parallel_residual": True},
        r"use_parallel_residual True",
    ),
}

_QWEN35_VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=16,
    num_heads=2,
    out_hidden_size=32,
    num_position_embeddings=16,
    patch_size=4,
)
#: the multimodal checkpoints whose text model is imported (the towers in source.skipped): the
#: text model of each the tiny one above, its vision (and Gemma 4's audio) tower tiny
MULTIMODAL = {
    "llama4": dict(
        vision_config=dict(
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=16,
            vision_output_dim=16,
            image_size=16,
            patch_size=4,
            projector_input_dim=16,
            projector_output_dim=32,
        )
    ),
    "qwen3_5": dict(vision_config=_QWEN35_VISION),
    "qwen3_5_moe": dict(vision_config=_QWEN35_VISION),
    "gemma4": dict(
        vision_config=dict(
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
            position_embedding_size=16,
            patch_size=4,
        ),
        audio_config=dict(
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            subsampling_conv_channels=[4, 4],
            output_proj_dims=16,
        ),
    ),
}
for _f, _towers in MULTIMODAL.items():
    _class = FAMILIES[f"{_f}_text"][0].replace("TextConfig", "Config")
    FAMILIES[_f] = (
        _class,
        _class.replace("Config", "ForConditionalGeneration"),
        dict(_towers, text_config=FAMILIES[f"{_f}_text"][2]),
        {"text_config": {"model_type": "llama"}},
        r"text_config 'llama'",
    )


def _needs(transformers, config_class: str) -> None:
    """Skip where the installed transformers lacks the family (CI's oldest torch stage)."""
    if not hasattr(transformers, config_class):
        pytest.skip(f"transformers {transformers.__version__} has no {config_class}")


def _save_tiny(family: str, folder, **changes) -> str:
    """transformers' model of ``family`` from its tiny config, every weight moved off its
    initial value at random (a norm left at 1 or 0 would not show a misplaced one), saved."""
    import torch
    import transformers

    config_class, model_class, kwargs, _, _ = FAMILIES[family]
    _needs(transformers, config_class)
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**kwargs, **changes})
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
        for name, b in model.named_buffers():  # saved buffers: DeepSeek V3's router bias,
            if name.endswith(("e_score_correction_bias", "layer_scalar")):  # Gemma 4's scalars
                b.add_(torch.randn_like(b) * 0.2)
    model.save_pretrained(folder)
    return str(folder)


@pytest.mark.torch
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_gives_the_sources_logits_and_refuses_what_it_does_not_compute(family, tmp_path):
    """Converted exactly (every tensor equal to the source's), logits within 1e-4 of
    transformers'; the same folder with a config field the family does not compute is
    refused naming the field, before anything is loaded."""
    src = _save_tiny(family, tmp_path / "src")
    with open(os.path.join(src, "config.json")) as f:
        assert json.load(f)["model_type"] == family
    ckpt = jax_ucp.convert(src, tmp_path / "ucp")
    found = jax_ucp.verify(ckpt, against=src, logits=True)
    assert found == [], found
    assert found.logits is not None and found.logits.ok
    assert found.logits.max_abs_diff <= 1e-4 and found.logits.batch == (2, 16)

    wrong = shutil.copytree(src, tmp_path / "wrong")
    with open(wrong / "config.json") as f:
        config = json.load(f)
    change, names = FAMILIES[family][3], FAMILIES[family][4]
    with open(wrong / "config.json", "w") as f:
        json.dump({**config, **change}, f)
    with pytest.raises(jax_ucp.SourceError, match=rf"config\.json.*{names}"):
        compare_logits(ckpt, str(wrong))


def _config(family: str, **changes) -> dict:
    """The tiny config of ``family`` as config.json holds it (no torch)."""
    return {"model_type": family, **FAMILIES[family][2], **changes}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_builds_a_model_of_the_counted_size_and_its_spec_loads(family):
    """Torch-free: the family's LMConfig variant runs (logits of the right shape, finite), holds
    exactly ``parameter_count()`` elements (what --logits checks a config.json against), and
    its shipped spec loads with the head settings."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_ucp.language import load_spec
    from jax_ucp.models import TransformerLM

    cfg, spec = hf_model(_config(family))
    assert load_spec(spec, **cfg.head_settings).name == spec
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(1, 12) % cfg.vocab_size
    # the parameters init makes (traced, not run: an eager init compiles every initializer
    # and runs the model once more, ~60 % of this test's time), filled with random values
    shapes = jax.eval_shape(TransformerLM(cfg).init, jax.random.key(0), tokens)
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda x: jnp.asarray((rng.standard_normal(x.shape) * 0.2).astype(x.dtype)), shapes
    )
    held = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    assert held == cfg.parameter_count()
    # jitted: one compiled program (op by op, every primitive of the family compiles apart and
    # runs eagerly: 3-4x the time); the same model, its code traced whole
    logits = jax.jit(TransformerLM(cfg).apply)(params, tokens)
    assert logits.shape == (1, 12, cfg.vocab_size) and bool(jnp.isfinite(logits).all())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_field_the_family_does_not_compute_is_refused_naming_it(family, tmp_path):
    """Torch-free: the field each family's torch test changes is refused by hf_model itself
    (a RequestError naming the field and value), and by --logits (a SourceError naming the
    config.json) before the checkpoint or torch is touched, never computed differently."""
    config = _config(family, **FAMILIES[family][3])
    with pytest.raises(jax_ucp.RequestError, match=rf"config\.json: {FAMILIES[family][4]}"):
        hf_model(config)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    with pytest.raises(jax_ucp.SourceError, match=rf"src/config\.json.*{FAMILIES[family][4]}"):
        compare_logits(str(tmp_path / "never-read"), str(tmp_path / "src"))


@pytest.mark.parametrize(
    "family, changes, names",
    [
        ("llama", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"rope_scaling\.rope_type"),
        ("llama", {"mlp_bias": True}, r"mlp_bias True"),
        ("qwen3", {"rope_parameters": {**_YARN, "truncate": "no"}}, r"truncate 'no'"),
        ("qwen3", {"rope_parameters": {**_YARN, "beta_fast": -1}}, r"beta_fast -1"),
        ("qwen3", {"rope_parameters": {**_YARN, "factor": None}}, r"factor None"),
        (
            "llama",
            {"rope_parameters": {**_LLAMA3, "low_freq_factor": None}},
            r"low_freq_factor None",
        ),
        ("qwen2", {"head_dim": 0}, r"head_dim 0"),
        ("gemma2", {"query_pre_attn_scalar": float("nan")}, r"query_pre_attn_scalar nan"),
        ("gemma3_text", {"rope_parameters": {"rope_type": "default"}}, r"rope_parameters"),
        ("mixtral", {"num_experts_per_tok": 5}, r"num_experts_per_tok 5"),
        ("qwen2_moe", {"mlp_only_layers": "1"}, r"mlp_only_layers"),
        ("qwen3_moe", {"decoder_sparse_step": 0}, r"decoder_sparse_step 0"),
        ("llama4_text", {"no_rope_layers": [1, 2, 1, 0]}, r"no_rope_layers \[1, 2, 1, 0\]"),
        ("llama4_text", {"moe_layers": "1"}, r"moe_layers '1'"),
        ("llama4_text", {"layer_types": ["sliding_attention"] * 4}, r"layer_types"),
        ("llama4_text", {"attention_chunk_size": None}, r"attention_chunk_size None"),
        ("llama4_text", {"floor_scale": 0}, r"floor_scale 0"),
        ("llama4_text", {"num_experts_per_tok": 5}, r"num_experts_per_tok 5"),
        ("llama", {"model_type": ["llama"]}, r"model_type \['llama'\]"),
        ("phi3", {"partial_rotary_factor": 0.375}, r"partial_rotary_factor 0.375.*odd"),
        ("phi3", {"partial_rotary_factor": 1.5}, r"partial_rotary_factor 1.5"),
        ("qwen3", {"partial_rotary_factor": 0.5}, r"partial_rotary_factor"),
        ("mistral", {"sliding_window": -3}, r"sliding_window -3"),
        ("llama", {"rms_norm_eps": 0}, r"rms_norm_eps 0: expected a finite number > 0"),
        # probe 11: a string is truthy, so "false" tied the output layer to the embedding
        ("llama", {"tie_word_embeddings": "false"}, r"tie_word_embeddings 'false': expected true"),
        ("gpt2", {"tie_word_embeddings": 0}, r"tie_word_embeddings 0: expected true or false"),
        ("gpt2", {"layer_norm_epsilon": 0}, r"layer_norm_epsilon 0: expected a finite number"),
        ("bert", {}, r"model_type 'bert'"),
        ("llama", {"num_hidden_layers": 2**30}, r"num_hidden_layers 1073741824"),
        ("gpt2", {"n_layer": 2**30}, r"num_hidden_layers 1073741824"),
        ("deepseek_v3", {"num_key_value_heads": 2}, r"num_key_value_heads 2: expected 4"),
        ("deepseek_v3", {"n_group": 3}, r"n_group 3"),
        ("deepseek_v3", {"n_group": 8}, r"n_group 8"),  # groups of one expert
        ("deepseek_v3", {"topk_group": 1, "num_experts_per_tok": 3}, r"topk_group 1"),
        ("deepseek_v3", {"first_k_dense_replace": -1}, r"first_k_dense_replace -1"),
        ("deepseek_v3", {"qk_rope_head_dim": 7}, r"qk_rope_head_dim 7: expected an even"),
        ("ernie4_5_moe", {"moe_norm_min": 0.9}, r"moe_norm_min 0.9: would clamp"),
        ("ernie4_5_moe", {"moe_layer_start_index": -1}, r"moe_layer_start_index -1"),
        ("ernie4_5_moe", {"moe_k": 5}, r"moe_k 5: more than the 4 experts"),
        ("minimax_m2", {"rotary_dim": 3}, r"partial_rotary_factor 0.1875: gives an odd"),
        ("minimax_m2", {"num_local_experts": 0}, r"num_local_experts 0"),
        ("kimi_k25", {"text_config": None}, r"text_config None"),
        ("gemma4_text", {"num_kv_shared_layers": 4}, r"num_kv_shared_layers 4: expected 0 to 3"),
        ("gemma4_text", {"num_kv_shared_layers": 3}, r"num_kv_shared_layers 3: shares a layer"),
        ("gemma4_text", {"per_layer_config": {"1": {"head_dim": 16}}}, r"per_layer_config"),
        ("gemma4_text", {"per_layer_config": {"3": {"sliding_window": 2}}}, r"per_layer_config"),
        ("gemma4_text", {"num_global_key_value_heads": 3}, r"num_global_key_value_heads 3"),
        ("gemma4_text", {"rope_parameters": {"rope_type": "default"}}, r"rope_parameters"),
        (
            "gemma4_text",
            {"rope_parameters": {"full_attention": {"rope_type": "yarn"}, "sliding_attention": {}}},
            r"rope_parameters\.full_attention\.rope_type 'yarn'",
        ),
        ("gemma4_text", {"num_hidden_layers": 2000}, r"num_hidden_layers 2000: expected at most"),
        ("deepseek_v32", {"q_lora_rank": None}, r"q_lora_rank None"),
        ("deepseek_v32", {"index_topk": 0}, r"index_topk 0"),
        ("deepseek_v32", {"mlp_layer_types": ["dense", "moe", "sparse"]}, r"mlp_layer_types"),
        ("deepseek_v32", {"layer_types": ["full_attention"] * 3}, r"layer_types"),
        ("kimi_k25", {"text_config": {**_DEEPSEEK_V3, "n_group": 3}}, r"n_group 3"),
    ],
)
def test_values_no_model_has_are_refused_naming_the_field(family, changes, names):
    config = _config(family, **changes) if family in FAMILIES else {"model_type": family}
    with pytest.raises(jax_ucp.RequestError, match=names):
        hf_model(config)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("recorded", [False, True])
def test_a_square_fused_experts_tensor_is_read_as_the_spec_says_only_out_loud(recorded, tmp_path):
    """Llama 4's experts ``gate_up_proj`` [E, H, 2F] with H == 2F (names.json's, random values)
    saved transposed: its shape is the same either way, so nothing in the files tells the
    orientation. Without a record of its writer (no config.json: a torch DCP's case) the
    restore with the family's spec warns naming the tensor and the layout it assumes (before:
    silently transposed values); with transformers' config.json (model type, transformers 5)
    the layout is that model's and nothing is said. ``down_proj`` [E, F, H], not square, is
    never named: its shape shows its layout."""
    import warnings

    import numpy as np
    from safetensors.numpy import save_file

    from jax_ucp.language import load_spec
    from tests.ucp_testing import FIXTURES

    with open(os.path.join(FIXTURES, "hf_families", "names.json")) as f:
        entry = json.load(f)["llama4_text"]
    rng = np.random.default_rng(0)
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in entry["tensors"].items()}
    fused = "model.layers.1.feed_forward.experts.gate_up_proj"
    assert tensors[fused].shape == (4, 32, 32)
    tensors[fused] = np.ascontiguousarray(tensors[fused].transpose(0, 2, 1))  # the attack
    (tmp_path / "src").mkdir()
    save_file(tensors, str(tmp_path / "src" / "model.safetensors"))
    if recorded:
        (tmp_path / "src" / "config.json").write_text(json.dumps(entry["config"]))
    ckpt = jax_ucp.convert(tmp_path / "src", tmp_path / "ucp")
    cfg, name = hf_model(entry["config"])
    spec = load_spec(name, **cfg.head_settings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = jax_ucp.restore(ckpt, spec=spec)["params"]
    said = [str(w.message) for w in caught if "cannot tell" in str(w.message)]
    assert np.array_equal(got["layers_1"]["moe"]["fc1"]["kernel"], tensors[fused])  # as saved
    if recorded:
        assert said == []
        return
    assert len(said) == 1 and "down_proj" not in said[0], said
    assert f"{fused} [4, 32, 32]" in said[0] and "read as [E, H, 2F]" in said[0]
    assert "no file records which layout its writer used" in said[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model_type", sorted(MULTIMODAL))
def test_a_multimodal_checkpoint_imports_its_text_model_and_lists_the_towers_skipped(
    model_type, tmp_path
):
    """Torch-free, over the names, shapes and config.json transformers saved (names.json, random
    values): the import holds exactly the tensors the text model's ``*ForCausalLM`` saves, under
    its names and shapes, equal to the source's (verify --against); every other source tensor
    (vision / audio tower, projector) is in source.skipped; the config recorded is the text
    model's (``text_config``), which an export writes back; the text family's spec maps the
    import into TransformerLM's tree. An export into the multimodal config is refused by name."""
    import jax
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import save_file

    from jax_ucp._src.exporters import SafetensorsExport
    from jax_ucp.models import TransformerLM
    from tests.ucp_testing import FIXTURES

    with open(os.path.join(FIXTURES, "hf_families", "names.json")) as f:
        names = json.load(f)
    entry, text = names[model_type], names[f"{model_type}_text"]
    rng = np.random.default_rng(0)
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in entry["tensors"].items()}
    (tmp_path / "src").mkdir()
    save_file(tensors, str(tmp_path / "src" / "model.safetensors"))
    (tmp_path / "src" / "config.json").write_text(json.dumps(entry["config"]))
    ckpt = jax_ucp.convert(tmp_path / "src", tmp_path / "ucp")
    found = jax_ucp.inspect(ckpt)
    held = {e.name.removeprefix("params/"): list(e.shape) for e in found.tensors}
    assert held == text["tensors"]
    assert found.source["config"]["model_type"] == f"{model_type}_text"
    skipped = found.source["skipped"]
    assert len(skipped) + len(held) == len(tensors) and not set(skipped) & set(text["tensors"])
    assert jax_ucp.verify(ckpt, against=tmp_path / "src") == []

    cfg, spec = hf_model(entry["config"])
    assert hf_model(found.source["config"]) == (cfg, spec)
    tokens = jax.ShapeDtypeStruct((1, 4), np.int32)
    want = jax.eval_shape(TransformerLM(cfg).init, jax.random.key(0), tokens)["params"]
    got = jax_ucp.restore(ckpt, spec=spec)["params"]
    assert jax.tree.map(np.shape, got) == jax.tree.map(lambda s: s.shape, want)
    jax_ucp.export(ckpt, tmp_path / "hf", SafetensorsExport())
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "np") as f:
        assert sorted(f.keys()) == sorted(text["tensors"])  # the text model's names
    with open(tmp_path / "hf" / "config.json") as f:
        assert json.load(f) == found.source["config"]
    with pytest.raises(jax_ucp.RequestError, match=rf"model_type '{model_type}': .* text model"):
        jax_ucp.export(ckpt, tmp_path / "mm", SafetensorsExport(config=entry["config"]))
    assert not os.path.exists(tmp_path / "mm")


def _tower_as_layer_7(model_type: str, tensors: dict) -> dict:
    prefix = "language_model.model." if model_type == "llama4" else "model.language_model."
    return {
        (f"{prefix}layers.7.{n.split('.', 2)[-1]}" if "vision" in n else n): v
        for n, v in tensors.items()
    }


@pytest.mark.parametrize("model_type", ["llama4", "gemma4"])
@pytest.mark.parametrize(
    "damage, said",
    [
        (
            "hidden_size",
            r"text_config's hidden_size is 64, but '[\w.]*embed_tokens\.weight' is \[96, 32\]",
        ),
        (
            "num_hidden_layers",
            r"text_config's num_hidden_layers is 5, but the weights hold .*\[0, 1, 2, 3\]",
        ),
        ("tower", r"num_hidden_layers is 4, but the weights hold .*\[0, 1, 2, 3, 7\]"),
        ("model_type", r"no tensor is under its text model's prefixes"),
        # probe 11: a vocabulary the embedding does not have (imported before), and a layer
        # count of 10**12 (a set of that many numbers built: a raw MemoryError before)
        ("vocab_size", r"text_config's vocab_size is 7, but '[\w.]*embed_tokens\.weight' is \[96,"),
        ("huge_layers", r"num_hidden_layers is 1000000000000, but the weights hold"),
    ],
)
def test_a_multimodal_config_that_disagrees_with_its_weights_is_refused(
    model_type, damage, said, tmp_path
):
    """Torch-free (names.json): a text_config edited against the tensors (hidden size, layer
    count), a vision tower renamed as a text layer, or model_type swapped for a multimodal type
    naming its text model otherwise: refused naming the field and what the weights hold. Before,
    each imported (the last one with no tensor at all, every one in source.skipped)."""
    import numpy as np
    from safetensors.numpy import save_file

    from tests.ucp_testing import FIXTURES, assert_convert_refused

    with open(os.path.join(FIXTURES, "hf_families", "names.json")) as f:
        entry = json.load(f)[model_type]
    rng = np.random.default_rng(0)
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in entry["tensors"].items()}
    config = json.loads(json.dumps(entry["config"]))
    if damage == "hidden_size":
        config["text_config"]["hidden_size"] *= 2
    elif damage == "num_hidden_layers":
        config["text_config"]["num_hidden_layers"] += 1
    elif damage == "tower":
        tensors = _tower_as_layer_7(model_type, tensors)
    elif damage in ("vocab_size", "huge_layers"):
        field = "vocab_size" if damage == "vocab_size" else "num_hidden_layers"
        config["text_config"][field] = 7 if damage == "vocab_size" else 10**12
    else:
        config["model_type"] = "qwen3_5" if model_type == "llama4" else "llama4"
    (tmp_path / "src").mkdir()
    save_file(tensors, str(tmp_path / "src" / "model.safetensors"))
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    assert_convert_refused(tmp_path / "src", tmp_path / "ucp", said)


def test_the_sliding_window_masks_keys_further_back_than_it():
    """A window at least the sequence's length is full attention, bit for bit; a window of 1
    is not (each query sees only itself)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_ucp.models import TransformerLM

    cfg, _ = hf_model(_config("mistral"))
    tokens = jnp.arange(10, dtype=jnp.int32)[None]
    params = jax.jit(TransformerLM(cfg).init)(jax.random.key(0), tokens)

    def logits(window):  # eager, as --logits runs it: bit for bit is each op's, not a fusion's
        return np.asarray(
            TransformerLM(dataclasses.replace(cfg, sliding_window=window)).apply(params, tokens)
        )

    full, one = logits(None), logits(1)
    assert np.array_equal(logits(10), full)
    assert not np.allclose(one, full) and np.allclose(one[:, 0], full[:, 0])


def _older_config(config: dict) -> dict:
    """``config`` as transformers 4 wrote it: RoPE in ``rope_theta`` / ``rope_scaling`` (Gemma 3:
    ``rope_local_base_freq`` for the local layers), no ``rope_parameters``, no ``layer_types``."""
    old = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types")}
    rope = config.get("rope_parameters") or {}
    if "full_attention" in rope:
        old["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    old["rope_theta"] = rope.get("rope_theta", 10000.0)
    if "partial_rotary_factor" in rope:
        old["partial_rotary_factor"] = rope["partial_rotary_factor"]
    if rope.get("rope_type", "default") != "default":
        old["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return old


@pytest.mark.torch
@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"gpt2", "gemma4_text"}))
def test_an_older_config_reads_as_transformers_reads_it(family, tmp_path):
    """A config.json in transformers 4's form (no rope_parameters, no layer_types): the model
    read from it is the one read from what transformers 5 makes of it (its own config class,
    defaults filled in, to_dict). Gemma 4 (transformers 5 only) has no older form."""
    import transformers

    config_class, _, kwargs, _, _ = FAMILIES[family]
    _needs(transformers, config_class)
    written = getattr(transformers, config_class)(**kwargs).to_dict()
    older = _older_config(written)
    again = getattr(transformers, config_class)(
        **{k: v for k, v in older.items() if k != "model_type"}
    ).to_dict()
    assert hf_model(older) == hf_model(again)


@pytest.mark.torch
@pytest.mark.parametrize("case", ["dense", *_GEMMA4_CASES])
def test_gemma4_released_config_reads_as_transformers_reads_it(case):
    """Gemma 4's config.json as released (``global_head_dim``, ``num_global_key_value_heads``,
    no ``per_layer_config``) gives the model read from what transformers 5 writes of it (its
    ``per_layer_config``, the last layer forced global)."""
    import transformers

    _needs(transformers, "Gemma4TextConfig")
    released = _config("gemma4_text", **_GEMMA4_CASES.get(case, {}))
    released["layer_types"] = [*released["layer_types"][:-1], "sliding_attention"]
    written = transformers.Gemma4TextConfig(**released).to_dict()
    assert "per_layer_config" in written and "per_layer_config" not in released
    assert hf_model(released) == hf_model(written)


def test_llama4_text_reads_its_layer_lists_as_transformers_does():
    """Torch-free: no_rope_layers empty or absent is every ``no_rope_layer_interval``-th layer
    without RoPE (the others chunked), moe_layers absent every ``interleave_moe_layer_step``-th,
    as Llama4TextConfig fills them in."""
    for rope in ([], None):
        cfg, _ = hf_model(_config("llama4_text", no_rope_layers=rope, num_hidden_layers=8))
        assert cfg.nope_layers == (3, 7) and cfg.sliding_layers == (0, 1, 2, 4, 5, 6)
        assert cfg.dense_layers == (0, 2, 4, 6) and cfg.attn_temperature == (3.0, 0.5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "family, field", [("qwen2_moe", "mlp_only_layers"), ("llama4_text", "moe_layers")]
)
def test_a_config_listing_half_of_a_million_layers_is_read_and_counted(family, field):
    """Hostile-size input: every other of 2**20 layers listed (dense for Qwen2-MoE, MoE for
    Llama 4) is read and its size counted (what --logits checks before from_pretrained) without
    a scan per layer of the list; the count is the 2-layer model's per-layer size times 2**19."""
    import dataclasses

    layers = 2**20
    big, _ = hf_model(_config(family, num_hidden_layers=layers, **{field: [*range(0, layers, 2)]}))
    two, _ = hf_model(_config(family, num_hidden_layers=2, **{field: [0]}))
    none = dataclasses.replace(two, num_layers=0).parameter_count()
    assert len(big.dense_layers) == layers // 2
    assert big.parameter_count() - none == layers // 2 * (two.parameter_count() - none)


def test_an_empty_rope_scaling_gives_way_to_rope_parameters():
    """transformers reads ``rope_scaling or rope_parameters``: an empty ``rope_scaling`` beside
    transformers 5's ``rope_parameters`` must not reset RoPE's base to the default."""
    rope = {"rope_type": "default", "rope_theta": 5e5}
    cfg, _ = hf_model(_config("llama", rope_scaling={}, rope_parameters=rope))
    assert cfg.rotary_base == 5e5


@pytest.mark.torch
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", sorted(_YARN_CASES))
def test_yarn_rope_gives_the_sources_logits(case, tmp_path):
    """A tiny Qwen3 with yarn RoPE (each set of its optional fields): logits within 1e-4 of
    transformers'."""
    rope = {**_YARN, **_YARN_CASES[case]}
    src = _save_tiny("qwen3", tmp_path / "src", rope_parameters=rope, max_position_embeddings=8192)
    found = jax_ucp.verify(jax_ucp.convert(src, tmp_path / "ucp"), against=src, logits=True)
    assert found == [] and found.logits is not None, found
    assert found.logits.max_abs_diff <= 1e-4 and found.logits.batch == (2, 16)


#: transformers 5.23's ``_compute_yarn_parameters`` for the tiny Qwen3 (head_dim 16) with
#: each case: (inverse frequencies, attention factor), printed by it and copied here
_YARN_TRANSFORMERS = {
    "defaults": (
        [
            1.0,
            0.316227764,
            0.100000001,
            0.025693506,
            0.00624999963,
            0.00138349656,
            0.00025,
            7.90569466e-05,
        ],
        1.138629436111989,
    ),
    "untruncated-mscale": (
        [
            1.0,
            0.316227764,
            0.100000001,
            0.0238701962,
            0.00505697168,
            0.000811290462,
            0.00025,
            7.90569466e-05,
        ],
        1.0648216253695715,
    ),
    "attention-factor-betas": (
        [
            1.0,
            0.316227764,
            0.100000001,
            0.023717083,
            0.005,
            0.000790569466,
            0.00025,
            7.90569466e-05,
        ],
        1.3,
    ),
}


@pytest.mark.parametrize("case", sorted(_YARN_CASES))
def test_yarn_rope_rotates_by_the_frequencies_transformers_computes(case):
    """Torch-free: position 1 turns (1, 0) pairs into attention * (cos, sin) of each inverse
    frequency; read back, the frequencies and attention factor are transformers' own."""
    import jax.numpy as jnp
    import numpy as np

    from jax_ucp._src.models import transformer

    cfg, _ = hf_model(_config("qwen3", rope_parameters={**_YARN, **_YARN_CASES[case]}))
    x = jnp.concatenate([jnp.ones(8), jnp.zeros(8)])[None, None, None, :]
    out = np.asarray(
        transformer.apply_rope(
            x, jnp.arange(1, 2), cfg.rotary_base, cfg.rotary_scaling_factor, yarn=cfg.rotary_yarn
        )
    )[0, 0, 0]
    inverse, attention = _YARN_TRANSFORMERS[case]
    np.testing.assert_allclose(np.arctan2(out[8:], out[:8]), inverse, rtol=1e-5)
    np.testing.assert_allclose(np.hypot(out[8:], out[:8]), attention, rtol=1e-6)


#: DeepSeek V3's variants beside its FAMILIES config: one q projection (no q_lora_rank),
#: RoPE dims not interleaved, top-k weights not renormalised, no dense layer, plain RoPE
_DEEPSEEK_V3_CASES = {
    "q-proj-rotate-half": dict(q_lora_rank=None, rope_interleave=False, norm_topk_prob=False),
    "all-moe-default-rope": dict(first_k_dense_replace=0, rope_parameters={"rope_theta": 1e4}),
    "deepseek-yarn": dict(  # DeepSeek V3's own rope_scaling form, mscale = mscale_all_dim
        rope_parameters=None,
        rope_scaling={
            **_YARN,
            "type": "yarn",
            "factor": 40.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
}


@pytest.mark.torch
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", sorted(_DEEPSEEK_V3_CASES))
def test_deepseek_v3_variants_give_the_sources_logits(case, tmp_path):
    """DeepSeek V3 saved by transformers with each variant: logits within 1e-4 of its own."""
    src = _save_tiny("deepseek_v3", tmp_path / "src", **_DEEPSEEK_V3_CASES[case])
    found = jax_ucp.verify(jax_ucp.convert(src, tmp_path / "ucp"), against=src, logits=True)
    assert found == [] and found.logits is not None, found
    assert found.logits.max_abs_diff <= 1e-4 and found.logits.batch == (2, 16)


def test_moe_with_sigmoid_input_adds_the_experts_biases():
    """Torch-free: ``moe_bias`` with ``moe_sigmoid_input`` (the chosen experts compute on x times
    sigmoid(router logit)) adds each expert's fc1 / fc2 biases, and only the chosen experts'
    outputs are summed: the MoE layer equals a per-token numpy reference."""
    import jax
    import numpy as np

    from jax_ucp._src.models.transformer import MoE
    from jax_ucp.models import LMConfig

    cfg = LMConfig(
        16,
        8,
        1,
        2,
        12,
        normalization="RMSNorm",
        gated=True,
        bias=False,
        num_experts=4,
        moe_router_topk=2,
        moe_sigmoid_input=True,
        moe_bias=True,
    )
    x = np.random.default_rng(0).normal(size=(1, 5, 8)).astype(np.float32)
    params = jax.eval_shape(MoE(cfg).init, jax.random.key(0), x)["params"]  # shapes: refilled
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
    assert set(params) == {"router", "fc1", "fc2", "fc1_bias", "fc2_bias"}
    got = np.asarray(jax.jit(MoE(cfg).apply)({"params": params}, x))
    fc1, fc2 = params["fc1"]["kernel"], params["fc2"]["kernel"]
    for t in range(5):
        logits = x[0, t] @ params["router"]["kernel"] + params["router"]["bias"]
        want = np.zeros(8, np.float32)
        for e in np.argsort(-logits)[:2]:
            h = x[0, t] / (1 + np.exp(-logits[e])) @ fc1[e] + params["fc1_bias"][e]
            gate, up = h[:12], h[12:]
            want += (gate / (1 + np.exp(-gate)) * up) @ fc2[e] + params["fc2_bias"][e]
        np.testing.assert_allclose(got[0, t], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "spec", ["hf_olmo3", "hf_glm4_moe", "hf_qwen3_5", "hf_qwen3_5_moe", "hf_qwen3_next"]
)
def test_the_new_family_specs_name_the_logical_axes_of_every_tensor(spec):
    """Torch-free: every restore rule of the specs added for OLMo 3, GLM-4.5 MoE, Qwen3.5 and
    Qwen3-Next names its tensor's logical axes (what a restore onto a mesh shards by)."""
    from jax_ucp.language import load_spec

    rules = load_spec(spec, num_attention_heads=4, num_query_groups=2, head_dim=8).restore
    assert rules and [r.pattern for r in rules if not r.axes] == []


#: the families added in round 14, each checked further: logits within 1e-5 of transformers'
#: from a restore sharded onto a 2 x 4 mesh by the spec's logical axes
NEW_FAMILIES = [
    "ernie4_5_moe",
    "minimax_m2",
    "kimi_k25",
    "gemma4_text",
    "gemma4_text/moe",
    "deepseek_v32",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "qwen3_next",
    # their text models (Gemma 4's not: its tiny multimodal model's random text weights, not
    # gemma4_text's, give 1.4e-5 jitted on the mesh, 9.5e-6 eager; --logits checks it to 1e-4.
    # fp32 rounding, amplified by the RMSNorm of the per-layer inputs: over seeds 0-4 its logits
    # are 0.8-2.4e-5 from transformers', 0.6-3.0e-5 from its fp64 forward (transformers' fp32
    # 0.4-0.9e-5); gemma4_text's 0.3-1.4e-5 from transformers' (seed 0, tested: 3.3e-6))
    *sorted(set(MULTIMODAL) - {"gemma4"}),
]
#: Gated DeltaNet's gated RMSNorm rescales small head outputs, so fp32 rounding grows: on the tiny
#: Qwen3.5, transformers' own chunked and token-by-token kernels differ by 4.4e-5 in the logits;
#: over seeds 0-4 transformers' fp32 logits are 0.8-3.1e-5 from its fp64 forward, TransformerLM's
#: 0.8-3.6e-5, and the two 0.8-1.5e-5 apart (MoE / Qwen3-Next 1.0-4.6e-5): the kernels are
#: equally exact (test_gated_deltanets_kernel_is_as_exact_as_transformers_own), their roundings differ
_ATOL = dict.fromkeys(
    ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "qwen3_5", "qwen3_5_moe"], 1e-4
)
_MESH_RULES = [("embed", "data"), ("heads", "model"), ("mlp", "model"), ("experts", "model")]


@pytest.mark.torch
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_a_new_family_restores_sharded_on_a_2x4_mesh_with_the_sources_logits(family, tmp_path):
    """transformers' tiny model (or its variant) saved, converted and restored with the
    family's spec onto a 2 x 4 mesh (its logical axes sharded by the rules): the same values as
    the unsharded restore, some tensors split over both mesh axes, and fp32 logits within 1e-5 of
    transformers' forward (1e-4 with Gated DeltaNet: ``_ATOL``)."""
    import jax
    import numpy as np
    import torch
    import transformers
    from jax.sharding import Mesh

    from jax_ucp.language import load_spec
    from jax_ucp.models import TransformerLM

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    family, _, case = family.partition("/")  # a variant: gemma4_text/moe
    src = _save_tiny(family, tmp_path / "src", **(_GEMMA4_CASES[case] if case else {}))
    with open(os.path.join(src, "config.json")) as f:
        cfg, spec = hf_model(json.load(f))
    spec = load_spec(spec, **cfg.head_settings)
    ckpt = jax_ucp.convert(src, tmp_path / "ucp")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    got = jax_ucp.restore(ckpt, spec=spec, mesh=mesh, rules=_MESH_RULES)["params"]
    plain = jax_ucp.restore(ckpt, spec=spec)["params"]
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(plain)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)
    split = {tuple(s for s in x.sharding.spec if s) for x in jax.tree.leaves(got)}
    assert ("data", "model") in split or ("model", "data") in split, split
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16))
    model = getattr(transformers, FAMILIES[family][1]).from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        want = source_logits(model.eval(), torch.from_numpy(tokens)).numpy()
    logits = np.asarray(jax.jit(TransformerLM(cfg).apply)({"params": got}, tokens))
    assert np.abs(logits - want).max() <= _ATOL.get(family, 1e-5)


@pytest.mark.torch
@pytest.mark.timeout(300)
def test_gated_deltanets_kernel_is_as_exact_as_transformers_own(tmp_path):
    """Why ``_ATOL`` is 1e-4 for Gated DeltaNet (the residual is fp32 rounding, not a wrong
    sum): on the inputs transformers' tiny Qwen3.5 hands its chunked kernel, ``gated_delta_rule``
    (fp32) is as close to the rule evaluated token by token in fp64 (numpy) as transformers'
    kernel is, relative to each head's output (the gated RMSNorm rescales it to unit size):
    within twice its distance and 1e-6. Measured: 0.4-3.3e-5, transformers' 0.9-3.3e-5; the
    two differ from each other by as much (seeds 0-2; 3.3e-4 for both on a head of rms 2e-7)."""
    import importlib

    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers

    from jax_ucp._src.models.transformer import gated_delta_rule

    src = _save_tiny("qwen3_5_text", tmp_path / "src")
    model = transformers.Qwen3_5ForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    module = importlib.import_module(type(model).__module__)
    kernel, calls = module.torch_chunk_gated_delta_rule, []

    def recorded(q, k, v, g, beta, **kw):
        assert kw.get("use_qk_l2norm_in_kernel")  # the l2 norm below, as the kernel's
        out = kernel(q, k, v, g=g, beta=beta, **kw)
        calls.append(([t.numpy().copy() for t in (q, k, v, g, beta)], out[0].numpy().copy()))
        return out

    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 96, (2, 16)))
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "torch_chunk_gated_delta_rule", recorded)
        model(tokens)
    assert len(calls) == 3  # the tiny model's linear_attention layers
    worst = {"ours": 0.0, "transformers": 0.0}
    for (q, k, v, g, beta), theirs in calls:
        r, scale = v.shape[2] // q.shape[2], q.shape[-1] ** -0.5

        def l2(t, dtype):  # the kernel's l2 norm (fp32, as GatedDeltaNet's), repeated
            t = t.astype(dtype)
            return np.repeat(t / np.sqrt((t * t).sum(-1, keepdims=True) + 1e-6), r, 2)

        args = (jnp.asarray(x) for x in (l2(q, np.float32) * np.float32(scale), l2(k, np.float32)))
        ours = np.asarray(gated_delta_rule(*args, *(jnp.asarray(x) for x in (v, g, beta))))
        q, k = l2(q, np.float64) * scale, l2(k, np.float64)
        exact = np.zeros(v.shape)  # [b, s, h, dv]: S decays by exp(g), learns v at k, q S out
        state = np.zeros((*v.shape[:1], v.shape[2], q.shape[-1], v.shape[-1]))
        for t in range(v.shape[1]):
            state *= np.exp(g[:, t].astype(np.float64))[..., None, None]
            error = v[:, t] - np.einsum("bhk,bhkv->bhv", k[:, t], state)
            state += np.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * error)
            exact[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t], state)
        rms = np.sqrt((exact**2).mean(-1, keepdims=True))
        for who, out in (("ours", ours), ("transformers", theirs)):
            worst[who] = max(worst[who], float(np.abs((out - exact) / rms).max()))
    assert worst["ours"] <= 2 * worst["transformers"] + 1e-6, worst


def test_deepseek_v32s_indexer_keeps_the_top_k_causal_keys_of_each_query():
    """Torch-free: the indexer's selection holds min(index_topk, i + 1) causal keys for query
    i; with index_topk at least the sequence's length the model is DeepSeek V3's latent
    attention (within 1e-6: the jitted programs differ). Fewer keys: the torch test."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_ucp._src.models.transformer import Indexer
    from jax_ucp.models import TransformerLM

    cfg, _ = hf_model(_config("deepseek_v32", num_hidden_layers=1))  # one dense layer
    tokens = jnp.arange(12, dtype=jnp.int32)[None] % cfg.vocab_size
    rng = np.random.default_rng(0)  # random weights, no init compiled
    shapes = jax.eval_shape(TransformerLM(cfg).init, jax.random.key(0), tokens)
    params = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32) * 0.3, shapes)
    x = rng.normal(size=(2, 12, cfg.hidden_size)).astype(np.float32)
    x_q = rng.normal(size=(2, 12, cfg.mla[0])).astype(np.float32)  # type: ignore[index]
    indexer = {"params": params["params"]["layers_0"]["attn"]["indexer"]}
    keep = np.asarray(jax.jit(Indexer(cfg).apply)(indexer, x, x_q))
    assert not np.any(np.triu(keep, 1))
    np.testing.assert_array_equal(keep.sum(-1), [np.minimum(5, np.arange(1, 13))] * 2)

    def logits(indexer):
        model = TransformerLM(dataclasses.replace(cfg, indexer=indexer))
        return np.asarray(jax.jit(model.apply)(params, tokens))  # V3's: the indexer unused

    heads, dim, _ = cfg.indexer  # type: ignore[misc]
    np.testing.assert_allclose(logits((heads, dim, 12)), logits(None), rtol=0, atol=1e-6)


@pytest.mark.torch
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model_type", sorted(MULTIMODAL))
def test_a_multimodal_checkpoints_text_model_goes_out_as_the_text_model_transformers_loads(
    model_type, tmp_path
):
    """transformers' multimodal model saved, converted (its text model), exported with the
    config.json recorded: ``AutoModelForCausalLM`` loads the text model's class with every
    weight of the multimodal model's language model, and computes its logits."""
    import numpy as np
    import torch
    import transformers

    from jax_ucp._src.exporters import SafetensorsExport

    src = _save_tiny(model_type, tmp_path / "src")
    ckpt = jax_ucp.convert(src, tmp_path / "ucp")
    jax_ucp.export(ckpt, tmp_path / "hf", SafetensorsExport())
    fp32 = dict(dtype=torch.float32)
    text = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", **fp32).eval()
    full = getattr(transformers, FAMILIES[model_type][1]).from_pretrained(src, **fp32).eval()
    assert type(text).__name__ == FAMILIES[f"{model_type}_text"][1]
    if model_type == "llama4":  # its language model is a Llama4ForCausalLM
        want = full.language_model.state_dict()
    else:
        language = full.model.language_model.state_dict()
        want = {f"model.{k}": v for k, v in language.items()} | {
            "lm_head.weight": full.lm_head.weight
        }
    got = text.state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 96, (2, 16)))
    with torch.no_grad():
        assert torch.equal(text(tokens).logits, source_logits(full, tokens))
