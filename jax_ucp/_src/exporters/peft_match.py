"""peft's rules for which module an adapter config's names select (``target_modules``,
``exclude_modules``, ``rank_pattern``, ``modules_to_save``), applied as peft 0.21 applies them,
with a cost bound: a config is untrusted, and peft's patterns are Python regexes, whose
backtracking a crafted one makes exponential. Only a subset is evaluated (literals, ``.``,
classes, ``\\d``-style escapes, ``(...)`` / ``(?:...)`` with ``|``, quantifiers on one character,
``?`` on a group), whose paths are counted before any match runs; anything else is refused."""

from __future__ import annotations

import re
from collections.abc import Sequence

from jax_ucp._src.errors import RequestError

MAX_PATTERN = 256  # characters of one pattern
MAX_PATHS = 10**8  # paths the matcher may try over every module name, all patterns together
_ESCAPES = frozenset("dDwWsS.\\-_/[](){}|*+?^$")  # after a backslash: no backreference, no \b
_QUANTIFIER = re.compile(r"(?:[*+?]|\{[0-9]{1,3}(?:,[0-9]{0,3})?\})[?+]?")


def paths(pattern: str, n: int) -> int:
    """How many paths Python's matcher can try for ``pattern`` on a name of ``n`` characters at
    most (each quantified character a choice of n + 1 counts, each ``|`` a branch); a
    ``ValueError`` saying what falls outside the subset this bound holds for."""
    if len(pattern) > MAX_PATTERN:
        raise ValueError(f"longer than {MAX_PATTERN} characters")
    pos = 0

    def alternatives() -> int:
        nonlocal pos
        total = sequence()
        while pos < len(pattern) and pattern[pos] == "|":
            pos += 1
            total += sequence()
        return total

    def sequence() -> int:
        nonlocal pos
        product = 1
        while pos < len(pattern) and pattern[pos] not in "|)":
            c, pos = pattern[pos], pos + 1
            count, group = 1, c == "("
            if group:
                if pattern.startswith("?", pos):
                    if not pattern.startswith("?:", pos):
                        raise ValueError(f"'(?' at {pos - 1} (lookaround, flag or named group)")
                    pos += 2
                count = alternatives()
                if not pattern.startswith(")", pos):
                    raise ValueError("an unclosed '('")
                pos += 1
            elif c in "[\\":
                pos = _class_end(pattern, pos) if c == "[" else _escape_end(pattern, pos)
            elif c in "*+?{":
                raise ValueError(f"{c!r} at {pos - 1} repeats nothing")
            q = _QUANTIFIER.match(pattern, pos)
            if q:
                pos = q.end()
                if group and q.group() != "?":
                    raise ValueError(f"{q.group()!r} on a group (nested repetition)")
                count = 1 + count if group else count * (n + 1)
            product *= count
        return product

    total = alternatives()
    if pos < len(pattern):
        raise ValueError(f"an unmatched ')' at {pos}")
    return total


def _escape_end(pattern: str, pos: int) -> int:
    """Past the escape whose backslash ends at ``pos``, one of :data:`_ESCAPES` only."""
    if pattern[pos : pos + 1] not in _ESCAPES:
        raise ValueError(f"the escape {pattern[pos - 1 : pos + 1]!r}")
    return pos + 1


def _class_end(pattern: str, pos: int) -> int:
    """Past the character class opened before ``pos`` (no nested ``[``)."""
    end = pos + (pattern[pos : pos + 1] == "^")
    end += pattern[end : end + 1] == "]"
    while end < len(pattern) and pattern[end] != "]":
        if pattern[end] == "[":
            raise ValueError("'[' in a class")
        end = _escape_end(pattern, end + 1) if pattern[end] == "\\" else end + 1
    if end >= len(pattern):
        raise ValueError("an unclosed '['")
    return end + 1


def checked(patterns: Sequence[str], names: Sequence[str], field: str, where: str) -> None:
    """Each of ``patterns`` (the regexes of ``field``) in the subset, and matching all of
    ``names`` within :data:`MAX_PATHS`; else refused naming the pattern and why."""
    n = max((len(x) for x in names), default=0) + 2  # peft's (.*\.)? prefix of rank_pattern
    total = 0
    for pattern in patterns:
        try:
            total += (n + 2) * paths(pattern, n) * max(len(names), 1)
            re.compile(pattern)  # a range or a count out of order
        except (ValueError, re.error) as e:
            raise RequestError(
                f"adapter export: {where} {field} pattern {pattern!r} is not evaluated here "
                f"({e}): a regex of literals, '.', classes, groups and '|', repeating single "
                f"characters only, is"
            ) from None
    if total > MAX_PATHS:
        raise RequestError(
            f"adapter export: {where} {field} patterns {list(patterns)!r} may try {total:.2e} "
            f"paths over {len(names)} module names (at most {MAX_PATHS:.0e}): a simpler "
            f"pattern, or a list of names"
        )


def selects(spec: str | Sequence[str], module: str) -> bool:
    """peft's ``target_modules`` / ``exclude_modules`` rule: a string is a regex matching the
    whole name; a list names a module, or the last parts of its name (checked before)."""
    if isinstance(spec, str):
        return re.fullmatch(spec, module) is not None
    return module in spec or any(module.endswith(f".{s}") for s in spec)


def rank_key(patterns: Sequence[str], module: str) -> str | None:
    """The first ``rank_pattern`` key that names ``module`` as peft matches it."""
    return next((k for k in patterns if re.match(rf"(.*\.)?({k})$", module)), None)


def saved_by(modules_to_save: Sequence[str], module: str) -> bool:
    """peft's rule that keeps LoRA off a ``modules_to_save`` module (each name a regex there)."""
    return any(re.match(rf"(^|.*\.){m}($|\..*)", module) for m in modules_to_save)
