"""The file-open spy: every file Python code opens (``os.open``, ``open``/``io.open``, so
``pathlib`` too), whoever opens it, is reported with whether it was opened for writing.
Shared by ``tests/importers/test_reads_inside.py`` and the hostile-input harness. Files opened
by native code (TensorStore's C++ reads) are not seen."""

from __future__ import annotations

import builtins
import contextlib
import io
import os
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
