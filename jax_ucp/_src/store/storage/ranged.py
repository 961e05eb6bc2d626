"""The read half of a medium: one file read at any offset (``Storage.reader``), ``pread`` on a
local file, ranged GETs of an object-store object or a Hub file (where ``Storage.ranged`` says it
is read from: the Hub's CDN redirect followed there), so that a reader of a format that reads
parts of a file (safetensors' header, then each tensor's rows) is one reader whatever the medium;
and the ranged reads of a remote file every reader shares (``fetch_ranges``: pieces in flight at
once, ``pieces``). JAX-free.
"""

from __future__ import annotations

import abc
import contextlib
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import tensorstore as ts

from jax_ucp._src.errors import SourceError, tensorstore_message
from jax_ucp._src.format import files, mapped_file
from jax_ucp._src.store.in_flight import InFlightBytes

if TYPE_CHECKING:
    from jax_ucp._src.store.storage.base import Storage


PIECE = 8 << 20  # bytes per ranged GET
IN_FLIGHT = 64 << 20  # bytes of ranged GETs in flight at once
#: ``(at, n, into)``: ``n`` bytes of a file from ``at``, read into ``into`` (None: any buffer)
Piece = tuple[int, int, "memoryview | None"]
_SCRATCH = threading.local()  # LocalFile's reusable read buffer, per thread

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
    #: each read is a request (a round trip): a reader needing a whole range reads it at once
    requests = False

    @abc.abstractmethod
    def read(self, offset: int, n: int) -> bytes | None:
        """Up to ``n`` bytes from ``offset`` (fewer: the file ends first), None when there is
        no such file; a range the medium refuses is a ``RangeError``."""

    @abc.abstractmethod
    def read_into(self, pieces: Sequence[Piece], done: Callable[[int, memoryview], None]) -> None:
        """Bytes ``[at, at + n)`` of each ``(at, n, into)`` of ``pieces``, handed on in their order
        as ``done(i, data)``: ``into`` filled (writable bytes), else a view valid during the call;
        the file missing or ending before a piece ends is a ``RangeError``."""

    @abc.abstractmethod
    def size(self, at_least: int) -> int:
        """Its size, or ``at_least`` when it holds at least that many bytes; -1: no such file."""

    def mapped(self) -> mapped_file.FileMap | None:
        """The file mapped (read through ``format.mapped_file``, never touched); None: by ranges."""
        return None

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

    def mapped(self) -> mapped_file.FileMap | None:
        with contextlib.suppress(FileNotFoundError):  # ``read`` says there is none
            return mapped_file.map_file(self.shown)

    def size(self, at_least: int) -> int:
        """By ``stat``: a FIFO refused (``UnsafeFileError``), a link to nothing a ``RangeError``."""
        if not os.path.lexists(self.shown):
            return -1
        try:
            files.check_regular(self.shown)
            return os.stat(self.shown).st_size
        except FileNotFoundError:
            raise RangeError(f"{self.shown}: dangling link") from None

    def read_into(self, pieces: Sequence[Piece], done: Callable[[int, memoryview], None]) -> None:
        """One ``preadv`` a piece, into ``into`` or this thread's scratch buffer."""
        try:
            fd = files.open_regular(self.shown)
        except FileNotFoundError:
            raise RangeError(_short(self.shown, 0, 0, None)) from None
        try:
            for i, (at, n, into) in enumerate(pieces):
                if into is None:
                    into = getattr(_SCRATCH, "buf", None)
                    if into is None or len(into) < n:
                        into = _SCRATCH.buf = memoryview(bytearray(n))
                got = mapped_file.preadv_full(fd, [into[:n]], at)
                if got < n:
                    raise RangeError(_short(self.shown, at, n, got))
                done(i, into[:n])
        finally:
            os.close(fd)


class RangedObject(RandomAccess):
    """An object of an object-store prefix or a Hub repo, each read one ranged GET through
    TensorStore's kvstore drivers (opened once per file)."""

    requests = True

    def __init__(self, storage: Storage, name: str):
        self.kv, self.key = opened(storage, name)
        self.shown, self._at = storage.join(name), (storage, name)

    def size(self, at_least: int) -> int:
        """A GET of its last byte, the size from the server's answer when it ends before (a
        local view's stand-in is empty: its size says nothing)."""
        for start in (max(at_least - 1, 0), 0):  # from 0 tells the size where one past it cannot
            try:
                got = self.kv.read(self.key, byte_range=slice(start, at_least)).result()
            except ValueError as e:
                if (size := size_when_short(e, self.shown)) is not None:
                    return size
                continue
            return -1 if got.state != "value" else start + len(got.value)
        return 0 if self._at[0].exists(self._at[1]) else -1

    def read(self, offset: int, n: int) -> bytes | None:
        try:
            got = self.kv.read(self.key, byte_range=slice(offset, offset + n)).result()
        except ValueError as e:  # OUT_OF_RANGE, a server's status: named by the caller
            size_when_short(e, self.shown)  # (another range answered: named here)
            raise RangeError(tensorstore_message(e)) from None
        return bytes(got.value) if got.state == "value" else None

    def read_into(self, pieces: Sequence[Piece], done: Callable[[int, memoryview], None]) -> None:
        """Adjacent pieces fetched together, :data:`PIECE` bytes a GET (a larger piece cut), at
        most :data:`IN_FLIGHT` bytes in flight; each GET's bytes copied into ``into`` (a piece
        cut without one gets a buffer) or handed on as they came."""
        window: InFlightBytes[tuple[int, int, ts.Future, list]] = InFlightBytes(IN_FLIGHT)
        start = end = 0
        parts: list = []  # of the GET being gathered: (i, at, n, into, piece's start, last)

        def issue() -> None:
            for job in window.make_room(end - start):
                _hand_on(self.shown, *job, done)
            window.add(
                (start, end, self.kv.read(self.key, byte_range=slice(start, end)), parts),
                end - start,
            )

        for i, (first, n, into) in enumerate(pieces):
            if into is None and n > PIECE:
                into = memoryview(bytearray(n))
            for at in range(first, first + max(n, 1), PIECE):
                k = min(PIECE, first + n - at)
                if parts and (at != end or end - start + k > PIECE):
                    issue()
                    parts = []
                if not parts:
                    start = end = at
                parts.append((i, at, k, into, first, at + k == first + n))
                end = at + k
        if parts:
            issue()
        for job in window.drain():
            _hand_on(self.shown, *job, done)


def _hand_on(shown: str, start: int, end: int, future: ts.Future, parts: list, done) -> None:
    """One GET's bytes ``[start, end)`` into its ``parts`` (``RangedObject.read_into``)."""
    try:
        got = future.result()
    except ValueError as e:  # past the end of the object (OUT_OF_RANGE), a server's status
        size_when_short(e, shown)
        raise RangeError(f"{shown}: {tensorstore_message(e)}") from None
    data = memoryview(got.value) if got.state == "value" else None
    if data is None or len(data) < end - start:
        raise RangeError(_short(shown, start, end - start, None if data is None else len(data)))
    for i, at, n, into, first, last in parts:
        part = data[at - start : at - start + n]
        if into is not None:
            into[at - first : at - first + n] = part
        if last:
            done(i, part if into is None else into[: at + n - first])


def _short(shown: str, at: int, n: int, got: int | None) -> str:
    """Why ``n`` bytes from ``at`` were not read: ``got`` of them were (None: no such file)."""
    if got is None:
        return f"{shown}: no such file"
    return f"{shown}: bytes [{at}, {at + n}) asked, the file ends at byte {at + got} (truncated)"


def opened(storage: Storage, name: str) -> tuple[ts.KvStore, str]:
    """The opened kvstore object ``name`` of ``storage`` is read from by byte ranges, and its
    key there."""
    spec, key = storage.ranged(name)
    return ts.KvStore.open(spec).result(), key


def pieces(storage: Storage, name: str) -> Iterator[bytes]:
    """Object ``name`` of ``storage``, :data:`PIECE` bytes per ranged GET (the last one to its
    end); FileNotFoundError when there is none."""
    (kv, key), at = opened(storage, name), 0
    while True:
        try:
            got = kv.read(key, byte_range=slice(at, at + PIECE)).result()
        except ValueError as e:  # fewer bytes left: the rest (none: OUT_OF_RANGE again)
            size_when_short(e, storage.join(name))
            try:
                got = kv.read(key, byte_range=slice(at, None)).result()
            except ValueError as again:
                size_when_short(again, storage.join(name))
                return
        if got.state != "value":
            raise FileNotFoundError(storage.join(name))
        yield bytes(got.value)
        if len(got.value) < PIECE:
            return
        at += PIECE


def fetch_ranges(
    kv: ts.KvStore,
    key: str,
    ranges: list[tuple[int, int]],
    put: Callable[..., None],
    url: str = "",
) -> None:
    """Bytes ``[start, end)`` of each of ``ranges`` of object ``key`` (at ``url``, for
    messages): ranged GETs of :data:`PIECE` bytes, at most :data:`IN_FLIGHT` bytes in flight,
    each handed on oldest first as ``put(at, n, data)``: the ``n`` bytes from ``at``, fewer
    (none) where the object ends before, None when it is gone; another range answered is an
    error naming both."""
    window: InFlightBytes[tuple[int, int, ts.Future]] = InFlightBytes(IN_FLIGHT)

    def finish(at: int, n: int, future) -> None:
        try:
            got = future.result()
            data = bytes(got.value) if got.state == "value" else None
        except ValueError as e:  # the range ends past the object's end (OUT_OF_RANGE)
            size_when_short(e, url or key)
            data = b""
        put(at, n, data)

    for start, end in ranges:
        for at in range(start, end, PIECE):
            n = min(PIECE, end - at)
            for job in window.make_room(n):
                finish(*job)
            window.add((at, n, kv.read(key, byte_range=slice(at, at + n))), n)
    for job in window.drain():
        finish(*job)
