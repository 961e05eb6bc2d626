"""The names Orbax recorded before the handlers moved to ``jax_ucp.orbax`` (issue 31), kept so
checkpoints written then still load.

Orbax writes each item's handler by its qualified name into every step it saves
(``_CHECKPOINT_METADATA``): ``jax_ucp.handler.checkpoint_handler.UCPCheckpointHandler`` for a
CheckpointManager step, ``jax_ucp.handler.orbax_v1.UCPHandler`` for a v1 checkpoint. Both old
module names are the modules themselves (``sys.modules`` aliases, not copies), so a class
looked up by either name is the one class. New code imports ``jax_ucp.orbax``.
"""

from __future__ import annotations

import importlib
import sys

__all__: list[str] = []

#: old module name (under ``jax_ucp.handler``) -> the module it is now
_MOVED = {
    "checkpoint_handler": "jax_ucp._src.orbax.handler",
    "orbax_v1": "jax_ucp._src.orbax.v1",
}

for _old, _new in _MOVED.items():
    globals()[_old] = sys.modules[f"{__name__}.{_old}"] = importlib.import_module(_new)
