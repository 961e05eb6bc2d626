"""Layer 5: Orbax integration and the save/restore/inspect entry points.

Names are loaded on first use, so importing the package costs nothing until JAX is needed.
"""

from __future__ import annotations

from jax_ucp.lazy_names import lazy_attributes

_LAZY = {
    "inspect": "jax_ucp.handler.api",
    "restore": "jax_ucp.handler.api",
    "save": "jax_ucp.handler.api",
    "UCPCheckpointHandler": "jax_ucp.handler.checkpoint_handler",
    "UCPRestore": "jax_ucp.handler.checkpoint_handler",
    "UCPSave": "jax_ucp.handler.checkpoint_handler",
    "UCPStreamSave": "jax_ucp.handler.checkpoint_handler",
    "CheckpointError": "jax_ucp.handler.reader",
    "write_manager_step": "jax_ucp.handler.manager_step",
}

__all__ = list(_LAZY)


__getattr__, __dir__ = lazy_attributes(globals(), _LAZY)
