"""A reference flax model (a Llama / GPT-style decoder) that imported checkpoints restore into.

The code is in ``jax_ucp._src``."""

from jax_ucp._src.models import LMConfig as LMConfig
from jax_ucp._src.models import TransformerLM as TransformerLM
from jax_ucp._src.models import from_megatron as from_megatron

__all__ = [
    "LMConfig",
    "TransformerLM",
    "from_megatron",
]
