"""Content digests of the files a writer writes, computed while it writes them.

An export's record (``commit.EXPORT_RECORD``) binds each file it lists to its content, so a
forced export replaces an earlier one only while every file is as written. The digest is taken
from the bytes as they pass through ``durable.durable_file`` (no second read of what was just
written): ``recording(directory)`` collects the digests of the files written under
``directory`` while it is active, from any thread.

The digest: CRC-32C of each 1 MiB block, then CRC-32C of those block values (with the size
beside it in the record). CRC-32C because it is hardware-accelerated (the ``crc32c`` package the
format already uses for shard data; several GB/s, about ten times blake2b here), so the binding
costs an export next to nothing; and because a stronger hash would buy nothing: no unkeyed
digest stops someone who writes the record themselves, and an accidental edit that keeps the
size escapes a CRC-32C only with probability 2**-32 (never a burst of up to 32 bits). Blocks make
the digest robust to writers that seek back and patch what they wrote (``zipfile`` rewrites a
member's local header after its data, as ``torch.save`` archives are written here): only the
blocks patched are read again when the file is finished, not the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
import threading

import crc32c as crc32c_lib

from jax_ucp._src.format import mapped_file

BLOCK = 1 << 20  # bytes per CRC-32C block
KIND = "crc32c of the crc32c of each 1 MiB block"  # what the record's digests are

_lock = threading.Lock()
_recordings: dict[str, dict[str, FileDigest]] = {}  # directory -> relative path -> digest


@dataclasses.dataclass(frozen=True)
class FileDigest:
    """A file's size and content digest (8 hex digits, see the module docstring)."""

    size: int
    crc32c: str


def combine(blocks: list[int]) -> str:
    """The file digest from its blocks' CRC-32C values, in order."""
    return f"{crc32c_lib.crc32c(b''.join(c.to_bytes(4, 'little') for c in blocks)):08x}"


@contextlib.contextmanager
def recording(directory: str):
    """Collects ``{relative path: FileDigest}`` of the files written under ``directory``
    through ``durable.durable_file`` while the block runs (yielded; complete at its end)."""
    directory = os.path.abspath(directory)
    digests: dict[str, FileDigest] = {}
    with _lock:
        if directory in _recordings:
            raise RuntimeError(f"{directory}: its writes are already being recorded")
        _recordings[directory] = digests
    try:
        yield digests
    finally:
        with _lock:
            del _recordings[directory]


def recorder_for(path: str):
    """The digest dict recording ``path`` (a file under a ``recording`` directory) and the
    path relative to that directory; None when no recording covers it."""
    path = os.path.abspath(path)
    with _lock:
        for directory, digests in _recordings.items():
            if path.startswith(directory + os.sep):
                return digests, os.path.relpath(path, directory)
    return None


class DigestingFile:
    """A binary file opened for writing, digesting what is written through it.

    Bytes appended in order are digested as they pass; a write at an earlier position (a
    patched header) marks the blocks it touches, and a write past the end (a hole) or a
    ``truncate`` everything from there on, to be read again by ``finish``.
    """

    def __init__(self, f, path: str):
        self._f, self._path = f, path
        self._blocks: list[int] = []  # CRC-32C of each full block digested in order
        self._crc, self._filled = 0, 0  # the current partial block
        self._end = 0  # bytes digested in order (the file's written prefix)
        self._dirty: set[int] = set()  # blocks to read again
        self._reread_from: int | None = None  # everything from here to be read again

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        start = self._f.tell()
        n = self._f.write(view)
        n = len(view) if n is None else n
        stop = start + n
        if start < self._end:
            first, last = start // BLOCK, (min(stop, self._end) - 1) // BLOCK
            self._dirty.update(range(first, last + 1))
        if stop > self._end:
            if start > self._end or self._reread_from is not None:
                self._read_again_from(self._end)
            else:
                self._feed(view[self._end - start : n])
            self._end = stop
        return n

    def _feed(self, view: memoryview) -> None:
        while len(view):
            take = min(BLOCK - self._filled, len(view))
            self._crc = crc32c_lib.crc32c(view[:take], self._crc)
            self._filled += take
            view = view[take:]
            if self._filled == BLOCK:
                self._blocks.append(self._crc)
                self._crc, self._filled = 0, 0

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def truncate(self, size: int | None = None) -> int:
        size = self._f.tell() if size is None else size
        self._read_again_from(min(size, self._end))
        return self._f.truncate(size)

    def _read_again_from(self, offset: int) -> None:
        if self._reread_from is None or offset < self._reread_from:
            self._reread_from = offset

    def __getattr__(self, name):  # tell, seek, flush, fileno, closed, name, ...: the file's own
        return getattr(self._f, name)

    def finish(self) -> FileDigest:
        """The digest of the file as written (flushed first); reads back only the blocks
        patched after they were digested (none for a file written in order)."""
        self._f.flush()
        size = os.fstat(self._f.fileno()).st_size
        blocks = self._blocks + ([self._crc] if self._filled else [])
        if size != self._end:  # written around this wrapper: read it all again
            self._read_again_from(0)
        count = -(-size // BLOCK)
        again = set(self._dirty)
        if self._reread_from is not None:
            again.update(range(self._reread_from // BLOCK, count))
        blocks = (blocks + [0] * count)[:count]
        if again:
            fd = os.open(self._path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                for k in sorted(again):
                    want = min(BLOCK, size - k * BLOCK)
                    block = _read_block(fd, k * BLOCK, want)
                    if len(block) < want:
                        raise OSError(f"{fd}: file shorter than {size} bytes while digesting it")
                    blocks[k] = crc32c_lib.crc32c(block)
            finally:
                os.close(fd)
        return FileDigest(size, combine(blocks))


def digest_file(path: str) -> FileDigest:
    """The digest of the regular file ``path`` as it is now (read once, 1 MiB at a time; a link,
    FIFO or device is refused as ``OSError``, never followed or opened for reading)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path}: not a regular file")
        blocks, size = [], 0
        while True:
            block = _read_block(fd, size)
            if not block:
                break
            blocks.append(crc32c_lib.crc32c(block))
            size += len(block)
            if len(block) < BLOCK:
                break
        return FileDigest(size, combine(blocks))
    finally:
        os.close(fd)


def _read_block(fd: int, offset: int, want: int = BLOCK) -> memoryview:
    """``want`` bytes at ``offset``, fewer only at the end of the file."""
    block = bytearray(want)
    return memoryview(block)[: mapped_file.preadv_full(fd, [block], offset)]
