"""Module attributes loaded on first use (PEP 562), so host-only paths never import JAX/Orbax."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

_API = "jax_ucp._src.api"
_ERRORS = "jax_ucp._src.errors"
_FORMAT = "jax_ucp._src.format"
_HANDLER = "jax_ucp._src.orbax.handler"
_OPTAX_TORCH = "jax_ucp._src.optax_torch"
_PLAN = "jax_ucp._src.restoring.plan"
_V1 = "jax_ucp._src.orbax.v1"

#: ``jax_ucp``'s names, each with the module it is loaded from on first use: the one list of
#: the top-level API (its ``__all__``). ``jax_ucp/__init__.pyi`` names the same for type
#: checkers; tests/test_public_api.py keeps the two in step.
PUBLIC = {
    "CheckpointError": _ERRORS,
    "LanguageError": _ERRORS,
    "MultiProcessError": _ERRORS,
    "OptimizerOrderWarning": _ERRORS,
    "RequestError": _ERRORS,
    "ResumeWarning": _ERRORS,
    "SaveConflictError": _ERRORS,
    "SourceError": _ERRORS,
    "UCPError": _ERRORS,
    "UnsafeFileError": _ERRORS,
    "Manifest": _FORMAT,
    "TensorEntry": _FORMAT,
    "ValueEntry": _FORMAT,
    "__version__": "jax_ucp._src.version",
    "UCPCheckpointHandler": _HANDLER,
    "UCPRestore": _HANDLER,
    "UCPSave": _HANDLER,
    "UCPHandler": _V1,
    "orbax_v1_context": _V1,
    "RestoreOptions": "jax_ucp._src.restoring.options",
    "inspect": "jax_ucp._src.restoring.inspecting",
    "latest_step": _API,
    "save": _API,
    "verify": _API,
    "abstract_mesh": _PLAN,
    "plan": _PLAN,
    "diff": "jax_ucp._src.restoring.checks",
    "restore": "jax_ucp._src.restoring.restore_entry",
    "ReplicationWarning": "jax_ucp._src.sharding.mesh_layout",
    "convert": "jax_ucp._src.conversion",
    "export": "jax_ucp._src.exporters",
    "set_object_store_options": "jax_ucp._src.store.storage.object_store",
    "optax_from_torch": _OPTAX_TORCH,
    "TorchOptimizer": _OPTAX_TORCH,
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
