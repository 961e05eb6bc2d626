"""The file-open spy: every file Python code opens (``os.open``, ``open``/``io.open``, so
``pathlib`` too), whoever opens it, is reported with whether it was opened for writing.
Shared by ``tests/importers/test_reads_inside.py`` and the hostile-input harness. Files opened
by native code (TensorStore's C++ reads) are not seen by ``watch_opens``: ``NativeOpens`` sees
every open of a file in the folders it watches, whoever's code made it (the kernel's inotify)."""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import io
import os
import struct
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def watch_opens(note: Callable[[str | bytes | int, bool], None]) -> Iterator[None]:
    """Within the block, ``note(path, writing)`` before each open (``path`` as given: a str,
    bytes, an ``os.PathLike`` made str, or a file descriptor)."""
    os_open, builtin_open, io_open = os.open, builtins.open, io.open

    def spy_os_open(path, flags, *args, **kwargs):
        note(_plain(path), bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)))
        return os_open(path, flags, *args, **kwargs)

    def spy_open(file, mode="r", *args, **kwargs):
        note(_plain(file), any(c in mode for c in "wax+"))
        return builtin_open(file, mode, *args, **kwargs)

    os.open, builtins.open, io.open = spy_os_open, spy_open, spy_open  # type: ignore[assignment]
    try:
        yield
    finally:
        os.open, builtins.open, io.open = os_open, builtin_open, io_open


def _plain(path):
    return path if isinstance(path, (int, str, bytes)) else os.fspath(path)


_IN_OPEN, _IN_ONLYDIR, _IN_DONT_FOLLOW, _IN_ISDIR = 0x20, 0x01000000, 0x02000000, 0x40000000


class NativeOpens:
    """Every file opened in the folder ``top`` and below it (links not followed, folders
    ``skip`` says yes to left out) by anyone, native code included: inotify's ``IN_OPEN``
    events, queued by the kernel as each open happens, so ``drain`` after a call returns the
    files that call opened."""

    def __init__(self, top: str, skip: Callable[[str], bool] = lambda path: False):
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.dirs: dict[int, str] = {}
        mask = _IN_OPEN | _IN_ONLYDIR | _IN_DONT_FOLLOW
        for dirpath, dirnames, _ in os.walk(top):
            dirnames[:] = [d for d in dirnames if not skip(os.path.join(dirpath, d))]
            wd = self._libc.inotify_add_watch(self.fd, os.fsencode(dirpath), mask)
            if wd < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {dirpath}")
            self.dirs[wd] = dirpath

    def drain(self) -> list[str]:
        """The files opened since the last call (folders listed are not counted)."""
        out = []
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return out
            at = 0
            while at < len(data):
                wd, mask, _, n = struct.unpack_from("iIII", data, at)
                name = data[at + 16 : at + 16 + n].rstrip(b"\0")
                at += 16 + n
                if mask & _IN_OPEN and not mask & _IN_ISDIR and wd in self.dirs:
                    out.append(os.path.join(self.dirs[wd], os.fsdecode(name)))

    def close(self) -> None:
        os.close(self.fd)
