"""How Megatron tensors are spread over tensor-parallel ranks (the default import rules), and
which saved run arguments become import settings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jax_ucp._src.language import QKV, ImportRule, Partitioned, Replicated, Spec, SwiGLU, Vocab

_VOCAB = r"(?:.*\.)?(?:embedding\.word_embeddings\.weight|output_layer\.(?:weight|bias))"

# Megatron-LM run arguments (pickled argparse.Namespace) taken as import settings.
ARG_SETTINGS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "swiglu",
    "padded_vocab_size",
    "make_vocab_size_divisible_by",
    "untie_embeddings_and_output_weights",
    "group_query_attention",
    "normalization",
    "position_embedding_type",
    "num_experts",
    "vocab_size",
    "overlap_grad_reduce",
    "data_parallel_size",
    "ddp_bucket_size",
    "add_bias_linear",
    "max_position_embeddings",
)


def add_arg_settings(args: Mapping[str, Any], settings: dict) -> None:
    """The saved run arguments that are import settings, where ``settings`` has none yet."""
    settings.update(
        {k: v for k, v in args.items() if k in ARG_SETTINGS and settings.get(k) is None}
    )


def default_import_rules(settings: Mapping[str, Any]) -> list:
    """How each Megatron tensor is spread over TP ranks (megatron-core and older Megatron-LM names).

    Dims count from the end so the same rule covers per-layer and stacked ``[L, ...]`` tensors.
    ``qkv`` is used when the head counts are known (it checks the per-query-group layout),
    ``swiglu`` when the MLP is gated; otherwise plain ``partitioned``.
    """
    vocab = (
        Vocab(dim=0, vocab_size=int(settings["vocab_size"]))
        if settings.get("vocab_size") is not None
        else Partitioned(dim=0)
    )
    heads, head_dim = settings.get("num_attention_heads"), settings.get("head_dim")
    if heads and head_dim:
        groups = int(settings.get("num_query_groups") or heads)
        layout: dict[str, Any] = dict(
            num_heads=int(heads), num_kv_heads=groups, head_dim=int(head_dim)
        )
        qkv_weight, qkv_bias = QKV(dim=-2, **layout), QKV(dim=-1, **layout)
    else:
        qkv_weight, qkv_bias = Partitioned(dim=-2), Partitioned(dim=-1)
    fc1 = SwiGLU if settings.get("swiglu") or settings.get("gated_linear_unit") else Partitioned
    qkv = r".*\.(?:linear_qkv|query_key_value)"
    column_parallel = r".*\.(?:linear_fc1|dense_h_to_4h)"
    row_parallel = r".*\.(?:linear_proj|dense|linear_fc2|dense_4h_to_h)"
    rules = [
        (_VOCAB, vocab, "vocab-parallel embedding / output layer"),
        (r"(?:.*\.)?position_embeddings\.weight", Replicated(), ""),
        (rf"{qkv}\.weight", qkv_weight, "fused qkv"),
        (rf"{qkv}\.bias", qkv_bias, "fused qkv bias"),
        (rf"{column_parallel}\.weight", fc1(dim=-2), "fc1"),
        (rf"{column_parallel}\.bias", fc1(dim=-1), "fc1 bias"),
        (rf"{row_parallel}\.weight", Partitioned(dim=-1), "row-parallel"),
        (rf"{row_parallel}\.bias", Replicated(), "row-parallel bias"),
        (r".*(?:norm|layer_norm)[^.]*\.(?:weight|bias)", Replicated(), "norms"),
        (r".*\.router\.(?:weight|expert_bias)", Replicated(), "MoE router"),
    ]
    return [ImportRule(p, kind, label=label, required=False) for p, kind, label in rules]


def import_rules_spec(user_spec: Spec | None, settings: dict) -> Spec:
    """The spec used to classify names: the user's import rules if it has any, else the defaults."""
    known = {k: v for k, v in settings.items() if v is not None}
    if user_spec is not None and user_spec.imports:
        return user_spec.with_settings(**known)
    return Spec(
        name="megatron-default-import",
        settings=known,
        imports=tuple(default_import_rules(settings)),
        strict=False,
    )
