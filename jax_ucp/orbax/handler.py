"""The module name Orbax recorded for the v0 handler in steps saved before the move to
``_src`` (its ``_CHECKPOINT_METADATA``), so those steps still load by name.

The code is in ``jax_ucp._src``."""

from jax_ucp._src.orbax.handler import UCPCheckpointHandler as UCPCheckpointHandler
from jax_ucp._src.orbax.handler import UCPRestore as UCPRestore
from jax_ucp._src.orbax.handler import UCPSave as UCPSave

__all__ = [
    "UCPCheckpointHandler",
    "UCPRestore",
    "UCPSave",
]
