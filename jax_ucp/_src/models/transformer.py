"""A small decoder-only transformer in flax (linen) matching Megatron's GPT / Llama math.

Megatron definitions it follows (megatron-core 0.16): pre-norm residual ``TransformerLayer``;
``SelfAttention`` with fused ``linear_qkv`` laid out per query group as [the group's q heads,
k, v] (so GQA is ``num_query_groups < num_attention_heads``); causal softmax(q k^T / sqrt(d));
RoPE non-interleaved (rotate-half, ``rotary_base`` 10000); ``MLP`` with ``linear_fc1`` =
[gate; up] and ``silu(gate) * up`` when gated, exact-erf GELU otherwise; final norm; output
layer tied to the word embedding or separate.

``from_megatron`` maps imported Megatron parameters into this model's tree with the restore rules
of the shipped UCP-language specs (``jax_ucp/_src/language/specs``): the name mapping is written once,
in the specs, for both this numpy route and ``jax_ucp.restore(path, spec=...)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax_ucp._src.errors import RequestError
from jax_ucp._src.language import Spec, apply_spec_to_tree, load_spec


@dataclass(frozen=True)
class LMConfig:
    """The hyper-parameters of ``TransformerLM`` (Megatron-LM's names where they exist)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    ffn_hidden_size: int
    num_query_groups: int | None = None
    normalization: str = "LayerNorm"  # or "RMSNorm"
    gated: bool = False  # SwiGLU
    bias: bool = True  # add_bias_linear
    position: str = "learned_absolute"  # or "rope"
    max_position_embeddings: int = 2048
    rotary_base: float = 10000.0
    eps: float = 1e-5
    tied: bool = False
    num_experts: int | None = None  # MoE (every layer): router + SwiGLU/GELU experts
    gelu_tanh: bool = False  # GELU's tanh approximation (GPT-2's "gelu_new") instead of erf
    moe_router_topk: int = 2

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_llama(cls, config: Mapping[str, Any], **overrides) -> LMConfig:
        """From a Hugging Face Llama-family ``config.json`` (LlamaForCausalLM and kin: RMSNorm,
        SwiGLU, RoPE, GQA, no biases): the model the shipped ``hf_llama`` spec restores into."""
        act = config.get("hidden_act", "silu")
        if act != "silu" or config.get("attention_bias") or config.get("mlp_bias"):
            raise RequestError(
                f"config.json: hidden_act {act!r}, attention_bias "
                f"{config.get('attention_bias')}, mlp_bias {config.get('mlp_bias')}: only "
                "silu without biases is a Llama-family model TransformerLM computes"
            )
        if config.get("rope_scaling"):
            raise RequestError(
                f"config.json: rope_scaling {config['rope_scaling']} is not supported"
            )
        rope = config.get("rope_parameters")  # transformers 5 writes RoPE's settings there
        rope = rope if isinstance(rope, Mapping) else {}
        if rope.get("rope_type", "default") != "default":
            raise RequestError(
                f"config.json: rope_parameters {dict(rope)}: only the default RoPE is supported"
            )
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        if int(config.get("head_dim") or hidden // heads) != hidden // heads:
            raise RequestError("config.json: head_dim other than hidden_size / heads")
        kw: dict[str, Any] = dict(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            ffn_hidden_size=int(config["intermediate_size"]),
            num_query_groups=int(config.get("num_key_value_heads") or heads),
            normalization="RMSNorm",
            gated=True,
            bias=False,
            position="rope",
            max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
            rotary_base=float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0),
            eps=float(config.get("rms_norm_eps") or 1e-6),
            tied=bool(config.get("tie_word_embeddings", False)),
        )
        return cls(**kw | overrides)

    @classmethod
    def from_hf_gpt2(cls, config: Mapping[str, Any], **overrides) -> LMConfig:
        """From a Hugging Face GPT-2 ``config.json`` (GPT2LMHeadModel: learned positions,
        LayerNorm, GELU, fused c_attn, biases, tied output): what the ``hf_gpt2`` spec targets."""
        act = config.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
            raise RequestError(f"config.json: activation_function {act!r} is not a GELU")
        hidden = int(config.get("n_embd") or config["hidden_size"])
        kw: dict[str, Any] = dict(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(config.get("n_layer") or config["num_hidden_layers"]),
            num_attention_heads=int(config.get("n_head") or config["num_attention_heads"]),
            ffn_hidden_size=int(config.get("n_inner") or 4 * hidden),
            normalization="LayerNorm",
            gated=False,
            bias=True,
            position="learned_absolute",
            max_position_embeddings=int(config.get("n_positions") or 1024),
            eps=float(config.get("layer_norm_epsilon") or 1e-5),
            tied=bool(config.get("tie_word_embeddings", True)),
            gelu_tanh=act != "gelu",
        )
        return cls(**kw | overrides)

    @property
    def head_settings(self) -> dict[str, int]:
        """What the q/k/v ops of the shipped specs need (``load_spec(name, **head_settings)``)."""
        return {
            "num_attention_heads": self.num_attention_heads,
            "num_query_groups": self.groups,
            "head_dim": self.head_dim,
        }

    @classmethod
    def from_settings(cls, s: Mapping[str, Any], **overrides) -> LMConfig:
        """From Megatron-LM argument names (as recorded in an import's manifest ``settings``)."""
        gated = bool(s.get("swiglu") or s.get("gated_linear_unit"))
        kw: dict[str, Any] = dict(
            vocab_size=int(s["vocab_size"]),
            hidden_size=int(s["hidden_size"]),
            num_layers=int(s["num_layers"]),
            num_attention_heads=int(s["num_attention_heads"]),
            ffn_hidden_size=int(s.get("ffn_hidden_size") or 4 * int(s["hidden_size"])),
            num_query_groups=int(s["num_query_groups"]) if s.get("num_query_groups") else None,
            normalization=s.get("normalization", "LayerNorm"),
            gated=gated,
            bias=bool(s.get("add_bias_linear", not gated)),
            position=s.get("position_embedding_type", "learned_absolute"),
            tied=not s.get("untie_embeddings_and_output_weights", False),
            max_position_embeddings=int(s.get("max_position_embeddings") or 2048),
            num_experts=int(s["num_experts"]) if s.get("num_experts") else None,
            moe_router_topk=int(s.get("moe_router_topk") or 2),
        )
        return cls(**kw | overrides)


def _norm_layer(cfg: LMConfig, name: str):
    # flat names (``ln_1/scale``) as the spec expects: no wrapper scope
    if cfg.normalization == "RMSNorm":
        return nn.RMSNorm(epsilon=cfg.eps, name=name)
    return nn.LayerNorm(epsilon=cfg.eps, use_fast_variance=False, name=name)


def _apply_rope(x, positions, base):
    """Rotary position embedding, non-interleaved (rotate-half) like megatron-core's default."""
    dim = x.shape[-1]
    inverse_freq = 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    freqs = positions[:, None].astype(jnp.float32) * inverse_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], -1)
    cos, sin = jnp.cos(emb)[None, :, None, :], jnp.sin(emb)[None, :, None, :]
    first, second = x[..., : dim // 2], x[..., dim // 2 :]
    return x * cos + jnp.concatenate([-second, first], -1) * sin


class Attention(nn.Module):
    """Causal self-attention with a fused QKV laid out per query group (GQA when groups < heads)."""

    cfg: LMConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        batch, seq, _ = x.shape
        heads, groups, head_dim = cfg.num_attention_heads, cfg.groups, cfg.head_dim
        q_per_group = heads // groups
        qkv = nn.Dense(groups * (q_per_group + 2) * head_dim, use_bias=cfg.bias, name="qkv")(x)
        qkv = qkv.reshape(batch, seq, groups, (q_per_group + 2) * head_dim)
        q = qkv[..., : q_per_group * head_dim].reshape(batch, seq, heads, head_dim)
        k = qkv[..., q_per_group * head_dim : (q_per_group + 1) * head_dim]
        v = qkv[..., (q_per_group + 1) * head_dim :]
        if cfg.position == "rope":
            q, k = (_apply_rope(x, jnp.arange(seq), cfg.rotary_base) for x in (q, k))
        k, v = (jnp.repeat(x, q_per_group, axis=2) for x in (k, v))  # each group's heads
        scores = jnp.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(head_dim)
        mask = jnp.tril(jnp.ones((seq, seq), bool))
        scores = jnp.where(mask, scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        context = jnp.einsum("bnqk,bknd->bqnd", probs, v).reshape(batch, seq, heads * head_dim)
        return nn.Dense(cfg.hidden_size, use_bias=cfg.bias, name="proj")(context)


def _activation(cfg: LMConfig, hidden):
    """SwiGLU (``silu(gate) * up`` over [gate | up]) when gated, exact-erf GELU otherwise."""
    if cfg.gated:
        gate, up = jnp.split(hidden, 2, axis=-1)
        return jax.nn.silu(gate) * up
    return jax.nn.gelu(hidden, approximate=cfg.gelu_tanh)


class MLP(nn.Module):
    """fc1 -> activation -> fc2; fc1 is [gate | up] when gated."""

    cfg: LMConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        width = cfg.ffn_hidden_size * (2 if cfg.gated else 1)
        hidden = nn.Dense(width, use_bias=cfg.bias, name="fc1")(x)
        return nn.Dense(cfg.hidden_size, use_bias=cfg.bias, name="fc2")(_activation(cfg, hidden))


class _StackedKernel(nn.Module):
    """A bare ``kernel`` parameter (the experts' kernels stacked on a leading axis)."""

    shape: tuple

    @nn.compact
    def __call__(self):
        return self.param("kernel", nn.initializers.lecun_normal(batch_axis=(0,)), self.shape)


class MoE(nn.Module):
    """megatron-core TopKRouter (softmax over the top-k router logits) + experts.

    Every expert is evaluated densely (fine for small models; the math is what matters here):
    ``y = sum_k p_k * expert_{i_k}(x)``. Kernels are stacked over experts: fc1 [E, h, X], fc2
    [E, ffn, h] (the shipped ``mixtral`` spec's targets)."""

    cfg: LMConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        experts, hidden_size, ffn = cfg.num_experts, cfg.hidden_size, cfg.ffn_hidden_size
        assert experts is not None  # Block builds an MoE only when num_experts is set
        logits = nn.Dense(experts, use_bias=False, name="router")(x)
        top, index = jax.lax.top_k(logits, cfg.moe_router_topk)
        probs = jax.nn.softmax(top, axis=-1)
        weights = jnp.sum(
            probs[..., None] * jax.nn.one_hot(index, experts, dtype=x.dtype), axis=-2
        )  # [b, s, E]
        fc1 = _StackedKernel((experts, hidden_size, ffn * (2 if cfg.gated else 1)), name="fc1")()
        fc2 = _StackedKernel((experts, ffn, hidden_size), name="fc2")()
        hidden = _activation(cfg, jnp.einsum("bsh,ehx->bsex", x, fc1))
        y = jnp.einsum("bsef,efh->bseh", hidden, fc2)
        return jnp.einsum("bse,bseh->bsh", weights, y)


class Block(nn.Module):
    """Pre-norm residual layer: attention, then the MLP (or MoE)."""

    cfg: LMConfig

    @nn.compact
    def __call__(self, x):
        x = x + Attention(self.cfg, name="attn")(_norm_layer(self.cfg, "ln_1")(x))
        ffn = MoE(self.cfg, name="moe") if self.cfg.num_experts else MLP(self.cfg, name="mlp")
        return x + ffn(_norm_layer(self.cfg, "ln_2")(x))


class TransformerLM(nn.Module):
    """tokens [b, s] int -> logits [b, s, vocab_size]."""

    cfg: LMConfig

    @nn.compact
    def __call__(self, tokens):
        cfg = self.cfg
        wte = nn.Embed(cfg.vocab_size, cfg.hidden_size, name="wte")
        x = wte(tokens)
        if cfg.position == "learned_absolute":
            wpe = nn.Embed(cfg.max_position_embeddings, cfg.hidden_size, name="wpe")
            x = x + wpe(jnp.arange(tokens.shape[1]))[None]
        for i in range(cfg.num_layers):
            x = Block(cfg, name=f"layers_{i}")(x)
        x = _norm_layer(cfg, "ln_f")(x)
        if cfg.tied:
            return wte.attend(x)
        return nn.Dense(cfg.vocab_size, use_bias=False, name="lm_head")(x)


def shipped_spec_for(cfg: LMConfig, names: Iterable[str]) -> Spec:
    """The shipped spec whose restore rules map these Megatron parameter names into the tree of
    ``TransformerLM(cfg)``: ``megatron_lm_gpt`` for Megatron-LM's older ``language_model.*``
    names, else ``mixtral`` for MoE, ``llama`` for RMSNorm models, ``megatron_gpt`` otherwise."""
    settings = dict(
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.groups,
    )
    if any(name.startswith("language_model.") for name in names):
        return load_spec("megatron_lm_gpt", swiglu=cfg.gated, **settings)
    if cfg.num_experts:
        return load_spec("mixtral", num_experts=cfg.num_experts, **settings)
    return load_spec("llama" if cfg.normalization == "RMSNorm" else "megatron_gpt", **settings)


def from_megatron(params: Mapping[str, np.ndarray], cfg: LMConfig) -> dict:
    """Raw imported Megatron params (torch layout; stacked or per-layer names) -> flax params
    ``{"params": tree}``, through the restore rules of ``shipped_spec_for(cfg, names)``: torch
    ``[out, in]`` -> flax ``[in, out]``, stacked ``[L, ...]`` unstacked, per-expert, stacked and
    grouped-GEMM experts stacked ``[E, ...]``.

    Strict: a source tensor no rule covers (or a required tensor missing) is a
    ``jax_ucp.LanguageError`` naming it."""
    arrays = {name: np.asarray(array) for name, array in params.items()}
    spec = shipped_spec_for(cfg, arrays)
    return {"params": apply_spec_to_tree(spec, {"params": arrays})["params"]}
