"""Orbax's v1 API (``orbax.checkpoint.experimental.v1``): the handler and the type strings of
checkpoints it also reads (its context: ``jax_ucp.orbax_v1_context``).

The code is in ``jax_ucp._src``."""

from jax_ucp._src.orbax.v1 import SECONDARY_TYPESTRS as SECONDARY_TYPESTRS
from jax_ucp._src.orbax.v1 import UCPHandler as UCPHandler

__all__ = [
    "SECONDARY_TYPESTRS",
    "UCPHandler",
]
