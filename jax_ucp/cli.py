"""``jax-ucp``: inspect, verify, convert, demo.

Exit codes: 0 success, 1 a failed operation (bad or corrupt input, a refused overwrite), 2 a
usage error (typer's own: unknown option, missing argument).
"""

from __future__ import annotations

import functools
import os
import re

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from jax_ucp.format import ValueEntry

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    help="Universal checkpoints for JAX: inspect, verify, convert torch checkpoints, demo.",
)
convert_app = typer.Typer(
    no_args_is_help=True, help="Import a torch checkpoint as a UCP checkpoint."
)
app.add_typer(convert_app, name="convert")
console = Console()


def _version(value: bool):
    if value:
        from jax_ucp.version import __version__

        console.print(f"jax_ucp {__version__}", highlight=False)
        raise typer.Exit(0)


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="print the version and exit"
    ),
):
    """Universal checkpoints for JAX: inspect, verify, convert torch checkpoints, demo."""


def _cli_wording(message: str) -> str:
    """Library advice in command-line terms (``force=True`` is ``--force`` here)."""
    return re.sub(r"\bforce=True\b", "--force", message)


def _user_errors(fn):
    """Bad input (missing files, corrupt checkpoints, refused overwrites) → one clear line, exit 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, OSError, TypeError, KeyError) as e:
            message = _cli_wording(str(e))
            console.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from e

    return wrapper


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _manager_steps(path: str) -> list[str]:
    """Step directories of an Orbax CheckpointManager root (numeric names with a UCP item)."""
    if not os.path.isdir(path):
        return []
    steps = []
    for name in os.listdir(path):
        step = os.path.join(path, name)
        if name.isdigit() and os.path.isdir(step):
            if any(os.path.isfile(os.path.join(step, i, "ucp.json")) for i in os.listdir(step)):
                steps.append(name)
    return sorted(steps, key=int)


def _checkpoint_or_steps(path: str) -> None:
    """A CheckpointManager root is not a checkpoint: list its steps and how to pick one."""
    steps = _manager_steps(path)
    if steps and not os.path.exists(os.path.join(path, "ucp.json")):
        step = os.path.join(path, steps[-1])
        items = sorted(
            i for i in os.listdir(step) if os.path.isfile(os.path.join(step, i, "ucp.json"))
        )
        shown = ", ".join(steps[-10:])
        raise ValueError(
            f"{path} is a CheckpointManager directory with {_plural(len(steps), 'step')} "
            f"({'… ' if len(steps) > 10 else ''}{shown}); pick one, e.g. "
            f"{os.path.join(step, items[0])}"
        )


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@app.command()
@_user_errors
def inspect(
    path: str,
    limit: int = typer.Option(0, help="show only the first N entries (0: all)"),
):
    """Show the manifest: tensors, shapes, dtypes, bytes, roles, saved sharding."""
    import jax_ucp

    _checkpoint_or_steps(path)
    m = jax_ucp.inspect(path)
    console.print(
        f"{path}: {_plural(len(m.tensors), 'tensor')}, {_plural(len(m.values), 'value')}, "
        f"{_human(m.nbytes)} (format v{m.version}, {m.created_by})",
        highlight=False,
    )
    wide = console.width >= 120
    table = Table(box=None, pad_edge=False, header_style="bold")
    table.add_column("name", overflow="fold", ratio=3)
    table.add_column("shape", overflow="fold")
    table.add_column("dtype")
    table.add_column("size", justify="right")
    table.add_column("role")
    if wide:
        table.add_column("saved spec", overflow="fold")
        table.add_column("logical axes", overflow="fold")
    entries = m.entries[:limit] if limit else m.entries
    for e in entries:
        if isinstance(e, ValueEntry):
            row = [e.name, "-", type(e.value).__name__, "-", e.role]
            if wide:
                row += [repr(e.value)[:40], ""]
            table.add_row(*row)
            continue
        row = [
            e.name,
            "x".join(map(str, e.shape)) or "()",
            e.dtype,
            _human(e.nbytes),
            e.role + (f"/{e.sub_role}" if e.sub_role else ""),
        ]
        if wide:
            ss = e.saved_sharding
            spec = "" if ss is None else f"{ss.partition_spec}"
            row += [spec, "" if e.logical_axes is None else str(e.logical_axes)]
        table.add_row(*row)
    console.print(table)
    if limit and len(m.entries) > limit:
        console.print(f"… and {len(m.entries) - limit} more (--limit 0 shows all)")
    if m.source:
        console.print(f"source: {m.source}", highlight=False)


@app.command()
@_user_errors
def verify(path: str):
    """Read every tensor and check every shard file (crc32c, digests); report what is wrong."""
    import jax_ucp

    _checkpoint_or_steps(path)
    m = jax_ucp.inspect(path)
    with _progress() as progress:
        task = progress.add_task("verifying", total=len(m.tensors))

        def on_progress(name, done, total):
            progress.update(task, completed=done, description=name[-40:])

        bad = jax_ucp.verify(path, progress=on_progress)
    if bad:
        for _, err in bad:  # each message names its tensor and file
            console.print(f"[red]✗[/red] {err}", highlight=False)
        raise typer.Exit(1)
    console.print(
        f"[green]✓ {_plural(len(m.tensors), 'tensor')} ({_human(m.nbytes)}) read back intact[/green]"
    )


def _progress() -> Progress:
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )


def _run_convert(fn, src, dst, **kwargs):
    """The bar appears with the first parameter written: a checkpoint refused while it is
    checked prints its error alone."""
    progress, task = _progress(), None

    def on_progress(name, done, total):
        nonlocal task
        if task is None:
            progress.start()
            task = progress.add_task("importing", total=total)
        progress.update(task, completed=done, total=total, description=str(name)[-48:])

    try:
        out = fn(src, dst, progress=on_progress, **kwargs)
    finally:
        if task is not None:
            progress.stop()
    console.print(f"[green]✓ wrote {out}[/green]", highlight=False)
    return out


@convert_app.command("deepspeed")
@_user_errors
def convert_deepspeed(
    src: str,
    dst: str,
    force: bool = typer.Option(False, help="replace DST"),
    step: int | None = typer.Option(None, help="write as step N of a CheckpointManager dir"),
    spec: str | None = typer.Option(
        None,
        help="UCP-language spec file (Megatron-DeepSpeed TP/PP without universal_checkpoint_info)",
    ),
):
    """A DeepSpeed checkpoint (folder with `latest`, or a global_stepN folder; ZeRO 1/2/3, TP/PP)."""
    from jax_ucp import conversion

    _run_convert(conversion.convert_deepspeed, src, dst, force=force, step=step, spec=spec)


@convert_app.command("megatron")
@_user_errors
def convert_megatron(
    src: str,
    dst: str,
    spec: str | None = typer.Option(None, help="UCP-language spec file"),
    vocab_size: int | None = typer.Option(None, help="original vocab size (strips padding)"),
    force: bool = typer.Option(False, help="replace DST"),
    step: int | None = typer.Option(None, help="write as step N of a CheckpointManager dir"),
):
    """A Megatron checkpoint (torch_dist, or legacy iter_N/mp_rank_XX)."""
    from jax_ucp import conversion

    _run_convert(
        conversion.convert_megatron,
        src,
        dst,
        spec=spec,
        vocab_size=vocab_size,
        force=force,
        step=step,
    )


@convert_app.command("safetensors")
@_user_errors
def convert_safetensors(
    src: str,
    dst: str,
    force: bool = typer.Option(False, help="replace DST"),
    step: int | None = typer.Option(None, help="write as step N of a CheckpointManager dir"),
):
    """Hugging Face safetensors (a .safetensors file, or a folder with shards and an index)."""
    from jax_ucp import conversion

    _run_convert(conversion.convert_safetensors, src, dst, force=force, step=step)


@app.command()
def demo(
    directory: str | None = typer.Option(None, help="where to write (default: a temp dir)"),
):
    """Save a small model on 8 CPU devices, restore onto two other meshes, check every byte."""
    from jax_ucp import demo as demo_lib

    ok = demo_lib.run(directory, console=None)
    raise typer.Exit(0 if ok else 1)


def main():  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
