"""Where the command line writes: one Rich console per invocation, and the few ways it prints
(literal text, one ``error:`` line, a marked line, a table, a progress bar).

Every text that may come from a file (tensor names, values, paths, error messages) reaches the
terminal through ``printable`` (``format.display``'s, which the notebook displays use too): a
name holding ``\\x1b]0;title\\x07`` (set the window title), ``\\x1b[2J`` (clear the screen) or
a bidi override (show text reversed) is printed escaped, never obeyed, and never parsed as Rich
markup."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from jax_ucp._src.format.display import printable

console = Console()


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
