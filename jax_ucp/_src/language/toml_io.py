"""The TOML file form of a spec (docs/LANGUAGE.md shows one): TOML text <-> the spec's dict form
(validated in ``spec``; errors here add the rule's line), and the shipped specs (``specs/*.toml``)
found by name with ``load_spec``."""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomli_w

from jax_ucp._src.errors import LanguageError
from jax_ucp._src.language.spec import Spec, spec_from_dict, spec_to_dict

SPECS_DIR = Path(__file__).parent / "specs"

#: A spec file is a few kilobytes; this bounds what reading and parsing one can cost.
MAX_SPEC_BYTES = 4 << 20
#: Deepest nesting accepted (arrays, inline tables, dotted key components): tomllib recurses per
#: level and copies the key path per component (20k components take 1.5 GB).
MAX_TOML_DEPTH = 64


def _check_nesting(text: str, source: str) -> None:
    """Refuses TOML nested deeper than :data:`MAX_TOML_DEPTH` before ``tomllib`` parses it."""
    brackets: list[str] = []  # "h" for a table header's brackets
    in_key, key_dots, i, n = True, 0, 0, len(text)
    while i < n:
        c = text[i]
        if c == "#":
            end = text.find("\n", i)
            i = n if end < 0 else end
            continue
        if c in "\"'":
            quote = text[i : i + 3] if text[i : i + 3] in ('"""', "'''") else c
            j = i + len(quote)
            while j < n and not text.startswith(quote, j):
                j += 2 if c == '"' and text[j] == "\\" else 1
            i = j + len(quote)
            continue
        if c == "[" and in_key and all(b == "h" for b in brackets):
            brackets.append("h")  # [table] or [[array of tables]]
        elif c in "[{":
            brackets.append(c)
            in_key, key_dots = c == "{", 0
        elif c in "]}" and brackets:
            header = brackets.pop() == "h"
            in_key = header and bool(brackets)
            key_dots = key_dots if in_key else 0
        elif c == "." and in_key:
            key_dots += 1
        elif c == "=":
            in_key, key_dots = False, 0
        elif c == "," and brackets and brackets[-1] == "{":
            in_key = True
        elif c == "\n" and not brackets:
            in_key, key_dots = True, 0
        if len(brackets) + key_dots > MAX_TOML_DEPTH:
            raise LanguageError(
                f"{source} line {text.count(chr(10), 0, i) + 1}: nested deeper than "
                f"{MAX_TOML_DEPTH} levels (arrays, inline tables, dotted keys); refused"
            )
        i += 1


def _table_lines(text: str, table: str) -> list[int]:
    """The line number of each ``[[table]]`` header, in order."""
    header = re.compile(r"^\s*\[\[\s*" + re.escape(table) + r"\s*\]\]")
    return [i + 1 for i, line in enumerate(text.splitlines()) if header.match(line)]


def spec_from_toml(text: str, *, source: str = "<spec>", settings: Mapping | None = None) -> Spec:
    """A spec from TOML text (over the size or depth limits: refused unparsed).

    Args:
        text: the TOML text
        source: the file it came from, for messages
        settings: overrides of its ``[settings]``"""
    if len(text) > MAX_SPEC_BYTES:
        raise LanguageError(
            f"{source}: {len(text)} characters; a spec file holds at most {MAX_SPEC_BYTES}"
        )
    _check_nesting(text, source)
    try:
        d = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise LanguageError(f"{source}: invalid TOML: {e}") from None
    except RecursionError:  # not reached below MAX_TOML_DEPTH; kept as the last line of defence
        raise LanguageError(f"{source}: nested too deeply") from None
    lines = {table: _table_lines(text, table) for table in ("import", "restore", "roots")}
    return spec_from_dict(d, source=source, settings=settings, table_lines=lines)


def _plain(v: Any, where: str) -> Any:
    """``v`` as what TOML holds: tuples as lists, None left out (TOML has no null)."""
    if isinstance(v, Mapping):
        return {str(k): _plain(x, f"{where}.{k}") for k, x in v.items() if x is not None}
    if isinstance(v, list | tuple):
        if any(x is None for x in v):
            raise LanguageError(f"{where}: TOML cannot hold None in a list")
        return [_plain(x, where) for x in v]
    if isinstance(v, bool | int | float | str):
        return v
    raise LanguageError(f"{where}: cannot write {type(v).__name__} {v!r} to TOML")


def spec_to_toml(spec: Spec) -> str:
    """TOML text of ``spec``; ``spec_from_toml`` gives the spec back."""
    return tomli_w.dumps(_plain(spec_to_dict(spec), "spec"))


def dump_spec(spec: Spec, path: str | os.PathLike) -> None:
    """Write ``spec`` to a TOML file."""
    Path(path).write_text(spec_to_toml(spec))


def list_specs() -> list[str]:
    """Names of the shipped specs (``specs/*.toml``)."""
    return sorted(path.stem for path in SPECS_DIR.glob("*.toml"))


def load_spec(name_or_path: str | os.PathLike | Spec, **settings) -> Spec:
    """A shipped spec by name (``list_specs()``) or a TOML file, settings overridden by keywords."""
    if isinstance(name_or_path, Spec):
        return name_or_path.with_settings(**settings) if settings else name_or_path
    path = Path(name_or_path)
    if not path.is_file():
        shipped = SPECS_DIR / f"{str(name_or_path).replace('-', '_')}.toml"
        if shipped.is_file():
            path = shipped
        elif path.suffix == ".toml" or os.sep in str(name_or_path):
            raise LanguageError(f"spec file {str(name_or_path)!r} not found")
        else:
            raise LanguageError(
                f"unknown spec {str(name_or_path)!r}: not a file and not a shipped spec "
                f"(shipped: {', '.join(list_specs()) or 'none'})"
            )
    with open(path, "rb") as f:  # a regular file (is_file above); read no more than the cap
        raw = f.read(MAX_SPEC_BYTES + 1)
    if len(raw) > MAX_SPEC_BYTES:
        raise LanguageError(f"{path}: more than {MAX_SPEC_BYTES} bytes; not a spec file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LanguageError(f"{path}: not UTF-8 text (byte {e.start})") from None
    return spec_from_toml(text, source=str(path), settings=settings)
