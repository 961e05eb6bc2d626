"""The command line's text layout: sizes, shapes and specs as short text, and a borderless
table that fits the terminal (names wrap at ``/``, optional columns go first when it is
narrow). Plain text in, Rich renderables out; no command logic."""

from __future__ import annotations

import re

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from jax_ucp._src.cli import output
from jax_ucp._src.cli.output import printable
from jax_ucp._src.format.sizes import format_size as human  # commands use layout.human


def plural(n: int, word: str, plural_form: str | None = None) -> str:
    """``1 tensor``, ``2 tensors`` (``plural_form`` where adding an s is wrong).

    Args:
        n: the count.
        word: the singular.
        plural_form: the plural, when it is not ``word`` + s.
    """
    return f"{n} {word}" if n == 1 else f"{n} {plural_form or word + 's'}"


def shape_text(shape) -> str:
    """``4x8``; ``()`` for a scalar."""
    return "x".join(map(str, shape)) or "()"


def partition_spec_text(spec) -> str:
    """A PartitionSpec (or saved spec / logical axes) compactly: ``(data, (fsdp, tp), None)``."""
    texts = (partition_spec_text(e) if isinstance(e, (tuple, list)) else str(e) for e in spec)
    return "(" + ", ".join(texts) + ")"


def short(value, limit: int = 40) -> str:
    """A value's repr cut to ``limit`` characters with an ellipsis."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def wrap_path(name: str, width: int) -> str:
    """A ``/``-joined name cut into lines at ``/`` boundaries to fit ``width`` (a component
    longer than that is folded by the table); continuation lines are indented."""
    if len(name) <= width:
        return name
    parts = name.split("/")
    lines, line = [], ""
    for i, part in enumerate(parts):
        piece = part + ("/" if i < len(parts) - 1 else "")
        if line.strip() and len(line) + len(piece) > width:
            lines.append(line)
            line = "  " + piece
        else:
            line += piece
    lines.append(line)
    return "\n".join(lines)


def table(
    header: list[str], rows: list[list[str]], *, width: int | None = None, right=(), optional=()
) -> RenderableType:
    """A borderless table that fits ``width`` columns (default: the terminal's).

    Names (column 0) wrap at ``/``; the columns named in ``optional`` are dropped when empty,
    and otherwise last first while names would get narrower than 40 columns (or than the
    longest name). A column dropped for width is named under the table with the width that
    shows it. Cells are plain text, never markup, control characters escaped (a tensor name
    is file content).

    Args:
        header: the column titles; column 0 holds the names.
        rows: one list of cell texts per row, as long as ``header``.
        width: the width in columns (None: the console's, ``output.console.width``).
        right: titles of the columns aligned right (numbers).
        optional: titles of the columns that may be left out, least wanted last.
    """
    width = output.console.width if width is None else width
    rows = [[printable(cell) for cell in r] for r in rows]
    columns = list(range(len(header)))

    def column_width(c):
        return max([len(header[c])] + [len(r[c]) for r in rows])

    def room(cols):  # what is left for the name column (2 spaces between columns)
        return width - sum(column_width(c) + 2 for c in cols[1:])

    for name in optional:  # an optional column empty in every row says nothing
        if all(not r[header.index(name)] for r in rows):
            columns.remove(header.index(name))
    longest = column_width(0)
    dropped = []
    for name in reversed(optional):
        if header.index(name) not in columns:
            continue
        if room(columns) >= min(longest, 40):
            break
        columns.remove(header.index(name))
        dropped.insert(0, header.index(name))
    name_width = max(room(columns), 12)
    out = Table(box=None, pad_edge=False, header_style="bold", show_edge=False)
    for c in columns:
        out.add_column(
            header[c],
            justify="right" if header[c] in right else "left",
            overflow="fold",
            no_wrap=c != 0,
        )
    for r in rows:
        out.add_row(*[Text(wrap_path(r[0], name_width) if c == 0 else r[c]) for c in columns])
    if not dropped:
        return out
    wide = sum(column_width(c) + 2 for c in columns[1:] + dropped) + min(longest, 40)
    note = Text(
        f"not shown at {width} columns: {', '.join(header[c] for c in dropped)} "
        f"(COLUMNS={wide} shows {'them' if len(dropped) > 1 else 'it'})"
    )
    return Group(out, note)


#: more rows than this are shown grouped by name pattern (digits as ``*``) unless asked for all
GROUP_AT = 200
_DIGITS = re.compile(r"[0-9]+")


def grouped(names: list[str], rows: list[list[str]], sums: dict[int, list[int]]) -> list[list[str]]:
    """``rows`` (cells as text, column 0 the name) merged by name pattern, digits as ``*``
    (``layers/*/mlp/w``): the name shows the count, a column whose cells agree shows that cell,
    else how many kinds; the columns in ``sums`` (index -> a number per row) show their total
    through :func:`human`. Keeps a 100 000-tensor table to the few lines a reader takes in.

    Args:
        names: each row's tensor name, matched to a pattern with its digits as ``*``.
        rows: the table's rows, cells as text (column 0 the name).
        sums: column index -> one number per row, shown as the group's total.
    """
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        groups.setdefault(_DIGITS.sub("*", name), []).append(i)
    out = []
    for pattern, members in groups.items():
        row = [pattern if len(members) == 1 else f"{pattern} ({len(members)})"]
        for c in range(1, len(rows[0])):
            if c in sums:
                row.append(human(sum(sums[c][i] for i in members)))
                continue
            kinds = {rows[i][c] for i in members}
            row.append(kinds.pop() if len(kinds) == 1 else f"{len(kinds)} kinds")
        out.append(row)
    return out
