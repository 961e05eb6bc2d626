"""jax_ucp: Universal Checkpointing for JAX on Orbax.

Save distributed (each process writes its own shards), land every tensor as one consolidated
zarr v3 array, restore onto any mesh; import DeepSpeed / Megatron checkpoints.

The JAX/Orbax-facing names are loaded on first use (PEP 562): importers and the ``convert``
command are host-only and start without paying JAX's and Orbax's import (~1 s).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jax_ucp._src.errors import (
    CheckpointError,
    LanguageError,
    MultiProcessError,
    OptimizerOrderWarning,
    RequestError,
    ResumeWarning,
    SaveConflictError,
    SourceError,
    UnsafeFileError,
)
from jax_ucp._src.format import Manifest, TensorEntry, UCPError, ValueEntry
from jax_ucp._src.lazy_names import lazy_attributes as _lazy_attributes
from jax_ucp._src.version import __version__

_LAZY = {
    "UCPCheckpointHandler": "jax_ucp._src.orbax.handler",
    "UCPRestore": "jax_ucp._src.orbax.handler",
    "RestoreOptions": "jax_ucp._src.restoring.options",
    "UCPSave": "jax_ucp._src.orbax.handler",
    "UCPHandler": "jax_ucp._src.orbax.v1",
    "orbax_v1_context": "jax_ucp._src.orbax.v1",
    "inspect": "jax_ucp._src.restoring.inspecting",
    "latest_step": "jax_ucp._src.api",
    "verify": "jax_ucp._src.api",
    "abstract_mesh": "jax_ucp._src.restoring.plan",
    "plan": "jax_ucp._src.restoring.plan",
    "diff": "jax_ucp._src.restoring.checks",
    "restore": "jax_ucp._src.restoring.restore_entry",
    "save": "jax_ucp._src.api",
    "ReplicationWarning": "jax_ucp._src.sharding.mesh_layout",
    "convert": "jax_ucp._src.conversion",
    "export": "jax_ucp._src.exporters",
    "set_object_store_options": "jax_ucp._src.store.location",
    "optax_from_torch": "jax_ucp._src.optax_torch",
    "TorchOptimizer": "jax_ucp._src.optax_torch",
}

if TYPE_CHECKING:  # what _LAZY loads at run time, named for type checkers (test_public_api)
    from jax_ucp._src.api import latest_step, save, verify
    from jax_ucp._src.conversion import convert
    from jax_ucp._src.exporters import export
    from jax_ucp._src.optax_torch import TorchOptimizer, optax_from_torch
    from jax_ucp._src.orbax.handler import UCPCheckpointHandler, UCPRestore, UCPSave
    from jax_ucp._src.orbax.v1 import UCPHandler, orbax_v1_context
    from jax_ucp._src.restoring.checks import diff
    from jax_ucp._src.restoring.inspecting import inspect
    from jax_ucp._src.restoring.options import RestoreOptions
    from jax_ucp._src.restoring.plan import abstract_mesh, plan
    from jax_ucp._src.restoring.restore_entry import restore
    from jax_ucp._src.sharding.mesh_layout import ReplicationWarning
    from jax_ucp._src.store.location import set_object_store_options

__all__ = [
    "CheckpointError",
    "LanguageError",
    "Manifest",
    "MultiProcessError",
    "OptimizerOrderWarning",
    "ReplicationWarning",
    "RequestError",
    "RestoreOptions",
    "ResumeWarning",
    "SaveConflictError",
    "SourceError",
    "TensorEntry",
    "TorchOptimizer",
    "UCPCheckpointHandler",
    "UCPError",
    "UCPHandler",
    "UCPRestore",
    "UCPSave",
    "UnsafeFileError",
    "ValueEntry",
    "__version__",
    "abstract_mesh",
    "convert",
    "diff",
    "export",
    "inspect",
    "latest_step",
    "optax_from_torch",
    "orbax_v1_context",
    "plan",
    "restore",
    "save",
    "set_object_store_options",
    "verify",
]


__getattr__, _ = _lazy_attributes(globals(), _LAZY)


def __dir__() -> list[str]:
    """The public API only (not this module's imports and helpers)."""
    return sorted(__all__)
