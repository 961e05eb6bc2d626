"""Each process's beat under ``jax_ucp/beat/<index>`` every ``BEAT_S``; a peer whose counter stands
still for ``CUT_OFF_S`` is lost (a live one beats late only while a call holds its GIL, 3.6 s
measured)."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

from jax_ucp._src.format import files
from jax_ucp._src.multihost import liveness

BEAT_S = 0.5  # how often each process posts its counter
CUT_OFF_S = 4.0  # how long a counter stands still before its process is taken for lost
_HELD_UP_S = 1.0  # a waiting process that polled no more for this long counts afresh
_PREFIX = "jax_ucp/beat/"
_lock = threading.Lock()
_beating: list = [None]  # the client this process beats through


def start() -> None:
    """Starts this process's beat, once per ``jax.distributed`` job; it never raises."""
    from jax._src import distributed

    client, index = distributed.global_state.client, distributed.global_state.process_id
    with _lock:
        if client is None or _beating[0] is client:
            return
        _beating[0] = client
    me = liveness.identity(os.getpid()) or {}

    def beat() -> None:
        count = 0
        while distributed.global_state.client is client:
            with contextlib.suppress(Exception):  # the coordinator busy: the next beat tells
                client.key_value_set(f"{_PREFIX}{index}", json.dumps(dict(me, n=count)), True)
            count += 1
            time.sleep(BEAT_S)

    threading.Thread(target=beat, name="jax_ucp heartbeat", daemon=True).start()


class Beats:
    """The others' beats as a waiting process hears them (still for ``CUT_OFF_S``: ``stopped``)."""

    def __init__(self, client):
        self.client = client
        self.heard: dict[int, tuple[str, float]] = {}  # index -> (beat, when it last moved)
        self.polled = 0.0
        self.expect: list[dict] = []  # each process's identity as it said hello, once known

    def hear(self) -> None:
        """Reads every beat now (one request); another program's keys or beats are not heard."""
        beats = dict(self.client.key_value_dir_get(_PREFIX))
        now = time.monotonic()
        fresh = now - self.polled > _HELD_UP_S  # this process was held up: counts afresh
        for key, beat in beats.items():
            i, me = files.name_number(key.rsplit("/", 1)[1]), _identity(beat)
            said = self.expect[i] if i is not None and i < len(self.expect) else None
            if i is None or me is None or (said and any(me.get(k) != said.get(k) for k in _SELF)):
                continue
            if fresh or self.heard.get(i, ("",))[0] != beat:
                self.heard[i] = (beat, now)
        self.polled = now

    def identity(self, i: int) -> dict | None:
        """Process ``i``'s ``liveness.identity`` as it beat (None if it never did)."""
        return _identity(self.heard[i][0]) if i in self.heard else None

    def stopped(self, i: int) -> bool:
        """Whether process ``i`` beat once and its counter has not moved since ``CUT_OFF_S``."""
        return i in self.heard and time.monotonic() - self.heard[i][1] >= CUT_OFF_S


_SELF = ("pid", "start", "boot")  # what tells a process from any other


def _identity(beat: str) -> dict | None:
    """The ``liveness.identity`` a beat carries (strict JSON), None when it carries none."""
    try:
        me = files.strict_loads(beat)
    except (ValueError, RecursionError):
        return None
    ok = isinstance(me, dict) and type(me.get("pid")) is int and isinstance(me.get("start"), str)
    return me if ok else None
