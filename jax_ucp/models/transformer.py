"""A small decoder-only transformer in flax (linen) matching Megatron's GPT / Llama math.

Megatron definitions it follows (megatron-core 0.16): pre-norm residual ``TransformerLayer``;
``SelfAttention`` with fused ``linear_qkv`` laid out per query group as [the group's q heads,
k, v] (so GQA is ``num_query_groups < num_attention_heads``); causal softmax(q k^T / sqrt(d));
RoPE non-interleaved (rotate-half, ``rotary_base`` 10000); ``MLP`` with ``linear_fc1`` =
[gate; up] and ``silu(gate) * up`` when gated, exact-erf GELU otherwise; final norm; output
layer tied to the word embedding or separate.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class LMConfig:
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
    moe_router_topk: int = 2

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_settings(cls, s: Mapping[str, Any], **overrides) -> LMConfig:
        """From Megatron-LM argument names (as recorded in an import's manifest ``settings``)."""
        gated = bool(s.get("swiglu") or s.get("gated_linear_unit"))
        kw = dict(
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
        kw.update(overrides)
        return cls(**kw)


def _norm(cfg: LMConfig, name: str):
    # flat names (``ln_1/scale``) as the spec expects: no wrapper scope
    if cfg.normalization == "RMSNorm":
        return nn.RMSNorm(epsilon=cfg.eps, name=name)
    return nn.LayerNorm(epsilon=cfg.eps, use_fast_variance=False, name=name)


def _rope(x, positions, base):
    d = x.shape[-1]
    inv = 1.0 / (base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    fr = positions[:, None].astype(jnp.float32) * inv[None, :]
    emb = jnp.concatenate([fr, fr], -1)
    cos, sin = jnp.cos(emb)[None, :, None, :], jnp.sin(emb)[None, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + jnp.concatenate([-x2, x1], -1) * sin


class Attention(nn.Module):
    cfg: LMConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        b, s, _ = x.shape
        nh, ng, d = c.num_attention_heads, c.groups, c.head_dim
        qpg = nh // ng
        qkv = nn.Dense(ng * (qpg + 2) * d, use_bias=c.bias, name="qkv")(x)
        qkv = qkv.reshape(b, s, ng, (qpg + 2) * d)
        q = qkv[..., : qpg * d].reshape(b, s, nh, d)
        k = qkv[..., qpg * d : (qpg + 1) * d]
        v = qkv[..., (qpg + 1) * d :]
        if c.position == "rope":
            pos = jnp.arange(s)
            q, k = _rope(q, pos, c.rotary_base), _rope(k, pos, c.rotary_base)
        k = jnp.repeat(k, qpg, axis=2)
        v = jnp.repeat(v, qpg, axis=2)
        sc = jnp.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(d)
        mask = jnp.tril(jnp.ones((s, s), bool))
        sc = jnp.where(mask, sc, -jnp.inf)
        p = jax.nn.softmax(sc, axis=-1)
        ctx = jnp.einsum("bnqk,bknd->bqnd", p, v).reshape(b, s, nh * d)
        return nn.Dense(c.hidden_size, use_bias=c.bias, name="proj")(ctx)


class MLP(nn.Module):
    cfg: LMConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        z = nn.Dense(c.ffn_hidden_size * (2 if c.gated else 1), use_bias=c.bias, name="fc1")(x)
        if c.gated:
            a, u = jnp.split(z, 2, axis=-1)
            z = jax.nn.silu(a) * u
        else:
            z = jax.nn.gelu(z, approximate=False)
        return nn.Dense(c.hidden_size, use_bias=c.bias, name="fc2")(z)


class _Kernel(nn.Module):
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
        c = self.cfg
        E, h, f = c.num_experts, c.hidden_size, c.ffn_hidden_size
        logits = nn.Dense(E, use_bias=False, name="router")(x)
        top, idx = jax.lax.top_k(logits, c.moe_router_topk)
        probs = jax.nn.softmax(top, axis=-1)
        w = jnp.sum(probs[..., None] * jax.nn.one_hot(idx, E, dtype=x.dtype), axis=-2)  # [b, s, E]
        fc1 = _Kernel((E, h, f * (2 if c.gated else 1)), name="fc1")()
        fc2 = _Kernel((E, f, h), name="fc2")()
        z = jnp.einsum("bsh,ehx->bsex", x, fc1)
        if c.gated:
            a, u = jnp.split(z, 2, axis=-1)
            z = jax.nn.silu(a) * u
        else:
            z = jax.nn.gelu(z, approximate=False)
        y = jnp.einsum("bsef,efh->bseh", z, fc2)
        return jnp.einsum("bse,bseh->bsh", w, y)


class Block(nn.Module):
    cfg: LMConfig

    @nn.compact
    def __call__(self, x):
        x = x + Attention(self.cfg, name="attn")(_norm(self.cfg, "ln_1")(x))
        if self.cfg.num_experts:
            return x + MoE(self.cfg, name="moe")(_norm(self.cfg, "ln_2")(x))
        return x + MLP(self.cfg, name="mlp")(_norm(self.cfg, "ln_2")(x))


class TransformerLM(nn.Module):
    """tokens [b, s] int -> logits [b, s, vocab_size]."""

    cfg: LMConfig

    @nn.compact
    def __call__(self, tokens):
        c = self.cfg
        wte = nn.Embed(c.vocab_size, c.hidden_size, name="wte")
        x = wte(tokens)
        if c.position == "learned_absolute":
            x = (
                x
                + nn.Embed(c.max_position_embeddings, c.hidden_size, name="wpe")(
                    jnp.arange(tokens.shape[1])
                )[None]
            )
        for i in range(c.num_layers):
            x = Block(c, name=f"layers_{i}")(x)
        x = _norm(c, "ln_f")(x)
        if c.tied:
            return wte.attend(x)
        return nn.Dense(c.vocab_size, use_bias=False, name="lm_head")(x)


# ------------------------------------------------------------------------- Megatron -> flax

_OLD = [
    ("language_model.encoder.", "decoder."),
    ("language_model.", ""),
    ("self_attention.query_key_value.", "self_attention.linear_qkv."),
    ("self_attention.dense.", "self_attention.linear_proj."),
    ("post_attention_layernorm.", "pre_mlp_layernorm."),
    ("mlp.dense_h_to_4h.", "mlp.linear_fc1."),
    ("mlp.dense_4h_to_h.", "mlp.linear_fc2."),
    ("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
    ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."),
]

_LAYER_MAP = {
    "input_layernorm.weight": ("ln_1", "scale", False),
    "input_layernorm.bias": ("ln_1", "bias", False),
    "pre_mlp_layernorm.weight": ("ln_2", "scale", False),
    "pre_mlp_layernorm.bias": ("ln_2", "bias", False),
    "self_attention.linear_qkv.weight": ("attn/qkv", "kernel", True),
    "self_attention.linear_qkv.bias": ("attn/qkv", "bias", False),
    "self_attention.linear_proj.weight": ("attn/proj", "kernel", True),
    "self_attention.linear_proj.bias": ("attn/proj", "bias", False),
    "mlp.linear_fc1.weight": ("mlp/fc1", "kernel", True),
    "mlp.linear_fc1.bias": ("mlp/fc1", "bias", False),
    "mlp.linear_fc2.weight": ("mlp/fc2", "kernel", True),
    "mlp.linear_fc2.bias": ("mlp/fc2", "bias", False),
}
_GLOBAL_MAP = {
    "embedding.word_embeddings.weight": ("wte", "embedding", False),
    "embedding.position_embeddings.weight": ("wpe", "embedding", False),
    "decoder.final_layernorm.weight": ("ln_f", "scale", False),
    "decoder.final_layernorm.bias": ("ln_f", "bias", False),
    "output_layer.weight": ("lm_head", "kernel", True),
}


def megatron_names(name: str) -> str:
    """Canonical megatron-core per-layer-style name (older Megatron-LM / TE-style names mapped)."""
    for a, b in _OLD:
        name = name.replace(a, b)
    return name


def _put(tree: dict, path: str, leaf: str, value) -> None:
    d = tree
    for p in path.split("/"):
        d = d.setdefault(p, {})
    if leaf in d:
        raise ValueError(f"two source tensors map to {path}/{leaf}")
    d[leaf] = value


def from_megatron(params: Mapping[str, np.ndarray], cfg: LMConfig) -> dict:
    """Raw imported Megatron params (torch layout; stacked or per-layer names) -> flax params.

    Every source tensor must map somewhere (an unknown name is an error naming it)."""
    tree: dict = {}
    for name, arr in params.items():
        n = megatron_names(name)
        arr = np.asarray(arr)
        if n in _GLOBAL_MAP:
            path, leaf, tr = _GLOBAL_MAP[n]
            _put(tree, path, leaf, arr.T if tr else arr)
            continue
        m = re.fullmatch(r"decoder\.layers\.(?:(\d+)\.)?(.+)", n)
        if m and _moe(tree, m, arr, cfg, name):
            continue
        if not m or m.group(2) not in _LAYER_MAP:
            raise KeyError(f"{name!r}: no flax destination for this Megatron tensor")
        path, leaf, tr = _LAYER_MAP[m.group(2)]
        layers = [(int(m.group(1)), arr)] if m.group(1) is not None else list(enumerate(arr))
        for i, a in layers:
            _put(tree, f"layers_{i}/{path}", leaf, a.T if tr else a)
    for layer, d in tree.items():  # per-expert legacy tensors -> stacked kernels
        moe = d.get("moe", {}) if isinstance(d, dict) else {}
        for part in ("fc1", "fc2"):
            per = moe.get(part, {}).get("kernel")
            if isinstance(per, dict):
                if sorted(per) != list(range(cfg.num_experts or 0)):
                    raise ValueError(
                        f"{layer}/moe/{part}: experts {sorted(per)}, expected 0..{cfg.num_experts - 1}"
                    )
                moe[part]["kernel"] = np.stack([per[e] for e in sorted(per)])
    return {"params": tree}


def _moe(tree: dict, m: re.Match, arr: np.ndarray, cfg: LMConfig, name: str) -> bool:
    """MoE tensors in the three megatron-core layouts -> moe/{router,fc1,fc2}/kernel."""
    rest = m.group(2)
    layers = [(int(m.group(1)), arr)] if m.group(1) is not None else list(enumerate(arr))
    if rest == "mlp.router.weight":
        for i, a in layers:
            _put(tree, f"layers_{i}/moe/router", "kernel", a.T)
        return True
    st = re.fullmatch(
        r"mlp\.experts\.experts\.linear_fc([12])\.weight", rest
    )  # torch_dist [E, out, in]
    if st:
        for i, a in layers:
            _put(tree, f"layers_{i}/moe/fc{st.group(1)}", "kernel", np.swapaxes(a, -1, -2))
        return True
    le = re.fullmatch(
        r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight", rest
    )  # legacy, global e
    if le:
        ((i, a),) = layers
        d = (
            tree.setdefault(f"layers_{i}", {})
            .setdefault("moe", {})
            .setdefault(f"fc{le.group(2)}", {})
        )
        d.setdefault("kernel", {})[int(le.group(1))] = a.T
        return True
    gw = re.fullmatch(r"mlp\.experts\.weight([12])", rest)  # legacy GroupedMLP buffers
    if gw:
        E, h = cfg.num_experts, cfg.hidden_size
        for i, a in layers:
            # GroupedMLP uses weight1 as view(E, h, X) and weight2 as view(E, ffn, h)
            k = a.reshape(E, h, -1) if gw.group(1) == "1" else a.reshape(E, -1, h)
            _put(tree, f"layers_{i}/moe/fc{gw.group(1)}", "kernel", k)
        return True
    return False
