"""One checkpoint written by every process of a job and committed once, by the primary: the
protocol of ``jax_ucp.save`` (a directory or an object store) and of a distributed convert
(``writer.write_shared_checkpoint``). Three steps, each agreed on (``agreement.agree``), so no
process waits for one that already failed: "ready" (the primary opened the transaction: where to
write), "written" (every process wrote its part and reports it), "committed" (the primary merged
the reports and committed). A failure anywhere is raised in every process, what was written is
removed and the previous checkpoint is never touched. JAX-free: the exchange is handed in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from jax_ucp._src.multihost import agreement
from jax_ucp._src.multihost.agreement import Gather


def _alone(step: str, value: str, wait: bool = True) -> list[str]:
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
    gather = gather or _alone
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
