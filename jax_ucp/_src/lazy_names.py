"""Module attributes loaded on first use (PEP 562), so host-only paths never import JAX/Orbax."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


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
