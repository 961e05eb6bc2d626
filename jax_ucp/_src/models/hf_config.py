"""A ``TransformerLM``'s ``LMConfig`` as the Hugging Face ``config.json`` of one of the families
a spec maps, for an export given no config: written from the settings, then read back by the
family's own reader (``hf_families.hf_model``) and kept only when it gives the same ``LMConfig``,
so a setting this writer does not spell is refused by name, never written wrong."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from jax_ucp._src.errors import RequestError
from jax_ucp._src.models.hf_families import FAMILIES, GPT2_NAMES
from jax_ucp._src.models.transformer import LMConfig, hf_model

#: model_type -> the class ``architectures`` names (transformers' own spelling)
ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "stablelm": "StableLmForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}


def _rope(cfg: LMConfig) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_theta": cfg.rotary_base, "rope_type": "default"}
    if cfg.rotary_llama3 is not None:
        low, high, original = cfg.rotary_llama3
        params.update(
            rope_type="llama3",
            factor=cfg.rotary_scaling_factor,
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_embeddings=int(original),
        )
    elif cfg.rotary_yarn is not None:
        fast, slow, original, truncate, attention = cfg.rotary_yarn
        params.update(
            rope_type="yarn",
            factor=cfg.rotary_scaling_factor,
            beta_fast=fast,
            beta_slow=slow,
            original_max_position_embeddings=int(original),
            truncate=truncate,
            attention_factor=attention,
        )
    elif cfg.rotary_scaling_factor != 1.0:
        params.update(rope_type="linear", factor=cfg.rotary_scaling_factor)
    return params


def _fields(cfg: LMConfig, model_type: str) -> dict[str, Any]:
    """The config.json fields of ``cfg`` as ``model_type`` spells them."""
    common = {
        "model_type": model_type,
        "architectures": [
            ARCHITECTURES.get(model_type, f"{model_type.title().replace('_', '')}ForCausalLM")
        ],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "intermediate_size": cfg.ffn_hidden_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tied,
        "torch_dtype": "float32",
        # the token ids are no model setting: unknown here (a family's defaults may lie
        # outside this vocabulary); give config= the model's own for generation
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if model_type == "gpt2":
        return {
            **common,
            "n_inner": cfg.ffn_hidden_size,
            "layer_norm_epsilon": cfg.eps,
            "activation_function": "gelu_new" if cfg.gelu_tanh else "gelu",
            **{own: common[name] for name, own in GPT2_NAMES.items()},
        }
    out = {
        **common,
        "num_key_value_heads": cfg.groups,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.eps,
        "rope_parameters": _rope(cfg),
        "hidden_act": "silu",
    }
    if cfg.rotary_percent != 1.0:
        out["partial_rotary_factor"] = cfg.rotary_percent
    out["sliding_window"] = cfg.sliding_window
    if cfg.sliding_layers is not None:  # the windowed layers by name
        kind = "chunked_attention" if cfg.sliding_chunked else "sliding_attention"
        out["layer_types"] = [
            kind if i in cfg.sliding_layers else "full_attention" for i in range(cfg.num_layers)
        ]
        out["use_sliding_window"] = bool(cfg.sliding_layers)
    elif cfg.sliding_window is not None:  # every layer
        out["use_sliding_window"] = True
    if cfg.num_experts:
        out.update(_experts(cfg))
    out.update(_EXTRA.get(model_type, lambda cfg: {})(cfg))
    return out


def _experts(cfg: LMConfig) -> dict[str, Any]:
    """The experts as each MoE family names them (a family reads the names it knows)."""
    width = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
    shared = cfg.moe_shared_expert_intermediate_size or 0
    return {
        "num_local_experts": cfg.num_experts,
        "num_experts": cfg.num_experts,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.moe_router_topk,
        "moe_intermediate_size": width,
        "norm_topk_prob": cfg.moe_norm_topk,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(cfg.dense_layers),
        "shared_expert_intermediate_size": shared,
        "n_shared_experts": shared // width,
        "first_k_dense_replace": len(cfg.dense_layers),
    }


def _whole(x: float) -> float | int:
    """``x`` as the integer it is within rounding (transformers types some fields int)."""
    return round(x) if abs(x - round(x)) < 1e-9 * max(1.0, abs(x)) else x


def _gemma(cfg: LMConfig) -> dict[str, Any]:
    act = {"gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}.get(cfg.glu_activation)
    out = {
        "hidden_activation": act,
        "query_pre_attn_scalar": _whole((cfg.attention_scale or 1.0) ** -2),
        "attn_logit_softcapping": cfg.attn_logit_softcapping,
        "final_logit_softcapping": cfg.final_logit_softcapping,
    }
    if cfg.local_rotary_base is not None:  # Gemma 3: a RoPE per layer type
        out["rope_parameters"] = _typed_rope(cfg)
    return out


def _typed_rope(cfg: LMConfig) -> dict[str, Any]:
    """Gemma 3's and OLMo 3's ``rope_parameters``: one set per layer type."""
    local = dataclasses.replace(
        cfg,
        rotary_base=cfg.local_rotary_base,
        rotary_scaling_factor=cfg.local_rotary_scaling_factor,
        rotary_llama3=None,
        rotary_yarn=None,
    )
    return {"full_attention": _rope(cfg), "sliding_attention": _rope(local)}


def _gemma4(cfg: LMConfig) -> dict[str, Any]:
    """Gemma 4: a RoPE per layer type (proportional on the global layers), the global layers'
    head_dim / kv heads as transformers 5.24 writes them (``per_layer_config``), shared k / v,
    per-layer inputs and the MoE block."""
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rotary_proportional:
        full.update(
            rope_type="proportional",
            partial_rotary_factor=cfg.rotary_percent,
            factor=cfg.rotary_scaling_factor,
        )
    local = {"rope_type": "default", "rope_theta": cfg.local_rotary_base}
    types = [_LAYER_TYPES[cfg.is_sliding(i)] for i in range(cfg.num_layers)]
    width = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
    return {
        **_gemma(cfg),
        "query_pre_attn_scalar": None,
        "rope_parameters": {"full_attention": full, "sliding_attention": local},
        "layer_types": types,
        "per_layer_config": {
            str(i): {
                "head_dim": cfg.global_head_dim,
                "num_key_value_heads": cfg.global_query_groups,
            }
            for i, kind in enumerate(types)
            if kind == "full_attention"
        },
        "attention_k_eq_v": cfg.global_kv_from_k,
        "num_kv_shared_layers": cfg.kv_shared_layers,
        "use_double_wide_mlp": cfg.wide_shared_mlp,
        "hidden_size_per_layer_input": cfg.per_layer_input or 0,
        "vocab_size_per_layer_input": cfg.per_layer_vocab or cfg.vocab_size,
        "enable_moe_block": cfg.moe_beside_mlp,
        "top_k_experts": cfg.moe_router_topk if cfg.moe_beside_mlp else None,
        "moe_intermediate_size": width if cfg.moe_beside_mlp else None,
        "attention_bias": False,
    }


#: a layer's type by ``is_sliding``
_LAYER_TYPES = ("full_attention", "sliding_attention")


def _olmo3(cfg: LMConfig) -> dict[str, Any]:
    """Its layer types always (absent, three of four layers are windowed)."""
    windowed = cfg.sliding_layers if cfg.sliding_window is not None else ()
    types = [
        "sliding_attention" if windowed is None or i in windowed else "full_attention"
        for i in range(cfg.num_layers)
    ]
    return {"rope_parameters": _typed_rope(cfg), "layer_types": types}


def _groups(cfg: LMConfig) -> dict[str, Any]:
    """DeepSeek V3's and GLM-4.5's group-limited routing."""
    groups, top_groups, scaling = cfg.moe_groups or (1, 1, 1.0)
    return {"n_group": groups, "topk_group": top_groups, "routed_scaling_factor": scaling}


def _llama4(cfg: LMConfig) -> dict[str, Any]:
    floor, scale = cfg.attn_temperature or (None, None)
    return {
        "intermediate_size": cfg.moe_ffn_hidden_size,
        "intermediate_size_mlp": cfg.ffn_hidden_size,
        "no_rope_layers": [int(i not in cfg.nope_layers) for i in range(cfg.num_layers)],
        "moe_layers": [i for i in range(cfg.num_layers) if i not in cfg.dense_layers],
        "attention_chunk_size": cfg.sliding_window,
        "sliding_window": None,
        "use_qk_norm": cfg.qk_l2_norm,
        "attn_temperature_tuning": cfg.attn_temperature is not None,
        "floor_scale": None if floor is None else _whole(floor),
        "attn_scale": scale,
    }


def _deepseek(cfg: LMConfig) -> dict[str, Any]:
    q_rank, kv_rank, nope, rope, v = cfg.mla or (0, 0, 0, 0, 0)
    rope_parameters = _rope(cfg)
    factor, scale = cfg.rotary_scaling_factor, (nope + rope) ** -0.5
    if factor > 1 and cfg.attention_scale != scale:  # yarn's mscale_all_dim, squared, on it
        mscale = (cfg.attention_scale or scale) / scale
        rope_parameters["mscale_all_dim"] = (mscale**0.5 - 1) / (0.1 * math.log(factor))
    return {
        "rope_parameters": rope_parameters,
        "q_lora_rank": q_rank or None,
        "kv_lora_rank": kv_rank,
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v,
        "head_dim": rope,
        "rope_interleave": cfg.rope_interleaved,
        **_groups(cfg),
    }


def _deepseek_v32(cfg: LMConfig) -> dict[str, Any]:
    """DeepSeek V3's fields, its indexer's and each layer's MLP kind (V3.2 has no
    ``rope_interleave``: always interleaved)."""
    heads, dim, top = cfg.indexer or (0, 0, 0)
    out = {k: v for k, v in _deepseek(cfg).items() if k != "rope_interleave"}
    kinds = ["dense" if not cfg.is_moe(i) else "sparse" for i in range(cfg.num_layers)]
    return {
        **out,
        "index_n_heads": heads,
        "index_head_dim": dim,
        "index_topk": top,
        "mlp_layer_types": kinds,
    }


def _ernie(cfg: LMConfig) -> dict[str, Any]:
    """Ernie 4.5's MoE layers as a first, last and interval (read back: another set refused)."""
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe(i)] or [cfg.num_layers]
    width = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
    return {
        "moe_num_experts": cfg.num_experts,
        "moe_k": cfg.moe_router_topk,
        "moe_num_shared_experts": (cfg.moe_shared_expert_intermediate_size or 0) // width,
        "moe_layer_start_index": moe[0],
        "moe_layer_end_index": moe[-1],
        "moe_layer_interval": moe[1] - moe[0] if len(moe) > 1 else moe[0] + 1,
        "use_bias": False,
    }


def _gated_delta_net(cfg: LMConfig) -> dict[str, Any]:
    """Qwen3.5's and Qwen3-Next's linear attention layers and partial rotary."""
    nk, nv, dk, dv, width = cfg.gdn or (0, 0, 0, 0, 0)
    return {
        "rope_parameters": {**_rope(cfg), "partial_rotary_factor": cfg.rotary_percent},
        "attention_bias": False,
        "layer_types": [
            "linear_attention" if cfg.is_linear(i) else "full_attention"
            for i in range(cfg.num_layers)
        ],
        "linear_num_key_heads": nk,
        "linear_num_value_heads": nv,
        "linear_key_head_dim": dk,
        "linear_value_head_dim": dv,
        "linear_conv_kernel_dim": width,
    }


#: the fields one family adds to the common ones
_EXTRA = {
    "qwen3_5_text": _gated_delta_net,
    "qwen3_5_moe_text": _gated_delta_net,
    "qwen3_next": _gated_delta_net,
    "stablelm": lambda cfg: {"layer_norm_eps": cfg.eps, "use_qkv_bias": cfg.qkv_bias},
    "granite": lambda cfg: {
        "embedding_multiplier": cfg.embedding_multiplier,
        "residual_multiplier": cfg.residual_multiplier,
        "attention_multiplier": cfg.attention_scale,
        "logits_scaling": cfg.logits_scaling,
    },
    "olmo3": _olmo3,
    "smollm3": lambda cfg: {
        "no_rope_layers": [int(i not in cfg.nope_layers) for i in range(cfg.num_layers)],
    },
    "glm4_moe": lambda cfg: {
        "rope_parameters": {**_rope(cfg), "partial_rotary_factor": cfg.rotary_percent},
        "attention_bias": cfg.qkv_bias,
        "use_qk_norm": cfg.qk_norm,
        **_groups(cfg),
    },
    "gemma2": _gemma,
    "gemma3_text": _gemma,
    "gemma4_text": _gemma4,
    "llama4_text": _llama4,
    "deepseek_v3": _deepseek,
    "deepseek_v32": _deepseek_v32,
    "ernie4_5_moe": _ernie,
    "gpt_oss": lambda cfg: {
        "attention_bias": cfg.bias,
        "swiglu_alpha": (cfg.moe_clamped_swiglu or (None, None))[0],
        "swiglu_limit": (cfg.moe_clamped_swiglu or (None, None))[1],
    },
}


def hf_config(cfg: LMConfig, model_types: Sequence[str]) -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` as the first of ``model_types`` that reads back as ``cfg``
    exactly; a ``RequestError`` naming the settings that differ when none does."""
    differ: dict[str, list[str]] = {}
    for model_type in model_types:
        if model_type not in FAMILIES:
            continue
        config = _fields(cfg, model_type)
        try:
            read, _ = hf_model(config)
        except RequestError as e:
            differ[model_type] = [str(e)]
            continue
        diff = [
            f.name for f in dataclasses.fields(cfg) if getattr(read, f.name) != getattr(cfg, f.name)
        ]
        if not diff:
            return config
        differ[model_type] = diff
    raise RequestError(
        f"config=LMConfig(...): no config.json of {', '.join(model_types)} reads back as this "
        f"model (settings written differently: {differ}); give the model's config.json"
    )
