"""The ``--processes N`` options of ``jax-ucp convert``: checked together, and this same command
re-run as N local processes of one jax.distributed job (started and watched by
``multihost.launch``), cleaned up after and reported."""

from __future__ import annotations

import os

import typer

from jax_ucp._src.cli import output
from jax_ucp._src.multihost import launch


def check_parallel(processes, coordinator, num_processes, process_id) -> None:
    """How many processes convert: ``--processes N`` spawns N local ones; ``--coordinator``,
    ``--num-processes`` and ``--process-id`` make this one process of a jax.distributed job
    (several hosts: run the same command on each, sharing one file system). Checked together:
    a usage error (exit 2) names the option (``--processes`` is at least 1: typer's ``min``,
    and at most what the machine holds: ``launch.local_process_limit``, before anything
    starts).

    Args:
        processes: ``--processes``: local processes to spawn, or None.
        coordinator: ``--coordinator``: host:port of process 0, or None.
        num_processes: ``--num-processes``: the job's process count, or None.
        process_id: ``--process-id``: this process's index, or None.
    """
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
    if processes and processes > 1:
        limit, why = launch.local_process_limit()
        if processes > limit:
            raise typer.BadParameter(
                f"{processes} local processes is more than this machine holds: at most {limit} "
                f"({why}); use fewer, or --coordinator across hosts",
                param_hint="--processes",
            )


def spawn_local(n: int, dst: str) -> None:
    """Runs this same command as ``n`` processes of a jax.distributed job on 127.0.0.1
    (``multihost.launch.run_local``); then what killed ones left beside DST is removed, and the
    error names each failed process (index and pid) and whether DST was committed."""
    import sys

    argv = [sys.executable, "-m", "jax_ucp._src.cli", *child_argv(sys.argv[1:])]
    before = dir_identity(dst)

    def command(i: int, coordinator: str) -> list[str]:
        return [
            *argv,
            "--coordinator",
            coordinator,
            "--num-processes",
            str(n),
            "--process-id",
            str(i),
        ]

    try:
        run = launch.run_local(n, command)
    except BaseException:  # Ctrl-C, SIGTERM: the processes are killed
        _remove_abandoned(dst)
        raise
    if not run.failed:
        return
    _remove_abandoned(dst)
    lines = run.failure_lines()
    after = dir_identity(dst)
    if after is not None and after != before:
        lines.append(f"{dst} was committed before that, with every process's part")
    else:
        lines.append(f"nothing was committed: {dst} is {'unchanged' if after else 'absent'}")
    output.console.print(f"[red]error:[/red] convert across {n} processes failed:", highlight=False)
    text = "\n".join(output.printable(part) for line in lines for part in line.split("\n"))
    output.console.print(text, highlight=False, markup=False, soft_wrap=True)
    raise typer.Exit(1)


def _remove_abandoned(dst: str) -> None:
    """What killed processes left beside ``dst``."""
    from jax_ucp._src import store

    store.storage_for(dst).remove_abandoned()


def child_argv(argv: list[str]) -> list[str]:
    """This command's arguments without ``--processes N`` (each child is one process)."""
    out, args = [], iter(argv)
    for arg in args:
        if arg == "--processes":
            next(args, None)  # its value
        elif not arg.startswith("--processes="):
            out.append(arg)
    return out


def dir_identity(path: str):
    """(device, inode) of a directory: a commit renames a new one into place."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino
