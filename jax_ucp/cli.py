"""``jax-ucp``: inspect, verify, convert, demo."""

from __future__ import annotations

import functools

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


def _user_errors(fn):
    """Bad input (missing files, corrupt checkpoints, refused overwrites) → one clear line, exit 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, OSError, TypeError, KeyError) as e:
            console.print(f"[red]error:[/red] {type(e).__name__}: {e}", highlight=False)
            raise typer.Exit(2) from e

    return wrapper


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@app.command()
@_user_errors
def inspect(path: str, limit: int = typer.Option(0, help="show only the first N entries (0: all)")):
    """Show the manifest: tensors, shapes, dtypes, bytes, roles, saved sharding."""
    import jax_ucp

    m = jax_ucp.inspect(path)
    table = Table(
        title=f"{path} — {len(m.tensors)} tensors, {len(m.values)} values, "
        f"{_human(m.nbytes)} (format v{m.version}, {m.created_by})"
    )
    for col in ("name", "shape", "dtype", "bytes", "role", "saved PartitionSpec", "logical axes"):
        table.add_column(col, no_wrap=col == "name")
    entries = m.entries[:limit] if limit else m.entries
    for e in entries:
        if isinstance(e, ValueEntry):
            table.add_row(e.name, "-", type(e.value).__name__, "-", e.role, repr(e.value), "")
            continue
        ss = e.saved_sharding
        spec = (
            ""
            if ss is None
            else f"{ss.partition_spec} on {dict(zip(ss.mesh_axis_names, ss.mesh_shape))}"
        )
        table.add_row(
            e.name,
            str(e.shape),
            e.dtype,
            _human(e.nbytes),
            e.role + (f"/{e.sub_role}" if e.sub_role else ""),
            spec,
            "" if e.logical_axes is None else str(e.logical_axes),
        )
    console.print(table)
    if m.source:
        console.print(f"source: {m.source}")


@app.command()
@_user_errors
def verify(path: str):
    """Read every tensor and check every shard file (crc32c, digests); report what is wrong."""
    import jax_ucp

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
        f"[green]✓ {len(m.tensors)} tensors ({_human(m.nbytes)}) read back intact[/green]"
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
    with _progress() as progress:
        task = progress.add_task("importing", total=None)

        def on_progress(name, done, total):
            progress.update(task, completed=done, total=total, description=str(name)[-48:])

        out = fn(src, dst, progress=on_progress, **kwargs)
    console.print(f"[green]✓ wrote {out}[/green]")
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
