"""A zip archive of a remote medium (``.pt`` and the like, any ``Storage`` whose files are not
local) read as a local file: a private, unlinked sparse file of the object's size, of which its
first :data:`HEAD` bytes and its zip directory are fetched at once (a suffix GET, two one-byte
GETs holding the size the directory implies to the object's) and the rest as a reader needs it
(:meth:`RemoteArchive.fetch`: ranged GETs, concurrent within ``ranged.IN_FLIGHT`` bytes), so a
process fetches the members it reads. ``Storage.mapped`` hands it to the torch zip reader; an
archive opened again within :data:`REUSE` seconds (a restore's detection, then its plan) is the
same copy, its bytes fetched once.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import struct
import tempfile
import threading
import time
from typing import TYPE_CHECKING

import tensorstore as ts

from jax_ucp._src.errors import SourceError
from jax_ucp._src.store.storage import ranged

if TYPE_CHECKING:
    from jax_ucp._src.store.storage.base import Storage

TAIL = 64 << 10  # the suffix GET that finds an archive's zip directory
HEAD = 4 << 10  # an archive's first bytes, fetched with its directory
MAX_DIRECTORY = 256 << 20  # the largest zip directory fetched
REUSE = 30.0  # seconds an archive's copy serves the next opening of its URL

_counts = {"gets": 0, "bytes": 0}
_lock = threading.Lock()
#: URL -> (when opened, its copy)
_opened: dict[str, tuple[float, RemoteArchive]] = {}


def fetched() -> tuple[int, int]:
    """(GETs, bytes) this process has fetched into local copies so far."""
    return _counts["gets"], _counts["bytes"]


def count(gets: int, nbytes: int) -> None:
    """Adds to :func:`fetched`."""
    with _lock:
        _counts["gets"] += gets
        _counts["bytes"] += nbytes


@dataclasses.dataclass(eq=False)
class RemoteArchive:
    """A zip archive in a remote storage (``key`` in ``kv``), standing as the sparse local file
    ``fd`` is open on (read and write, closed with this): ``size`` bytes, of which the ranges
    ``here`` are fetched."""

    url: str
    kv: ts.KvStore
    key: str
    size: int
    fd: int
    here: list[tuple[int, int]]  # the ranges fetched (merged, sorted)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def __del__(self) -> None:
        os.close(self.fd)

    def missing(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[start, end)`` not fetched yet."""
        out, at = [], max(0, start)
        for lo, hi in self.here:
            if lo >= end:
                break
            if hi > at:
                if lo > at:
                    out.append((at, lo))
                at = max(at, hi)
        return [*out, (at, end)] if at < end else out

    def fetch(self, ranges: list[tuple[int, int]]) -> None:
        """Bytes ``[start, end)`` of each of ``ranges`` into the local file, those not here
        yet: ranged GETs (``ranged.fetch_ranges``). An object shorter than ``size`` is an
        error naming it."""
        with self.lock:
            self._fetch([m for a, b in ranges for m in self.missing(a, min(b, self.size))])

    def _fetch(self, todo: list[tuple[int, int]]) -> None:
        ranged.fetch_ranges(self.kv, self.key, todo, self._put, self.url)
        merged: list[tuple[int, int]] = []
        for lo, hi in sorted([*self.here, *todo]):
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        self.here = merged

    def _put(self, at: int, n: int, data: bytes | None) -> None:
        if data is None:
            raise SourceError(f"{self.url}: the object is gone (deleted while being read)")
        count(1, len(data))
        if len(data) != n:
            raise SourceError(
                f"{self.url}: bytes [{at}, {at + n}) asked, {len(data)} came; its zip directory "
                f"gave {self.size} bytes (truncated or replaced while being read)"
            )
        view = memoryview(data)
        while view:
            view = view[os.pwrite(self.fd, view, at + len(data) - len(view)) :]


def remote_archive(storage: Storage, name: str) -> RemoteArchive | None:
    """File ``name`` of ``storage`` as a :class:`RemoteArchive`, its head and zip directory
    fetched (the copy of the last :data:`REUSE` seconds, if any); None when it ends no zip
    archive. One that disagrees with the size its directory implies is a ``SourceError``
    naming it."""
    url, now = storage.join(name), time.monotonic()
    with _lock:
        for key in [k for k, (at, _) in _opened.items() if now - at > REUSE]:
            del _opened[key]
        if url in _opened:
            return _opened[url][1]
    kv, key = ranged.opened(storage, name)
    try:
        tail = kv.read(key, byte_range=slice(-TAIL, None)).result()
    except ValueError:  # shorter than TAIL: from its first byte
        tail = kv.read(key).result()
    if tail.state != "value":
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), url)
    count(1, len(tail.value))
    found = zip_extent(bytes(tail.value))
    if found is None:
        return None
    size, directory = found
    held: list[int] = []  # the size, held to the object's: a byte at size - 1, none at size
    if len(tail.value) <= size <= directory + MAX_DIRECTORY:
        probes = [(size - 1, size), (size, size + 1)]
        ranged.fetch_ranges(kv, key, probes, lambda at, n, got: held.append(len(got or b"")), url)
    if held != [1, 0]:
        raise SourceError(
            f"{url}: its zip directory implies a {size}-byte archive (directory at "
            f"{directory}); the object disagrees (truncated or corrupt)"
        )
    with tempfile.TemporaryFile(prefix="ucp-archive-") as f:  # unlinked: gone with its fd
        fd = os.dup(f.fileno())
    os.ftruncate(fd, size)
    os.pwrite(fd, tail.value, size - len(tail.value))
    remote = RemoteArchive(url, kv, key, size, fd, [(size - len(tail.value), size)])
    # its first bytes (a reader checks the signature); a directory larger than the tail
    remote.fetch([(0, min(HEAD, size)), (directory, size)])
    with _lock:
        _opened[url] = now, remote
    return remote


_EOCD = struct.Struct("<4sHHHHIIH")


def zip_extent(tail: bytes) -> tuple[int, int] | None:
    """(the archive's size, where its central directory starts) from its last bytes (zip64
    too), or None when they end no zip archive. The size is where a record the tail holds
    starts, by its own offsets, plus the bytes from it to the tail's end."""
    at = tail.rfind(b"PK\x05\x06", 0, max(0, len(tail) - _EOCD.size + 4))
    if at < 0:
        return None
    _, _, _, here, total, cd_size, cd_start, comment = _EOCD.unpack_from(tail, at)
    if at + _EOCD.size + comment != len(tail):
        return None
    record, pos, locator = cd_start + cd_size, at, at - 20
    if locator >= 0 and tail[locator : locator + 4] == b"PK\x06\x07":  # zip64 (torch's always)
        (record,) = struct.unpack_from("<Q", tail, locator + 8)
        pos = tail.rfind(b"PK\x06\x06", 0, locator)
        if pos < 0 or pos + 56 > locator:
            return None
        cd_size, cd_start = struct.unpack_from("<QQ", tail, pos + 40)
    elif 0xFFFFFFFF in (cd_size, cd_start) or 0xFFFF in (here, total):
        return None
    if cd_start + cd_size > record:
        return None
    return record + len(tail) - pos, cd_start
