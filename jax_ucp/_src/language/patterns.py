"""Name patterns matched in time linear in the name: every spec pattern runs on RE2.

Patterns come from files jax_ucp does not control (a spec TOML, the
``universal_checkpoint_info`` inside a DeepSpeed checkpoint). Python's ``re`` backtracks: a
pattern such as ``(\\w+\\.?)+\\.never`` takes exponential time on an ordinary parameter name,
so one line of a file could hang an import. RE2 (``google-re2``) guarantees time linear in the
name and bounded memory for the compiled program, and speaks Python's syntax for what it
supports. One engine for every spec pattern, however the spec was written (a file or Python
objects), so a spec means the same in code and in TOML (``spec_to_toml`` round-trips).

What RE2 refuses (back-references, look-arounds, possessive or atomic groups, ``(?x)``,
``\\Z``, counted repetitions above 1000) is a :class:`LanguageError` naming the pattern and where it
came from; so is ``{,n}``, which Python reads as ``{0,n}`` and RE2 as literal text. ``\\d``,
``\\w``, ``\\s`` and ``\\b`` are ASCII classes in RE2 (Python's ``re.ASCII``).
"""

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
    """True when ``pattern`` holds ``{,n}`` outside a character class (Python: ``{0,n}``; RE2:
    the literal text), i.e. a pattern the two engines would read differently."""
    plain = re.sub(r"\\.", "e", pattern, flags=re.S)  # escapes out of the way, then classes
    plain = re.sub(r"\[\^?\]?[^\]]*(?:\]|$)", "c", plain)  # (a leading ']' is a literal)
    return re.search(r"\{,[0-9]+\}", plain) is not None


def compile_pattern(pattern: Any, where: str = "") -> Any:
    """``pattern`` compiled with RE2 (``fullmatch``/``match`` give ``groups()``/``groupdict()``
    like Python's ``re``); an error starting with ``where`` when RE2 cannot compile it or it is
    not a string of at most :data:`MAX_PATTERN_CHARS` characters."""
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
