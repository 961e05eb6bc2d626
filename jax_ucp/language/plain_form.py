"""Reading the plain (TOML / dict) form of kinds and ops: one parser for both registries."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jax_ucp.language.errors import SpecError


def parse_plain(
    obj: Any,
    *,
    tag: str,
    registry: Mapping[str, type],
    a_noun: str,
    where: str,
    convert: Callable[[str, Any], Any],
) -> tuple[type, dict]:
    """(class, keyword arguments) from ``"name"`` or ``{<tag> = "name", param = value, ...}``.

    Unknown names and parameters are errors that list what is known, prefixed with ``where``.
    """
    noun = a_noun.split(" ", 1)[1]
    if isinstance(obj, str):
        obj = {tag: obj}
    if not isinstance(obj, Mapping) or tag not in obj:
        raise SpecError(f"{where}{a_noun} must be a name or a table with '{tag}', got {obj!r}")
    name = obj[tag]
    cls = registry.get(name)
    if cls is None:
        raise SpecError(f"{where}unknown {noun} {name!r} (known: {', '.join(sorted(registry))})")
    fields = {f.name for f in dataclasses.fields(cls)}
    kw = {}
    for k, v in obj.items():
        if k == tag:
            continue
        if k not in fields:
            raise SpecError(
                f"{where}{noun} {name!r} has no parameter {k!r} "
                f"(known: {', '.join(sorted(fields)) or 'none'})"
            )
        kw[k] = convert(k, v)
    return cls, kw
