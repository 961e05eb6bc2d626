"""How a checkpoint's description shows in a notebook: rows (list of dicts, pandas-ready
without pandas) and the same rows as an HTML table (Jupyter), Markdown, or plain text
(IPython's pretty printer). Shared by the manifest here and the restore plan
(``jax_ucp._src.restoring.plan``), so both look alike; no JAX, no I/O.

A checkpoint may hold 100 000 tensors: tables show the first :data:`MAX_ROWS` rows and say how
many more there are (``to_rows()`` always has them all).
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

#: rows a table shows before "… and N more"
MAX_ROWS = 50


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
    out = [f"<div><b>{html.escape(title)}</b>"]
    out += [f"<br>{html.escape(line)}" for line in lines]
    out.append("<table><thead><tr>")
    out += [f"<th style='text-align:left'>{html.escape(c)}</th>" for c in columns]
    out.append("</tr></thead><tbody>")
    for r in cells:
        out.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>")
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

    def esc(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    out = [f"**{esc(title)}**", ""] + [f"{esc(line)}  " for line in lines] + [""]
    out.append("| " + " | ".join(columns) + " |")
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
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [title, *lines, fmt.format(*columns).rstrip()]
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
