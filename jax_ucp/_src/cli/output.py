"""Where the command line writes: one Rich console per invocation, and the few ways it prints
(literal text, one ``error:`` line, a marked line, a table, a progress bar).

Every text that may come from a file (tensor names, values, paths, error messages) reaches the
terminal through ``printable`` here: a name holding ``\\x1b]0;title\\x07`` (set the window title),
``\\x1b[2J`` (clear the screen) or a bidi override (show text reversed) is printed escaped,
never obeyed, and never parsed as Rich markup."""

from __future__ import annotations

import re

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console()

# C0 controls, DEL and C1 controls (a lone 0x9b is CSI on many terminals), the Unicode line and
# paragraph separators, the bidi marks, embeddings, overrides and isolates, lone surrogates
_UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u2028\u2029\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(m: re.Match) -> str:
    c = m.group()
    if c in _SHORT:
        return _SHORT[c]
    return f"\\x{ord(c):02x}" if ord(c) <= 0xFF else f"\\u{ord(c):04x}"


def printable(text: object) -> str:
    """``text`` with every control character written as its escape (``\\x1b``, ``\\n``,
    ``\\u202e``), as Python's ``repr`` writes it; everything else unchanged."""
    return _UNSAFE.sub(_escaped, str(text))


def fresh_console() -> None:
    """A console for this invocation: its width comes from the terminal (or COLUMNS) now, not
    from whenever this module was first imported."""
    global console
    console = Console()


def say(text: str, style: str | None = None) -> None:
    """Prints text that may come from a file (tensor names, paths) literally: control characters
    escaped, never parsed as Rich markup (where a name like ``a[/b]`` would raise MarkupError);
    wrapped at the console's width."""
    console.print(printable(text), style=style, markup=False, highlight=False)


def marked(mark: str, text: str) -> None:
    """``mark`` (Rich markup of ours, e.g. ``[yellow]![/yellow]``) then ``text`` literally."""
    console.print(f"{mark} {escape(printable(text))}", highlight=False)


def error(text: str) -> None:
    """The one line a refused command prints: ``error: <text>``."""
    console.print(f"[red]error:[/red] {escape(printable(text))}", highlight=False, soft_wrap=True)


def table(renderable) -> None:
    """A ``layout.table`` (its cells went through ``printable`` there)."""
    console.print(renderable, highlight=False)


def label(name: object, width: int = 48) -> str:
    """A progress bar's description: the last ``width`` characters of a name, as markup that
    shows it literally."""
    return escape(printable(name)[-width:])


def progress(transient: bool = False) -> Progress:
    """A bar with a count and the time elapsed; ``transient``: erased when done, and not shown
    at all when the output is not a terminal (nothing to leave behind in a log)."""
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=transient,
        disable=transient and not console.is_terminal,
    )
