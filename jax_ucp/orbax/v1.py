"""Orbax's v1 API (``orbax.checkpoint.experimental.v1``): the handler, its context and the
type strings of checkpoints it also reads.

The code is in ``jax_ucp._src``."""

from jax_ucp._src.orbax.v1 import SECONDARY_TYPESTRS as SECONDARY_TYPESTRS
from jax_ucp._src.orbax.v1 import UCPHandler as UCPHandler
from jax_ucp._src.orbax.v1 import context as context

__all__ = [
    "SECONDARY_TYPESTRS",
    "UCPHandler",
    "context",
]
