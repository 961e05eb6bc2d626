"""Processes deciding as one: each posts its outcome of a step through a ``gather`` exchange and
every process takes the same decision from the same list (``agree``); ``join`` gives the
exchange of a ``jax.distributed`` job (its key-value store, no device collective), checking on
the way that the peers it waits for on this host still live (``liveness``)."""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable, Iterable

from jax_ucp.errors import MultiProcessError
from jax_ucp.multihost import liveness


class ProcessLostError(MultiProcessError):
    """A process of a multi-process job died while the others waited for it. A class of its own
    for the command line, which then leaves at once (``jax.distributed``'s shutdown would wait
    for the lost process's heartbeat)."""


Gather = Callable[[str, str, bool], "list[str]"]
_OK, _FAILED = "ok:", "failed:"


def agree(
    gather: Gather, step: str, result: str | BaseException, where: str, wait: bool = True
) -> list[str]:
    """Every process's outcome of ``step``, exchanged through ``gather`` (each process's value, in
    process order, once all have posted theirs): ``result`` is this process's payload, or its
    error. Every process sees the same list, so all decide alike: this process's own error is
    raised, else a ``MultiProcessError`` naming each process that failed and why; else the
    payloads. ``wait=False`` only posts this process's outcome (the others wait for it).

    Args:
        gather: the exchange (see ``write_shared_checkpoint``).
        step: the name of the step agreed on ("ready", "written", "committed").
        result: this process's payload, or the error it met.
        where: the destination, for the error message.
        wait: wait for every process's outcome (False: post this one's only).

    Returns:
        Every process's payload, in process order.
    """
    failed = isinstance(result, BaseException)
    mine = _FAILED + f"{type(result).__name__}: {result}"[:4000] if failed else _OK + result
    values = gather(step, mine, wait)
    if failed:
        raise result
    errors = [f"process {i}: {v[len(_FAILED) :]}" for i, v in enumerate(values) if v[:3] != _OK]
    if errors:
        raise MultiProcessError(f"{where}: not committed; it failed in " + "; ".join(errors))
    return [v[len(_OK) :] for v in values]


_RUNS = itertools.count()
_POLL_MS = 200  # how often a waiting process checks that the processes it waits for still live


def join(where: str, timeout: float, purpose: str = "convert") -> tuple[int, int, Gather] | None:
    """This process's index, the process count and ``gather(step, value, wait=True)``: every
    process's value for ``step`` (jax.distributed's key-value store, no device collective), for
    a ``purpose`` (e.g. "convert") writing ``where``. While it waits, the processes it waits for
    that run on this host are checked every 0.2 s, so one that died is named at once instead of
    after jax's heartbeat timeout (100 s) or ``timeout``. None in a single-process job.

    Args:
        where: the path written, for the errors.
        timeout: seconds to wait for the others.
        purpose: what the processes do together, for the errors.
    """
    import jax

    if jax.process_count() == 1:
        return None
    from jax.errors import JaxRuntimeError

    client = distributed_client()
    index, count, run = jax.process_index(), jax.process_count(), next(_RUNS)
    peers: list[dict] = []

    def gather(step: str, value: str, wait: bool = True) -> list[str]:
        prefix = f"jax_ucp/{purpose}/{run}/{step}/"
        client.key_value_set(prefix + str(index), value)
        if not wait:
            return []
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = dict(client.key_value_dir_get(prefix))
                missing = [i for i in range(count) if prefix + str(i) not in got]
                if not missing:
                    return [got[prefix + str(i)] for i in range(count)]
                _raise_if_lost(peers, missing, step, where, index)
                if time.monotonic() > deadline:
                    raise MultiProcessError(
                        f"{where}: not committed; process(es) {', '.join(map(str, missing))} "
                        f"did not reach '{step}' within {timeout:g} s ({purpose}'s "
                        f"barrier_timeout)"
                    )
                client.blocking_key_value_get(prefix + str(missing[0]), _POLL_MS)
            except JaxRuntimeError as e:  # a timed-out poll, or the coordinator (process 0) gone
                if "DEADLINE_EXCEEDED" not in str(e):
                    _raise_if_lost(peers, range(count), step, where, index)
                    raise MultiProcessError(
                        f"{where}: not committed; jax.distributed failed at '{step}': {e}"
                    ) from e

    hello = json.dumps(dict(liveness.identity(os.getpid()) or {}, index=index))
    peers.extend(json.loads(v) for v in gather("hello", hello))
    return index, count, gather


def distributed_client():
    """The key-value store client of this process's ``jax.distributed`` job (what Orbax's
    ``multihost`` uses too: jax has no public accessor)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise MultiProcessError("jax.distributed is not initialized: call its initialize() first")
    return client


def _raise_if_lost(peers: list[dict], indices: Iterable[int], step: str, where: str, me: int):
    """``ProcessLostError`` naming the first of ``indices`` that ran on this host and is gone."""
    i = liveness.first_lost(peers, indices, me)
    if i is not None:
        peer = peers[i]
        raise ProcessLostError(
            f"{where}: not committed; process {i} (pid {peer['pid']} on {peer['host']}) died "
            f"while process {me} waited for it at '{step}'"
        )
