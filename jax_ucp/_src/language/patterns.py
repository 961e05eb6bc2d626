r"""Spec patterns run on RE2, in time linear in the name: they come from files jax_ucp does not
control, and Python's ``re`` backtracks exponentially (``(\w+\.?)+\.never``). What RE2 refuses, and
``{,n}`` (``{0,n}`` to Python, literal to RE2), is a :class:`LanguageError`; ``\d``, ``\w``, ``\s``,
``\b`` are ASCII classes."""

from __future__ import annotations

import re
from typing import Any

import re2

from jax_ucp._src.errors import LanguageError

#: Longest pattern accepted (a spec's patterns are a few dozen characters).
MAX_PATTERN_CHARS = 4096
#: Memory RE2 may use for one compiled pattern (bounds what a huge repetition can cost).
MAX_PROGRAM_BYTES = 8 << 20

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # the error is raised to the caller, not printed by RE2
_OPTIONS.max_mem = MAX_PROGRAM_BYTES


def _python_only_quantifier(pattern: str) -> bool:
    """True when ``pattern`` holds ``{,n}`` outside a class (Python and RE2 differ)."""
    plain = re.sub(r"\\.", "e", pattern, flags=re.S)  # escapes out of the way, then classes
    plain = re.sub(r"\[\^?\]?[^\]]*(?:\]|$)", "c", plain)  # (a leading ']' is a literal)
    return re.search(r"\{,[0-9]+\}", plain) is not None


def compile_pattern(pattern: Any, where: str = "") -> Any:
    """``pattern`` compiled with RE2, or an error starting with ``where``."""
    if not isinstance(pattern, str):
        raise LanguageError(f"{where}pattern must be a string, got {type(pattern).__name__}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise LanguageError(
            f"{where}pattern {pattern[:60]!r}... is {len(pattern)} characters long; at most "
            f"{MAX_PATTERN_CHARS} are accepted"
        )
    if _python_only_quantifier(pattern):
        raise LanguageError(
            f"{where}pattern {pattern!r}: write '{{0,n}}' instead of '{{,n}}' (patterns run on "
            "RE2, which reads '{,n}' as literal text)"
        )
    try:
        return re2.compile(pattern, _OPTIONS)
    except re2.error as e:
        reason = e.args[0] if e.args else str(e)
        if isinstance(reason, bytes):
            reason = reason.decode("utf-8", "replace")
        raise LanguageError(
            f"{where}bad regex {pattern[:200]!r}: {reason} (patterns are matched with RE2, in "
            "time linear in the name: no back-references, look-arounds, possessive or atomic "
            "groups, (?x) or \\Z; see docs/LANGUAGE.md, 'Patterns')"
        ) from None
