"""Whether the job's processes on this host still live: each records its ``identity``, a waiting
peer compares it with ``/proc``; other hosts are left to ``heartbeat``."""

from __future__ import annotations

import contextlib
import os
import socket


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


def _sockets(port: int) -> list[tuple[str, str]] | None:
    """(state, inode) of each TCP socket on local ``port``; None without ``/proc/net``."""
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
            if len(fields) > 9 and int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.append((fields[3], fields[9]))
    return found if read else None


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


def connected(port: int) -> int | None:
    """How many TCP connections to ``port`` of this host are established (None: unknown)."""
    sockets = _sockets(port)
    return None if sockets is None else sum(state == _ESTABLISHED for state, _ in sockets)


def _read(path: str) -> str:
    with contextlib.suppress(OSError), open(path) as f:
        return f.read().strip()
    return ""


def _link(path: str) -> str:
    with contextlib.suppress(OSError):
        return os.readlink(path)
    return ""
