"""One checkpoint written by every process of a job and committed once, by the primary.

The one protocol behind ``jax_ucp.save`` (local or object store) and a distributed convert
(``writer.write_shared_checkpoint``); Orbax's CheckpointManager runs its own barriers and calls
the same write and merge (``orbax.handler``). Three steps, each agreed on (``agreement.agree``),
so every process takes the same decision from the same outcomes and none waits for a process
that already failed:

- "ready": the primary (index 0) opens the commit (``begin``: a lock, the destination claimed,
  a temporary directory), every process learns where to write, or the primary's error;
- "written": every process writes its part there and reports it (``write``);
- "committed": the primary merges the reports and commits once (``merge``, then the
  transaction's ``commit``); the others wait for its outcome.

A failure anywhere is raised in every process (its own error where it happened, a
``SharedWriteError`` naming the process and its error elsewhere), the primary's transaction
removes what was written, and the previous checkpoint is never touched. JAX-free: the exchange
(``gather``) is handed in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from jax_ucp.multihost import agreement
from jax_ucp.multihost.agreement import Gather


def alone(step: str, value: str, wait: bool = True) -> list[str]:
    """The exchange of a single-process job: its own value."""
    return [value]


def commit_once(
    where: str,
    *,
    index: int,
    gather: Gather | None,
    begin: Callable[[], contextlib.AbstractContextManager[Any]],
    write: Callable[[str], str],
    merge: Callable[[str, list[str]], None],
) -> None:
    """Every process writes its part of the checkpoint ``where``; the primary commits it once.

    Args:
        where: the destination, for error messages.
        index: this process's index (0: the primary, which opens and commits).
        gather: the exchange between the processes (``agreement.join``); None: one process.
        begin: the primary's transaction (``writer.commit.transaction``): a context manager
            whose value has ``path`` (where every process writes) and ``commit()``; leaving it
            with an error removes what was written.
        write: writes this process's part under the given path; returns its report.
        merge: the primary's merge of every process's report (in process order) under the
            given path, before the commit.
    """
    gather = gather or alone
    with contextlib.ExitStack() as stack:
        ready: str | BaseException = ""
        tx = None
        if index == 0:  # only the primary locks, claims and commits
            try:
                tx = stack.enter_context(begin())
                ready = tx.path
            except BaseException as e:
                ready = e
        path = agreement.agree(gather, "ready", ready, where)[0]
        written: str | BaseException
        try:
            written = write(path)
        except BaseException as e:
            written = e
        reports = agreement.agree(gather, "written", written, where)
        committed: str | BaseException = ""
        if tx is not None:
            try:
                merge(path, reports)
                tx.commit()
            except BaseException as e:
                committed = e
        # Only the others wait for the primary's outcome: a process lost after it committed
        # does not turn a whole, committed checkpoint into an error there.
        agreement.agree(gather, "committed", committed, where, wait=index != 0)
