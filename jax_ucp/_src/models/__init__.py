"""Flax definitions of the models the importers target (Megatron GPT and Llama-style).

``TransformerLM`` with a ``LMConfig`` covers GPT (LayerNorm, GELU, learned positions), Llama
(RMSNorm, SwiGLU, GQA, RoPE) and MoE layers (megatron-core's top-k router + experts). Parameter
names follow the shipped specs' restore targets (``wte``, ``wpe``, ``layers_{i}/{ln_1,
attn/{qkv,proj}, ln_2, mlp/{fc1,fc2} | moe/{router,fc1,fc2}}``, ``ln_f``, ``lm_head``), and
``from_megatron`` maps an imported (raw, torch-layout) params dict into that tree with those
specs' restore rules (``shipped_spec_for`` picks the spec).
"""

from jax_ucp._src.models.transformer import LMConfig, TransformerLM, from_megatron, shipped_spec_for

__all__ = ["LMConfig", "TransformerLM", "from_megatron", "shipped_spec_for"]
