"""Module attributes loaded on first use (PEP 562), so host-only paths never import JAX/Orbax."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

#: ``jax_ucp``'s names, each with the module it is loaded from on first use: the one list of
#: the top-level API (its ``__all__``). ``jax_ucp/__init__.pyi`` names the same for type
#: checkers; tests/test_public_api.py keeps the two in step.
PUBLIC = {
    "CheckpointError": "jax_ucp._src.errors",
    "LanguageError": "jax_ucp._src.errors",
    "MultiProcessError": "jax_ucp._src.errors",
    "OptimizerOrderWarning": "jax_ucp._src.errors",
    "RequestError": "jax_ucp._src.errors",
    "ResumeWarning": "jax_ucp._src.errors",
    "SaveConflictError": "jax_ucp._src.errors",
    "SourceError": "jax_ucp._src.errors",
    "UCPError": "jax_ucp._src.errors",
    "UnsafeFileError": "jax_ucp._src.errors",
    "Manifest": "jax_ucp._src.format",
    "TensorEntry": "jax_ucp._src.format",
    "ValueEntry": "jax_ucp._src.format",
    "__version__": "jax_ucp._src.version",
    "UCPCheckpointHandler": "jax_ucp._src.orbax.handler",
    "UCPRestore": "jax_ucp._src.orbax.handler",
    "UCPSave": "jax_ucp._src.orbax.handler",
    "UCPHandler": "jax_ucp._src.orbax.v1",
    "orbax_v1_context": "jax_ucp._src.orbax.v1",
    "RestoreOptions": "jax_ucp._src.restoring.options",
    "inspect": "jax_ucp._src.restoring.inspecting",
    "latest_step": "jax_ucp._src.api",
    "save": "jax_ucp._src.api",
    "verify": "jax_ucp._src.api",
    "abstract_mesh": "jax_ucp._src.restoring.plan",
    "plan": "jax_ucp._src.restoring.plan",
    "diff": "jax_ucp._src.restoring.checks",
    "restore": "jax_ucp._src.restoring.restore_entry",
    "ReplicationWarning": "jax_ucp._src.sharding.mesh_layout",
    "convert": "jax_ucp._src.conversion",
    "export": "jax_ucp._src.exporters",
    "set_object_store_options": "jax_ucp._src.store.storage.object_store",
    "optax_from_torch": "jax_ucp._src.optax_torch",
    "TorchOptimizer": "jax_ucp._src.optax_torch",
}


def lazy_attributes(
    namespace: dict, where: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list]]:
    """``__getattr__`` and ``__dir__`` for a package whose names ``where`` maps to their modules."""

    def __getattr__(name: str):
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later lookups are plain attribute reads
        return value

    def __dir__():
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
