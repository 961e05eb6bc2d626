"""Layer 5: Orbax integration and the save/restore/inspect entry points.

Names are loaded on first use: ``host_writer`` / ``stream`` / ``tensor_writes`` / ``commit``
(the importers' write path) need neither JAX nor Orbax and must not pull them in.
"""

from __future__ import annotations

import importlib

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


def __getattr__(name: str):
  module = _LAZY.get(name)
  if module is None:
    raise AttributeError(f"module 'jax_ucp.handler' has no attribute {name!r}")
  value = getattr(importlib.import_module(module), name)
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(_LAZY))
