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


def _parse_pairs(text: str, what: str) -> list[tuple[str, str]]:
    pairs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or not name or not value:
            raise typer.BadParameter(f"{what}: expected name=value[,name=value...], got {part!r}")
        pairs.append((name.strip(), value.strip()))
    return pairs


@app.command()
@_user_errors
def plan(
    path: str,
    mesh: str = typer.Option(..., help="target mesh, e.g. data=2,model=4"),
    rules: str | None = typer.Option(None, help="logical-axis rules, e.g. embed=data,mlp=model"),
    limit: int = typer.Option(20, help="tensors to list (0: all)"),
):
    """Before restoring: the PartitionSpec of each tensor on MESH, bytes per device and per
    process, tensors that would be replicated or whose dims do not divide. Reads no tensor data."""
    axes = [(name, int(size)) for name, size in _parse_pairs(mesh, "--mesh")]
    devices_needed = 1
    for _, size in axes:
        devices_needed *= size
    if "jax" not in __import__("sys").modules:  # CPU stand-ins for the mesh's devices
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices_needed}"
    import jax
    import numpy as np

    import jax_ucp

    if jax.device_count() < devices_needed:
        raise ValueError(
            f"--mesh {mesh} needs {devices_needed} devices, JAX has {jax.device_count()}"
        )
    devices = np.array(jax.devices()[:devices_needed]).reshape([s for _, s in axes])
    the_mesh = jax.sharding.Mesh(devices, tuple(n for n, _ in axes))
    rule_pairs = _parse_pairs(rules, "--rules") if rules else None
    _checkpoint_or_steps(path)
    result = jax_ucp.plan(path, mesh=the_mesh, rules=rule_pairs)
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("name", "shape", "spec", "per device"):
        table.add_column(
            column, overflow="fold", justify="right" if column == "per device" else "left"
        )
    shown = result.tensors[:limit] if limit else result.tensors
    for t in shown:
        spec = "(" + ", ".join(str(p) if p is not None else "·" for p in t.partition_spec) + ")"
        table.add_row(t.name, "x".join(map(str, t.shape)) or "()", spec, _human(t.bytes_per_device))
    console.print(table)
    if limit and len(result.tensors) > limit:
        console.print(f"… and {len(result.tensors) - limit} more (--limit 0 shows all)")
    per_device = sorted(set(result.device_bytes.values()))
    console.print(
        f"per device: {_human(min(per_device))} to {_human(max(per_device))}; per process read: "
        + ", ".join(
            f"process {p}: {_human(b)}" for p, b in sorted(result.process_read_bytes.items())
        ),
        highlight=False,
    )
    if result.replicated:
        console.print(
            f"replicated on every device ({len(result.replicated)}): "
            + ", ".join(result.replicated[:10]),
            highlight=False,
        )
    if result.not_divisible:
        console.print(
            f"could not be split as asked ({len(result.not_divisible)}): "
            + ", ".join(result.not_divisible[:10]),
            highlight=False,
        )


@app.command()
@_user_errors
def diff(a: str, b: str):
    """Compare two checkpoints: per-tensor max abs/rel difference, shape or dtype changes,
    leaves only in one. Exit 0 when identical, 1 when they differ."""
    import jax_ucp

    result = jax_ucp.diff(a, b)
    for t in result.tensors:
        if t.max_abs is None and t.differing is None:
            console.print(
                f"≠ {t.name}: shape {t.shape[0]} vs {t.shape[1]}, dtype {t.dtype[0]} vs {t.dtype[1]}",
                highlight=False,
            )
        else:
            console.print(
                f"≠ {t.name}: {t.differing} elements differ, max abs {t.max_abs:.3g}, "
                f"max rel {t.max_rel:.3g}",
                highlight=False,
            )
    for name, va, vb in result.values:
        console.print(f"≠ {name}: {va!r} vs {vb!r}", highlight=False)
    for name in result.only_in_a:
        console.print(f"- {name} (only in {a})", highlight=False)
    for name in result.only_in_b:
        console.print(f"+ {name} (only in {b})", highlight=False)
    if result.identical:
        console.print(
            f"[green]identical: {_plural(result.same, 'leaf')}[/green]".replace("leafs", "leaves")
        )
        return
    raise typer.Exit(1)


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
