"""The read half of a medium: one file read at any offset (``Storage.reader``), ``pread`` on a
local file, ranged GETs of an object-store object or a Hub file (where ``Storage.ranged`` says it
is read from: the Hub's CDN redirect followed there), so that a reader of a format that reads
parts of a file (safetensors' header, then each tensor's rows) is one reader whatever the medium.
JAX-free.
"""

from __future__ import annotations

import abc
import os
import re
from typing import TYPE_CHECKING

import tensorstore as ts

from jax_ucp._src.errors import SourceError, tensorstore_message
from jax_ucp._src.format import files, mapped_file

if TYPE_CHECKING:
    from jax_ucp._src.store.storage.base import Storage


#: TensorStore's OUT_OF_RANGE for a ranged read answered with other bytes than asked
_ANSWERED = re.compile(
    r"Requested byte range \[(-?[0-9]+), ([0-9]+|\?)\) was not satisfied by response with "
    r"byte range \[([0-9]+), ([0-9]+)\) and total size ([0-9]+)"
)


def size_when_short(e: ValueError, url: str) -> int | None:
    """The object's size when TensorStore's ``e`` (OUT_OF_RANGE of a ranged read of ``url``)
    says the range asked runs past its end; None when it says nothing of its size (a range
    starting past the end: HTTP 416). A server answering another range than the one asked
    (a CDN or proxy misbehaving) is a ``SourceError`` naming the URL and both ranges."""
    m = _ANSWERED.search(str(e))
    if m is None:
        return None
    start, stop, got_start, got_stop, total = m.groups()
    short = int(got_stop) == int(total) and (stop == "?" or int(stop) > int(total))
    if short and (got_start == start or (int(start) < 0 and got_start == "0")):
        return int(total)
    raise SourceError(
        f"{url}: bytes [{start}, {stop}) asked, the server answered bytes [{got_start}, "
        f"{got_stop}) of {total} (a CDN or proxy answering another range); nothing is read "
        f"from an answer to another question"
    )


class RangeError(SourceError):
    """The medium refused a range (past the end of an object that shrank, a server's error
    status or a ``Range`` it ignored): its message, for the caller's error naming the file (a
    ``ValueError`` too, as TensorStore's own, so that ``format`` catches it without importing
    this)."""


class RandomAccess(abc.ABC):
    """One file of a medium, read by byte ranges; ``shown`` names it (its path or URL)."""

    shown: str

    @abc.abstractmethod
    def read(self, offset: int, n: int) -> bytes | None:
        """Up to ``n`` bytes from ``offset`` (fewer: the file ends first), None when there is
        no such file; a range the medium refuses is a ``RangeError``."""

    def holds(self, size: int) -> bool:
        """Whether the file has at least ``size`` bytes (one byte read just before it)."""
        try:
            got = self.read(size - 1, 1)
        except RangeError:
            return False
        return got is not None and len(got) == 1


class LocalFile(RandomAccess):
    """A local regular file read with ``pread`` (``format.mapped_file.preadv_full``)."""

    def __init__(self, path: str):
        self.shown = path

    def read(self, offset: int, n: int) -> bytes | None:
        try:
            fd = files.open_regular(self.shown)
        except FileNotFoundError:
            return None
        try:
            out = bytearray(n)
            return bytes(out[: mapped_file.preadv_full(fd, [out], offset)])
        finally:
            os.close(fd)


class RangedObject(RandomAccess):
    """An object of an object-store prefix or a Hub repo, each read one ranged GET through
    TensorStore's kvstore drivers (opened once per file)."""

    def __init__(self, storage: Storage, name: str):
        spec, self.key = storage.ranged(name)
        self.kv = ts.KvStore.open(spec).result()
        self.shown = storage.join(name)

    def read(self, offset: int, n: int) -> bytes | None:
        try:
            got = self.kv.read(self.key, byte_range=slice(offset, offset + n)).result()
        except ValueError as e:  # OUT_OF_RANGE, a server's status: named by the caller
            size_when_short(e, self.shown)  # (another range answered: named here)
            raise RangeError(tensorstore_message(e)) from None
        return bytes(got.value) if got.state == "value" else None
