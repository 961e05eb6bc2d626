"""``jax-ucp``: inspect, verify, plan, diff, convert, demo.

Exit codes: 0 success, 1 a failed operation (bad or corrupt input, a refused overwrite; for
``diff``: the checkpoints differ), 2 a usage error (unknown option, missing argument, a
malformed ``--mesh``/``--rules``).
"""

from __future__ import annotations

import functools
import inspect as inspect_lib
import os
import re
from typing import Annotated

import typer
from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from jax_ucp.format import ValueEntry


def _plain_placeholders(params) -> None:
    """Arguments named ``SRC``, flags without a ``<bool>`` value they do not take."""
    for param in params:
        if isinstance(param, typer.core.TyperArgument) and param.metavar is None:
            param.metavar = param.name.upper()
        elif getattr(param, "is_flag", False):
            param.metavar = ""


class _Command(typer.core.TyperCommand):
    """Help in placeholders users know: ``SRC DST`` (typer 0.2x writes required arguments as
    ``{src}``) and flags without ``<bool>``; a docstring's paragraphs re-flowed to the terminal
    (Rich markup mode keeps the source's line breaks)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.help:
            self.help = re.sub(r"(?<!\n)\n(?!\n)", " ", inspect_lib.cleandoc(self.help))

    def get_params(self, ctx) -> list:
        params = super().get_params(ctx)
        _plain_placeholders(params)
        return params

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, typer.core.TyperArgument):
                name = param.metavar + ("..." if param.nargs != 1 else "")
                pieces.append(name if param.required else f"[{name}]")
            else:
                pieces.extend(param.get_usage_pieces(ctx))
        return pieces


class _Group(typer.core.TyperGroup):
    """``--version`` and ``--help`` of the command groups without ``<bool>``."""

    def get_params(self, ctx) -> list:
        params = super().get_params(ctx)
        _plain_placeholders(params)
        return params


app = typer.Typer(
    cls=_Group,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    help="Universal checkpoints for JAX: inspect, verify, plan a restore, diff two checkpoints, "
    "convert torch checkpoints, demo.",
)
convert_app = typer.Typer(
    cls=_Group, no_args_is_help=True, help="Import a torch checkpoint as a UCP checkpoint."
)
app.add_typer(convert_app, name="convert")
console = Console()


def _fresh_console() -> None:
    """A console for this invocation: its width comes from the terminal (or COLUMNS) now, not
    from whenever this module was first imported."""
    global console
    console = Console()


def _version(value: bool):
    _fresh_console()
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
    """Universal checkpoints for JAX: inspect, verify, plan a restore, diff two checkpoints,
    convert torch checkpoints, demo."""
    _fresh_console()


def _cli_wording(message: str) -> str:
    """Library advice in command-line terms (``force=True`` is ``--force`` here)."""
    message = re.sub(r"\bprocesses=(\d+)", r"--processes \1", message)
    message = re.sub(r"\bstrict=False\b", "--no-strict", message)
    return re.sub(r"\bforce=True\b", "--force", message)


def _os_error_text(e: OSError) -> str:
    """``[Errno 2] No such file or directory: 'x'`` as ``x: no such file or directory``; an
    OSError raised with a message of its own (jax_ucp's advice) is left as it is."""
    if e.strerror and e.filename is not None:
        text = f"{os.fsdecode(e.filename)}: {e.strerror[0].lower()}{e.strerror[1:]}"
        if e.filename2 is not None:
            text += f" ({os.fsdecode(e.filename2)})"
        return text
    return str(e)


def _user_errors(fn):
    """Bad input (missing files, corrupt checkpoints, refused overwrites) → one clear line, exit 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, OSError, TypeError, KeyError) as e:
            text = _os_error_text(e) if isinstance(e, OSError) else str(e)
            _error(_cli_wording(text))
            raise typer.Exit(1) from e

    return wrapper


def _say(text: str, style: str | None = None) -> None:
    """Prints text that may come from a file (tensor names, paths) literally: never parsed as
    Rich markup, where a name like ``a[/b]`` would raise MarkupError; wrapped at the console's
    width."""
    console.print(text, style=style, markup=False, highlight=False)


def _error(text: str) -> None:
    console.print(f"[red]error:[/red] {escape(text)}", highlight=False, soft_wrap=True)


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {plural or word + 's'}"


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


def _shape_text(shape) -> str:
    return "x".join(map(str, shape)) or "()"


def _spec_text(spec) -> str:
    """A PartitionSpec (or saved spec / logical axes) compactly: ``(data, None)``."""

    def entry(e):
        if isinstance(e, (tuple, list)):
            return "(" + ", ".join(map(str, e)) + ")"
        return str(e)

    return "(" + ", ".join(entry(e) for e in spec) + ")"


def _wrap_path(name: str, width: int) -> str:
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


def _table(header: list[str], rows: list[list[str]], *, right=(), optional=()) -> RenderableType:
    """A borderless table that fits the console: names (column 0) wrap at ``/``; the columns
    named in ``optional`` are dropped when empty, and otherwise last first while names would
    get narrower than 40 columns (or than the longest name). A column dropped for width is
    named under the table with the width that shows it. Cells are plain text, never markup
    (a tensor name is file content)."""
    columns = list(range(len(header)))

    def width(c):
        return max([len(header[c])] + [len(r[c]) for r in rows])

    def room(cols):  # what is left for the name column (2 spaces between columns)
        return console.width - sum(width(c) + 2 for c in cols[1:])

    for name in optional:  # an optional column empty in every row says nothing
        if all(not r[header.index(name)] for r in rows):
            columns.remove(header.index(name))
    longest = width(0)
    dropped = []
    for name in reversed(optional):
        if header.index(name) not in columns:
            continue
        if room(columns) >= min(longest, 40):
            break
        columns.remove(header.index(name))
        dropped.insert(0, header.index(name))
    name_width = max(room(columns), 12)
    table = Table(box=None, pad_edge=False, header_style="bold", show_edge=False)
    for c in columns:
        table.add_column(
            header[c],
            justify="right" if header[c] in right else "left",
            overflow="fold",
            no_wrap=c != 0,
        )
    for r in rows:
        table.add_row(*[Text(_wrap_path(r[0], name_width) if c == 0 else r[c]) for c in columns])
    if not dropped:
        return table
    wide = sum(width(c) + 2 for c in columns[1:] + dropped) + min(longest, 40)
    note = Text(
        f"not shown at {console.width} columns: {', '.join(header[c] for c in dropped)} "
        f"(COLUMNS={wide} shows {'them' if len(dropped) > 1 else 'it'})"
    )
    return Group(table, note)


@app.command()
@_user_errors
def inspect(
    path: str,
    limit: int = typer.Option(0, help="show only the first N entries (0: all)"),
):
    """Show the manifest: tensors and saved Python values.

    Per tensor: shape, dtype, size, role, and (when the terminal is wide enough) the saved
    PartitionSpec and logical axes."""
    import jax_ucp

    _checkpoint_or_steps(path)
    m = jax_ucp.inspect(path)
    _say(
        f"{path}: {_plural(len(m.tensors), 'tensor')}, {_plural(len(m.values), 'value')}, "
        f"{_human(m.nbytes)} (format v{m.version}, {m.created_by})"
    )
    entries = m.tensors + m.values
    shown = entries[:limit] if limit > 0 else entries
    tensors = [e for e in shown if not isinstance(e, ValueEntry)]
    values = [e for e in shown if isinstance(e, ValueEntry)]
    if tensors:
        rows = []
        for e in tensors:
            ss = e.saved_sharding
            rows.append(
                [
                    e.name,
                    _shape_text(e.shape),
                    e.dtype,
                    _human(e.nbytes),
                    e.role + (f"/{e.sub_role}" if e.sub_role else ""),
                    "" if ss is None else _spec_text(ss.partition_spec),
                    "" if e.logical_axes is None else _spec_text(e.logical_axes),
                ]
            )
        header = ["name", "shape", "dtype", "size", "role", "saved spec", "logical axes"]
        console.print(
            _table(header, rows, right=("size",), optional=("saved spec", "logical axes")),
            highlight=False,
        )
    if values:
        if tensors:
            console.print()
        rows = [[e.name, _short(e.value), type(e.value).__name__, e.role] for e in values]
        console.print(_table(["name", "value", "type", "role"], rows), highlight=False)
    if len(shown) < len(entries):
        console.print(f"… and {len(entries) - len(shown)} more (--limit 0 shows all)")
    if m.source:
        _say(f"source: {m.source}")
    for notice in m.notices:
        console.print(f"[yellow]![/yellow] {escape(notice)}", highlight=False)


def _short(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


@app.command()
@_user_errors
def verify(path: str):
    """Read every tensor and check every shard file (crc32c, digests); report what is wrong."""
    import jax_ucp

    _checkpoint_or_steps(path)
    m = jax_ucp.inspect(path)
    with _progress(transient=True) as progress:
        task = progress.add_task("verifying", total=len(m.tensors))

        def on_progress(name, done, total):
            progress.update(task, completed=done)

        bad = jax_ucp.verify(path, progress=on_progress)
    for _, notice in bad.notices:  # not errors: the data is intact
        console.print(f"[yellow]![/yellow] {escape(notice)}", highlight=False)
    if bad:
        for _, err in bad:  # each message names its tensor and file
            console.print(f"[red]✗[/red] {escape(str(err))}", highlight=False)
        console.print(
            f"[red]{_plural(len(bad), 'tensor')} of {len(m.tensors)} failed[/red]", highlight=False
        )
        raise typer.Exit(1)
    console.print(
        f"[green]✓ {_plural(len(m.tensors), 'tensor')} ({_human(m.nbytes)}) read back intact[/green]"
    )


def _progress(transient: bool = False) -> Progress:
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=transient,
        disable=transient and not console.is_terminal,  # nothing to leave behind in a log
    )


class _Parallel:
    """How many processes convert: ``--processes N`` spawns N local ones; ``--coordinator``,
    ``--num-processes`` and ``--process-id`` make this one process of a jax.distributed job
    (several hosts: run the same command on each, sharing one file system)."""

    def __init__(self, processes, coordinator, num_processes, process_id):
        self.processes, self.coordinator = processes, coordinator
        self.num_processes, self.process_id = num_processes, process_id
        if processes is not None and processes < 1:
            raise typer.BadParameter("must be at least 1", param_hint="--processes")
        if processes and processes > 1 and coordinator:
            raise typer.BadParameter(
                "--processes spawns its own job; use --coordinator without it",
                param_hint="--processes",
            )
        if coordinator and (num_processes is None or process_id is None):
            raise typer.BadParameter(
                "--coordinator needs --num-processes and --process-id",
                param_hint="--coordinator",
            )


def _spawn_local(n: int, dst: str) -> None:
    """Runs this same command as ``n`` processes of a jax.distributed job on 127.0.0.1; the
    first one's output is shown, the others' only if they fail. A process killed by a signal
    stops the others at once (one that fails with an error lets them finish reporting theirs,
    10 s at most); then what the killed ones left beside DST is removed, and the error names
    each failed process (index and pid) and whether DST was committed."""
    import contextlib
    import signal
    import socket
    import subprocess
    import sys
    import tempfile
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
        elif arg == "--processes":
            skip = True
        elif not arg.startswith("--processes="):
            argv.append(arg)
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    before = _dir_identity(dst)
    with contextlib.ExitStack() as stack:
        procs, logs = [], []
        if threading.current_thread() is threading.main_thread():  # SIGTERM: clean up first
            terminated = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
            stack.callback(signal.signal, signal.SIGTERM, terminated)
        try:
            for i in range(n):
                cmd = [sys.executable, "-m", "jax_ucp.cli", *argv]
                cmd += ["--coordinator", f"127.0.0.1:{port}"]
                cmd += ["--num-processes", str(n), "--process-id", str(i)]
                log = stack.enter_context(tempfile.TemporaryFile("w+")) if i else None
                logs.append(log)
                quiet = dict(stdout=log, stderr=subprocess.STDOUT) if i else {}
                procs.append(subprocess.Popen(cmd, env=env, text=True, **quiet))
            failed, stopped = _wait_for_children(procs)
        finally:
            for p in procs:  # Ctrl-C, SIGTERM or an error here: no process outlives the command
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            if any(p.returncode for p in procs):
                _remove_abandoned(dst)
        if not failed:
            return
        lines = []
        for i in failed:
            code = procs[i].returncode
            why = f"exited with code {code}" if code > 0 else f"was killed by {_signal_name(-code)}"
            lines.append(f"process {i} (pid {procs[i].pid}) {why}")
            if i and code > 0:
                logs[i].seek(0)
                lines.append(logs[i].read()[-4000:].rstrip())
        if stopped:
            others = ", ".join(f"{i} (pid {procs[i].pid})" for i in stopped)
            lines.append(f"stopped the other process(es): {others}")
        after = _dir_identity(dst)
        if after is not None and after != before:
            lines.append(f"{dst} was committed before that, with every process's part")
        else:
            lines.append(f"nothing was committed: {dst} is {'unchanged' if after else 'absent'}")
        console.print(f"[red]error:[/red] convert across {n} processes failed:", highlight=False)
        console.print("\n".join(lines), highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(1)


def _remove_abandoned(dst: str) -> None:
    """What killed processes of a convert left beside ``dst`` (a local path)."""
    from jax_ucp import store, writer

    if not store.is_url(dst):
        writer.remove_abandoned(dst)


def _wait_for_children(procs) -> tuple[list[int], list[int]]:
    """Waits for every process; returns the indices of those that failed (the first one first)
    and of those it stopped: once one is killed by a signal, the others are killed at once;
    once one exits with an error, the others get 10 s to finish first (they report theirs)."""
    import subprocess
    import time

    pending = dict(enumerate(procs))
    failed: list[int] = []
    while pending and not failed:
        for i in _next_exits(pending):
            del pending[i]
            if procs[i].returncode != 0:
                failed.append(i)
    if failed and pending:
        if procs[failed[0]].returncode > 0:
            deadline = time.monotonic() + 10
            for i, p in list(pending.items()):
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    continue
                del pending[i]
                if p.returncode != 0:
                    failed.append(i)
        for p in pending.values():
            p.kill()
            p.wait()
    return failed, sorted(pending)


def _next_exits(pending: dict) -> list[int]:
    """Blocks until a child in ``pending`` exits; the indices of those that have, reaped. One
    killed by SIGABRT comes after the others: jax aborts a process whose coordinator died."""
    import signal
    import time

    if hasattr(os, "waitid"):
        try:  # sleeps until a child exits, without reaping it (Popen does)
            os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass
    while True:
        done = [i for i, p in pending.items() if p.poll() is not None]
        if done:
            return sorted(done, key=lambda i: (pending[i].returncode == -signal.SIGABRT, i))
        time.sleep(0.02)  # waitid woke for a child that is not ours


def _signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _dir_identity(path: str):
    """(device, inode) of a directory: a commit renames a new one into place."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _run_convert(fn, src, dst, parallel: _Parallel | None = None, **kwargs):
    """The bar appears with the first parameter written: a checkpoint refused while it is
    checked prints its error alone."""
    if parallel is not None and parallel.processes and parallel.processes > 1:
        _spawn_local(parallel.processes, dst)
        return dst
    if parallel is not None and parallel.coordinator:
        import jax

        jax.distributed.initialize(
            coordinator_address=parallel.coordinator,
            num_processes=parallel.num_processes,
            process_id=parallel.process_id,
        )
        kwargs["distributed"] = True
    progress, task = _progress(), None

    def on_progress(name, done, total):
        nonlocal task
        if task is None:
            progress.start()
            task = progress.add_task("importing", total=total)
        progress.update(task, completed=done, total=total, description=escape(str(name)[-48:]))

    try:
        out = fn(src, dst, progress=on_progress, **kwargs)
    except Exception as e:
        import sys

        from jax_ucp import conversion, writer

        if not isinstance(e, writer.SharedWriteError):
            raise
        if task is not None:
            progress.stop()
        _error(str(e))
        if isinstance(e, conversion.ProcessLostError):
            # jax.distributed's shutdown at exit would wait for the lost process (its heartbeat
            # timeout, 100 s) and then abort: the job is over, leave now.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        raise typer.Exit(1) from e
    finally:
        if task is not None:
            progress.stop()
    _say(f"✓ wrote {out}", style="green")
    return out


# Options every convert command shares (one definition, typer's Annotated form).
Force = Annotated[bool, typer.Option(help="replace DST")]
Step = Annotated[int | None, typer.Option(help="write as step N of a CheckpointManager dir")]
Processes = Annotated[
    int | None,
    typer.Option("--processes", help="convert with N local processes (each reads 1/N of it)"),
]
Coordinator = Annotated[
    str | None,
    typer.Option("--coordinator", help="host:port of the jax.distributed job this process is in"),
]
NumProcesses = Annotated[int | None, typer.Option("--num-processes", help="processes in it")]
ProcessId = Annotated[int | None, typer.Option("--process-id", help="this process's index")]


@convert_app.command("deepspeed")
@_user_errors
def convert_deepspeed(
    src: str,
    dst: str,
    force: Force = False,
    step: Step = None,
    spec: str | None = typer.Option(
        None,
        help="UCP-language spec file (Megatron-DeepSpeed TP/PP without universal_checkpoint_info)",
    ),
    weights_only: bool = typer.Option(
        False, "--weights-only", help="import the weights alone, skip the optimizer state"
    ),
    processes: Processes = None,
    coordinator: Coordinator = None,
    num_processes: NumProcesses = None,
    process_id: ProcessId = None,
):
    """A DeepSpeed checkpoint (folder with `latest`, or a global_stepN folder; ZeRO 1/2/3, TP/PP)."""
    from jax_ucp import conversion

    _run_convert(
        conversion.convert_deepspeed,
        src,
        dst,
        force=force,
        step=step,
        spec=spec,
        weights_only=weights_only,
        parallel=_Parallel(processes, coordinator, num_processes, process_id),
    )


@convert_app.command("megatron")
@_user_errors
def convert_megatron(
    src: str,
    dst: str,
    spec: str | None = typer.Option(None, help="UCP-language spec file"),
    vocab_size: int | None = typer.Option(None, help="original vocab size (strips padding)"),
    force: Force = False,
    step: Step = None,
    weights_only: bool = typer.Option(
        False, "--weights-only", help="import the weights alone, skip the optimizer state"
    ),
    processes: Processes = None,
    coordinator: Coordinator = None,
    num_processes: NumProcesses = None,
    process_id: ProcessId = None,
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
        weights_only=weights_only,
        parallel=_Parallel(processes, coordinator, num_processes, process_id),
    )


@convert_app.command("safetensors")
@_user_errors
def convert_safetensors(
    src: str,
    dst: str,
    force: Force = False,
    step: Step = None,
    weights_only: bool = typer.Option(
        False, "--weights-only", help="import the weights alone (a Trainer's optimizer.pt skipped)"
    ),
    processes: Processes = None,
    coordinator: Coordinator = None,
    num_processes: NumProcesses = None,
    process_id: ProcessId = None,
):
    """Hugging Face safetensors (a .safetensors file, or a folder with shards and an index)."""
    from jax_ucp import conversion

    _run_convert(
        conversion.convert_safetensors,
        src,
        dst,
        force=force,
        step=step,
        weights_only=weights_only,
        parallel=_Parallel(processes, coordinator, num_processes, process_id),
    )


@convert_app.command("orbax")
@_user_errors
def convert_orbax(
    src: str,
    dst: str,
    tag: int | None = typer.Option(None, help="step of a CheckpointManager dir (default: latest)"),
    force: Force = False,
    step: Step = None,
    weights_only: bool = typer.Option(
        False, "--weights-only", help="import the params/ subtree alone"
    ),
):
    """An Orbax checkpoint (StandardCheckpointer / PyTreeCheckpointer dir, or a
    CheckpointManager step or root; OCDBT or not)."""
    from jax_ucp import conversion

    _run_convert(
        conversion.convert,
        src,
        dst,
        format="orbax",
        tag=tag,
        force=force,
        step=step,
        weights_only=weights_only,
    )


@convert_app.command("torch")
@_user_errors
def convert_torch(
    src: str,
    dst: str,
    force: Force = False,
    step: Step = None,
    weights_only: bool = typer.Option(
        False, "--weights-only", help="import the weights alone, skip the optimizer state"
    ),
    processes: Processes = None,
    coordinator: Coordinator = None,
    num_processes: NumProcesses = None,
    process_id: ProcessId = None,
):
    """A torch DCP checkpoint (FSDP1/FSDP2, torchtitan, Accelerate, Lightning) or torch.save
    files (pytorch_model.bin, .pt, .ckpt)."""
    from jax_ucp import conversion

    _run_convert(
        conversion.convert_torch,
        src,
        dst,
        force=force,
        step=step,
        weights_only=weights_only,
        parallel=_Parallel(processes, coordinator, num_processes, process_id),
    )


def _parse_mesh(text: str) -> list[tuple[str, int]]:
    axes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, size = part.partition("=")
        if not sep or not name.strip() or not size.strip().isdigit() or int(size) < 1:
            raise typer.BadParameter(
                f"expected axis=size[,axis=size...] (e.g. data=2,model=4), got {part!r}",
                param_hint="--mesh",
            )
        axes.append((name.strip(), int(size)))
    if not axes:
        raise typer.BadParameter("no mesh axes given (e.g. data=2,model=4)", param_hint="--mesh")
    names = [name for name, _ in axes]
    if len(set(names)) != len(names):
        raise typer.BadParameter(f"axis names repeat: {names}", param_hint="--mesh")
    return axes


def _parse_rules(texts: list[str]) -> list[tuple[str, object]]:
    rules: list[tuple[str, object]] = []
    for text in texts:
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, axes = part.partition("=")
            if not sep or not name.strip():
                raise typer.BadParameter(
                    f"expected logical=axis[,logical=axis...] (e.g. embed=data,mlp=model), "
                    f"got {part!r}",
                    param_hint="--rules",
                )
            names = tuple(a.strip() for a in axes.split("+") if a.strip())
            rule = None if not names else names[0] if len(names) == 1 else names
            rules.append((name.strip(), rule))
    return rules


def _padded(spec, ndim: int) -> tuple:
    spec = tuple(spec or ())
    return spec + (None,) * (ndim - len(spec))


def _per_process(reads) -> str:
    """``reads``: a plan's IndexedBytes (lowest/highest without walking every process)."""
    low, high = reads.lowest(), reads.highest()
    if low == high:
        return _human(high) if len(reads) == 1 else f"{_human(high)} each ({len(reads)} processes)"
    if len(reads) <= 4:
        return ", ".join(f"process {p}: {_human(b)}" for p, b in sorted(reads.items()))
    most = reads.highest_index()
    return (
        f"{_human(low)} to {_human(high)} (process {most} reads the most; {len(reads)} processes)"
    )


@app.command()
@_user_errors
def plan(
    path: str,
    mesh: str = typer.Option(..., help="the mesh to restore onto, e.g. data=2,model=4"),
    rules: Annotated[
        list[str] | None,
        typer.Option(
            help="logical-axis rules, e.g. embed=data,mlp=model (a+b: several mesh axes; "
            "name= : replicated); repeatable",
        ),
    ] = None,
    processes: int = typer.Option(1, min=1, help="processes sharing the mesh's devices"),
    limit: int = typer.Option(0, help="show only the first N tensors (0: all)"),
    strict: bool = typer.Option(
        True,
        "--strict/--no-strict",
        help="refuse rules for logical names no tensor carries and mesh axes nothing uses",
    ),
):
    """Plan a restore onto a mesh: PartitionSpecs, bytes per device and per process.

    Per tensor: the PartitionSpec restore(mesh=, rules=) would give it on MESH, the bytes each
    device holds and each process reads; then the totals, the tensors replicated on every
    device and the dimensions that do not divide. Reads no tensor data and needs no devices.
    A rule for a logical name no tensor carries, or a mesh axis no rule and no saved
    PartitionSpec uses, is an error naming the closest known names (--no-strict plans it)."""
    import jax_ucp
    from jax_ucp.handler.plan import abstract_mesh

    axes = _parse_mesh(mesh)
    rule_pairs = _parse_rules(rules) if rules else None
    _checkpoint_or_steps(path)
    result = jax_ucp.plan(
        path, mesh=abstract_mesh(axes), rules=rule_pairs, processes=processes, strict=strict
    )
    n_devices = len(result.device_bytes)
    _say(
        f"{path} on mesh {' × '.join(f'{n}={s}' for n, s in axes)} "
        f"({_plural(n_devices, 'device')}, {_plural(processes, 'process', 'processes')}): "
        f"{_plural(len(result.tensors), 'tensor')}, {_plural(result.values, 'value')}"
    )
    shown = result.tensors[:limit] if limit > 0 else result.tensors
    rows = [
        [
            t.name,
            _shape_text(t.shape),
            t.dtype,
            "host" if t.on_host else _spec_text(_padded(t.partition_spec, len(t.shape))),
            _human(t.bytes_per_device or 0),
            _human(t.read_bytes.highest()),
        ]
        for t in shown
    ]
    header = ["name", "shape", "dtype", "spec", "per device", "per process"]
    console.print(
        _table(header, rows, right=("per device", "per process"), optional=("dtype",)),
        highlight=False,
    )
    if len(shown) < len(result.tensors):
        console.print(f"… and {len(result.tensors) - len(shown)} more (--limit 0 shows all)")
    low, high = result.min_device_bytes, result.max_device_bytes
    console.print(
        "per device: "
        + (f"{_human(high)} each" if low == high else f"{_human(low)} to {_human(high)}"),
        highlight=False,
    )
    console.print(f"per process read: {_per_process(result.process_read_bytes)}", highlight=False)
    cap = limit if limit > 0 else 20
    for title, names in (
        ("replicated on every device", result.replicated),
        ("kept on host (64-bit; jax_enable_x64 is off)", result.on_host),
        ("not divisible", [f"{t.name}: {m}" for t in result.tensors for m in t.not_divisible]),
    ):
        if names:
            console.print(f"{title} ({len(names)}):", highlight=False)
            for name in names[:cap]:
                _say(f"  {name}")
            if len(names) > cap:
                console.print(f"  … and {len(names) - cap} more", highlight=False)


@app.command()
@_user_errors
def diff(a: str, b: str):
    """Compare two checkpoints leaf by leaf; exit 0 when identical, 1 when they differ.

    Lists the tensors that differ (how many elements, max absolute and max relative
    difference), shapes or dtypes that changed, saved values that differ, and leaves only in
    one. Reads one tensor of each checkpoint at a time."""
    import jax_ucp

    _checkpoint_or_steps(a)
    _checkpoint_or_steps(b)
    with _progress(transient=True) as progress:
        task = progress.add_task("comparing", total=None)

        def on_progress(name, done, total):
            progress.update(task, completed=done, total=total)

        result = jax_ucp.diff(a, b, progress=on_progress)
    for t in result.tensors:
        if not t.compared:
            changes = [
                f"{what} {x} vs {y}"
                for what, x, y in (
                    ("shape", _shape_text(t.shape[0]), _shape_text(t.shape[1])),
                    ("dtype", *t.dtype),
                )
                if x != y
            ]
            _say(f"≠ {t.name}: " + ", ".join(changes))
            continue
        text = f"≠ {t.name}: {t.differing} of {_plural(t.size, 'element')} differ"
        if t.max_abs is not None:
            text += f", max abs {t.max_abs:.4g}, max rel {t.max_rel:.4g}"
            if t.max_abs != t.max_abs:
                text += " (NaN in one of them)"
        _say(text)
    for v in result.values:
        _say(f"≠ {v.name}: {v.a!r} vs {v.b!r}")
    for name in result.only_in_a:
        _say(f"- {name} (only in {a})")
    for name in result.only_in_b:
        _say(f"+ {name} (only in {b})")
    leaves = _plural(result.same, "leaf", "leaves")
    if result.identical:
        console.print(f"[green]identical: {leaves}[/green]", highlight=False)
        return
    parts = [
        f"{_plural(len(result.tensors), 'tensor')} and {_plural(len(result.values), 'value')} "
        "differ",
        f"{len(result.only_in_a)} only in A, {len(result.only_in_b)} only in B",
        f"{leaves} identical",
    ]
    console.print("[red]" + "; ".join(parts) + "[/red]", highlight=False)
    raise typer.Exit(1)


@app.command()
@_user_errors
def export(
    ckpt: str,
    dst: str,
    to: str = typer.Option(
        "safetensors", help="output format: safetensors, torch-dcp, deepspeed-universal or orbax"
    ),
    select: str | None = typer.Option(
        None,
        help="key-path prefix to export ('params', 'opt_state/mu', '' for all; default: params "
        "for safetensors, all for torch-dcp)",
    ),
    spec: str | None = typer.Option(None, help="UCP-language spec whose restore views to export"),
    dtype: str | None = typer.Option(None, help="write every tensor as this dtype (e.g. bfloat16)"),
    max_file_size: str = typer.Option("5GB", help="data per file before sharding (e.g. 500MB)"),
    param_groups: int = typer.Option(
        1, help="deepspeed-universal: param groups of the loading engine's optimizer"
    ),
    config: str | None = typer.Option(
        None, help="safetensors: a config.json to write beside the weights (for from_pretrained)"
    ),
    force: bool = typer.Option(False, help="replace DST if it is an earlier export"),
):
    """Export a checkpoint for PyTorch tools (safetensors, torch DCP, DeepSpeed universal) or
    Orbax (a StandardCheckpointer checkpoint)."""
    from jax_ucp import exporters

    progress, task = _progress(), None

    def on_progress(name, done, total):
        nonlocal task
        if task is None:
            progress.start()
            task = progress.add_task("exporting", total=total)
        progress.update(task, completed=done, total=total, description=escape(str(name)[-48:]))

    try:
        out = exporters.export(
            ckpt,
            dst,
            to=to,
            select=select,
            spec=spec,
            dtype=dtype,
            max_file_bytes=_parse_size(max_file_size),
            param_groups=param_groups,
            config=config,
            force=force,
            progress=on_progress,
        )
    finally:
        if task is not None:
            progress.stop()
    _say(
        f"✓ wrote {out.tensors} tensors ({out.bytes / 1e6:.1f} MB) to {out.path}: "
        f"{', '.join(out.files)}",
        style="green",
    )
    if out.skipped:
        _say(
            f"not exported ({len(out.skipped)}, outside --select or not tensors): "
            f"{', '.join(out.skipped[:6])}{' ...' if len(out.skipped) > 6 else ''}"
        )


def _parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1024' -> bytes (decimal units as transformers' max_shard_size)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    units |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    t = text.strip().upper()
    number = t.rstrip("KMGTIB")
    unit = t[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise typer.BadParameter(f"expected a size like 5GB or 500MB, got {text!r}")
    return int(value * units[unit])


@app.command()
def demo(
    directory: str | None = typer.Option(None, help="where to write (default: a temp dir)"),
):
    """Save a small model on 8 CPU devices, restore onto two other meshes, check every byte."""
    from jax_ucp import demo as demo_lib

    ok = demo_lib.run(directory, console=None)
    raise typer.Exit(0 if ok else 1)


for _typer in (app, convert_app):  # every command, whoever defines it
    for _info in _typer.registered_commands:
        if _info.cls in (None, typer.core.TyperCommand):
            _info.cls = _Command


def main():  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
