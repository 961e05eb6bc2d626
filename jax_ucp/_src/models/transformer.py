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

import dataclasses
import functools
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
from jax_ucp._src.models.hf_families import hf_fields


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
    # The variants Hugging Face families need (``jax_ucp._src.models.hf_families`` reads them
    # from config.json); each default keeps the Megatron / Llama math above.
    kv_channels: int | None = None  # head_dim when not hidden_size / heads (Qwen3, Gemma)
    qkv_bias: bool = False  # biases on q/k/v only (Qwen2); ``bias`` puts them everywhere
    qk_norm: bool = False  # RMSNorm of each head's q and k before RoPE (Qwen3, Gemma 3)
    qk_norm_scope: str = "head"  # "head": over head_dim; "all": over all heads at once (OLMo2)
    pre_norm: bool = True  # norms before attention and MLP (False: OLMo2's output norms only)
    residual_multiplier: float = 1.0  # attention and MLP outputs times this (Granite)
    logits_scaling: float = 1.0  # logits divided by this (Granite)
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + w): Gemma's (1 + w)
    sandwich_norm: bool = False  # norms on the attention and MLP outputs too (Gemma 2/3)
    glu_activation: str = "silu"  # the gated MLP's activation: silu, gelu_tanh or gelu
    embedding_multiplier: float = 1.0  # embeddings times this (Gemma: sqrt(hidden_size))
    attention_scale: float | None = None  # softmax scale (None: 1 / sqrt(head_dim))
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    sliding_window: int | None = None  # a query sees the last `sliding_window` keys (itself too)
    sliding_layers: tuple[int, ...] | None = None  # the windowed layers (None: all of them)
    rotary_percent: float = 1.0  # RoPE on the first int(head_dim * rotary_percent) dims
    rotary_scaling_factor: float = 1.0  # linear RoPE scaling (positions / factor)
    local_rotary_base: float | None = None  # RoPE base of the windowed layers (Gemma 3)
    local_rotary_scaling_factor: float = 1.0
    moe_ffn_hidden_size: int | None = None  # the experts' width (None: ffn_hidden_size)
    moe_norm_topk: bool = True  # top-k weights renormalised (False: softmax over all experts)
    moe_shared_expert_intermediate_size: int | None = None  # a shared expert on every token
    moe_shared_expert_gate: bool = False  # the shared expert scaled by sigmoid(x @ gate)
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model with a dense MLP
    # Llama 4: the windowed layers' window a chunk (a query sees the keys of its own chunk), the
    # NoPE layers (no RoPE; q times log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1 with
    # attn_temperature = (floor_scale, attn_scale)), q/k L2 norms (no weight) after RoPE, the
    # experts' input scaled by sigmoid(top-k router logit) instead of their output by softmax
    sliding_chunked: bool = False
    nope_layers: tuple[int, ...] = ()
    attn_temperature: tuple[float, float] | None = None
    qk_l2_norm: bool = False
    moe_sigmoid_input: bool = False
    # llama3 RoPE scaling (Llama 3.1+, Llama 4): (low_freq_factor, high_freq_factor,
    # original_max_position_embeddings) with rotary_scaling_factor; global layers only
    rotary_llama3: tuple[float, float, float] | None = None
    # yarn RoPE scaling (GPT-OSS, DeepSeek V3, Qwen long context): (beta_fast, beta_slow,
    # original_max_position_embeddings, truncate, attention factor) with rotary_scaling_factor
    rotary_yarn: tuple[float, float, float, bool, float] | None = None
    # GPT-OSS: a learned logit per head (attn/sinks) beside each query's scores in the softmax,
    # dropped after it; router and experts with biases; the experts' fc1 [gate, up] interleaved
    # and their SwiGLU clamped: (up.clip(-limit, limit) + 1) * g * sigmoid(alpha * g) with
    # g = gate.clip(max=limit), moe_clamped_swiglu = (alpha, limit)
    attention_sinks: bool = False
    moe_bias: bool = False
    moe_clamped_swiglu: tuple[float, float] | None = None
    # DeepSeek V3: multi-head latent attention, mla = (q_lora_rank (0: one q projection),
    # kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim), the RoPE dims paired
    # interleaved with rope_interleaved; moe_groups = (n_group, topk_group, routed_scaling_factor):
    # sigmoid scores plus a correction bias pick the top groups (by their 2 best), then the
    # top-k experts in them, weighted by their scores (renormalised: moe_norm_topk) times scaling
    mla: tuple[int, int, int, int, int] | None = None
    rope_interleaved: bool = False
    moe_groups: tuple[int, int, float] | None = None
    # DeepSeek V3.2's lightning indexer beside the latent attention, indexer = (index_n_heads,
    # index_head_dim, index_topk): each query attends only to its index_topk best-scored keys
    indexer: tuple[int, int, int] | None = None
    # Ernie 4.5: the top-k of softmax(router logits) + router_score_bias, weighted by their
    # softmax renormalised
    moe_score_bias: bool = False
    # Qwen3-Next / Qwen3.5: Gated DeltaNet in the ``gdn_layers`` (transformers' linear_attention),
    # gdn = (key heads, value heads, key head dim, value head dim, conv kernel); ``gdn_grouped``:
    # Qwen3-Next's in_proj_qkvz / in_proj_ba, laid out per key head; ``attn_output_gate``: the
    # full attention's q projection gives each head [q | gate], its output times sigmoid(gate)
    gdn: tuple[int, int, int, int, int] | None = None
    gdn_layers: tuple[int, ...] = ()
    gdn_grouped: bool = False
    attn_output_gate: bool = False
    # Gemma 4 (SplitAttention with split_qkv): separate q/k/v projections, a weightless v norm;
    # the global (not windowed) layers' head_dim and kv heads, their v the k projection
    # (global_kv_from_k), RoPE on the first rotary_percent of their frequencies (the rest 0:
    # rotary_proportional); the last kv_shared_layers layers attend with the k/v of the last
    # earlier layer of their type, their MLP twice as wide with wide_shared_mlp; per-layer
    # inputs (per_layer_input dims from a per_layer_vocab-row embedding and a projection of
    # the embeddings) added after each layer's MLP; each layer's output times a learned scalar;
    # the MoE block beside the dense MLP, routed from the residual (moe_beside_mlp)
    split_qkv: bool = False
    global_head_dim: int | None = None
    global_query_groups: int | None = None
    global_kv_from_k: bool = False
    rotary_proportional: bool = False
    kv_shared_layers: int = 0
    wide_shared_mlp: bool = False
    per_layer_input: int | None = None
    per_layer_vocab: int | None = None
    layer_scalar: bool = False
    moe_beside_mlp: bool = False

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def is_sliding(self, layer: int) -> bool:
        """Whether layer ``layer`` attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return self.sliding_layers is None or layer in self.sliding_layers

    def is_moe(self, layer: int) -> bool:
        return bool(self.num_experts) and layer not in self.dense_layers

    def is_linear(self, layer: int) -> bool:
        """Whether layer ``layer`` mixes tokens by Gated DeltaNet instead of attention."""
        return bool(self.gdn) and layer in self.gdn_layers

    def is_kv_shared(self, layer: int) -> bool:
        """Whether layer ``layer`` attends with an earlier layer's keys and values (Gemma 4)."""
        return layer >= self.num_layers - self.kv_shared_layers

    def parameter_count(self) -> int:
        """How many elements ``TransformerLM(self)`` holds (what a checkpoint of the model
        holds at least): the module's own shapes (``jax.eval_shape``, nothing allocated) of a
        model with one dense layer and, with experts, one MoE layer, each counted as often as
        this config has layers of its kind (dense / MoE, attention / Gated DeltaNet); Gemma 4's
        (split_qkv: layers of several kinds, the per-layer inputs' sizes times the layers) the
        whole model's shapes."""
        tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
        if self.split_qkv:
            tree = jax.eval_shape(TransformerLM(self).init, jax.random.key(0), tokens)
            return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
        # layers 0-3: dense + attention, MoE + attention, dense + Gated DeltaNet, MoE + DeltaNet
        small = dataclasses.replace(self, num_layers=4, dense_layers=(0, 2), gdn_layers=(2, 3))
        tree = jax.eval_shape(TransformerLM(small).init, jax.random.key(0), tokens)["params"]
        sizes = {k: sum(math.prod(x.shape) for x in jax.tree.leaves(v)) for k, v in tree.items()}
        layers = range(self.num_layers)
        dense = {i for i in self.dense_layers if i in layers} if self.num_experts else set(layers)
        linear = {i for i in self.gdn_layers if i in layers} if self.gdn else set()
        both = len(dense & linear)
        counts = (len(dense) - both, self.num_layers - len(dense | linear), both)
        counts = (*counts, len(linear) - both)
        return sum(sizes.pop(f"layers_{k}") * n for k, n in enumerate(counts)) + sum(sizes.values())

    @classmethod
    def from_hf_llama(cls, config: Mapping[str, Any], **overrides) -> LMConfig:
        """From a Hugging Face Llama-family ``config.json`` (LlamaForCausalLM and kin: RMSNorm,
        SwiGLU, RoPE, GQA, no biases), read as ``model_type`` llama by :meth:`from_hf`: the
        model the shipped ``hf_llama`` spec restores into."""
        return cls.from_hf({**config, "model_type": "llama"}, **overrides)

    @classmethod
    def from_hf_gpt2(cls, config: Mapping[str, Any], **overrides) -> LMConfig:
        """From a Hugging Face GPT-2 ``config.json`` (GPT2LMHeadModel: learned positions,
        LayerNorm, GELU, fused c_attn, biases, tied output), read as ``model_type`` gpt2 by
        :meth:`from_hf`: what the ``hf_gpt2`` spec targets."""
        return cls.from_hf({**config, "model_type": "gpt2"}, **overrides)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], **overrides) -> LMConfig:
        """From the ``config.json`` of any Hugging Face family ``verify --logits`` computes
        (Llama, Mistral, Qwen2, Qwen3, GPT-2, Phi-3, Gemma 2/3/4, Mixtral, Qwen2/3-MoE, Granite,
        OLMo 2/3, SmolLM3, GLM-4.5 MoE, Ernie 4.5 MoE, MiniMax M2, StableLM, GPT-OSS, DeepSeek
        V3 / V3.2, Kimi K2.5's text model: ``hf_families.FAMILIES``); a field the model does not
        compute is a ``RequestError`` naming it. :meth:`hf_spec` gives the spec its weights
        restore through."""
        cfg, _ = hf_model(config)
        return dataclasses.replace(cfg, **overrides) if overrides else cfg

    @staticmethod
    def hf_spec(config: Mapping[str, Any]) -> Spec:
        """The shipped spec mapping the family's Hugging Face names into ``TransformerLM``'s
        tree (``hf_llama``, ``hf_qwen2``, ...), with the head settings of ``config``."""
        cfg, name = hf_model(config)
        return load_spec(name, **cfg.head_settings)

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
        """From Megatron-LM argument names (as recorded in an import's manifest ``settings``);
        ``overrides`` (LMConfig's fields) give what the settings lack. Megatron-LM records
        ``padded_vocab_size`` (the embedding's rows), the tokenizer's ``vocab_size`` only when
        given: ``convert(vocab_size=)`` strips the padding and records it."""
        s = {**s, **{k: v for k, v in overrides.items() if k in _REQUIRED}}
        missing = [k for k in _REQUIRED if s.get(k) is None]
        if missing:
            padded = s.get("padded_vocab_size")
            raise RequestError(
                f"LMConfig.from_settings: the settings have no {', '.join(missing)} (recorded: "
                f"{', '.join(sorted(s)[:12]) or 'nothing: a megatron-core save without Megatron-LM args'})"
                + (
                    f"; padded_vocab_size={padded} is the embedding's rows, the tokenizer's "
                    f"vocab_size is not recorded: import with vocab_size= to strip the padding, "
                    f"or pass vocab_size={padded} for a model of the padded rows kept"
                    if "vocab_size" in missing and padded is not None
                    else ""
                )
                + "; pass them as keyword arguments (LMConfig's field names)"
            )
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


#: the settings ``LMConfig.from_settings`` cannot do without
_REQUIRED = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads")


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaling by ``(offset + scale)``, computed in float32: Gemma's ``(1 + w)`` norm
    (its weight is stored centred on 0)."""

    eps: float
    offset: float

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.zeros, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * (self.offset + scale.astype(jnp.float32))).astype(x.dtype)


def _norm_layer(cfg: LMConfig, name: str):
    # flat names (``ln_1/scale``) as the spec expects: no wrapper scope
    if cfg.normalization == "RMSNorm":
        if cfg.norm_offset:
            return OffsetRMSNorm(eps=cfg.eps, offset=cfg.norm_offset, name=name)
        return nn.RMSNorm(epsilon=cfg.eps, name=name)
    return nn.LayerNorm(epsilon=cfg.eps, use_fast_variance=False, name=name)


def apply_rope(
    x, positions, base, factor=1.0, rotary_dim=None, llama3=None, yarn=None, proportional=False
):
    """Rotary position embedding, non-interleaved (rotate-half) like megatron-core's default,
    on the first ``rotary_dim`` dims (partial rotary; the rest pass), positions divided by
    ``factor`` (linear scaling; applied to the frequencies, as transformers does); with
    ``llama3`` = (low, high, original length) only wavelengths above original / low are
    divided, those between original / high and it smoothly (transformers' llama3 RoPE); with
    ``yarn`` = (beta_fast, beta_slow, original length, truncate, attention factor) the
    frequencies below the beta_fast..beta_slow correction range are divided, those in it by a
    linear ramp, and cos / sin times the attention factor (transformers' yarn RoPE); with
    ``proportional`` the whole head rotates, its first ``rotary_dim / 2`` frequencies the
    head's, the others 0 (transformers' proportional RoPE, Gemma 4's global layers)."""
    dim = x.shape[-1] if rotary_dim is None or proportional else rotary_dim
    inverse_freq = 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if proportional and rotary_dim is not None:
        inverse_freq = jnp.where(jnp.arange(dim // 2) < rotary_dim // 2, inverse_freq, 0.0)
    attention = 1.0
    if llama3 is not None:
        low, high, original = llama3
        wavelength = 2 * math.pi / inverse_freq
        smooth = (original / wavelength - low) / (high - low)
        scaled = jnp.where(wavelength > original / low, inverse_freq / factor, inverse_freq)
        medium = (wavelength >= original / high) & (wavelength <= original / low)
        inverse_freq = jnp.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    elif yarn is not None:
        *betas, original, truncate, attention = yarn
        low, high = (
            dim * math.log(original / (b * 2 * math.pi)) / (2 * math.log(base)) for b in betas
        )
        low, high = (math.floor(low), math.ceil(high)) if truncate else (low, high)
        low, high = max(low, 0), min(high, dim - 1)
        high += 0.001 if low == high else 0
        extrapolation = 1 - jnp.clip((jnp.arange(dim // 2) - low) / (high - low), 0, 1)
        inverse_freq = inverse_freq / factor * (1 - extrapolation) + inverse_freq * extrapolation
    elif factor != 1.0:
        inverse_freq = inverse_freq / factor
    freqs = positions[:, None].astype(jnp.float32) * inverse_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], -1)
    cos, sin = (f(emb)[None, :, None, :] * attention for f in (jnp.cos, jnp.sin))
    rot, rest = x[..., :dim], x[..., dim:]
    first, second = rot[..., : dim // 2], rot[..., dim // 2 :]
    rotated = rot * cos + jnp.concatenate([-second, first], -1) * sin
    return rotated if rest.shape[-1] == 0 else jnp.concatenate([rotated, rest], -1)


def _softcap(x, cap: float | None):
    """``cap * tanh(x / cap)`` (Gemma 2's soft-capping of scores and logits)."""
    return x if cap is None else jnp.tanh(x / cap) * cap


class Attention(nn.Module):
    """Causal self-attention with a fused QKV laid out per query group (GQA when groups < heads);
    ``layer`` picks the sliding window and RoPE base of the layer (local/global layers)."""

    cfg: LMConfig
    layer: int = 0

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        batch, seq, _ = x.shape
        heads, groups, head_dim = cfg.num_attention_heads, cfg.groups, cfg.head_dim
        q_per_group = heads // groups
        bias = cfg.bias or cfg.qkv_bias
        if cfg.attn_output_gate:  # q, k, v apart: q's rows are each head's [q | gate]
            q = nn.Dense(heads * 2 * head_dim, use_bias=bias, name="q")(x)
            q, gate = jnp.split(q.reshape(batch, seq, heads, 2 * head_dim), 2, axis=-1)
            k, v = (
                nn.Dense(groups * head_dim, use_bias=bias, name=n)(x).reshape(
                    batch, seq, groups, head_dim
                )
                for n in ("k", "v")
            )
        else:
            qkv = nn.Dense(groups * (q_per_group + 2) * head_dim, use_bias=bias, name="qkv")(x)
            qkv = qkv.reshape(batch, seq, groups, (q_per_group + 2) * head_dim)
            q = qkv[..., : q_per_group * head_dim].reshape(batch, seq, heads, head_dim)
            k = qkv[..., q_per_group * head_dim : (q_per_group + 1) * head_dim]
            v = qkv[..., (q_per_group + 1) * head_dim :]
        if cfg.qk_norm and cfg.qk_norm_scope == "all":  # over all heads' q (k) at once
            q = _norm_layer(cfg, "q_norm")(q.reshape(batch, seq, -1)).reshape(q.shape)
            k = _norm_layer(cfg, "k_norm")(k.reshape(batch, seq, -1)).reshape(k.shape)
        elif cfg.qk_norm:  # over each head's head_dim, before RoPE
            q, k = _norm_layer(cfg, "q_norm")(q), _norm_layer(cfg, "k_norm")(k)
        sliding = cfg.is_sliding(self.layer)
        if cfg.position == "rope" and self.layer not in cfg.nope_layers:
            base, factor = cfg.rotary_base, cfg.rotary_scaling_factor
            scaling = (cfg.rotary_llama3, cfg.rotary_yarn)
            if sliding and cfg.local_rotary_base is not None:
                base, factor = cfg.local_rotary_base, cfg.local_rotary_scaling_factor
                scaling = (None, None)
            rotary_dim = int(head_dim * cfg.rotary_percent)
            q, k = (
                apply_rope(x, jnp.arange(seq), base, factor, rotary_dim, *scaling) for x in (q, k)
            )
            if cfg.qk_l2_norm:
                q, k = (nn.RMSNorm(cfg.eps, use_scale=False)(x) for x in (q, k))
        elif cfg.attn_temperature is not None:
            floor_scale, scale = cfg.attn_temperature
            temperature = jnp.log1p(jnp.floor((jnp.arange(seq) + 1.0) / floor_scale)) * scale + 1
            q = q * temperature[:, None, None]
        sinks = (
            self.param("sinks", nn.initializers.zeros, (heads,)) if cfg.attention_sinks else None
        )
        context = _attend(cfg, sliding, q, k, v, sinks)
        if cfg.attn_output_gate:  # per head: gate [b, s, heads, d] laid out as context
            context = context * jax.nn.sigmoid(gate.reshape(context.shape))
        return nn.Dense(cfg.hidden_size, use_bias=cfg.bias, name="proj")(context)


def _attend(cfg: LMConfig, sliding: bool, q, k, v, sinks=None):
    """Causal (``sliding``: windowed or chunked) softmax attention of q [b, s, heads, d] over the
    groups' k / v [b, s, groups, d] (each group's heads repeated), scaled and soft-capped as
    ``cfg`` says; a learned logit per head beside the scores with ``sinks``. [b, s, heads * d]."""
    (batch, seq, heads, head_dim), groups = q.shape, k.shape[2]
    k, v = (jnp.repeat(x, heads // groups, axis=2) for x in (k, v))  # each group's heads
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k)
    if cfg.attention_scale is None:
        scores = scores / math.sqrt(head_dim)
    else:
        scores = scores * cfg.attention_scale
    scores = _softcap(scores, cfg.attn_logit_softcapping)
    mask = jnp.tril(jnp.ones((seq, seq), bool))
    if sliding:  # key j is seen from query i when i - window < j <= i
        position = jnp.arange(seq)
        window = cfg.sliding_window or 0  # set: is_sliding
        if cfg.sliding_chunked:
            mask = mask & (position[None, :] // window == position[:, None] // window)
        else:
            mask = mask & (position[None, :] > position[:, None] - window)
    scores = jnp.where(mask, scores, -jnp.inf)
    if sinks is not None:
        sinks = jnp.broadcast_to(sinks[None, :, None, None], (*scores.shape[:3], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sinks], -1), axis=-1)[..., :-1]
    else:
        probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bnqk,bknd->bqnd", probs, v).reshape(batch, seq, heads * head_dim)


class SplitAttention(nn.Module):
    """Gemma 4's attention (``split_qkv``): separate q / k / v projections of the layer type's
    head_dim and kv heads (``global_head_dim``, ``global_query_groups`` on the global layers,
    whose v is the k projection with ``global_kv_from_k``), q / k RMSNorms before RoPE, a
    weightless v RMSNorm; a kv-shared layer has no k / v of its own: it takes those ``kv``
    holds for its layer type (each earlier layer stores its own there)."""

    cfg: LMConfig
    layer: int = 0

    @nn.compact
    def __call__(self, x, kv: dict):
        cfg, (batch, seq, _) = self.cfg, x.shape
        sliding = cfg.is_sliding(self.layer)
        head_dim, groups = cfg.head_dim, cfg.groups
        if not sliding:
            head_dim, groups = cfg.global_head_dim or head_dim, cfg.global_query_groups or groups

        def project(heads: int, name: str):
            y = nn.Dense(heads * head_dim, use_bias=False, name=name)(x)
            return y.reshape(batch, seq, heads, head_dim)

        if sliding:
            base = cfg.local_rotary_base or cfg.rotary_base
            factor, rotary_dim = cfg.local_rotary_scaling_factor, None
        else:
            base, factor = cfg.rotary_base, cfg.rotary_scaling_factor
            rotary_dim = int(head_dim * cfg.rotary_percent)
        proportional = cfg.rotary_proportional and not sliding

        def rope(y):
            position = jnp.arange(seq)
            return apply_rope(y, position, base, factor, rotary_dim, proportional=proportional)

        q = rope(_norm_layer(cfg, "q_norm")(project(cfg.num_attention_heads, "q")))
        if cfg.is_kv_shared(self.layer):
            k, v = kv[sliding]
        else:
            k = project(groups, "k")
            v = k if cfg.global_kv_from_k and not sliding else project(groups, "v")
            k, v = rope(_norm_layer(cfg, "k_norm")(k)), nn.RMSNorm(cfg.eps, use_scale=False)(v)
            kv[sliding] = k, v
        return nn.Dense(cfg.hidden_size, use_bias=False, name="proj")(
            _attend(cfg, sliding, q, k, v)
        )


@functools.partial(jax.jit, static_argnames="chunk")  # one compile, not one per eager op
def gated_delta_rule(q, k, v, g, beta, chunk: int = 64):
    """The gated delta rule over q, k [b, s, h, dk], v [b, s, h, dv], g, beta [b, s, h] (fp32):
    per token each head's state S [dk, dv] decays by exp(g), then learns v at k with rate beta
    (S += k (beta (v - k S))), and the output is q S. Computed as transformers'
    ``torch_chunk_gated_delta_rule`` does (chunks of 64 tokens, the updates within one solved as
    a unit lower-triangular system, the state carried over chunks by ``lax.scan``), the same sums
    in the same order: a token-by-token recurrence differs from it by 4e-5 in a tiny model."""
    s = q.shape[1]
    pad = -s % chunk

    def chunked(t):  # [b, s, h, ...] -> [n, b, h, chunk, ...]
        t = jnp.pad(t, [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2))
        t = jnp.moveaxis(t, 1, 2).reshape(*t.shape[:1], t.shape[2], -1, chunk, *t.shape[3:])
        return jnp.moveaxis(t, 2, 0)

    q, k, v, g, beta = (chunked(t) for t in (q, k, v, g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = jnp.cumsum(g, axis=-1)
    upper = jnp.triu(jnp.ones((chunk, chunk), bool), 1)
    decay = jnp.exp(jnp.where(upper, -jnp.inf, cum[..., :, None] - cum[..., None, :]))
    system = (k_beta @ jnp.swapaxes(k, -1, -2)) * decay
    intra = (q @ jnp.swapaxes(k, -1, -2)) * decay

    def solve(b):
        return jax.lax.linalg.triangular_solve(
            system, b, left_side=True, lower=True, unit_diagonal=True
        )

    values, k_decayed = solve(v_beta), solve(k_beta * jnp.exp(cum)[..., None])
    q = q * jnp.exp(cum)[..., None]
    k = k * jnp.exp(cum[..., -1:] - cum)[..., None]

    def step(state, t):  # state [b, h, dk, dv]
        q_i, k_i, values_i, k_decayed_i, intra_i, cum_i = t
        fresh = values_i - k_decayed_i @ state
        out = q_i @ state + intra_i @ fresh
        state = state * jnp.exp(cum_i[..., -1])[..., None, None] + jnp.swapaxes(k_i, -1, -2) @ fresh
        return state, out

    b, h, dk, dv = *k.shape[1:3], k.shape[-1], v.shape[-1]
    state = jnp.zeros((b, h, dk, dv), jnp.float32)
    out = jax.lax.scan(step, state, (q, k, values, k_decayed, intra, cum))[1]
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, -1, dv)[:, :, :s]  # [b, h, s, dv]
    return jnp.moveaxis(out, 1, 2)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's / Qwen3.5's linear attention (transformers' ``Qwen3NextGatedDeltaNet``): q, k,
    v through a causal depthwise conv (``conv``, kernel [K, channels]) and SiLU; q and k L2-normed
    (q times 1/sqrt(head dim)) and repeated to the value heads; per token the state S [dk, dv] of
    each value head decays by exp(g), g = -exp(A_log) * softplus(a + dt_bias), and learns v at k
    by the delta rule with rate sigmoid(b); the output q S, RMSNormed per head (``norm``) times
    silu(z), projected (``out``); the recurrence in fp32 (``gated_delta_rule``)."""

    cfg: LMConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        assert cfg.gdn is not None  # Block builds it only then
        (batch, seq, _), (nk, nv, dk, dv, width) = x.shape, cfg.gdn
        r = nv // nk

        def dense(n, name):
            return nn.Dense(n, use_bias=False, name=name)(x)

        if cfg.gdn_grouped:  # per key head: [q, k, v of its r value heads, z of them], [b, a]
            qkvz = dense(nk * (2 * dk + 2 * r * dv), "qkvz").reshape(batch, seq, nk, -1)
            q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
            b, a = jnp.split(dense(nk * 2 * r, "ba").reshape(batch, seq, nk, 2 * r), 2, -1)
            qkv = jnp.concatenate([t.reshape(batch, seq, -1) for t in (q, k, v)], -1)
        else:
            qkv, z, b, a = (
                dense(2 * nk * dk + nv * dv, "qkv"),
                dense(nv * dv, "z"),
                *(dense(nv, n) for n in ("b", "a")),
            )
        channels = qkv.shape[-1]
        kernel = self.param("conv", nn.initializers.lecun_normal(), (width, channels))
        padded = jnp.pad(qkv, ((0, 0), (width - 1, 0), (0, 0)))
        qkv = jax.nn.silu(sum(padded[:, j : j + seq] * kernel[j] for j in range(width)))
        q, k, v = jnp.split(qkv.astype(jnp.float32), [nk * dk, 2 * nk * dk], axis=-1)
        q, k = (t.reshape(batch, seq, nk, dk) for t in (q, k))
        q, k = (
            jnp.repeat(t * jax.lax.rsqrt(jnp.sum(t * t, -1, keepdims=True) + 1e-6), r, 2)
            for t in (q, k)
        )
        q = q * dk**-0.5
        v = v.reshape(batch, seq, nv, dv)
        beta = jax.nn.sigmoid(b.reshape(batch, seq, nv).astype(jnp.float32))
        a_log = self.param("A_log", nn.initializers.zeros, (nv,))
        dt_bias = self.param("dt_bias", nn.initializers.ones, (nv,))
        a = a.reshape(batch, seq, nv).astype(jnp.float32)
        g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a + dt_bias)

        out = gated_delta_rule(q, k, v, g, beta)
        out = out * jax.lax.rsqrt(jnp.mean(out * out, -1, keepdims=True) + cfg.eps)
        scale = self.param("norm", nn.initializers.ones, (dv,))
        out = (scale * out.astype(x.dtype)).astype(jnp.float32)
        out = out * jax.nn.silu(z.reshape(batch, seq, nv, dv).astype(jnp.float32))
        out = out.astype(x.dtype).reshape(batch, seq, nv * dv)
        return nn.Dense(cfg.hidden_size, use_bias=False, name="out")(out)


class LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention (transformers' ``DeepseekV3Attention``): q through
    a rank-``q_lora_rank`` projection and RMSNorm (``q_a``, ``q_norm``, ``q_b``; or one ``q``),
    each head's [nope | rope] dims; keys and values from one normed rank-``kv_lora_rank``
    latent (``kv_a`` -> ``kv_norm`` -> ``kv_b``: each head's [k nope | v]) and one RoPE key
    shared by all heads (``kv_a``'s last ``qk_rope_head_dim`` outputs). The low-rank norms take
    eps 1e-6 whatever ``cfg.eps`` is, as transformers builds them."""

    cfg: LMConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        assert cfg.mla is not None  # Block builds it only then
        (batch, seq, _), heads = x.shape, cfg.num_attention_heads
        q_rank, kv_rank, nope, rope, v_dim = cfg.mla
        x_q = x
        if q_rank:
            x_q = nn.RMSNorm(1e-6, name="q_norm")(nn.Dense(q_rank, use_bias=False, name="q_a")(x))
        q = nn.Dense(heads * (nope + rope), use_bias=False, name="q_b" if q_rank else "q")(x_q)
        q = q.reshape(batch, seq, heads, nope + rope)
        latent = nn.Dense(kv_rank + rope, use_bias=False, name="kv_a")(x)
        kv = nn.Dense(heads * (nope + v_dim), use_bias=False, name="kv_b")(
            nn.RMSNorm(1e-6, name="kv_norm")(latent[..., :kv_rank])
        ).reshape(batch, seq, heads, nope + v_dim)
        q_rot, k_rot = q[..., nope:], latent[..., None, kv_rank:]
        if cfg.rope_interleaved:  # pairs (x0, x1), (x2, x3), ...: the same rotation de-interleaved
            q_rot, k_rot = (
                jnp.concatenate([r[..., 0::2], r[..., 1::2]], -1) for r in (q_rot, k_rot)
            )
        scaling = (cfg.rotary_scaling_factor, None, cfg.rotary_llama3, cfg.rotary_yarn)
        q_rot, k_rot = (
            apply_rope(r, jnp.arange(seq), cfg.rotary_base, *scaling) for r in (q_rot, k_rot)
        )
        q = jnp.concatenate([q[..., :nope], q_rot], -1)
        k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_rot, (*kv.shape[:3], rope))], -1)
        scores = jnp.einsum("bqnd,bknd->bnqk", q, k) * (
            cfg.attention_scale or (nope + rope) ** -0.5
        )
        mask = jnp.tril(jnp.ones((seq, seq), bool))
        if cfg.indexer:  # DeepSeek V3.2 (its reader requires q_lora_rank)
            mask = Indexer(cfg, name="indexer")(x, x_q)[:, None]
        scores = jnp.where(mask, scores, -jnp.inf)
        context = jnp.einsum("bnqk,bknd->bqnd", jax.nn.softmax(scores, axis=-1), kv[..., nope:])
        return nn.Dense(cfg.hidden_size, use_bias=False, name="proj")(
            context.reshape(batch, seq, heads * v_dim)
        )


class Indexer(nn.Module):
    """DeepSeek V3.2's lightning indexer (transformers' ``DeepseekV32Indexer``): the keys each
    query attends to, its ``index_topk`` causal keys of highest score sum_h w_h relu(q_h . k /
    sqrt(D)) / sqrt(H); q_h from the q latent (``q``), one key per token (``k`` then LayerNorm
    ``k_norm``), both with rotate-half RoPE on their first ``qk_rope_head_dim`` dims, the weights
    w from x (``weights``). A selection [b, q, k], so no gradient flows through it (transformers
    trains the indexer apart)."""

    cfg: LMConfig

    @nn.compact
    def __call__(self, x, x_q):
        cfg = self.cfg
        assert cfg.indexer is not None and cfg.mla is not None  # LatentAttention builds it then
        (heads, dim, top), (batch, seq, _) = cfg.indexer, x.shape
        q = nn.Dense(heads * dim, use_bias=False, name="q")(x_q).reshape(batch, seq, heads, dim)
        k = nn.Dense(dim, use_bias=False, name="k")(x)
        k = nn.LayerNorm(1e-6, use_fast_variance=False, name="k_norm")(k)[:, :, None]
        scaling = (cfg.rotary_scaling_factor, cfg.mla[3], cfg.rotary_llama3, cfg.rotary_yarn)
        q, k = (apply_rope(r, jnp.arange(seq), cfg.rotary_base, *scaling) for r in (q, k))
        scores = jax.nn.relu(jnp.einsum("bqhd,bkd->bqhk", q, k[:, :, 0]) * dim**-0.5)
        weights = nn.Dense(heads, use_bias=False, name="weights")(x) * heads**-0.5
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        index = jnp.where(causal, jnp.einsum("bqh,bqhk->bqk", weights, scores), -jnp.inf)
        chosen = jax.lax.top_k(jax.lax.stop_gradient(index), min(top, seq))[1]
        picked = jax.vmap(jax.vmap(lambda i: jnp.zeros(seq, bool).at[i].set(True)))(chosen)
        return picked & causal


#: the gated MLP's activations (``LMConfig.glu_activation``)
GLU_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


def _activation(cfg: LMConfig, hidden):
    """GLU (``act(gate) * up`` over [gate | up], SwiGLU by default) when gated, GELU otherwise."""
    if cfg.moe_clamped_swiglu:  # GPT-OSS's experts (it has no dense MLP): interleaved
        alpha, limit = cfg.moe_clamped_swiglu
        gate = jnp.minimum(hidden[..., ::2], limit)
        return (
            (jnp.clip(hidden[..., 1::2], -limit, limit) + 1) * gate * jax.nn.sigmoid(alpha * gate)
        )
    if cfg.gated:
        gate, up = jnp.split(hidden, 2, axis=-1)
        if cfg.glu_activation not in GLU_ACTIVATIONS:
            raise RequestError(
                f"glu_activation {cfg.glu_activation!r}: expected one of {sorted(GLU_ACTIVATIONS)}"
            )
        return GLU_ACTIVATIONS[cfg.glu_activation](gate) * up
    return jax.nn.gelu(hidden, approximate=cfg.gelu_tanh)


class MLP(nn.Module):
    """fc1 -> activation -> fc2; fc1 is [gate | up] when gated (``width``: the hidden width,
    None: ``ffn_hidden_size``; a shared expert's differs)."""

    cfg: LMConfig
    width: int | None = None
    bias: bool | None = None

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        bias = cfg.bias if self.bias is None else self.bias
        width = (self.width or cfg.ffn_hidden_size) * (2 if cfg.gated else 1)
        hidden = nn.Dense(width, use_bias=bias, name="fc1")(x)
        return nn.Dense(cfg.hidden_size, use_bias=bias, name="fc2")(_activation(cfg, hidden))


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
    [E, ffn, h] (the shipped ``mixtral`` spec's targets). ``moe_norm_topk=False`` weighs by the
    softmax over all experts (Qwen2-MoE); ``moe_groups`` routes as DeepSeek V3 (sigmoid scores,
    ``router_score_bias``, top groups); a shared expert (``shared/{fc1,fc2}``, gated by
    ``sigmoid(x @ shared_gate)``) is added on every token. Gemma 4's (``moe_beside_mlp``) routes
    ``routed`` (the residual) weightless-normed times ``router_scale`` / sqrt(hidden), its
    top-k weights times ``expert_scale``."""

    cfg: LMConfig

    @nn.compact
    def __call__(self, x, routed=None):
        cfg = self.cfg
        experts, hidden_size = cfg.num_experts, cfg.hidden_size
        ffn = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
        assert experts is not None  # Block builds an MoE only when num_experts is set
        routed = x if routed is None else routed
        if cfg.moe_beside_mlp:
            scale = self.param("router_scale", nn.initializers.ones, (hidden_size,))
            routed = nn.RMSNorm(cfg.eps, use_scale=False)(routed) * scale * hidden_size**-0.5
        logits = nn.Dense(experts, use_bias=cfg.moe_bias, name="router")(routed)
        top, index = jax.lax.top_k(logits, cfg.moe_router_topk)
        if cfg.moe_groups:  # DeepSeek V3
            groups, top_groups, scaling = cfg.moe_groups
            scores = jax.nn.sigmoid(logits)
            bias = self.param("router_score_bias", nn.initializers.zeros, (experts,))
            choice = (scores + bias).reshape(*x.shape[:2], groups, experts // groups)
            best = jnp.sum(jax.lax.top_k(choice, 2)[0], axis=-1)  # [b, s, groups]
            chosen = jnp.sum(jax.nn.one_hot(jax.lax.top_k(best, top_groups)[1], groups), -2)
            choice = jnp.where(chosen[..., None] > 0, choice, -jnp.inf).reshape(logits.shape)
            index = jax.lax.top_k(choice, cfg.moe_router_topk)[1]
            probs = jnp.take_along_axis(scores, index, axis=-1)
            if cfg.moe_norm_topk:
                probs = probs / (jnp.sum(probs, axis=-1, keepdims=True) + 1e-20)
            probs = probs * scaling
        elif cfg.moe_score_bias:  # Ernie 4.5
            scores = jax.nn.softmax(logits, axis=-1)
            bias = self.param("router_score_bias", nn.initializers.zeros, (experts,))
            index = jax.lax.top_k(scores + bias, cfg.moe_router_topk)[1]
            probs = jnp.take_along_axis(scores, index, axis=-1)
            probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
        elif cfg.moe_sigmoid_input:
            probs = jax.nn.sigmoid(top)
        elif cfg.moe_norm_topk:
            probs = jax.nn.softmax(top, axis=-1)
        else:
            probs = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), index, axis=-1)
        if cfg.moe_beside_mlp:
            probs = probs * self.param("expert_scale", nn.initializers.ones, (experts,))[index]
        picked = jax.nn.one_hot(index, experts, dtype=x.dtype)  # [b, s, k, E]
        weights = jnp.sum(probs[..., None] * picked, axis=-2)  # [b, s, E]
        fc1 = _StackedKernel((experts, hidden_size, ffn * (2 if cfg.gated else 1)), name="fc1")()
        fc2 = _StackedKernel((experts, ffn, hidden_size), name="fc2")()
        if cfg.moe_sigmoid_input:  # the chosen experts compute on x * weight_e, summed
            hidden = jnp.einsum("bse,bsh,ehx->bsex", weights, x, fc1)
            weights = jnp.sum(picked, axis=-2)
        else:
            hidden = jnp.einsum("bsh,ehx->bsex", x, fc1)
        if cfg.moe_bias:  # GPT-OSS: each expert's fc1 and fc2 biases [E, 2F], [E, H]
            hidden = hidden + self.param("fc1_bias", nn.initializers.zeros, fc1.shape[::2])
        y = jnp.einsum("bsef,efh->bseh", _activation(cfg, hidden), fc2)
        if cfg.moe_bias:
            y = y + self.param("fc2_bias", nn.initializers.zeros, fc2.shape[::2])
        out = jnp.einsum("bse,bseh->bsh", weights, y)
        if cfg.moe_shared_expert_intermediate_size:
            shared = MLP(cfg, cfg.moe_shared_expert_intermediate_size, False, name="shared")(x)
            if cfg.moe_shared_expert_gate:
                gate = nn.Dense(1, use_bias=False, name="shared_gate")(x)
                shared = jax.nn.sigmoid(gate) * shared
            out = out + shared
        return out


class Block(nn.Module):
    """Pre-norm residual layer: attention, then the MLP (or MoE); with ``sandwich_norm`` the
    attention's and the MLP's outputs are normed too (``attn_out_norm``, ``mlp_out_norm``),
    without ``pre_norm`` only they are. Gemma 4's: the MoE beside the MLP (each output normed,
    ``dense_out_norm`` / ``moe_out_norm``, the experts' input by ``moe_in_norm``), then the
    layer's per-layer input ``ple`` gated in, the output times ``layer_scalar``."""

    cfg: LMConfig
    layer: int = 0

    @nn.compact
    def __call__(self, x, ple=None, kv: dict | None = None):
        cfg = self.cfg

        def sublayer(module, x, pre: str, post: str):
            h = module(_norm_layer(cfg, pre)(x) if cfg.pre_norm else x)
            if cfg.sandwich_norm:
                h = _norm_layer(cfg, post)(h)
            if cfg.residual_multiplier != 1.0:
                h = h * cfg.residual_multiplier
            return x + h

        if cfg.split_qkv:
            kv = {} if kv is None else kv
            attn = functools.partial(SplitAttention(cfg, self.layer, name="attn"), kv=kv)
        elif cfg.is_linear(self.layer):
            attn = GatedDeltaNet(cfg, name="linear_attn")
        elif cfg.mla:
            attn = LatentAttention(cfg, name="attn")
        else:
            attn = Attention(cfg, self.layer, name="attn")
        x = sublayer(attn, x, "ln_1", "attn_out_norm")
        wide = cfg.wide_shared_mlp and cfg.is_kv_shared(self.layer)
        width = 2 * cfg.ffn_hidden_size if wide else None

        def beside(h):  # Gemma 4: the MoE beside the MLP, routed from the residual x
            moe = MoE(cfg, name="moe")(_norm_layer(cfg, "moe_in_norm")(x), routed=x)
            dense = _norm_layer(cfg, "dense_out_norm")(MLP(cfg, width, name="mlp")(h))
            return dense + _norm_layer(cfg, "moe_out_norm")(moe)

        moe = cfg.is_moe(self.layer)
        ffn = (
            beside
            if moe and cfg.moe_beside_mlp
            else (MoE(cfg, name="moe") if moe else MLP(cfg, width, name="mlp"))
        )
        x = sublayer(ffn, x, "ln_2", "mlp_out_norm")
        if cfg.per_layer_input:
            h = nn.Dense(cfg.per_layer_input, use_bias=False, name="ple_gate")(x)
            h = GLU_ACTIVATIONS[cfg.glu_activation](h) * ple
            h = nn.Dense(cfg.hidden_size, use_bias=False, name="ple_proj")(h)
            x = x + _norm_layer(cfg, "ple_norm")(h)
        if cfg.layer_scalar:
            x = x * self.param("layer_scalar", nn.initializers.ones, (1,))
        return x


class TransformerLM(nn.Module):
    """tokens [b, s] int -> logits [b, s, vocab_size]."""

    cfg: LMConfig

    @nn.compact
    def __call__(self, tokens):
        cfg = self.cfg
        wte = nn.Embed(cfg.vocab_size, cfg.hidden_size, name="wte")
        x = wte(tokens)
        if cfg.embedding_multiplier != 1.0:
            x = x * jnp.asarray(cfg.embedding_multiplier, x.dtype)
        if cfg.position == "learned_absolute":
            wpe = nn.Embed(cfg.max_position_embeddings, cfg.hidden_size, name="wpe")
            x = x + wpe(jnp.arange(tokens.shape[1]))[None]
        ple = self.per_layer_inputs(tokens, x) if cfg.per_layer_input else None
        kv: dict = {}  # Gemma 4's keys and values by layer type, for the kv-shared layers
        for i in range(cfg.num_layers):
            x = Block(cfg, i, name=f"layers_{i}")(x, None if ple is None else ple[:, :, i], kv)
        x = _norm_layer(cfg, "ln_f")(x)
        if cfg.tied:
            logits = wte.attend(x)
        else:
            logits = nn.Dense(cfg.vocab_size, use_bias=False, name="lm_head")(x)
        if cfg.logits_scaling != 1.0:
            logits = logits / cfg.logits_scaling
        return _softcap(logits, cfg.final_logit_softcapping)

    def per_layer_inputs(self, tokens, x):
        """Gemma 4's per-layer inputs [b, s, layers, per_layer_input]: the tokens' rows of
        ``ple_embed`` times sqrt(per_layer_input) plus the embeddings ``x`` through
        ``ple_model_proj`` / sqrt(hidden) normed (``ple_proj_norm``), over sqrt(2)."""
        cfg = self.cfg
        width, shape = cfg.per_layer_input or 0, (*tokens.shape, cfg.num_layers, -1)
        embed = nn.Embed(
            cfg.per_layer_vocab or cfg.vocab_size, cfg.num_layers * width, name="ple_embed"
        )
        token = embed(tokens).reshape(shape) * jnp.asarray(width**0.5, x.dtype)
        proj = nn.Dense(cfg.num_layers * width, use_bias=False, name="ple_model_proj")(x)
        proj = _norm_layer(cfg, "ple_proj_norm")((proj * cfg.hidden_size**-0.5).reshape(shape))
        return (proj + token) * 2**-0.5


def hf_model(config: Mapping[str, Any]) -> tuple[LMConfig, str]:
    """The ``LMConfig`` of a Hugging Face ``config.json`` and the shipped spec mapping its
    tensors (``hf_families.hf_fields``: a family not in its table or a field it does not
    compute is refused, a ``RequestError`` naming the field and value)."""
    fields, spec = hf_fields(config)
    return LMConfig(**fields), spec


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
