"""Whether the job's processes still live: each records its ``identity``, a waiting peer on its
host compares it with ``/proc``; on other hosts, each process beats under ``jax_ucp/beat/<index>``
every ``BEAT_S`` and a peer whose counter stands still for ``CUT_OFF_S`` is lost (a live one beats
late only while a call holds its GIL, 3.6 s measured)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time

from jax_ucp._src.format import files


def identity(pid: int) -> dict | None:
    """Where process ``pid`` runs and when it started (None: no such process), so reuse is told."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().rsplit(b")", 1)[1].split()
    except FileNotFoundError:
        return None
    except OSError:  # no /proc: only the pid can be checked
        if not pid_alive(pid):
            return None
        stat = [b"?"] * 20
    return {
        "host": socket.gethostname(),
        "boot": _read("/proc/sys/kernel/random/boot_id"),
        "pidns": _link("/proc/self/ns/pid"),
        "pid": pid,
        "start": stat[19].decode(),  # field 22 of /proc/<pid>/stat: start time in clock ticks
        "zombie": stat[0] in (b"Z", b"X"),
    }


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (``kill(pid, 0)``; another user's process counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def alive_here(peer: dict, me: dict) -> bool | None:
    """Whether process ``peer`` still runs, if it ran on this host (None elsewhere)."""
    if not me or any(peer.get(k) != me[k] for k in ("host", "boot", "pidns")):
        return None  # another machine: its heartbeat tells
    now = identity(peer["pid"])
    return not (now is None or now.get("zombie") or now["start"] != peer["start"])


_TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_ESTABLISHED, _LISTEN = "01", "0A"


def _endpoint(text: str) -> tuple[bytes, int]:
    """(IPv4 or IPv6 address bytes, port) of a ``/proc/net/tcp*`` address (an IPv4-mapped IPv6
    address as its IPv4: a dual-stack server's and its IPv4 client's entries then match)."""
    addr, port = text.split(":")
    raw = b"".join(bytes.fromhex(addr[i : i + 8])[::-1] for i in range(0, len(addr), 8))
    if len(raw) == 16 and raw[:12] == b"\0" * 10 + b"\xff\xff":
        raw = raw[12:]
    return raw, int(port, 16)


def tcp_table() -> list[tuple[tuple, tuple, str, str]] | None:
    """(local, remote, state, inode) of each TCP socket of this network namespace; None
    without ``/proc/net``."""
    found, read = [], False
    for table in _TCP_TABLES:
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        read = True
        for line in lines:
            fields = line.split()
            if len(fields) > 9:
                found.append((_endpoint(fields[1]), _endpoint(fields[2]), fields[3], fields[9]))
    return found if read else None


def _sockets(port: int) -> list[tuple[str, str]] | None:
    """(state, inode) of each TCP socket on local ``port``; None without ``/proc/net``."""
    table = tcp_table()
    return None if table is None else [(st, ino) for lo, _, st, ino in table if lo[1] == port]


def serves(port: int) -> bool:
    """Whether this process listens on TCP ``port`` (so ``connected`` counts its clients)."""
    sockets = _sockets(port) or []
    listening = {f"socket:[{inode}]" for state, inode in sockets if state == _LISTEN}
    if not listening:
        return False
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}") in listening:
                    return True
    return False


def served_port() -> int | None:
    """The port of the ``jax.distributed`` coordinator this process serves, when its
    connections can be counted (None: it serves none, or they cannot)."""
    from jax._src import distributed

    state = distributed.global_state
    address = getattr(state, "coordinator_address", None)
    if getattr(state, "service", None) is None or not address:
        return None
    try:
        port = int(address.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None
    return port if serves(port) else None


def connected(port: int, others: bool = False) -> int | None:
    """How many of the job's processes hold a TCP connection to ``port`` of this host (None:
    unknown); with ``others``, this one not counted. A connection from this host counts once
    for the process owning its other end, and only if that process runs JAX (maps ``jaxlib``):
    another program's connection, or a second one of a process counted, is no peer's (a foreign
    connection hid a dead peer until the step's timeout). One whose other end cannot be seen
    (another host, user or network namespace) counts as one peer."""
    table = tcp_table()
    if table is None:
        return None
    # a socket's other end is the one with its (remote, local) pair: keyed by the local address
    # alone, a TIME_WAIT socket once on the same port (inode 0) hid a live one's owner
    inodes = {(lo, rem): ino for lo, rem, _, ino in table if ino != "0"}
    ends = [inodes.get((r, lo)) for lo, r, st, _ in table if lo[1] == port and st == _ESTABLISHED]
    owners = _owners({i for i in ends if i})
    pids = {owners[i] for i in ends if i in owners} - ({os.getpid()} if others else set())
    return sum(1 for i in ends if i not in owners) + sum(_runs_jax(p) for p in pids)


def _owners(inodes: set[str]) -> dict[str, int]:
    """socket inode -> the pid holding it, for those of ``inodes`` this user can see."""
    wanted, found = {f"socket:[{i}]": i for i in inodes}, {}
    with contextlib.suppress(OSError):
        for pid in (p for p in os.listdir("/proc") if p.isascii() and p.isdigit()):
            if len(found) == len(wanted):
                break
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    with contextlib.suppress(OSError):
                        inode = wanted.get(os.readlink(f"/proc/{pid}/fd/{fd}"))
                        if inode is not None:
                            found[inode] = int(pid)
    return found


def _runs_jax(pid: int) -> bool:
    """Whether process ``pid`` has jaxlib loaded (a process of a jax.distributed job does)."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
        return any("jaxlib" in line for line in f)
    return True  # not readable: taken for a peer, as before


def _read(path: str) -> str:
    with contextlib.suppress(OSError), open(path) as f:
        return f.read().strip()
    return ""


def _link(path: str) -> str:
    with contextlib.suppress(OSError):
        return os.readlink(path)
    return ""


BEAT_S = 0.5  # how often each process posts its counter
CUT_OFF_S = 4.0  # how long a counter stands still before its process is taken for lost
_HELD_UP_S = 1.0  # a waiting process that polled no more for this long counts afresh
_PREFIX = "jax_ucp/beat/"
_lock = threading.Lock()
_beating: list = [None]  # the client this process beats through


def start_beat() -> None:
    """Starts this process's beat, once per ``jax.distributed`` job; it never raises."""
    from jax._src import distributed

    client, index = distributed.global_state.client, distributed.global_state.process_id
    with _lock:
        if client is None or _beating[0] is client:
            return
        _beating[0] = client
    me = identity(os.getpid()) or {}

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
        """Process ``i``'s ``identity`` as it beat (None if it never did)."""
        return _identity(self.heard[i][0]) if i in self.heard else None

    def stopped(self, i: int) -> bool:
        """Whether process ``i`` beat once and its counter has not moved since ``CUT_OFF_S``."""
        return i in self.heard and time.monotonic() - self.heard[i][1] >= CUT_OFF_S


_SELF = ("pid", "start", "boot")  # what tells a process from any other


def _identity(beat: str) -> dict | None:
    """The ``identity`` a beat carries (strict JSON), None when it carries none."""
    try:
        me = files.strict_loads(beat)
    except (ValueError, RecursionError):
        return None
    ok = isinstance(me, dict) and type(me.get("pid")) is int and isinstance(me.get("start"), str)
    return me if ok else None
