"""The plain form of kinds and ops (TOML or dict): ``"name"`` or ``{<tag> = "name", parameter =
value, ...}``; one parser for both registries, so both give the same errors."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jax_ucp._src.errors import LanguageError
from jax_ucp._src.language.settings import MAX_EXPRESSION_CHARS


def plain_fields(obj: Any) -> dict:
    """The dataclass ``obj``'s non-default fields as plain (TOML) values."""

    def plain(v):
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        return v.to_dict() if hasattr(v, "to_dict") else v

    def default(f: dataclasses.Field) -> Any:
        factory = f.default_factory
        return f.default if factory is dataclasses.MISSING else factory()

    fields = dataclasses.fields(obj)
    return {
        f.name: plain(getattr(obj, f.name)) for f in fields if getattr(obj, f.name) != default(f)
    }


def _longest_string(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        return max((_longest_string(v) for v in value), default=0)
    return 0


def parse_plain_form(
    obj: Any,
    *,
    tag: str,
    registry: Mapping[str, type],
    a_noun: str,
    where: str,
    convert: Callable[[str, Any], Any],
) -> tuple[type, dict]:
    """(class, keyword arguments) from the plain form; unknown names list the known.

    Args:
        obj: the plain value: a name, or a table with ``tag`` and parameters
        tag: the key naming the class in a table (``kind``, ``op``)
        registry: name -> dataclass
        a_noun: what is parsed, for messages (``a kind``)
        where: the message prefix (file, table, line)
        convert: ``convert(parameter, value)`` -> the field's value"""
    noun = a_noun.split(" ", 1)[1]
    if isinstance(obj, str):
        obj = {tag: obj}
    if not isinstance(obj, Mapping) or tag not in obj:
        raise LanguageError(f"{where}{a_noun} must be a name or a table with '{tag}', got {obj!r}")
    name = obj[tag]
    cls = registry.get(name)
    if cls is None:
        raise LanguageError(
            f"{where}unknown {noun} {name!r} (known: {', '.join(sorted(registry))})"
        )
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in obj.items():
        if key == tag:
            continue
        if key not in fields:
            raise LanguageError(
                f"{where}{noun} {name!r} has no parameter {key!r} "
                f"(known: {', '.join(sorted(fields)) or 'none'})"
            )
        if _longest_string(value) > MAX_EXPRESSION_CHARS:  # expressions are short formulas
            raise LanguageError(
                f"{where}{noun} {name!r}: parameter {key!r} holds a string of "
                f"{_longest_string(value)} characters; at most {MAX_EXPRESSION_CHARS} are accepted"
            )
        kwargs[key] = convert(key, value)
    return cls, kwargs
