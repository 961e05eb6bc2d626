"""Layer 5: Orbax integration and the save/restore/inspect entry points.

Names are loaded on first use: ``host_writer`` / ``stream`` / ``tensor_writes`` / ``commit``
(the importers' write path) need neither JAX nor Orbax and must not pull them in.
"""

from __future__ import annotations

from jax_ucp._lazy import lazy_attributes

_LAZY = {
    "inspect": "jax_ucp.handler.api",
    "restore": "jax_ucp.handler.api",
    "save": "jax_ucp.handler.api",
    "UCPCheckpointHandler": "jax_ucp.handler.checkpoint_handler",
    "UCPRestore": "jax_ucp.handler.checkpoint_handler",
    "UCPSave": "jax_ucp.handler.checkpoint_handler",
    "UCPStreamSave": "jax_ucp.handler.checkpoint_handler",
    "CheckpointError": "jax_ucp.handler.reader",
    "HostItem": "jax_ucp.handler.stream",
}

__all__ = list(_LAZY)


__getattr__, __dir__ = lazy_attributes(globals(), _LAZY)
