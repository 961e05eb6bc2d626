"""The ``jax-ucp`` commands: inspect, verify, plan, diff, convert, export, latest, demo.

Exit codes: 0 success, 1 a failed operation (bad or corrupt input, a refused overwrite, a full
disk: one ``error:`` line; for ``diff``: the checkpoints differ), 2 a usage error (unknown
option, missing argument, a malformed ``--mesh``/``--rules``), 130 interrupted (Ctrl-C). A bug
shows its traceback. Text from files is printed escaped (``output.printable``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect as inspect_lib
import os
import re
import sys
from typing import Annotated

import typer
import typer.core

from jax_ucp._src import bulk
from jax_ucp._src import format as fmt
from jax_ucp._src.cli import layout, output, spawn
from jax_ucp._src.cli.fields import FromField, taking
from jax_ucp._src.errors import RequestError, UCPError, is_tensorstore_io_error, tensorstore_message
from jax_ucp._src.format import ValueEntry, display, files
from jax_ucp._src.format.sizes import DEFAULT_MEMORY_BUDGET, parse_size
from jax_ucp._src.version import __version__


class _PlainPlaceholders:
    """Arguments named ``SRC``, flags without a ``<bool>`` value they do not take (for the
    commands and for the groups' ``--version``/``--help``)."""

    def get_params(self, ctx) -> list:
        params = super().get_params(ctx)  # pyright: ignore[reportAttributeAccessIssue]
        for param in params:
            if isinstance(param, typer.core.TyperArgument) and param.metavar is None:
                param.metavar = param.name.upper()
            elif getattr(param, "is_flag", False):
                param.metavar = ""
        return params


class _Command(_PlainPlaceholders, typer.core.TyperCommand):
    """Help in placeholders users know: ``SRC DST`` (typer 0.2x writes required arguments as
    ``{src}``) and flags without ``<bool>``; a docstring's paragraphs re-flowed to the terminal
    (Rich markup mode keeps the source's line breaks)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.help:
            self.help = re.sub(r"(?<!\n)\n(?!\n)", " ", inspect_lib.cleandoc(self.help))

    def format_help(self, ctx, formatter) -> None:  # the registries' formats, for --help alone
        from jax_ucp._src.exporters.options import FORMATS as EXPORTS
        from jax_ucp._src.importers.registry import FORMATS

        for param in (p for p in self.params if isinstance(p, typer.core.TyperOption)):
            param.help = (param.help or "").replace("{formats}", ", ".join(FORMATS))
            param.help = param.help.replace(
                "{exports}", f"{', '.join(EXPORTS)} (default: the first)"
            )
        super().format_help(ctx, formatter)

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, typer.core.TyperArgument):
                metavar = param.metavar or (param.name or "").upper()  # get_params sets it
                name = metavar + ("..." if param.nargs != 1 else "")
                pieces.append(name if param.required else f"[{name}]")
            else:
                pieces.extend(param.get_usage_pieces(ctx))
        return pieces


class _Group(_PlainPlaceholders, typer.core.TyperGroup):
    pass


app = typer.Typer(
    cls=_Group,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    help="Universal checkpoints for JAX: inspect, verify, plan a restore, diff two checkpoints, "
    "convert other frameworks' checkpoints, the step a resume takes (latest), demo.",
)


def _version(value: bool):
    output.fresh_console()
    if value:
        output.console.print(f"jax_ucp {__version__}", highlight=False)
        raise typer.Exit(0)


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="print the version and exit"
    ),
):
    output.fresh_console()  # the help is the app's


def _cli_wording(message: str) -> str:
    """Library advice in command-line terms (``force=True`` is ``--force`` here)."""
    message = re.sub(r"\bprocesses=([0-9]+)", r"--processes \1", message)
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
    """Bad input (missing files, corrupt checkpoints, refused overwrites, a full disk: a
    ``UCPError``, an ``OSError``, or a TensorStore error about the files that no layer wrapped)
    → one clear line, exit 1; Ctrl-C → exit 130. Anything else is a bug and shows its
    traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (UCPError, OSError) as e:
            text = _os_error_text(e) if isinstance(e, OSError) else str(e)
            output.error(_cli_wording(text))
            raise typer.Exit(1) from e
        except ValueError as e:
            if not is_tensorstore_io_error(e):
                raise
            output.error(tensorstore_message(e))
            raise typer.Exit(1) from e
        except KeyboardInterrupt:
            raise typer.Exit(130) from None

    return wrapper


def _checkpoint_or_steps(path: str) -> None:
    """A CheckpointManager root is not a checkpoint: list its steps and how to pick one."""
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, fmt.MANIFEST_FILE)):
        return
    from jax_ucp._src.restoring import steps as run_root  # TensorStore: not for --version

    try:
        steps = run_root.with_ucp_items(path)
    except UCPError:
        return
    if steps:
        shown = ", ".join(str(s.step) for s in steps[:10][::-1])
        raise RequestError(
            f"{path} is a CheckpointManager directory with {layout.plural(len(steps), 'step')} "
            f"({'… ' if len(steps) > 10 else ''}{shown}); pick one with --step N or "
            f"--step latest, e.g. {steps[0].items[0]}"
        )


def _at_step(path: str, step: str | None) -> str:
    """The checkpoint ``--step`` names on the CheckpointManager root ``path`` (the step's UCP
    item: N, or ``latest``, the step ``restore(root, step="latest")`` takes), by the one
    step-name rule of the resume (``restoring.resume``); ``path`` itself without ``--step``."""
    if step is None:
        _checkpoint_or_steps(path)
        return path
    from jax_ucp._src.restoring import resume

    if step == "latest":
        return resume.one_item(resume.latest_readable(path, fallback=False).step)
    if re.fullmatch(r"[0-9]+", step) is None:
        raise typer.BadParameter(
            f"expected a step number or latest, got {step!r}", param_hint="--step"
        )
    return resume.step_item(path, int(step))


StepOption = Annotated[
    str | None,
    typer.Option(
        "--step",
        help="PATH is a CheckpointManager root: read its step N, or latest (the step "
        "restore(root, step='latest') takes)",
    ),
]


def _size_option(ctx: typer.Context, param: typer.CallbackParam, value: str | None):
    """A byte-size option ("5G", "256MiB", "1.5GB", "1048576") in bytes, read by the one
    parser of the Python API (format.sizes); an error names the option."""
    if value is None or ctx.resilient_parsing:
        return value
    what = param.opts[0] if param.opts else str(param.name)
    try:
        return parse_size(value, what)
    except RequestError as e:  # click's message names the option already
        raise typer.BadParameter(str(e).removeprefix(f"{what}: ")) from None


MemoryBudget = Annotated[
    str | None,
    typer.Option(
        help="bytes of tensor data in flight at once (e.g. 256MiB, 1G; default "
        f"{DEFAULT_MEMORY_BUDGET >> 20}MiB)",
        callback=_size_option,
    ),
]


@contextlib.contextmanager
def _bar(what: str, transient: bool = False):
    """``progress(name, done, total)`` drawing a bar that appears with the first item done
    (input refused while it is checked prints its error alone) and is stopped at the end
    (``transient``: erased, and not drawn outside a terminal)."""
    progress, task = output.progress(transient), None

    def on_progress(name, done, total):
        nonlocal task
        if task is None:
            progress.start()
            task = progress.add_task(what, total=total)
        progress.update(task, completed=done, total=total, description=output.label(name))

    try:
        yield on_progress
    finally:
        if task is not None:
            progress.stop()


@app.command()
@_user_errors
@bulk.cyclic_gc_paused()  # rows by the tensor, 100 000 and more, none dropped
def inspect(
    path: str,
    limit: int = typer.Option(0, help="show only the first N entries (0: all)"),
    as_json: bool = typer.Option(False, "--json", help="print the manifest's rows as JSON"),
    every: bool = typer.Option(
        False, "--all", help=f"one row per tensor even past {layout.GROUP_AT} (else grouped)"
    ),
    step: StepOption = None,
):
    """Show the manifest: tensors and saved Python values.

    Per tensor: shape, dtype, logical axes, saved PartitionSpec, and as the terminal allows,
    size and role (the saved mesh above the table). --json prints every row, for scripts."""
    import jax_ucp

    path = _at_step(path, step)
    m = jax_ucp.inspect(path)
    if as_json:
        rows = m.to_rows()
        manifest = {
            "path": path,
            "format_version": m.version,
            "created_by": m.created_by,
            "bytes": m.nbytes,
            "saved_meshes": m.saved_meshes,
            "source": m.source,
            "tensors": rows[: len(m.tensors)],
            "values": rows[len(m.tensors) :],
        }
        typer.echo(display.json_text(manifest))  # strict JSON, unwrapped: NaN as text
        return
    output.say(
        f"{path}: {layout.plural(len(m.tensors), 'tensor')}, {layout.plural(len(m.values), 'value')}, "
        f"{layout.human(m.nbytes)} (format v{m.version}, {m.created_by})"
    )
    if m.saved_meshes:
        output.say(f"saved mesh: {'; '.join(m.saved_meshes)}")
    entries = m.tensors + m.values
    shown = entries[:limit] if limit > 0 else entries
    tensors = [e for e in shown if not isinstance(e, ValueEntry)]
    values = [e for e in shown if isinstance(e, ValueEntry)]
    if tensors:
        shape_text, spec_text, human = _cell_texts()
        rows = [
            [
                e.name,
                shape_text(e.shape),
                e.dtype,
                human(e.nbytes),
                e.role + (f"/{e.sub_role}" if e.sub_role else ""),
                "" if e.saved_sharding is None else spec_text(e.saved_sharding.partition_spec),
                "" if e.logical_axes is None else spec_text(e.logical_axes),
            ]
            for e in tensors
        ]
        header = ["name", "shape", "dtype", "size", "role", "saved spec", "logical axes"]
        optional = ("saved spec", "logical axes", "dtype", "size", "role")  # role goes first
        if not every and limit <= 0:
            rows = _grouped([e.name for e in tensors], rows, {3: [e.nbytes for e in tensors]})
        output.table(layout.table(header, rows, right=("size",), optional=optional))
    if values:
        if tensors:
            output.console.print()
        rows = [[e.name, layout.short(e.value), type(e.value).__name__, e.role] for e in values]
        output.table(layout.table(["name", "value", "type", "role"], rows))
    if len(shown) < len(entries):
        output.console.print(f"… and {len(entries) - len(shown)} more (--limit 0 shows all)")
    if m.source:
        output.say(f"source: {_certificate_counted(m.source)}")
    for notice in m.notices:
        output.marked("[yellow]![/yellow]", notice)


@app.command()
@_user_errors
def verify(
    path: str,
    memory_budget: MemoryBudget = None,
    against: str | None = typer.Option(
        None,
        help="the source checkpoint it was imported from: compare every copied tensor bit for "
        "bit with what the source framework's own loader reads",
    ),
    logits: bool = typer.Option(
        False,
        "--logits",
        help="with --against (a source whose config.json names a family docs/HF.md lists: Llama, Mistral, Qwen2/3, GPT-2, Phi-3, Gemma 2/3, Mixtral, Qwen2-MoE, Granite, OLMo 2, StableLM): also compare the logits of "
        "one batch, the source loaded by transformers (from_pretrained, or the config's model "
        "given the weights the source framework's own loader reads: DCP, DeepSpeed, torch.save) "
        "vs the checkpoint's weights in jax_ucp's flax model; exit 1 beyond the tolerance "
        "(needs jax_ucp[hf])",
    ),
    logits_tolerance: float | None = typer.Option(
        None, help="largest absolute difference of the logits accepted (default 1e-4)"
    ),
    accept_uncertified: bool = typer.Option(
        False,
        "--accept-uncertified",
        help="with --against: compare a checkpoint whose ucp.json records no certificate of the "
        "source's files (converted before one was recorded, from an object store, or with it "
        "removed); without it that fails",
    ),
    step: StepOption = None,
    newest: int = typer.Option(
        0, min=0, help="on a CheckpointManager root: verify only its newest N steps (0: all)"
    ),
    spec: str | None = typer.Option(
        None,
        help="PATH an export, --against the jax_ucp checkpoint it was written from: the spec it "
        "was exported by (e.g. hf_llama); every exported tensor is compared with the checkpoint's",
    ),
):
    """Read every tensor and check every shard file (crc32c, digests); report what is wrong.
    With --against SRC, also compare with the source read by its framework's own loader;
    with --logits, also the logits of one batch through both. On a CheckpointManager root
    (without --step): verify every committed step, and say which one a resume takes."""
    import jax_ucp

    if logits and against is None:
        raise typer.BadParameter("--logits compares with the source: give --against SRC")
    if step is None and _is_run_root(path):
        if against is not None:
            raise typer.BadParameter("--against compares one checkpoint: give --step N")
        _verify_run(path, newest, memory_budget)
        return
    path = _at_step(path, step)
    with _bar("verifying", transient=True) as on_progress:
        bad = jax_ucp.verify(
            path,
            progress=on_progress,
            memory_budget=memory_budget,
            against=against,
            logits=logits,
            logits_tolerance=logits_tolerance,
            accept_uncertified=accept_uncertified,
            spec=spec,
        )
    if bad.exported is not None:
        _say_export_checked(bad, str(against))
        return
    for _, notice in bad.notices:  # not errors: the data is intact
        output.marked("[yellow]![/yellow]", notice)
    if bad.logits is not None and bad.logits.ok:
        output.marked("[green]✓[/green]", bad.logits.describe())
    if bad.against is not None:
        _say_compared(bad.against, str(against))
    if bad.source is not None:
        _say_source_checked(bad)
        return
    m = jax_ucp.inspect(path)
    if bad:
        for _, err in bad:  # each message names its tensor and file
            output.marked("[red]✗[/red]", str(err))
        far = bad.logits is not None and not bad.logits.ok
        held = {e.name for e in m.tensors}
        changed = len(bad.against.files) if bad.against is not None else 0
        records = len(bad.against.records) if bad.against is not None else 0
        failed = sum(name in held for name, _ in bad)  # the logits' problem is no tensor
        # the source's tensors the checkpoint lacks
        missing = len(bad) - failed - far - changed - records
        said = [f"{layout.plural(changed, 'source file')} not as certified"] if changed else []
        said += [f"{layout.plural(records, 'source record')} not as planned"] if records else []
        said += [f"{layout.plural(failed, 'tensor')} of {len(m.tensors)} failed"] if failed else []
        said += [f"{layout.plural(missing, 'source tensor')} missing"] if missing else []
        said += ["the logits differ beyond the tolerance"] if far else []
        output.console.print(f"[red]{'; '.join(said)}[/red]", highlight=False)
        raise typer.Exit(1)
    output.console.print(
        f"[green]✓ {layout.plural(len(m.tensors), 'tensor')} ({layout.human(m.nbytes)}) read back intact[/green]"
    )


def _certificate_counted(source: dict) -> dict:
    """The manifest's source record with its certificate (a line per source file) counted."""
    cert = source.get("certificate")
    if not isinstance(cert, dict) or not isinstance(listed := cert.get("files"), dict):
        return source
    said = f"{len(listed)} files, {cert.get('algorithm')} (jax-ucp verify --against SRC checks it)"
    return {**source, "certificate": said}


def _say_compared(found, against: str) -> None:
    """``verify --against``: the source's certificate (checked first), then how many tensors
    were compared (weights and optimizer state apart), not compared, missing."""
    output.say(f"against {against}: certificate: {found.certificate}")
    if found.files:
        return
    compared = [*found.equal, *found.different]
    moments = sum(name.split("/", 1)[0] == "opt_state" for name in compared)
    output.say(
        f"against {against}: {layout.plural(len(compared), 'tensor')} compared "
        f"({len(found.equal)} equal, {len(found.different)} different), "
        f"{len(found.not_compared)} not compared (built by the import), "
        f"{len(found.missing)} missing from the checkpoint; compared: "
        f"{len(compared) - moments} weights, {moments} optimizer state"
        + (
            f" ({len(found.rebuilt)} that no framework loader gives whole with the import "
            f"planned again: the flat buckets of megatron-core's distributed optimizer, "
            f"tensor-parallel merges, the step)"
            if found.rebuilt
            else ""
        )
    )


def _say_export_checked(bad, against: str) -> None:
    """``verify EXPORTED --against CKPT``: the tensors compared, left out, differing (exit 1)."""
    found = bad.exported
    for _, err in bad:
        output.marked("[red]✗[/red]", str(err))
    left = f"; {len(found.not_exported)} of the checkpoint's not exported" * bool(
        found.not_exported
    )
    said = f"{len(found.equal)} of {len(found.equal) + len(found.different)} {found.format} "
    if bad:
        output.console.print(
            f"[red]{said}tensors equal to {against}'s{left}[/red]", highlight=False
        )
        raise typer.Exit(1)
    output.console.print(
        f"[green]✓ {said}tensors equal to {against}'s{left}[/green]", highlight=False
    )


def _say_source_checked(bad) -> None:
    """``verify SRC`` of a torch source: what was checked, what its files record no check of,
    what failed (exit 1)."""
    check = bad.source
    for line in check.checked:
        output.marked("[green]✓[/green]", line)
    for line in check.unchecked:
        output.marked("[yellow]![/yellow]", f"not checked: {line}")
    for _, err in bad:
        output.marked("[red]✗[/red]", str(err))
    if bad:
        output.console.print(
            f"[red]{layout.plural(len(bad), 'problem')} in the {check.format} source "
            f"({layout.plural(check.tensors, 'tensor')})[/red]",
            highlight=False,
        )
        raise typer.Exit(1)
    output.console.print(
        f"[green]✓ {layout.plural(check.tensors, 'tensor')} of the {check.format} source read back "
        f"intact[/green]",
        highlight=False,
    )


def _is_run_root(path: str) -> bool:
    """A CheckpointManager root: a folder without ucp.json whose committed steps hold UCP items
    (or a link or a damaged one)."""
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, fmt.MANIFEST_FILE)):
        return False
    from jax_ucp._src.restoring import steps as run_root  # TensorStore: not for --version

    try:
        return bool(run_root.run_steps(path).steps)
    except UCPError:
        return True  # its step names are the error: run_steps says why


def _verify_run(root: str, newest: int, memory_budget) -> None:
    """``verify ROOT``: each committed step (the newest ``newest``) verified whole, newest first,
    then the step a resume takes: without fallback the newest step (an error if it is
    damaged), with fallback the newest intact one (``restoring.resume``'s rule)."""
    import jax_ucp
    from jax_ucp._src.restoring import steps as run_root

    listed = run_root.run_steps(root)
    for notice in listed.notices:
        output.marked("[yellow]![/yellow]", notice)
    steps = listed.steps[:newest] if newest else listed.steps
    intact = []
    for s in steps:
        problems = [s.problem] if s.problem else []
        for item in [] if s.problem else s.items:
            with _bar(f"step {s.step}", transient=True) as on_progress:
                found = jax_ucp.verify(item, progress=on_progress, memory_budget=memory_budget)
            problems += [err for _, err in found]
        if problems:
            for err in problems:
                output.marked("[red]✗[/red]", f"step {s.step}: {err}")
        else:
            intact.append(s.step)
            output.marked("[green]✓[/green]", f"step {s.step}: {', '.join(s.items)} intact")
    checked = f"{layout.plural(len(steps), 'committed step')} verified"
    if len(steps) < len(listed.steps):
        checked += f" (the newest of {len(listed.steps)})"
    output.say(checked)
    if intact:
        output.say(
            f"a resume takes step {intact[0]} (restore(root, step='latest'"
            f"{'' if intact[0] == steps[0].step else ', fallback=True'}))"
        )
    else:
        output.say("no step verified here can be resumed from", style="red")
    if len(intact) < len(steps):
        raise typer.Exit(1)


@app.command()
@_user_errors
def latest(
    root: str,
    fallback: bool = typer.Option(
        True,
        "--fallback/--no-fallback",
        help="pass over steps that cannot be read, reading each candidate whole (as "
        "restore(root, step='latest', fallback=True)); --no-fallback: the newest committed "
        "step, checked for its manifest and files only",
    ),
):
    """Print the step of a CheckpointManager root, or of a torch trainer's run root (a Trainer's
    output_dir, torchtitan's checkpoint/, a DeepSpeed save_dir, a Megatron or verl save root), a
    resume takes, and why each newer step was passed over (the rule of restore(root,
    step='latest') and jax_ucp.latest_step)."""
    from jax_ucp._src.restoring import resume

    found = resume.latest_readable(root, fallback=fallback)
    for notice in found.notices:
        output.marked("[yellow]![/yellow]", notice)
    for step, why in found.skipped:
        output.marked("[red]✗[/red]", f"step {step} skipped: {why}")
    output.say(f"step {found.step.step}: {', '.join(found.step.items)}", style="green")
    if not fallback:
        output.say("(its manifest and shard files checked; its data is checked as it is restored)")


_IMPORT = "importers.plan.ImportOptions"
_CONVERT = "conversion.ConvertOptions"
# The import options (the format's options class, built once the format is detected) and
# convert's own, each a field of its dataclass.
IMPORT_FIELDS = (
    FromField(_IMPORT, "spec"),
    FromField(_IMPORT, "weights_only", flags=("--weights-only",)),
    FromField("importers.plan.TaggedOptions", "tag"),
    FromField("importers.megatron.MegatronOptions", "vocab_size", prefix="megatron: "),
    FromField(
        "importers.torch.options.TorchOptions",
        "parameter_order",
        help="a file naming the parameters an index-keyed optimizer numbers, in torch's order "
        "(one name a line, or a JSON list)",
        prefix="torch: ",
    ),
    FromField("importers.torch.options.TorchOptions", "model_config", prefix="torch: "),
)
CONVERT_FIELDS = (
    FromField(_CONVERT, "force"),
    FromField(_CONVERT, "step"),
    FromField(_CONVERT, "memory_budget", callback=_size_option),
)


@app.command()
@_user_errors
@taking(*IMPORT_FIELDS, *CONVERT_FIELDS)
def convert(
    src: str,
    dst: str,
    from_: str | None = typer.Option(
        None,
        "--from",
        help="the source format: {formats} (default: detected from the files)",
    ),
    processes: int | None = typer.Option(
        None, min=1, help="convert with N local processes (each reads 1/N of it)"
    ),
    coordinator: str | None = typer.Option(
        None, help="host:port of the jax.distributed job this process is in"
    ),
    num_processes: int | None = typer.Option(None, help="processes in it"),
    process_id: int | None = typer.Option(None, help="this process's index"),
    **options,
):
    """Import another framework's checkpoint as a UCP checkpoint: DeepSpeed (ZeRO 1/2/3,
    TP/PP, universal), Megatron (torch_dist, legacy, Bridge), Orbax, Hugging Face safetensors,
    torch DCP or torch.save files, verl FSDP checkpoints. The format is detected from the files unless --from names
    it; when no format fits, the error says what each one looked for."""
    from jax_ucp._src.importers import registry

    spawn.check_parallel(processes, coordinator, num_processes, process_id)
    if options["parameter_order"] is not None:
        options["parameter_order"] = _read_parameter_order(options["parameter_order"])
    importer = registry.importer_for(src, from_)  # detected first, then its format's options
    importing = registry.importer_options(
        importer, **{f.name: options[f.name] for f in IMPORT_FIELDS}
    )
    if processes and processes > 1:
        spawn.spawn_local(processes, dst)
        return
    if coordinator:
        from jax_ucp._src.multihost import launch

        launch.initialize(coordinator, num_processes, process_id)
    out = _convert_reporting_lost_processes(
        src,
        dst,
        format=importer.name,
        importing=importing,
        distributed=bool(coordinator),
        **{f.name: options[f.name] for f in CONVERT_FIELDS},
    )
    output.say(f"✓ wrote {out}", style="green")
    if not coordinator or process_id == 0:
        _say_imported(str(out))


def _convert_reporting_lost_processes(src: str, dst: str, **options) -> str:
    """``convert`` under a progress bar; a distributed import that failed in another process
    is reported as the CLI's error, and a lost process ends this one at once (jax.distributed's
    shutdown at exit would wait for the lost process's heartbeat timeout, 100 s, then abort)."""
    from jax_ucp._src import conversion
    from jax_ucp._src.multihost import agreement

    try:
        with _bar("importing") as on_progress:
            return conversion.convert(src, dst, progress=on_progress, **options)
    except agreement.MultiProcessError as e:
        output.error(str(e))
        if isinstance(e, agreement.ProcessLostError):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        raise typer.Exit(1) from e


def _read_parameter_order(path: str) -> list[str]:
    """``--parameter-order FILE``: a JSON list of names, or one name a line."""
    try:
        text = files.read_regular(str(path), 64 << 20).decode("utf-8")
    except (OSError, UnicodeDecodeError, UCPError) as e:
        raise typer.BadParameter(f"{path}: {e}", param_hint="--parameter-order") from None
    if text.lstrip().startswith("["):
        try:
            names = files.strict_loads(text)
        except ValueError as e:
            raise typer.BadParameter(
                f"{path}: not a JSON list ({e})", param_hint="--parameter-order"
            ) from None
    else:
        names = [line.strip() for line in text.splitlines() if line.strip()]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise typer.BadParameter(
            f"{path}: expected parameter names (one a line, or a JSON list of strings)",
            param_hint="--parameter-order",
        )
    return names


def _say_imported(out: str) -> None:
    """What the import brought (tensors, bytes, moments, step, skipped) and how to use it."""
    import jax_ucp

    m = jax_ucp.inspect(out)
    tensors = m.tensors
    moments = sum(1 for e in tensors if e.role == "opt_state" and e.sub_role in ("mu", "nu"))
    params = sum(1 for e in tensors if e.role == "param")
    count = next((e.value for e in m.values if e.name == "opt_state/count"), None)
    if count is None and any(e.name == "opt_state/count" for e in tensors):
        count = int(jax_ucp.restore(out, select="opt_state/count")["opt_state"]["count"])
    skipped = (m.source or {}).get("skipped") or {}
    parts = [
        f"{layout.plural(len(tensors), 'tensor')} ({layout.human(m.nbytes)}): "
        f"{layout.plural(params, 'parameter')}, {layout.plural(moments, 'optimizer moment')}",
        f"step {count}" if count is not None else "no optimizer step",
        f"{layout.plural(len(skipped), 'source entry', 'source entries')} skipped (listed in "
        f"source.skipped)"
        if skipped
        else "nothing skipped",
    ]
    output.say("imported: " + "; ".join(parts))
    for note in ((m.source or {}).get("notes") or [])[:5]:
        output.say(f"note: {note}")
    output.say(f"next: jax-ucp inspect {out}   |   python: jax_ucp.restore({out!r}, mesh=...)")


def _parse_mesh(text: str) -> list[tuple[str, int]]:
    axes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, size = part.partition("=")
        number = files.name_number(size.strip())  # ASCII digits: int("²") would be a raw ValueError
        if not sep or not name.strip() or number is None or number < 1:
            raise typer.BadParameter(
                f"expected axis=size[,axis=size...] (e.g. data=2,model=4), got {part!r}",
                param_hint="--mesh",
            )
        axes.append((name.strip(), number))
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


def _cell_texts():
    """``layout.shape_text``, ``.partition_spec_text`` and ``.human``, each keeping its texts
    (the rows of 100 000 tensors repeat a few shapes, specs and sizes; all are tuples or ints)."""
    return tuple(
        functools.cache(f) for f in (layout.shape_text, layout.partition_spec_text, layout.human)
    )


def _grouped(names: list[str], rows: list, sums: dict[int, list[int]]) -> list:
    """``rows`` grouped by name pattern (``layout.grouped``) past ``layout.GROUP_AT`` of them."""
    if len(rows) <= layout.GROUP_AT:
        return rows
    out = layout.grouped(names, rows, sums)
    output.say(
        f"{len(rows)} tensors in {len(out)} name patterns (digits as *; --all lists each, "
        f"--json gives every row)"
    )
    return out


def _padded(spec, ndim: int) -> tuple:
    spec = tuple(spec or ())
    return spec + (None,) * (ndim - len(spec))


def _per_process(reads) -> str:
    """``reads``: a plan's IndexedBytes (lowest/highest without walking every process)."""
    low, high = reads.lowest(), reads.highest()
    if low == high:
        return (
            layout.human(high)
            if len(reads) == 1
            else f"{layout.human(high)} each ({len(reads)} processes)"
        )
    if len(reads) <= 4:
        return ", ".join(f"process {p}: {layout.human(b)}" for p, b in sorted(reads.items()))
    most = reads.highest_index()
    return f"{layout.human(low)} to {layout.human(high)} (process {most} reads the most; {len(reads)} processes)"


_RESTORE = "restoring.options.RestoreOptions"
# the restore to plan: RestoreOptions' fields (PlanOptions' processes) that a command line
# gives as they are (--mesh and --rules are parsed: the command's own)
PLAN_FIELDS = (
    FromField("restoring.plan.PlanOptions", "processes", min=1),
    FromField(_RESTORE, "strict"),
    FromField(_RESTORE, "spec"),
)


@app.command()
@_user_errors
@bulk.cyclic_gc_paused()  # rows by the tensor, 100 000 and more, none dropped
@taking(*PLAN_FIELDS)
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
    limit: int = typer.Option(0, help="show only the first N tensors (0: all)"),
    as_json: bool = typer.Option(False, "--json", help="print the plan's rows as JSON"),
    every: bool = typer.Option(
        False, "--all", help=f"one row per tensor even past {layout.GROUP_AT} (else grouped)"
    ),
    config: str | None = typer.Option(
        None, help="with --spec: a Hugging Face config.json giving the spec's head settings"
    ),
    step: StepOption = None,
    **options,
):
    """Plan a restore onto a mesh: PartitionSpecs, bytes per device and per process.

    Per tensor: the PartitionSpec restore(mesh=, rules=) would give it on MESH, the bytes each
    device holds and each process reads; then the totals, the tensors replicated on every
    device and the dimensions that do not divide. Reads no tensor data and needs no devices.
    A rule for a logical name no tensor carries, or a mesh axis no rule and no saved
    PartitionSpec uses, is an error naming the closest known names (--no-strict plans it)."""
    import jax_ucp
    from jax_ucp._src.restoring.plan import abstract_mesh

    axes = _parse_mesh(mesh)
    rule_pairs = _parse_rules(rules) if rules else None
    path = _at_step(path, step)
    options["spec"] = _spec_with_config(options["spec"], config)
    result = jax_ucp.plan(path, mesh=abstract_mesh(axes), rules=rule_pairs, **options)
    processes = options["processes"] or 1  # as said: PlanOptions' default
    if as_json:
        _print_plan_json(path, axes, processes, result)
        return
    output.say(
        f"{path} on mesh {' × '.join(f'{n}={s}' for n, s in axes)} "
        f"({layout.plural(len(result.device_bytes), 'device')}, "
        f"{layout.plural(processes, 'process', 'processes')}): "
        f"{layout.plural(len(result.tensors), 'tensor')}, {layout.plural(result.values, 'value')}"
    )
    shown = result.tensors[:limit] if limit > 0 else result.tensors
    _print_plan_table(shown, grouped=not every and limit <= 0)
    if len(shown) < len(result.tensors):
        output.console.print(f"… and {len(result.tensors) - len(shown)} more (--limit 0 shows all)")
    _print_plan_totals(result, limit)


def _print_plan_json(path: str, axes, processes: int, result) -> None:
    """``plan --json``: the totals and every tensor's row, for scripts."""
    planned = {
        "path": path,
        "mesh": dict(axes),
        "processes": processes,
        "device_bytes": {"min": result.min_device_bytes, "max": result.max_device_bytes},
        "process_read_bytes": {"max": result.process_read_bytes.highest()},
        "replicated": result.replicated,
        "unmatched_rules": list(result.unmatched_rules),
        "tensors": result.to_rows(),
    }
    typer.echo(display.json_text(planned))  # strict JSON, unwrapped: NaN as text


def _print_plan_table(shown, grouped: bool) -> None:
    """One row per planned tensor (placement, bytes per device and per process), grouped by
    name pattern past ``layout.GROUP_AT`` rows when ``grouped``."""
    placements = {id(t.read_bytes): t.read_bytes for t in shown}  # shared by their tensors
    highest = {k: r.highest() for k, r in placements.items()}
    reads = [highest[id(t.read_bytes)] for t in shown]
    shape_text, spec_text, human = _cell_texts()
    rows = [
        [
            t.name,
            shape_text(t.shape),
            t.dtype,
            "host" if t.on_host else spec_text(_padded(t.partition_spec, len(t.shape))),
            human(t.bytes_per_device or 0),
            human(read),
        ]
        for t, read in zip(shown, reads)
    ]
    header = ["name", "shape", "dtype", "spec", "per device", "per process"]
    right = ("per device", "per process")
    if grouped:
        sums = {4: [t.bytes_per_device or 0 for t in shown], 5: reads}
        rows = _grouped([t.name for t in shown], rows, sums)
    output.table(layout.table(header, rows, right=right, optional=("dtype",)))


def _print_plan_totals(result, limit: int) -> None:
    """Bytes per device and per process, then what is replicated, on host or not divisible."""
    low, high = (layout.human(b) for b in (result.min_device_bytes, result.max_device_bytes))
    output.say(f"per device: {high} each" if low == high else f"per device: {low} to {high}")
    output.say(f"per process read: {_per_process(result.process_read_bytes)}")
    cap = limit if limit > 0 else 20
    if result.unmatched_rules:
        output.say(
            f"rules matching no tensor's logical axis names ({len(result.unmatched_rules)}): "
            f"{', '.join(result.unmatched_rules)} (they shard nothing: everything they name is "
            "replicated)"
        )
    for title, names in (
        ("replicated on every device", result.replicated),
        ("kept on host (64-bit; jax_enable_x64 is off)", result.on_host),
        ("not divisible", [f"{t.name}: {m}" for t in result.tensors for m in t.not_divisible]),
    ):
        if names:
            output.say(f"{title} ({len(names)}):")
            for name in names[:cap]:
                output.say(f"  {name}")
            if len(names) > cap:
                output.say(f"  … and {len(names) - cap} more")


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
    with _bar("comparing", transient=True) as on_progress:
        result = jax_ucp.diff(a, b, progress=on_progress)
    for t in result.tensors:
        if not t.compared:
            changes = [
                f"{what} {x} vs {y}"
                for what, x, y in (
                    ("shape", layout.shape_text(t.shape[0]), layout.shape_text(t.shape[1])),
                    ("dtype", *t.dtype),
                )
                if x != y
            ]
            output.say(f"≠ {t.name}: " + ", ".join(changes))
            continue
        text = f"≠ {t.name}: {t.differing} of {layout.plural(t.size or 0, 'element')} differ"
        if t.max_abs is not None:
            text += f", max abs {t.max_abs:.4g}, max rel {t.max_rel:.4g}"
            if t.max_abs != t.max_abs:
                text += " (NaN in one of them)"
        output.say(text)
    for v in result.values:
        output.say(f"≠ {v.name}: {v.a!r} vs {v.b!r}")
    for name in result.only_in_a:
        output.say(f"- {name} (only in {a})")
    for name in result.only_in_b:
        output.say(f"+ {name} (only in {b})")
    leaves = layout.plural(result.same, "leaf", "leaves")
    if result.identical:
        output.console.print(f"[green]identical: {leaves}[/green]", highlight=False)
        return
    parts = [
        f"{layout.plural(len(result.tensors), 'tensor')} and {layout.plural(len(result.values), 'value')} "
        "differ",
        f"{len(result.only_in_a)} only in A, {len(result.only_in_b)} only in B",
        f"{leaves} identical",
    ]
    output.console.print("[red]" + "; ".join(parts) + "[/red]", highlight=False)
    raise typer.Exit(1)


_TENSORS = "exporters.options._TensorsExport"
_SAFETENSORS = "exporters.options.SafetensorsExport"
# export's options, each a field of the format's options class (``exporters.options_for``)
EXPORT_FIELDS = (
    FromField(_TENSORS, "select"),
    FromField(_TENSORS, "spec"),
    FromField(_TENSORS, "dtype"),
    FromField(
        _SAFETENSORS,
        "max_file_bytes",
        flags=("--max-file-size",),
        prefix="safetensors: ",
        callback=_size_option,
    ),
    FromField(
        "exporters.options.DeepSpeedUniversalExport",
        "param_groups",
        prefix="deepspeed-universal: ",
    ),
    FromField(_SAFETENSORS, "config", prefix="safetensors: "),
    FromField(_SAFETENSORS, "adapter", prefix="safetensors: "),
    *(
        FromField("exporters.options.MegatronExport", name, prefix="megatron: ")
        for name in (
            *("tp", "pp", "ep", "etp", "vpp", "make_vocab_size_divisible_by"),
            *("iteration", "run_record"),
        )
    ),
    FromField(_TENSORS, "force"),
    FromField("exporters.options._Export", "memory_budget", callback=_size_option),
)


@app.command()
@_user_errors
@taking(*EXPORT_FIELDS)
def export(
    ckpt: str,
    dst: str,
    to: str | None = typer.Option(None, help="output format: {exports}"),
    step: StepOption = None,
    **options,
):
    """Export a checkpoint for PyTorch tools (safetensors, torch DCP, DeepSpeed universal,
    megatron-core torch_dist) or Orbax (a StandardCheckpointer checkpoint)."""
    from jax_ucp._src import exporters

    ckpt = _at_step(ckpt, step)

    with _bar("exporting") as on_progress:
        chosen = exporters.options_for(to or exporters.FORMATS[0], progress=on_progress, **options)
        out = exporters.export(ckpt, dst, chosen)
    output.say(
        f"✓ wrote {out.tensors} tensors ({out.bytes / 1e6:.1f} MB) to {out.path}: "
        f"{', '.join(out.files)}",
        style="green",
    )
    if out.skipped:
        output.say(
            f"not exported ({len(out.skipped)}, outside --select or not tensors): "
            f"{', '.join(out.skipped[:6])}{' ...' if len(out.skipped) > 6 else ''}"
        )


def _spec_with_config(spec: str | None, config: str | None):
    """``--spec`` loaded with the head settings of ``--config`` (a Hugging Face config.json)."""
    if spec is None:
        if config is not None:
            raise typer.BadParameter("--config gives a spec's settings: give --spec too")
        return None
    if config is None:
        return spec
    from jax_ucp._src import language
    from jax_ucp._src.exporters.by_spec import read_config
    from jax_ucp._src.language.settings import hf_head_settings

    return language.load_spec(spec, **hf_head_settings(read_config(config), config))


@app.command()
def demo(
    directory: str | None = typer.Option(None, help="where to write (default: a temp dir)"),
):
    """Save a small model on 8 CPU devices, restore onto two other meshes, check every byte."""
    from jax_ucp._src.cli import demo as demo_lib

    ok = demo_lib.run(directory, console=None)
    raise typer.Exit(0 if ok else 1)


for _info in app.registered_commands:  # every command, whoever defines it
    if _info.cls in (None, typer.core.TyperCommand):
        _info.cls = _Command


def main():  # pragma: no cover
    """The ``jax-ucp`` console script."""
    app()
