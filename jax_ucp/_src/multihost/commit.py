"""One checkpoint written by every process and committed once by the primary, in three agreed steps
("ready", "written", "committed"): a failure anywhere is raised everywhere, what was written
removed, the previous checkpoint untouched. The primary returns once every process has heard its
outcome; one that loses the exchange meanwhile reports what storage proves."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

from jax_ucp._src.errors import MultiProcessError
from jax_ucp._src.format import MANIFEST_FILE
from jax_ucp._src.multihost import agreement
from jax_ucp._src.multihost.agreement import Gather

log = logging.getLogger(__name__)


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
        begin: the primary's transaction: a context manager whose value has ``path`` and
            ``commit()``; leaving it with an error removes what was written.
        write: writes this process's part under the given path; returns its report.
        merge: the primary's merge of every process's report (in process order) under the
            given path, before the commit."""
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
        written_into = _identity(path)  # before "written": the primary renames it once agreed
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
        if index == 0:
            # a process lost after the commit does not turn it into an error here
            try:
                agreement.agree(gather, "committed", committed, where, wait=False)
            finally:
                _until_heard(gather, where)
            return
        lost: list[MultiProcessError] = []

        def watched(step: str, value: str, wait: bool = True) -> list[str]:
            try:
                return gather(step, value, wait)
            except MultiProcessError as e:
                lost.append(e)
                raise

        try:
            agreement.agree(watched, "committed", committed, where)
        except MultiProcessError as e:
            if not lost:  # the primary's own outcome: it failed
                raise
            _outcome_from_storage(where, written_into, e)
        finally:
            with contextlib.suppress(Exception):  # tell the primary it may leave
                gather("heard", "", False)


def _until_heard(gather: Gather, where: str) -> None:
    """The primary waits for every process to hear its outcome (leaving ends the exchange)."""
    try:
        gather("heard", "", True)
    except MultiProcessError as e:
        log.warning("%s: a process did not confirm the outcome: %s", where, e)


def _identity(path: str) -> tuple[int, int] | None:
    """The directory ``path`` (device, inode), kept through a rename; else None."""
    if not os.path.isabs(path):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _outcome_from_storage(
    where: str, written_into: tuple[int, int] | None, lost: MultiProcessError
) -> None:
    """The exchange was lost awaiting the primary's outcome: return if storage proves the commit,
    raise ``lost`` if it proves none, say unknown otherwise."""
    if written_into is None:
        detail = str(lost).removeprefix(f"{where}: not committed; ")
        raise MultiProcessError(
            f"{where}: whether the primary committed it cannot be read from storage here; {detail}"
        ) from lost
    parent, name = os.path.split(os.path.abspath(where))
    candidates = [os.path.join(parent, name)]  # where the commit renamed it (made absolute)
    if not os.path.lexists(where):  # mid-replacement: the newer one sits beside it
        with contextlib.suppress(OSError):
            beside = [n for n in os.listdir(parent) if n.startswith(name + ".")]
            candidates = [os.path.join(parent, n) for n in beside]
    for candidate in candidates:
        if _identity(candidate) == written_into and os.path.isfile(
            os.path.join(candidate, MANIFEST_FILE)
        ):
            log.warning(
                "%s: committed (read from storage after the exchange ended: %s)", where, lost
            )
            return
    raise lost
