"""Hugging Face model families -> ``TransformerLM``: which shipped spec maps a family's tensor
names (the only copy of that mapping: ``jax_ucp/_src/language/specs/hf_*.toml``) and how its
``config.json`` becomes the fields of an ``LMConfig`` (built by ``transformer.hf_model``, which
imports this table: the table returns fields, so it never imports the model).

Each family in :data:`FAMILIES` has a reader of its config fields; a value of one of them the
model does not compute (a RoPE type other than default, linear, llama3 or yarn, biases where the
family has none, bidirectional attention, an activation other than the family's) is a ``RequestError``
naming the field, never computed differently. Missing fields take transformers' defaults for
the family (5.24), so a ``config.json`` written by an older transformers reads the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from jax_ucp._src.errors import RequestError

__all__ = ["FAMILIES", "GPT2_NAMES", "LACKS", "Family", "canonical_config", "hf_fields"]


@dataclass(frozen=True)
class Family:
    """One ``model_type``: the shipped spec mapping its tensor names, the reader of its
    ``config.json`` and transformers' defaults of the fields it reads."""

    model_type: str
    spec: str
    read: Callable[[Mapping], dict]  # the LMConfig fields
    defaults: Mapping[str, Any]
    #: fields refused when true (biases, layouts the family's spec does not map)
    refuses: tuple[str, ...] = ()
    #: whether ``hidden_act`` is read (only silu computed)
    silu: bool = True


def _family(model_type, spec, read, refuses=(), silu=True, **defaults) -> Family:
    return Family(model_type, spec, read, defaults, refuses, silu)


#: families transformers has that TransformerLM does not compute: what it lacks for each (none
#: now: the multimodal Llama 4, Qwen3.5 and Gemma 4 are read as their text models)
LACKS: dict[str, str] = {}

#: GPT-2's own names of the common fields (its config.json spells only these)
GPT2_NAMES = {
    "hidden_size": "n_embd",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "max_position_embeddings": "n_positions",
}


def canonical_config(config: Mapping[str, Any]) -> dict:
    """``config`` with the family's missing fields at transformers' defaults, and GPT-2's own
    names (``n_embd``, ...) copied to the common ones (``hidden_size``, ...) the checks read."""
    family = FAMILIES.get(str(config.get("model_type")))
    out = {**(family.defaults if family else {}), **config}
    if family is not None and family.model_type == "gpt2":
        for common, own in GPT2_NAMES.items():
            out.setdefault(common, config.get(own))
        n_inner, hidden = config.get("n_inner"), out.get("hidden_size")
        if n_inner is None and isinstance(hidden, int) and not isinstance(hidden, bool):
            n_inner = 4 * hidden
        out.setdefault("intermediate_size", n_inner)
    return out


def hf_fields(config: Mapping[str, Any]) -> tuple[dict, str]:
    """The ``LMConfig`` fields of a Hugging Face ``config.json`` and the shipped spec mapping its
    tensors; a family not in :data:`FAMILIES` or a field it does not compute is refused
    (``RequestError`` naming the field and value)."""
    model_type = config.get("model_type")
    family = FAMILIES.get(str(model_type))
    if family is None or "auto_map" in config:
        found = "custom code (auto_map)" if "auto_map" in config else repr(model_type)
        lacks = LACKS.get(str(model_type))
        lacks = f"TransformerLM lacks {lacks}; " if lacks else ""
        raise RequestError(
            f"model_type {found}: {lacks}TransformerLM computes {', '.join(FAMILIES)}"
        )
    c = canonical_config(config)
    if family.silu:
        _act(c, "hidden_act", _SILU)
    _false(c, *family.refuses)
    return family.read(c), family.spec


# ----------------------------------------------------------------------------- value checks
def _refuse(field: str, value: Any, why: str) -> RequestError:
    return RequestError(f"config.json: {field} {str(value)[:200]}: {why}")


def _int(c: Mapping, field: str, value: Any = None) -> int:
    value = c.get(field) if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31:
        raise _refuse(field, repr(value), "expected a positive integer below 2**31")
    return value


def _number(field: str, value: Any) -> float:
    good = isinstance(value, int | float) and not isinstance(value, bool)
    if not good or not (math.isfinite(float(value)) and float(value) > 0):
        raise _refuse(field, repr(value), "expected a finite number > 0")
    return float(value)


def _tied(c: Mapping, default: bool) -> bool:
    """``tie_word_embeddings``, a bool (a string "false" is truthy: silently tied)."""
    value = default if c.get("tie_word_embeddings") is None else c["tie_word_embeddings"]
    if not isinstance(value, bool):
        raise _refuse("tie_word_embeddings", repr(value)[:100], "expected true or false")
    return value


def _optional_number(c: Mapping, field: str) -> float | None:
    return None if c.get(field) is None else _number(field, c[field])


def _false(c: Mapping, *fields: str) -> None:
    """Fields whose true value changes the math in a way the family's spec does not map."""
    for field in fields:
        if c.get(field):
            raise _refuse(field, c[field], "not computed by TransformerLM for this family")


def _experts(c: Mapping, field: str, top_field: str = "num_experts_per_tok") -> dict:
    """The LMConfig fields of the experts: the count in ``field`` and the top-k
    ``top_field``, at most as many."""
    experts, top = _int(c, field), _int(c, top_field)
    if top > experts:
        raise _refuse(top_field, top, f"more than the {experts} experts")
    return {"num_experts": experts, "moe_router_topk": top}


def _act(c: Mapping, field: str, allowed: Mapping[str, str]) -> str:
    value = c.get(field, next(iter(allowed)))
    if value not in allowed:
        raise _refuse(field, repr(value), f"supported: {', '.join(allowed)}")
    return allowed[value]


# ---------------------------------------------------------------------------------- RoPE
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_LLAMA3 = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _yarn(params: Mapping, field: str, factor: float) -> tuple:
    """(beta_fast, beta_slow, original length, truncate, attention factor) of a yarn RoPE, the
    attention factor (on cos and sin) inferred from ``factor`` / ``mscale`` / ``mscale_all_dim``
    as transformers' ``_compute_yarn_parameters`` does when not given."""
    read = {
        key: None if params.get(key) is None else _number(f"{field}.{key}", params[key])
        for key in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")
    }
    original = _number(f"{field}.original_max_position_embeddings", params.get(_LLAMA3[2]))
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise _refuse(f"{field}.truncate", repr(truncate), "expected true or false")

    def mscale(m: float = 1.0) -> float:
        return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

    attention = read["attention_factor"]
    if attention is None and read["mscale"] and read["mscale_all_dim"]:
        attention = mscale(read["mscale"]) / mscale(read["mscale_all_dim"])
    beta = (read["beta_fast"] or 32.0, read["beta_slow"] or 1.0)
    return (*beta, original, truncate, mscale() if attention is None else attention)


def _rope_one(params: Any, field: str, theta: Any, partial_ok: bool) -> tuple:
    """(base, factor, rotary fraction, the LMConfig fields of a llama3 / yarn scaling) of one
    RoPE set."""
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise _refuse(field, repr(params), "expected a table of RoPE parameters")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise _refuse(
            f"{field}.rope_type", repr(kind), f"supported RoPE types: {', '.join(_ROPE_TYPES)}"
        )
    factor = _number(f"{field}.factor", params.get("factor")) if kind != "default" else 1.0
    scaling = {}
    if kind == "llama3":
        scaling["rotary_llama3"] = tuple(
            _number(f"{field}.{key}", params.get(key)) for key in _LLAMA3
        )
    elif kind == "yarn":
        scaling["rotary_yarn"] = _yarn(params, field, factor)
    base = params.get("rope_theta", theta)
    base = _number(f"{field}.rope_theta", 10000.0 if base is None else base)
    partial = params.get("partial_rotary_factor", 1.0)
    partial = _number(f"{field}.partial_rotary_factor", partial)
    if partial != 1.0 and not partial_ok:
        raise _refuse(f"{field}.partial_rotary_factor", partial, "not computed for this family")
    if partial > 1.0:
        raise _refuse(f"{field}.partial_rotary_factor", partial, "expected at most 1")
    return base, factor, partial, scaling


def _rope(c: Mapping, partial_ok: bool = False) -> tuple:
    """RoPE of a family with one set: ``rope_parameters`` (transformers 5) or the older
    ``rope_scaling`` + ``rope_theta`` (+ ``partial_rotary_factor``); both are checked, the
    older one read first (as transformers does)."""
    found = [
        (field, c.get(field))
        for field in ("rope_scaling", "rope_parameters")
        if c.get(field)  # an empty rope_scaling gives way to rope_parameters, as in transformers
    ] or [("rope_parameters", {})]
    read = []
    for field, params in found:
        if isinstance(params, Mapping) and "partial_rotary_factor" in c:
            params = {"partial_rotary_factor": c["partial_rotary_factor"], **params}
        read.append(_rope_one(params, field, c.get("rope_theta"), partial_ok))
    return read[0]


# ------------------------------------------------------------------------- sliding windows
_LAYER_TYPES = ("full_attention", "sliding_attention")


def _layer_types(c: Mapping, layers: int, default: list[str], kinds=_LAYER_TYPES) -> list[str]:
    types = c.get("layer_types")
    if types is None:
        return default
    if not isinstance(types, list) or len(types) != layers or any(t not in kinds for t in types):
        raise _refuse(
            "layer_types",
            repr(types)[:200],
            f"expected {layers} of {', '.join(kinds)} (one per layer)",
        )
    return types


def _ints(c: Mapping, field: str, default: list) -> list[int]:
    """A list of integers (layer indices, flags), ``default`` when absent."""
    value = default if c.get(field) is None else c[field]
    if not isinstance(value, list) or any(
        isinstance(i, bool) or not isinstance(i, int) for i in value
    ):
        raise _refuse(field, repr(value)[:200], "expected a list of integers (one per layer)")
    return value


def _window(c: Mapping, types: list[str], window: Any) -> dict:
    """The LMConfig fields of the windowed layers (``types``) with ``window``."""
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if not sliding:
        return {}
    return {"sliding_window": _int(c, "sliding_window", window), "sliding_layers": sliding}


def _every_layer_window(c: Mapping) -> dict:
    """Mistral, Mixtral, Phi-3: ``sliding_window`` (when set) windows every layer."""
    if c.get("sliding_window") is None:
        return {}
    return {"sliding_window": _int(c, "sliding_window"), "sliding_layers": None}


def _qwen_window(c: Mapping, layers: int, moe: bool = False) -> dict:
    """Qwen2/Qwen3 (windowed from ``max_window_layers`` on) and Qwen2-MoE (every other layer
    below it), only with ``use_sliding_window``."""
    use = bool(c.get("use_sliding_window"))
    first = c.get("max_window_layers", 28)
    if use:
        first = _int(c, "max_window_layers", first) if first else 0
    if moe:
        default = [
            "sliding_attention" if use and (i + 1) % 2 and i < first else "full_attention"
            for i in range(layers)
        ]
    else:
        default = [
            "sliding_attention" if use and i >= first else "full_attention" for i in range(layers)
        ]
    types = _layer_types(c, layers, default)
    if not use:
        if "sliding_attention" in types:
            raise _refuse("layer_types", "with sliding layers", "but use_sliding_window is false")
        return {}
    return _window(c, types, c.get("sliding_window"))


# ------------------------------------------------------------------------------- families
#: more layers than any model has: refused before a list per layer is built
_MAX_LAYERS = 1 << 20


def _layers(c: Mapping) -> int:
    layers = _int(c, "num_hidden_layers")
    if layers > _MAX_LAYERS:
        raise _refuse("num_hidden_layers", layers, f"expected at most {_MAX_LAYERS}")
    return layers


def _base(c: Mapping, partial_ok: bool = False, rope: tuple | None = None) -> dict:
    """The fields every RoPE / RMSNorm / GLU family shares (``rope``: the RoPE set read
    already, else the config's one)."""
    hidden, heads = _int(c, "hidden_size"), _int(c, "num_attention_heads")
    groups = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim")
    head_dim = _int(c, "head_dim") if head_dim is not None else hidden // heads
    if _int(c, "num_key_value_heads", groups) and heads % groups:
        raise _refuse("num_key_value_heads", groups, f"does not divide {heads} heads")
    base, factor, partial, scaling = rope or _rope(c, partial_ok)
    if int(head_dim * partial) % 2:
        raise _refuse("partial_rotary_factor", partial, f"gives an odd rotary dim of {head_dim}")
    return dict(
        vocab_size=_int(c, "vocab_size"),
        hidden_size=hidden,
        num_layers=_layers(c),
        num_attention_heads=heads,
        ffn_hidden_size=_int(c, "intermediate_size"),
        num_query_groups=groups,
        kv_channels=head_dim if head_dim != hidden // heads else None,
        normalization="RMSNorm",
        gated=True,
        bias=False,
        position="rope",
        max_position_embeddings=_int(
            c, "max_position_embeddings", c.get("max_position_embeddings") or 2048
        ),
        rotary_base=base,
        rotary_scaling_factor=factor,
        **scaling,
        rotary_percent=partial,
        eps=_optional_number(c, "rms_norm_eps") or 1e-6,  # absent: the default; 0 refused
        tied=_tied(c, False),
    )


_SILU = {"silu": "silu"}
_GELU = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu"}


def _llama(c: Mapping) -> dict:
    return dict(**_base(c))


def _mistral(c: Mapping) -> dict:
    return dict(**_base(c), **_every_layer_window(c))


def _qwen2(c: Mapping) -> dict:
    kw = _base(c)
    return dict(**kw, qkv_bias=True, **_qwen_window(c, kw["num_layers"]))


def _qwen3(c: Mapping) -> dict:
    kw = _base(c)
    return dict(**kw, qk_norm=True, **_qwen_window(c, kw["num_layers"]))


def _phi3(c: Mapping) -> dict:
    return dict(**_base(c, partial_ok=True), **_every_layer_window(c))


def _gemma(c: Mapping, types: list[str]) -> dict:
    """What Gemma 2 and 3 share: (1 + w) norms around attention and MLP, GeGLU, embeddings
    times sqrt(hidden), the query_pre_attn_scalar scale, soft-capping, local/global layers."""
    return dict(
        norm_offset=1.0,
        sandwich_norm=True,
        glu_activation=_act(c, "hidden_activation", _GELU),
        embedding_multiplier=float(c["hidden_size"]) ** 0.5,
        attention_scale=_number("query_pre_attn_scalar", c.get("query_pre_attn_scalar")) ** -0.5,
        attn_logit_softcapping=_optional_number(c, "attn_logit_softcapping"),
        final_logit_softcapping=_optional_number(c, "final_logit_softcapping"),
        **_window(c, types, c.get("sliding_window")),
    )


def _gemma2(c: Mapping) -> dict:
    kw = _base(c)
    layers = kw["num_layers"]
    default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    return dict(**kw, **_gemma(c, _layer_types(c, layers, default)))


def _typed_rope(
    c: Mapping, family: str, glob: float, local: float, local_field: str = "rope_theta"
) -> tuple[dict, tuple]:
    """The ``_base`` fields with the global layers' RoPE, and the local layers' RoPE set, of a
    family with a RoPE per layer type: ``rope_parameters`` keyed by ``full_attention`` /
    ``sliding_attention`` (transformers 5), else ``rope_theta`` (+ ``rope_scaling``) for the
    global layers and ``local`` (the theta, read from ``local_field``) for the local ones."""
    params = c.get("rope_parameters")
    if isinstance(params, Mapping):
        if not any(t in params for t in _LAYER_TYPES):
            raise _refuse(
                "rope_parameters",
                dict(params),
                f"{family} keys it by layer type (full_attention, sliding_attention)",
            )
        full = _rope_one(
            params.get("full_attention"), "rope_parameters.full_attention", glob, False
        )
        found = _rope_one(
            params.get("sliding_attention"), "rope_parameters.sliding_attention", local, False
        )
        if found[3]:
            kind = params["sliding_attention"].get("rope_type")
            raise _refuse("rope_parameters.sliding_attention.rope_type", kind, "not computed")
        return _base(c, rope=full), found
    kw = _base({**c, "rope_theta": c.get("rope_theta", glob)})
    return kw, _rope_one({}, local_field, local, False)


def _gemma3(c: Mapping) -> dict:
    """Gemma 3 adds q/k norms and a RoPE per layer type (``_typed_rope``; its older config
    names the local layers' theta ``rope_local_base_freq``)."""
    local = c.get("rope_local_base_freq", 1e4)
    kw, local = _typed_rope(c, "Gemma 3", 1e6, local, "rope_local_base_freq")
    layers = kw["num_layers"]
    pattern = _int(c, "sliding_window_pattern", c.get("sliding_window_pattern", 6))
    default = [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    return dict(
        **kw,
        **_gemma(c, _layer_types(c, layers, default)),
        qk_norm=True,
        local_rotary_base=local[0],
        local_rotary_scaling_factor=local[1],
    )


def _mixtral(c: Mapping) -> dict:
    return dict(**_base(c), **_every_layer_window(c), **_experts(c, "num_local_experts"))


def _qwen_moe(c: Mapping, layers: int) -> dict:
    """The experts Qwen2-MoE and Qwen3-MoE share: softmax router over all experts, top-k
    (renormalised only with ``norm_topk_prob``), dense layers (``mlp_only_layers``, and those
    ``decoder_sparse_step`` skips)."""
    step, only = _int(c, "decoder_sparse_step"), set(_ints(c, "mlp_only_layers", []))
    return dict(
        **_experts(c, "num_experts"),
        moe_ffn_hidden_size=_int(c, "moe_intermediate_size"),
        moe_norm_topk=bool(c.get("norm_topk_prob", False)),
        dense_layers=tuple(i for i in range(layers) if i in only or (i + 1) % step),
    )


def _qwen2_moe(c: Mapping) -> dict:
    kw = _base(c)
    layers = kw["num_layers"]
    return dict(
        **kw,
        **_qwen_window(c, layers, moe=True),
        **_qwen_moe(c, layers),
        qkv_bias=bool(c.get("qkv_bias", True)),
        **_shared_expert(c),
    )


def _qwen3_moe(c: Mapping) -> dict:
    """Qwen3's attention (q/k norms, no biases; ``sliding_window`` on every layer, only with
    ``use_sliding_window``) and Qwen2-MoE's experts without the shared expert."""
    if "num_local_experts" in c:  # transformers 5 writes it (Mixtral's name), and reads it first
        c = {**c, "num_experts": c["num_local_experts"]}
    kw = _base(c)
    window = _every_layer_window(c) if c.get("use_sliding_window") else {}
    return dict(**kw, **window, **_qwen_moe(c, kw["num_layers"]), qk_norm=True)


def _gated_delta_net(c: Mapping) -> dict:
    """Qwen3-Next's and Qwen3.5's layers: Gated DeltaNet (``linear_num_key_heads``,
    ``linear_num_value_heads``, ``linear_key_head_dim``, ``linear_value_head_dim``,
    ``linear_conv_kernel_dim``) in the ``linear_attention`` layers of ``layer_types`` (by default
    all but every ``full_attention_interval``-th), Qwen3 attention with each head's output gated
    by sigmoid of its half of q_proj, a partial rotary, (1 + w) RMSNorms."""
    kw = _base(c, partial_ok=True)
    layers = kw["num_layers"]
    interval = _int(c, "full_attention_interval")
    default = [
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)
    ]
    types = _layer_types(c, layers, default, ("linear_attention", "full_attention"))
    nk, nv, dk, dv = (
        _int(c, f"linear_{f}")
        for f in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim")
    )
    if nv % nk:
        raise _refuse("linear_num_value_heads", nv, f"is no multiple of {nk} key heads")
    return dict(
        **kw,
        qk_norm=True,
        norm_offset=1.0,
        attn_output_gate=True,
        gdn=(nk, nv, dk, dv, _int(c, "linear_conv_kernel_dim")),
        gdn_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
    )


def _shared_expert(c: Mapping) -> dict:
    """Qwen2-MoE's shared expert (``shared_expert_intermediate_size``, 0: none) and its gate."""
    shared = c.get("shared_expert_intermediate_size")
    width = _int(c, "shared_expert_intermediate_size") if shared else None
    return dict(moe_shared_expert_intermediate_size=width, moe_shared_expert_gate=bool(shared))


def _qwen3_5_text(c: Mapping) -> dict:
    return _gated_delta_net(c)


def _qwen3_5_moe_text(c: Mapping) -> dict:
    """Every layer MoE: the softmax router's top-k renormalised, a gated shared expert."""
    width = _int(c, "moe_intermediate_size")
    return dict(
        **_gated_delta_net({**c, "intermediate_size": width}),  # no dense MLP
        **_experts(c, "num_experts"),
        moe_ffn_hidden_size=width,
        **_shared_expert(c),
    )


def _qwen3_next(c: Mapping) -> dict:
    """Qwen3-Next: the in_proj_qkvz / in_proj_ba of Gated DeltaNet laid out per key head;
    Qwen2-MoE's experts, dense layers and gated shared expert."""
    kw = _gated_delta_net(c)
    return dict(**kw, gdn_grouped=True, **_qwen_moe(c, kw["num_layers"]), **_shared_expert(c))


def _rope_flags(c: Mapping, layers: int) -> list[int]:
    """``no_rope_layers`` (Llama 4, SmolLM3): 1 for a RoPE layer, 0 for a NoPE one; absent or
    empty, every ``no_rope_layer_interval``-th layer is NoPE."""
    interval = _int(c, "no_rope_layer_interval")
    rope = _ints(c, "no_rope_layers", []) or [int((i + 1) % interval != 0) for i in range(layers)]
    if len(rope) != layers or not set(rope) <= {0, 1}:
        raise _refuse("no_rope_layers", repr(rope)[:200], f"expected {layers} of 0, 1")
    return rope


def _smollm3(c: Mapping) -> dict:
    """SmolLM3: Llama with NoPE layers (``no_rope_layers`` 0, by default every fourth) and,
    with ``use_sliding_window``, windowed layers (``layer_types``, by default the NoPE ones)."""
    kw = _base(c)
    layers = kw["num_layers"]
    rope = _rope_flags(c, layers)
    use = bool(c.get("use_sliding_window")) and c.get("sliding_window") is not None
    default = ["sliding_attention" if use and not r else "full_attention" for r in rope]
    types = _layer_types(c, layers, default)
    window = _window(c, types, c.get("sliding_window")) if c.get("use_sliding_window") else {}
    return dict(**kw, **window, nope_layers=tuple(i for i, r in enumerate(rope) if not r))


def _llama4_text(c: Mapping) -> dict:
    """Llama 4's text model: RoPE layers (``no_rope_layers`` 1) with chunked attention
    (``layer_types``, ``attention_chunk_size``) and weightless q/k L2 norms after RoPE
    (``use_qk_norm``), NoPE layers with attention temperature tuning (``floor_scale``,
    ``attn_scale``); ``moe_layers`` weigh each token's top-k experts' input by sigmoid(router
    logit) and add a shared expert, the other layers' MLP is ``intermediate_size_mlp`` wide."""
    kw = _base(c)
    layers, moe_width = kw["num_layers"], kw["ffn_hidden_size"]
    rope = _rope_flags(c, layers)
    step = _int(c, "interleave_moe_layer_step")
    moe = set(_ints(c, "moe_layers", list(range(step - 1, layers, step))))
    default = ["chunked_attention" if r else "full_attention" for r in rope]
    types = _layer_types(c, layers, default, ("full_attention", "chunked_attention"))
    chunked = tuple(i for i, t in enumerate(types) if t == "chunked_attention")
    window = _int(c, "attention_chunk_size") if chunked else None
    tuning = c.get("attn_temperature_tuning") and (
        _number("floor_scale", c.get("floor_scale")),
        _number("attn_scale", c.get("attn_scale")),
    )
    return dict(
        **{**kw, "ffn_hidden_size": _int(c, "intermediate_size_mlp")},
        sliding_window=window,
        sliding_layers=chunked,
        sliding_chunked=True,
        nope_layers=tuple(i for i, r in enumerate(rope) if not r),
        attn_temperature=tuning or None,
        qk_l2_norm=bool(c.get("use_qk_norm")),
        **_experts(c, "num_local_experts"),
        moe_sigmoid_input=True,
        moe_ffn_hidden_size=moe_width,
        moe_shared_expert_intermediate_size=moe_width,
        dense_layers=tuple(i for i in range(layers) if i not in moe),
    )


def _gpt2(c: Mapping) -> dict:
    """GPT-2 (GPT2LMHeadModel): learned positions, LayerNorm, GELU (its tanh approximation but
    for ``gelu``), fused c_attn, biases, tied output; the attention variants it has flags for
    are refused unless at their defaults."""
    if c.get("scale_attn_weights", True) is not True:
        raise _refuse("scale_attn_weights", c["scale_attn_weights"], "only true is computed")
    act = c.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
        raise RequestError(f"config.json: activation_function {act!r} is not a GELU")
    return dict(
        vocab_size=_int(c, "vocab_size"),
        hidden_size=_int(c, "hidden_size"),
        num_layers=_layers(c),
        num_attention_heads=_int(c, "num_attention_heads"),
        ffn_hidden_size=_int(c, "intermediate_size"),
        max_position_embeddings=_int(
            c, "max_position_embeddings", c.get("max_position_embeddings") or 1024
        ),
        eps=_optional_number(c, "layer_norm_epsilon") or 1e-5,  # absent: the default; 0 refused
        tied=_tied(c, True),
        gelu_tanh=act != "gelu",
    )


def _granite(c: Mapping) -> dict:
    """Llama with Granite's four scalars: embeddings times ``embedding_multiplier``, attention
    and MLP outputs times ``residual_multiplier``, softmax scale ``attention_multiplier``,
    logits divided by ``logits_scaling``."""
    return dict(
        **_base(c),
        embedding_multiplier=_number("embedding_multiplier", c.get("embedding_multiplier")),
        residual_multiplier=_number("residual_multiplier", c.get("residual_multiplier")),
        attention_scale=_number("attention_multiplier", c.get("attention_multiplier")),
        logits_scaling=_number("logits_scaling", c.get("logits_scaling")),
    )


def _olmo2(c: Mapping) -> dict:
    """OLMo 2: norms on the attention's and the MLP's outputs only, q/k norms over all heads."""
    return dict(**_base(c), pre_norm=False, sandwich_norm=True, qk_norm=True, qk_norm_scope="all")


def _olmo3(c: Mapping) -> dict:
    """OLMo 3: OLMo 2 with windowed layers (``layer_types``, by default three of every four)
    and a RoPE per layer type (``_typed_rope``: yarn on the global layers only). An older
    config's ``rope_theta`` is the global layers' only: transformers 5.24 gives the local ones
    its default 5e5 (``Olmo3Config.convert_rope_params_to_dict`` pops it for the first)."""
    kw, local = _typed_rope(c, "OLMo 3", 5e5, 5e5)
    layers = kw["num_layers"]
    default = ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)]
    return dict(
        **kw,
        **_window(c, _layer_types(c, layers, default), c.get("sliding_window")),
        local_rotary_base=local[0],
        local_rotary_scaling_factor=local[1],
        pre_norm=False,
        sandwich_norm=True,
        qk_norm=True,
        qk_norm_scope="all",
    )


def _stablelm(c: Mapping) -> dict:
    """StableLM: LayerNorms (with biases), partial rotary (0.25 by default), q/k/v biases when
    ``use_qkv_bias``; per-head q/k LayerNorms and the parallel residual are refused."""
    kw = _base(c, partial_ok=True)
    kw.update(normalization="LayerNorm", eps=_number("layer_norm_eps", c.get("layer_norm_eps")))
    return dict(**kw, qkv_bias=bool(c.get("use_qkv_bias")))


def _gpt_oss(c: Mapping) -> dict:
    """GPT-OSS: attention sinks, q/k/v/o biases (``attention_bias``), windowed layers
    (``layer_types``, by default every other), every layer's MLP experts: a router with a bias
    (softmax over the top-k logits), experts with biases and the clamped SwiGLU (``swiglu_alpha``,
    ``swiglu_limit``) over interleaved gate / up; yarn RoPE."""
    kw = _base(c)
    layers = kw["num_layers"]
    default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    return dict(
        **{**kw, "bias": bool(c.get("attention_bias"))},
        **_window(c, _layer_types(c, layers, default), None),
        attention_sinks=True,
        **_experts(c, "num_local_experts"),
        moe_bias=True,
        moe_clamped_swiglu=(
            _number("swiglu_alpha", c.get("swiglu_alpha")),
            _number("swiglu_limit", c.get("swiglu_limit")),
        ),
    )


def _deepseek_v3(c: Mapping) -> dict:
    """DeepSeek V3: multi-head latent attention (``q_lora_rank`` (null: one q projection),
    ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, RoPE dims
    interleaved with ``rope_interleave``; the softmax scale times yarn's mscale(factor,
    ``mscale_all_dim``) squared), dense MLPs in the first ``first_k_dense_replace`` layers, then
    ``n_routed_experts`` with group-limited sigmoid routing (``n_group``, ``topk_group``, the
    score-correction bias, ``norm_topk_prob``, ``routed_scaling_factor``) and shared experts."""
    heads, rope = _int(c, "num_attention_heads"), _int(c, "qk_rope_head_dim")
    if c.get("num_key_value_heads") != heads:  # transformers' MLA repeats no kv heads
        raise _refuse("num_key_value_heads", c.get("num_key_value_heads"), f"expected {heads}")
    if rope % 2:
        raise _refuse("qk_rope_head_dim", rope, "expected an even number (pairs rotate)")
    kw = _base({**c, "head_dim": rope})  # transformers' head_dim: the RoPE dims
    q_rank = None if c.get("q_lora_rank") is None else _int(c, "q_lora_rank")
    mla = (q_rank or 0, _int(c, "kv_lora_rank"), _int(c, "qk_nope_head_dim"), rope)
    scale, factor = (mla[2] + rope) ** -0.5, kw["rotary_scaling_factor"]  # factor 1: default
    all_dim = (c.get("rope_scaling") or c.get("rope_parameters") or {}).get("mscale_all_dim")
    if all_dim and factor > 1:
        scale *= (0.1 * _number("mscale_all_dim", all_dim) * math.log(factor) + 1) ** 2
    return dict(
        **kw,
        attention_scale=scale,
        mla=(*mla, _int(c, "v_head_dim")),
        rope_interleaved=bool(c.get("rope_interleave")),
        **_grouped_moe(c, kw["num_layers"]),
    )


def _deepseek_v32(c: Mapping) -> dict:
    """DeepSeek V3.2: DeepSeek V3 (its RoPE pairs always interleaved, q always through
    ``q_lora_rank``) plus each layer's lightning indexer (``index_n_heads``, ``index_head_dim``,
    ``index_topk``: a query attends to the ``index_topk`` keys it scores highest only); the MLPs
    dense or MoE by ``mlp_layer_types`` (absent: the first ``first_k_dense_replace`` dense)."""
    if c.get("q_lora_rank") is None:
        raise _refuse("q_lora_rank", None, "expected an integer (V3.2 has no one q projection)")
    kw = _deepseek_v3({**c, "rope_interleave": True})
    layers, rope = kw["num_layers"], kw["mla"][3]
    index = tuple(_int(c, f) for f in ("index_n_heads", "index_head_dim", "index_topk"))
    if index[1] < rope:
        raise _refuse("index_head_dim", index[1], f"expected at least qk_rope_head_dim {rope}")
    _layer_types(c, layers, [], ("indexed_attention",))
    kinds = c.get("mlp_layer_types")
    if kinds is not None:
        good = isinstance(kinds, list) and len(kinds) == layers
        if not good or any(kind not in ("dense", "sparse") for kind in kinds):
            raise _refuse(
                "mlp_layer_types", repr(kinds)[:200], f"expected {layers} of dense, sparse"
            )
        kw["dense_layers"] = tuple(i for i, kind in enumerate(kinds) if kind == "dense")
    return {**kw, "indexer": index}


def _grouped_moe(c: Mapping, layers: int) -> dict:
    """DeepSeek V3's and GLM-4.5's MLPs: dense in the first ``first_k_dense_replace`` layers,
    then ``n_routed_experts`` with group-limited sigmoid routing (``n_group``, ``topk_group``,
    the score-correction bias, ``norm_topk_prob``, ``routed_scaling_factor``) and
    ``n_shared_experts`` shared ones."""
    experts = _int(c, "n_routed_experts")
    groups, top_groups = _int(c, "n_group"), _int(c, "topk_group")
    top, dense = _int(c, "num_experts_per_tok"), c.get("first_k_dense_replace")
    if experts % groups or experts // groups < 2:
        raise _refuse("n_group", groups, f"expected groups of at least 2 of {experts} experts")
    if top_groups > groups or top > top_groups * experts // groups:
        raise _refuse("topk_group", top_groups, f"too few groups for top {top} of {groups}")
    if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
        raise _refuse("first_k_dense_replace", repr(dense), "expected an integer >= 0")
    width = _int(c, "moe_intermediate_size")
    return dict(
        num_experts=experts,
        moe_router_topk=top,
        moe_ffn_hidden_size=width,
        moe_norm_topk=bool(c.get("norm_topk_prob")),
        moe_groups=(
            groups,
            top_groups,
            _number("routed_scaling_factor", c.get("routed_scaling_factor")),
        ),
        moe_shared_expert_intermediate_size=width * _int(c, "n_shared_experts"),
        dense_layers=tuple(range(min(dense, layers))),
    )


def _glm4_moe(c: Mapping) -> dict:
    """GLM-4.5 MoE: Llama attention with partial rotary (rotate-half on the first
    ``partial_rotary_factor`` of each head), q/k/v biases with ``attention_bias``, each head's q/k
    RMSNorm before RoPE with ``use_qk_norm``; DeepSeek V3's MLPs (``_grouped_moe``)."""
    if "num_local_experts" in c:  # the attribute's name, n_routed_experts the one written
        c = {**c, "n_routed_experts": c["num_local_experts"]}
    kw = _base(c, partial_ok=True)
    return dict(
        **kw,
        qkv_bias=bool(c.get("attention_bias")),
        qk_norm=bool(c.get("use_qk_norm")),
        **_grouped_moe(c, kw["num_layers"]),
    )


def _ernie4_5_moe(c: Mapping) -> dict:
    """Ernie 4.5 MoE: Llama attention with RoPE on interleaved pairs (q/k rows permuted to
    rotate-half by the spec, ``rope_half``); MoE in the layers from ``moe_layer_start_index`` to
    ``moe_layer_end_index`` (-1: the last) every ``moe_layer_interval``-th: the top-k of the
    softmax over all experts plus the score-correction bias, weighted by their softmax
    renormalised, plus ``moe_num_shared_experts`` shared experts. ``moe_norm_min`` only clamps
    a sum that is at least top-k / experts, so a larger one is refused."""
    kw = _base(c)
    layers = kw["num_layers"]
    experts = _experts(c, "moe_num_experts", "moe_k")
    first_last = []
    for field in ("moe_layer_start_index", "moe_layer_end_index"):
        value = c.get(field)
        value = layers - 1 if value == -1 and field.endswith("end_index") else value
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _refuse(field, repr(value), "expected an integer >= 0 (end: or -1)")
        first_last.append(value)
    start, end = first_last
    step = _int(c, "moe_layer_interval")
    floor = _number("moe_norm_min", c.get("moe_norm_min"))
    if floor > experts["moe_router_topk"] / experts["num_experts"]:
        raise _refuse("moe_norm_min", floor, "would clamp the top-k weights' sum")
    width, shared = _int(c, "moe_intermediate_size"), c.get("moe_num_shared_experts") or 0
    shared = _int(c, "moe_num_shared_experts") * width if shared else None
    moe = {i for i in range(layers) if (i + 1) % step == 0 and start <= i <= end}
    return dict(
        **kw,
        **experts,
        moe_ffn_hidden_size=width,
        moe_score_bias=True,
        moe_shared_expert_intermediate_size=shared,
        dense_layers=tuple(i for i in range(layers) if i not in moe),
    )


def _minimax_m2(c: Mapping) -> dict:
    """MiniMax M2: Mixtral's layers (every one MoE) with q/k RMSNorms over all heads (OLMo 2's)
    before a partial rotary (``partial_rotary_factor``, or the released checkpoints'
    ``rotary_dim``); sigmoid scores plus the score-correction bias pick the top-k experts,
    weighted by their scores renormalised (DeepSeek V3's routing in one group, unscaled)."""
    if c.get("rotary_dim") is not None and "partial_rotary_factor" not in c:
        c = {**c, "partial_rotary_factor": _int(c, "rotary_dim") / _int(c, "head_dim")}
    return dict(
        **_base(c, partial_ok=True),
        qk_norm=True,
        qk_norm_scope="all",
        **_experts(c, "num_local_experts"),
        moe_groups=(1, 1, 1.0),
    )


def _text_model(*types: str) -> Callable[[Mapping], dict]:
    """The reader of a multimodal checkpoint's text model (Kimi K2.5, Llama 4, Qwen3.5, Gemma 4):
    its ``text_config`` (``model_type`` one of ``types``) read as the family ``types[0]``, tied
    by the outer ``tie_word_embeddings`` (as transformers ties it); the vision and audio towers
    are not computed (text logits only)."""

    def read(c: Mapping) -> dict:
        text = c.get("text_config")
        if not isinstance(text, Mapping) or text.get("model_type", types[0]) not in types:
            kind = text.get("model_type") if isinstance(text, Mapping) else text
            raise _refuse("text_config", repr(kind)[:200], f"expected a {types[0]} text model")
        fields, _ = hf_fields({**text, "model_type": types[0]})
        return {**fields, "tied": _tied(c, False)}

    return read


#: transformers' default rope_parameters of Gemma 4
_GEMMA4_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1e6,
    },
}
#: more layers than a Gemma 4 model has: its size is counted layer by layer (each kind differs)
_GEMMA4_MAX_LAYERS = 1024


def _gemma4_rope(c: Mapping) -> tuple[tuple, tuple, bool]:
    """The global layers' RoPE (default, or proportional: partial_rotary_factor of the
    frequencies, factor dividing them), the local layers' (default) and whether proportional."""
    params = c.get("rope_parameters") or _GEMMA4_ROPE
    if not isinstance(params, Mapping) or not all(t in params for t in _LAYER_TYPES):
        raise _refuse("rope_parameters", repr(params)[:200], "Gemma 4 keys it by layer type")
    read = []
    for kind, allowed in (
        ("full_attention", ("default", "proportional")),
        ("sliding_attention", ("default",)),
    ):
        p, field = params[kind], f"rope_parameters.{kind}"
        if not isinstance(p, Mapping) or p.get("rope_type", "default") not in allowed:
            got = p.get("rope_type") if isinstance(p, Mapping) else p
            raise _refuse(f"{field}.rope_type", repr(got), f"supported: {', '.join(allowed)}")
        read.append(p)
    full, local = read
    proportional = full.get("rope_type") == "proportional"
    theta = _number("rope_parameters.full_attention.rope_theta", full.get("rope_theta"))
    factor = partial = 1.0
    if proportional:  # transformers' default RoPE of Gemma 4 reads neither
        factor = _number("rope_parameters.full_attention.factor", full.get("factor", 1.0))
        partial = full.get("partial_rotary_factor", 1.0)
        partial = _number("rope_parameters.full_attention.partial_rotary_factor", partial)
        if partial > 1:
            raise _refuse(
                "rope_parameters.full_attention.partial_rotary_factor",
                partial,
                "expected at most 1",
            )
    local = _number("rope_parameters.sliding_attention.rope_theta", local.get("rope_theta"))
    return (theta, factor, partial, {}), (local, 1.0, 1.0, {}), proportional


def _gemma4_global_heads(c: Mapping, types: list[str], heads: int) -> tuple[int, int]:
    """The global layers' (head_dim, kv heads): ``per_layer_config`` (transformers 5.24 writes
    it: the same head_dim / num_key_value_heads on every full_attention layer, nothing on the
    others), else ``global_head_dim`` and, with ``attention_k_eq_v``, ``num_global_key_value_heads``
    (the released configs' form)."""
    groups = _int(c, "num_key_value_heads")
    per_layer = c.get("per_layer_config")
    if per_layer is None:
        dim = _int(c, "global_head_dim", c.get("global_head_dim", 512))
        found = c.get("num_global_key_value_heads") if c.get("attention_k_eq_v") else None
        found = groups if found is None else _int(c, "num_global_key_value_heads")
    else:
        full = {str(i) for i, t in enumerate(types) if t == "full_attention"}
        values = list(per_layer.values()) if isinstance(per_layer, Mapping) else []
        if (
            not isinstance(per_layer, Mapping)
            or {str(k) for k in per_layer} != full
            or any(v != values[0] or not isinstance(v, Mapping) for v in values)
            or not set(values[0]) <= {"head_dim", "num_key_value_heads"}
        ):
            raise _refuse(
                "per_layer_config",
                repr(per_layer)[:200],
                "computed: one head_dim / num_key_value_heads for every full_attention layer",
            )
        dim = _int(c, "per_layer_config.head_dim", values[0].get("head_dim", c.get("head_dim")))
        found = values[0].get("num_key_value_heads", groups)
        found = _int(c, "per_layer_config.num_key_value_heads", found)
    if heads % found:
        raise _refuse("num_global_key_value_heads", found, f"does not divide {heads} heads")
    return dim, found


def _gemma4(c: Mapping) -> dict:
    """Gemma 4's text model: plain RMSNorms (weight, not 1 + weight) around attention and MLP,
    GeGLU, embeddings times sqrt(hidden), softmax scale 1, q / k / weightless v norms; local
    (windowed) and global layers (``layer_types``, the last global), each type its head_dim and
    kv heads (``_gemma4_global_heads``) and RoPE (``_gemma4_rope``), the global layers' v the k
    projection with ``attention_k_eq_v``; the last ``num_kv_shared_layers`` layers reuse the k / v
    of the last earlier layer of their type (their MLP twice as wide with
    ``use_double_wide_mlp``); per-layer inputs (``hidden_size_per_layer_input``,
    ``vocab_size_per_layer_input``); a scalar per layer; with ``enable_moe_block`` the MoE
    (``num_experts``, ``top_k_experts``, ``moe_intermediate_size``) beside each dense MLP."""
    if c.get("use_bidirectional_attention") not in (None, "vision"):  # vision: images only
        raise _refuse(
            "use_bidirectional_attention",
            repr(c["use_bidirectional_attention"]),
            "not computed (causal only)",
        )
    layers = _layers(c)
    if layers > _GEMMA4_MAX_LAYERS:
        raise _refuse(
            "num_hidden_layers", layers, f"expected at most {_GEMMA4_MAX_LAYERS} for Gemma 4"
        )
    default = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
    types = [*_layer_types(c, layers, default)[:-1], "full_attention"]  # as transformers forces
    full, local, proportional = _gemma4_rope(c)
    kw = _base(c, rope=full)
    head_dim, groups = _gemma4_global_heads(c, types, kw["num_attention_heads"])
    shared = c.get("num_kv_shared_layers") or 0
    if isinstance(shared, bool) or not isinstance(shared, int) or not 0 <= shared < layers:
        raise _refuse("num_kv_shared_layers", repr(shared), f"expected 0 to {layers - 1}")
    if not set(types[layers - shared :]) <= set(types[: layers - shared]):
        raise _refuse("num_kv_shared_layers", shared, "shares a layer type no earlier layer has")
    out = dict(
        **kw,
        sandwich_norm=True,
        glu_activation=_act(c, "hidden_activation", _GELU),
        embedding_multiplier=float(kw["hidden_size"]) ** 0.5,
        attention_scale=1.0,
        final_logit_softcapping=_optional_number(c, "final_logit_softcapping"),
        **_window(c, types, c.get("sliding_window")),
        split_qkv=True,
        global_head_dim=head_dim,
        global_query_groups=groups,
        global_kv_from_k=bool(c.get("attention_k_eq_v")),
        rotary_proportional=proportional,
        local_rotary_base=local[0],
        kv_shared_layers=shared,
        wide_shared_mlp=bool(c.get("use_double_wide_mlp")) and shared > 0,
        layer_scalar=True,
    )
    if c.get("hidden_size_per_layer_input"):
        out.update(
            per_layer_input=_int(c, "hidden_size_per_layer_input"),
            per_layer_vocab=_int(c, "vocab_size_per_layer_input"),
        )
    if c.get("enable_moe_block"):
        out.update(
            **_experts(c, "num_experts", "top_k_experts"),
            moe_ffn_hidden_size=_int(c, "moe_intermediate_size"),
            moe_beside_mlp=True,
        )
    return out


_BIASES = ("attention_bias", "mlp_bias")
_GEMMA_REFUSES = ("attention_bias", "use_bidirectional_attention")
#: transformers' defaults Gemma 2 and 3 share
_GEMMA: dict[str, Any] = dict(
    rms_norm_eps=1e-6,
    head_dim=256,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    tie_word_embeddings=True,
    hidden_activation="gelu_pytorch_tanh",
)
#: transformers' window defaults of the Qwen families
_QWEN: dict[str, Any] = dict(rms_norm_eps=1e-6, sliding_window=4096)

#: transformers' defaults of Qwen3.5 and Qwen3-Next (Gated DeltaNet, partial rotary)
_QWEN35: dict[str, Any] = dict(
    rms_norm_eps=1e-6,
    head_dim=256,
    num_key_value_heads=4,
    partial_rotary_factor=0.25,
    full_attention_interval=4,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
)

#: transformers' defaults of DeepSeek V3 and V3.2 (V3.2 adds the indexer's)
_DEEPSEEK: dict[str, Any] = dict(
    rms_norm_eps=1e-6,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=2048,
    n_shared_experts=1,
    first_k_dense_replace=3,
    n_group=8,
    topk_group=4,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
)

# ------------------------------------------------------------------------------- the table
#: model_type -> family: the models ``verify --against SRC --logits`` computes
FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        _family("llama", "hf_llama", _llama, _BIASES, rms_norm_eps=1e-6),
        _family("mistral", "hf_llama", _mistral, rms_norm_eps=1e-6, sliding_window=4096),
        _family("qwen2", "hf_qwen2", _qwen2, max_window_layers=28, **_QWEN),
        _family(
            "qwen3",
            "hf_qwen3",
            _qwen3,
            ("attention_bias",),
            head_dim=128,
            max_window_layers=28,
            **_QWEN,
        ),
        _family(
            "gpt2",
            "hf_gpt2",
            _gpt2,
            ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"),
            silu=False,
            tie_word_embeddings=True,
        ),
        _family("phi3", "hf_phi3", _phi3, rms_norm_eps=1e-5),
        _family(
            "gemma2",
            "hf_gemma2",
            _gemma2,
            _GEMMA_REFUSES,
            silu=False,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            **_GEMMA,
        ),
        _family("gemma3_text", "hf_gemma3", _gemma3, _GEMMA_REFUSES, silu=False, **_GEMMA),
        _family(
            "gemma4_text",
            "hf_gemma4_text",
            _gemma4,
            ("attention_bias",),
            silu=False,
            rms_norm_eps=1e-6,
            head_dim=256,
            num_key_value_heads=4,
            sliding_window=512,
            tie_word_embeddings=True,
            hidden_activation="gelu_pytorch_tanh",
            max_position_embeddings=131072,
            vocab_size_per_layer_input=262144,
            hidden_size_per_layer_input=256,
        ),
        _family(
            "mixtral",
            "hf_mixtral",
            _mixtral,
            rms_norm_eps=1e-5,
            num_local_experts=8,
            num_experts_per_tok=2,
            rope_theta=1e6,
        ),
        _family(
            "qwen2_moe",
            "hf_qwen2_moe",
            _qwen2_moe,
            max_window_layers=28,
            **_QWEN,
            qkv_bias=True,
            num_experts=60,
            num_experts_per_tok=4,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
            norm_topk_prob=False,
            decoder_sparse_step=1,
        ),
        _family(
            "qwen3_moe",
            "hf_qwen3_moe",
            _qwen3_moe,
            ("attention_bias",),
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            **_QWEN,
        ),
        _family("qwen3_5_text", "hf_qwen3_5", _qwen3_5_text, ("attention_bias",), **_QWEN35),
        _family(
            "qwen3_5_moe_text",
            "hf_qwen3_5_moe",
            _qwen3_5_moe_text,
            ("attention_bias",),
            **{**_QWEN35, "num_key_value_heads": 2},
            num_experts=256,
            num_experts_per_tok=8,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
        ),
        _family(
            "qwen3_next",
            "hf_qwen3_next",
            _qwen3_next,
            ("attention_bias",),
            **{**_QWEN35, "num_key_value_heads": 2},
            num_experts=512,
            num_experts_per_tok=10,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            norm_topk_prob=True,
            decoder_sparse_step=1,
        ),
        _family(
            "llama4_text",
            "hf_llama4_text",
            _llama4_text,
            ("attention_bias",),
            rms_norm_eps=1e-5,
            head_dim=128,
            rope_theta=5e5,
            intermediate_size_mlp=16384,
            num_local_experts=16,
            num_experts_per_tok=1,
            interleave_moe_layer_step=1,
            no_rope_layer_interval=4,
            attention_chunk_size=8192,
            use_qk_norm=True,
            attn_temperature_tuning=True,
            floor_scale=8192,
            attn_scale=0.1,
        ),
        _family(
            "gpt_oss",
            "hf_gpt_oss",
            _gpt_oss,
            silu=False,
            rms_norm_eps=1e-5,
            head_dim=64,
            rope_theta=150000.0,
            rope_parameters=dict(
                rope_type="yarn",
                factor=32.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=4096,
            ),
            sliding_window=128,
            num_local_experts=128,
            num_experts_per_tok=4,
            swiglu_alpha=1.702,
            swiglu_limit=7.0,
            attention_bias=True,
        ),
        _family(
            "deepseek_v3",
            "hf_deepseek_v3",
            _deepseek_v3,
            ("attention_bias",),
            rope_interleave=True,
            **_DEEPSEEK,
        ),
        _family(
            "deepseek_v32",
            "hf_deepseek_v3",
            _deepseek_v32,
            ("attention_bias",),
            **_DEEPSEEK,
            index_topk=2048,
            index_head_dim=128,
            index_n_heads=64,
        ),
        _family(
            "granite",
            "hf_llama",
            _granite,
            _BIASES,
            rms_norm_eps=1e-6,
            embedding_multiplier=1.0,
            residual_multiplier=1.0,
            attention_multiplier=1.0,
            logits_scaling=1.0,
        ),
        _family("olmo2", "hf_olmo2", _olmo2, ("attention_bias",), rms_norm_eps=1e-5),
        _family(
            "olmo3",
            "hf_olmo3",
            _olmo3,
            ("attention_bias",),
            rms_norm_eps=1e-5,
            sliding_window=4096,
        ),
        _family(
            "smollm3",
            "hf_llama",
            _smollm3,
            _BIASES,
            rms_norm_eps=1e-6,
            rope_theta=2e6,
            no_rope_layer_interval=4,
            tie_word_embeddings=True,
        ),
        _family(
            "glm4_moe",
            "hf_glm4_moe",
            _glm4_moe,
            rms_norm_eps=1e-5,
            partial_rotary_factor=0.5,
            n_routed_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=1408,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=1.0,
        ),
        _family(
            "ernie4_5_moe",
            "hf_ernie4_5_moe",
            _ernie4_5_moe,
            ("use_bias",),
            rms_norm_eps=1e-5,
            rope_theta=5e5,
            tie_word_embeddings=True,
            moe_num_experts=64,
            moe_k=6,
            moe_intermediate_size=1536,
            moe_num_shared_experts=2,
            moe_layer_start_index=1,
            moe_layer_end_index=-1,
            moe_layer_interval=1,
            moe_norm_min=1e-12,
        ),
        _family(
            "minimax_m2",
            "hf_minimax_m2",
            _minimax_m2,
            rms_norm_eps=1e-6,
            head_dim=128,
            rope_theta=5e6,
            num_local_experts=256,
            num_experts_per_tok=8,
        ),
        _family(
            "kimi_k25",
            "hf_kimi_k25",
            _text_model("deepseek_v3", "kimi_k2"),  # kimi_k2: the released config's name
            silu=False,
            tie_word_embeddings=True,
        ),
        *(  # the text model of each, its spec's names as the import names them (importers)
            _family(f, spec, _text_model(f"{f}_text"), silu=False, tie_word_embeddings=tied)
            for f, spec, tied in (
                ("llama4", "hf_llama4_text", False),
                ("qwen3_5", "hf_qwen3_5", False),
                ("qwen3_5_moe", "hf_qwen3_5_moe", False),
                ("gemma4", "hf_gemma4_text", True),
            )
        ),
        _family(
            "stablelm",
            "hf_stablelm",
            _stablelm,
            ("qk_layernorm", "use_parallel_residual"),
            layer_norm_eps=1e-5,
            partial_rotary_factor=0.25,
        ),
    )
}
