"""How a checkpoint's description shows in a notebook: rows (list of dicts, pandas-ready
without pandas) and the same rows as an HTML table (Jupyter), Markdown, or plain text
(IPython's pretty printer). Shared by the manifest here and the restore plan
(``jax_ucp._src.restoring.plan``), so both look alike; no JAX, no I/O.

Tensor names, paths and values are file content: each medium has one escaping helper that
every display uses (``printable`` for a terminal and plain text, the command line's included;
``markdown_text``; ``html_text``), so a name holding ``<script>``, ``[a](javascript:…)`` or
``\\x1b[2J`` is shown as those characters, never rendered or obeyed.

A checkpoint may hold 100 000 tensors: tables show the first :data:`MAX_ROWS` rows and say how
many more there are (``to_rows()`` always has them all).
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

#: rows a table shows before "… and N more"
MAX_ROWS = 50

# C0 controls, DEL and C1 controls (a lone 0x9b is CSI on many terminals), the Unicode line and
# paragraph separators, the bidi marks, embeddings, overrides and isolates, lone surrogates
_UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u2028\u2029\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# what CommonMark / GitHub Markdown (and Jupyter's $math$) give a meaning inside a line: the
# backslash itself, emphasis, code, links and images, table cells, strikethrough, math
_MARKDOWN_ACTIVE = re.compile(r"([\\`*_\[\]|~$])")


def _escaped(m: re.Match) -> str:
    c = m.group()
    if c in _SHORT:
        return _SHORT[c]
    return f"\\x{ord(c):02x}" if ord(c) <= 0xFF else f"\\u{ord(c):04x}"


def printable(text: object) -> str:
    """``text`` with every control character written as its escape (``\\x1b``, ``\\n``,
    ``\\u202e``), as Python's ``repr`` writes it; everything else unchanged: what a terminal
    or plain text shows of a text from a file."""
    return _UNSAFE.sub(_escaped, str(text))


def markdown_text(text: object) -> str:
    """``text`` shown literally by a Markdown renderer: controls escaped (``printable``), the
    characters Markdown acts on backslash-escaped (``\\|``, ``\\[``, ``\\` ``, ``\\*``...)
    and ``<``, ``>``, ``&`` as HTML entities (Markdown passes raw HTML through)."""
    text = _MARKDOWN_ACTIVE.sub(r"\\\1", printable(text))
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def html_text(text: object) -> str:
    """``text`` shown literally in HTML: controls escaped (``printable``; a bidi override would
    show a name reversed), then ``html.escape``."""
    return html.escape(printable(text))


#: how ``json_text`` writes the floats strict JSON has no token for
NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def json_text(data: Any, indent: int | None = 1) -> str:
    """``data`` as strict JSON (RFC 8259: what ``jq`` and ``JSON.parse`` accept), for machine
    output such as ``--json``: a float NaN, infinity or -infinity (a saved learning rate of
    ``nan``) is written as the string ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` — never as the
    bare tokens Python's ``json`` writes by default; tuples as lists; a numpy scalar as its
    value; anything else JSON has no type for as its ``str``."""
    try:  # the usual case, at C speed: nothing to map
        return json.dumps(data, indent=indent, default=_json_default, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(data), indent=indent, default=_json_default, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else NON_FINITE[repr(float(value))]
    if isinstance(value, dict):
        return {_finite(k) if isinstance(k, float) else k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _json_default(value: Any) -> Any:
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "shape", None) == ():  # a numpy scalar
        return _finite(item())
    return str(value)


def cell_text(value: Any) -> str:
    """A cell as text: tuples of axis names as ``(fsdp, tp)``, None as blank."""
    if value is None:
        return ""
    if isinstance(value, tuple | list):
        return "(" + ", ".join(cell_text(v) if v is not None else "None" for v in value) + ")"
    return str(value)


def mesh_text(axis_names: Sequence[str], shape: Sequence[int]) -> str:
    """``fsdp=2 × tp=4``."""
    return " × ".join(f"{n}={s}" for n, s in zip(axis_names, shape))


def _shown(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]):
    cut = list(rows[:MAX_ROWS])
    return [[cell_text(r.get(c)) for c in columns] for r in cut], len(rows) - len(cut)


def html_table(
    title: str, lines: Iterable[str], rows: Sequence[Mapping[str, Any]], columns: Sequence[str]
) -> str:
    """An HTML table of ``rows`` (the ``columns`` of each), under ``title`` and ``lines``.

    Args:
        title: the heading above the table.
        lines: lines of summary shown under the title.
        rows: one mapping per row, cells by column name.
        columns: the columns shown, in order.
    """
    cells, more = _shown(rows, columns)
    out = [f"<div><b>{html_text(title)}</b>"]
    out += [f"<br>{html_text(line)}" for line in lines]
    out.append("<table><thead><tr>")
    out += [f"<th style='text-align:left'>{html_text(c)}</th>" for c in columns]
    out.append("</tr></thead><tbody>")
    for r in cells:
        out.append("<tr>" + "".join(f"<td>{html_text(c)}</td>" for c in r) + "</tr>")
    out.append("</tbody></table>")
    if more:
        out.append(f"<i>… and {more} more (to_rows() has them all)</i>")
    out.append("</div>")
    return "".join(out)


def markdown_table(
    title: str, lines: Iterable[str], rows: Sequence[Mapping[str, Any]], columns: Sequence[str]
) -> str:
    """The same table in Markdown.

    Args:
        title: the heading above the table.
        lines: lines of summary shown under the title.
        rows: one mapping per row, cells by column name.
        columns: the columns shown, in order.
    """
    cells, more = _shown(rows, columns)
    esc = markdown_text
    out = [f"**{esc(title)}**", ""] + [f"{esc(line)}  " for line in lines] + [""]
    out.append("| " + " | ".join(esc(c) for c in columns) + " |")
    out.append("|" + "---|" * len(columns))
    out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in cells]
    if more:
        out += ["", f"*… and {more} more (to_rows() has them all)*"]
    return "\n".join(out)


def text_table(
    title: str, lines: Iterable[str], rows: Sequence[Mapping[str, Any]], columns: Sequence[str]
) -> str:
    """The same table as aligned plain text (IPython's pretty printer, a terminal).

    Args:
        title: the heading above the table.
        lines: lines of summary shown under the title.
        rows: one mapping per row, cells by column name.
        columns: the columns shown, in order (aligned to their widest cell).
    """
    cells, more = _shown(rows, columns)
    cells = [[printable(c) for c in r] for r in cells]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [printable(title), *map(printable, lines), fmt.format(*columns).rstrip()]
    out += [fmt.format(*r).rstrip() for r in cells]
    if more:
        out.append(f"… and {more} more (to_rows() has them all)")
    return "\n".join(out)


class Tabular:
    """Notebook and IPython displays of an object that is a titled table: the subclass says
    its title, summary lines, rows and columns once (``table()``); html, markdown and pretty
    text are drawn from them."""

    __slots__ = ()

    def table(self) -> tuple[str, list[str], list[dict], Sequence[str]]:
        raise NotImplementedError

    def _repr_html_(self) -> str:
        return html_table(*self.table())

    def _repr_markdown_(self) -> str:
        return markdown_table(*self.table())

    def _repr_pretty_(self, p, cycle: bool) -> None:
        p.text(text_table(*self.table()))
