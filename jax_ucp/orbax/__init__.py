"""Orbax integration: the v0 ``UCPCheckpointHandler`` with its ``UCPSave`` / ``UCPRestore``
args, the v1 ``UCPHandler`` (``jax_ucp.orbax.v1``), and an Orbax export as a
CheckpointManager step.

The code is in ``jax_ucp._src``."""

from jax_ucp._src.exporters.orbax_out import export_orbax as export_orbax
from jax_ucp._src.orbax.handler import UCPCheckpointHandler as UCPCheckpointHandler
from jax_ucp._src.orbax.handler import UCPRestore as UCPRestore
from jax_ucp._src.orbax.handler import UCPSave as UCPSave
from jax_ucp._src.orbax.v1 import UCPHandler as UCPHandler

__all__ = [
    "UCPCheckpointHandler",
    "UCPHandler",
    "UCPRestore",
    "UCPSave",
    "export_orbax",
]
