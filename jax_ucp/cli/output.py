"""Where the command line writes: one Rich console per invocation, and the few ways it prints
(literal text, one ``error:`` line, a progress bar)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console()


def fresh_console() -> None:
    """A console for this invocation: its width comes from the terminal (or COLUMNS) now, not
    from whenever this module was first imported."""
    global console
    console = Console()


def say(text: str, style: str | None = None) -> None:
    """Prints text that may come from a file (tensor names, paths) literally: never parsed as
    Rich markup, where a name like ``a[/b]`` would raise MarkupError; wrapped at the console's
    width."""
    console.print(text, style=style, markup=False, highlight=False)


def error(text: str) -> None:
    """The one line a refused command prints: ``error: <text>``."""
    console.print(f"[red]error:[/red] {escape(text)}", highlight=False, soft_wrap=True)


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
