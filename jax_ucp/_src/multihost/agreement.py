"""Processes deciding as one: each posts its outcome of a step through a ``gather`` exchange and all
take the same decision from the same list (``agree``); ``Exchange`` is that exchange over a
``jax.distributed`` key-value store, checking that the peers it waits for still live."""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator

from jax_ucp._src.errors import MultiProcessError
from jax_ucp._src.multihost import liveness


class ProcessLostError(MultiProcessError):
    """A process of the job died while the others waited (the CLI then leaves at once)."""


Gather = Callable[[str, str, bool], "list[str]"]
_OK, _FAILED = "ok:", "failed:"


def agree(
    gather: Gather, step: str, result: str | BaseException, where: str, wait: bool = True
) -> list[str]:
    """Every process's outcome of ``step`` through ``gather``; all decide alike: this process's
    error, else a ``MultiProcessError`` naming each failure, else the payloads.

    Args:
        gather: the exchange (see ``write_shared_checkpoint``).
        step: the name of the step agreed on ("ready", "written", "committed").
        result: this process's payload, or the error it met.
        where: the destination, for the error message.
        wait: wait for every process's outcome (False: post this one's only).

    Returns:
        Every process's payload, in process order."""
    failed = isinstance(result, BaseException)
    mine = _FAILED + f"{type(result).__name__}: {result}"[:4000] if failed else _OK + result
    values = gather(step, mine, wait)
    if failed:
        raise result
    errors = [f"process {i}: {v[len(_FAILED) :]}" for i, v in enumerate(values) if v[:3] != _OK]
    if errors:
        raise MultiProcessError(f"{where}: not committed; it failed in " + "; ".join(errors))
    return [v[len(_OK) :] for v in values]


_RUNS: dict[str, Iterator[int]] = collections.defaultdict(itertools.count)  # per purpose
_POLL_MS = 200  # how often a waiting process checks that the processes it waits for still live
# how long a process that never beat must be disconnected from the coordinator to be lost
CUT_OFF_S = 1.0


def join(
    where: str, timeout: float, purpose: str = "convert", hint: str | None = None
) -> tuple[int, int, Gather] | None:
    """This process's index, the count and ``gather`` for ``purpose``; None in a one-process job.

    Args:
        where: the path written, for the errors.
        timeout: seconds to wait for the others.
        purpose: what the processes do together, for the errors.
        hint: what sets ``timeout``, said when it runs out (None: ``purpose``'s option
            ``barrier_timeout``)."""
    import jax

    if jax.process_count() == 1:
        return None
    hint = f" ({purpose}'s barrier_timeout)" if hint is None else hint
    job = Exchange(purpose, f"{where}: not committed;", timeout, hint=hint)
    return job.index, job.count, job.gather


class Exchange:
    """The processes of a ``jax.distributed`` job meeting through its key-value store: each posts
    its value of a step, ``gather`` waits for all, checking every 0.2 s that those awaited live
    (``/proc`` here, beats elsewhere, connections to the coordinator), so a dead one is named at
    once.

    Args:
        purpose: what the processes do together (the keys' prefix; "the restore" in errors).
        head: what the errors start with (e.g. "<path>: not committed;").
        timeout: seconds to wait for the others at each step.
        hint: added to the timeout's error (the option that sets it).
        lost: the error naming a process that died.
        hello: fields every process posts at the start, read back from ``peers``."""

    def __init__(
        self,
        purpose: str,
        head: str,
        timeout: float,
        *,
        hint: str = "",
        lost: type[MultiProcessError] = ProcessLostError,
        hello: dict | None = None,
    ):
        import jax

        self.client = distributed_client()
        self.index, self.count = jax.process_index(), jax.process_count()
        self.prefix = f"jax_ucp/{purpose}/{next(_RUNS[purpose])}/"
        self.purpose, self.head, self.timeout = purpose, head, timeout
        self.hint, self.lost = hint, lost
        self.peers: list[dict] = []
        self.served = liveness.served_port()
        self._short_since: float | None = None  # since when fewer processes are connected
        liveness.start_beat()
        self.beats = liveness.Beats(self.client)
        self.me = liveness.identity(os.getpid()) or {}
        me = dict(self.me, index=self.index, **(hello or {}))
        self.peers = [json.loads(v) for v in self.gather("hello", json.dumps(me))]
        self.beats.expect = self.peers  # a beat with another identity is not that process's

    def gather(
        self,
        step: str,
        value: str,
        wait: bool = True,
        head: str | None = None,
        check: Callable[[dict[int, str]], None] | None = None,
    ) -> list[str]:
        """Posts this process's ``value`` of ``step``; every process's, in order (``wait=False``:
        posts only). ``check`` sees the values so far at each poll; ``head`` replaces the
        exchange's."""
        from jax.errors import JaxRuntimeError

        head = head or self.head
        prefix = f"{self.prefix}{step}/"
        try:
            self.client.key_value_set(prefix + str(self.index), value)
        except JaxRuntimeError as e:  # the coordinator (process 0) gone
            raise self._failed(e, step, head) from e
        if not wait:
            return []

        def posted() -> dict[int, str]:
            got = dict(self.client.key_value_dir_get(prefix))
            values = {i: got[prefix + str(i)] for i in range(self.count) if prefix + str(i) in got}
            if check is not None:
                check(values)
            return values

        deadline = time.monotonic() + self.timeout
        while True:
            try:
                # aborts first: a failing process posts its value before its abort
                aborted = dict(self.client.key_value_dir_get(f"{self.prefix}abort/"))
                self.beats.hear()
                values = posted()
                missing = [i for i in range(self.count) if i not in values]
                if not missing:
                    return [values[i] for i in range(self.count)]
                if aborted:
                    key, why = sorted(aborted.items())[0]
                    raise MultiProcessError(
                        f"{head} process {key.rsplit('/', 1)[-1]} left the {self.purpose} ({why})."
                    )
                try:
                    self.raise_if_lost(missing, step, head)
                    self.raise_if_cut_off(missing, step, head)
                except MultiProcessError as e:
                    self.abort(e)  # the others stop waiting too
                    posted()  # it may have posted its error just before it exited
                    raise
                if time.monotonic() > deadline:
                    raise MultiProcessError(
                        f"{head} process(es) {', '.join(map(str, missing))} did not reach "
                        f"'{step}' within {self.timeout:g} s{self.hint}"
                    )
                self.client.blocking_key_value_get(prefix + str(missing[0]), _POLL_MS)
            except JaxRuntimeError as e:  # a timed-out poll, or the coordinator (process 0) gone
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise self._failed(e, step, head) from e

    def _failed(self, error: Exception, step: str, head: str) -> MultiProcessError:
        """The error of a failed ``jax.distributed`` call: ``lost`` naming a process gone
        (raised), else the call's own."""
        self.raise_if_lost(range(self.count), step, head)
        return MultiProcessError(f"{head} jax.distributed failed at '{step}': {error}")

    def abort(self, error: BaseException) -> None:
        """Tells the others this process left (they raise instead of waiting for it)."""
        with contextlib.suppress(Exception):
            self.client.key_value_set(
                f"{self.prefix}abort/{self.index}", f"{type(error).__name__}: {error}"[:2000]
            )

    def raise_if_lost(self, indices: Iterable[int], step: str | None, head: str) -> None:
        """``lost`` naming the first of ``indices`` that is gone."""
        for i in indices:
            peer = (self.peers[i] if i < len(self.peers) else None) or self.beats.identity(i)
            if i == self.index or not peer:
                continue
            here, at = liveness.alive_here(peer, self.me), f" at '{step}'" if step else ""
            who = f"{head} process {i} (pid {peer.get('pid')} on {peer.get('host')})"
            if here is False:
                raise self.lost(f"{who} died while process {self.index} waited for it{at}")
            if here is None and self.beats.stopped(i):
                raise self.lost(
                    f"{who} stopped beating while process {self.index} waited for it{at}: no "
                    f"sign of life for {liveness.CUT_OFF_S:g} s (killed, or cut off from "
                    "jax.distributed's coordinator)"
                )

    def raise_if_cut_off(self, missing: list[int], step: str, head: str) -> None:
        """``lost`` naming the ``missing`` processes that never beat."""
        missing = [i for i in missing if i not in self.beats.heard]
        if self.served is None or not missing:
            self._short_since = None
            return
        now = liveness.connected(self.served)
        if now is None or now >= self.count:
            self._short_since = None
            return
        if self._short_since is None:
            self._short_since = time.monotonic()
        if time.monotonic() - self._short_since < CUT_OFF_S:
            return
        gone, who = self.count - now, ", ".join(map(str, missing))
        coordinator = f"jax.distributed's coordinator (served by process {self.index})"
        if self.count == 2:  # the only other process is the one gone
            raise self.lost(
                f"{head} process {who} lost its connection to {coordinator} before reaching "
                f"'{step}': killed or cut off while process {self.index} waited"
            )
        # which one closed its connection is not known: the ones not there are named
        raise self.lost(
            f"{head} {gone} of the job's {self.count} processes lost their connection to "
            f"{coordinator}, killed or cut off, while process(es) {who} had not reached '{step}'"
        )


def distributed_client():
    """This process's ``jax.distributed`` key-value client (as Orbax gets it)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise MultiProcessError("jax.distributed is not initialized: call its initialize() first")
    return client
