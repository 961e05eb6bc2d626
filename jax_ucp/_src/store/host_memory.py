"""Host memory during a restore: how much this process may allocate (``host_memory_limit``,
what the read engine checks a tensor against before allocating it), and glibc's malloc with
the large transient host buffers of a restore (TensorStore's decoded chunks, a tensor's part
read before it is cut per device).

glibc serves a buffer under its mmap threshold from an arena, one per thread that allocates
(TensorStore's read threads), and raises that threshold as larger mapped buffers are freed, up
to 32 MiB, and its trim threshold with it (twice as much): what a thread's arena then frees at
its top stays resident up to 64 MiB per arena. Measured on 579 MB of params and Adam moments
restored at a 16 MiB ``memory_budget`` (one process, 8 CPU devices): peak RssAnon 335-400 MB
over what the restore keeps with glibc's defaults, 143 MB with ``MALLOC_MMAP_THRESHOLD_=131072``
in the environment, 139-143 MB inside ``trimming``; ``malloc_trim(0)`` after each tensor got only
252-259 MB (it does not shrink a thread arena's top), limiting malloc to one arena for the read
neither (threads that allocated before keep theirs).

Pinning the mmap threshold at 128 KiB instead would turn every later allocation above it into
a fresh mapping for the rest of the process (XLA:CPU's buffers of each training step among
them), so ``trimming`` lowers only the trim threshold, and only while a restore reads.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Iterator


@functools.cache
def libc_function(name: str):
    """The C library's function ``name`` (ctypes, errno kept for ``ctypes.get_errno``), or None
    where it has none. The one lookup of the store and writer layers (mallopt, syncfs,
    sync_file_range)."""
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), name, None)
    except (OSError, TypeError):  # pragma: no cover - no C library to open by None (Windows)
        return None


_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
# What the trim threshold is left at after a read: the most glibc's dynamic one reaches (twice
# its largest dynamic mmap threshold, 32 MiB), which it has once a 32 MiB buffer was freed.
_TRIM_AFTER = 64 << 20
_lock = threading.Lock()
_users = [0]


def _user_tuned() -> bool:
    """The user set glibc's thresholds (environment, tunables): left as they are."""
    return any(
        v in os.environ for v in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")
    ) or "threshold" in os.environ.get("GLIBC_TUNABLES", "")


@contextlib.contextmanager
def trimming() -> Iterator[None]:
    """In the block (of any thread), what a malloc arena frees at its top is returned to the
    system at once (glibc's trim threshold at one page). After the last block: a trim threshold
    of 64 MiB, the most glibc's dynamic one reaches, and the mmap threshold where glibc had
    raised it, no longer raised (glibc cannot read back or re-enable its dynamic thresholds).
    A user's own thresholds (environment, ``GLIBC_TUNABLES``) are left as they are."""
    mallopt = None if _user_tuned() else libc_function("mallopt")
    if mallopt is None:
        yield
        return
    with _lock:
        _users[0] += 1
        if _users[0] == 1:
            mallopt(_M_TRIM_THRESHOLD, 4096)
    try:
        yield
    finally:
        with _lock:
            _users[0] -= 1
            if _users[0] == 0:
                mallopt(_M_TRIM_THRESHOLD, _TRIM_AFTER)


_M_ARENA_MAX = -8  # glibc's malloc.h


@contextlib.contextmanager
def one_malloc_arena() -> Iterator[None]:
    """glibc's malloc limited to one arena in the block: each TensorStore thread compressing a
    chunk otherwise takes an arena of its own and keeps what it freed resident (an Orbax export
    at a 64 MiB budget: 234 → 125 MiB peak RssAnon, the excess growing with the tensors
    written). Threads started before keep their arenas; restored after; nothing where the C
    library has no ``mallopt``."""
    mallopt = libc_function("mallopt")
    if mallopt is not None:
        mallopt(_M_ARENA_MAX, 1)
    try:
        yield
    finally:
        if mallopt is not None:
            mallopt(_M_ARENA_MAX, 0)  # glibc's default (from the core count)


def host_memory_limit() -> tuple[int, str] | None:
    """(bytes, what limits them): the most this process can allocate, from the host's physical
    memory and the address-space / data-segment rlimits; None where unknown."""
    limits = []
    with contextlib.suppress(AttributeError, OSError, ValueError):  # pragma: no cover - not POSIX
        limits.append((os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "physical memory"))
    with contextlib.suppress(ImportError, OSError, ValueError):  # pragma: no cover - not POSIX
        import resource

        for which, what in (
            (resource.RLIMIT_AS, "RLIMIT_AS"),
            (resource.RLIMIT_DATA, "RLIMIT_DATA"),
        ):
            soft = resource.getrlimit(which)[0]
            if soft != resource.RLIM_INFINITY and soft > 0:
                limits.append((soft, f"the {what} limit"))
    limits = [x for x in limits if x[0] > 0]
    return min(limits) if limits else None
