"""Reading a file's bytes, the one reader of ``format``: ``preadv_full`` (straight into the
caller's buffers, whatever the kernel leaves unfilled read again), and memory-mapped files that
may shrink while they are read, whose bytes are read through it.

Readers map a user's checkpoint file so a tensor costs page cache, not anonymous memory, and only
touched bytes are read. But a file truncated while it is mapped turns every later touch of a
page past its new end into SIGBUS: the process dies with no message. So the bytes of a mapping
are never touched in bulk: :func:`read_out`, :func:`copy_into` and :func:`crc32` read them with
``pread`` from the mapping's file (a short read is :class:`CheckpointError`, naming the file), and
:func:`read_bytes` serves the small reads of headers the same way. An array that views no
:class:`FileMap` passes through them unchanged. Since every read passes here, a check of a byte
range (a zip member's CRC-32) can wait until the range is first read (:func:`check_before_read`):
bytes never read are never checked, nor read.
"""

from __future__ import annotations

import mmap
import os
import threading
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.lib.array_utils import byte_bounds

from jax_ucp._src.errors import CheckpointError
from jax_ucp._src.format.files import open_regular

#: Bytes read per ``pread`` (and CRC-summed while still in the CPU cache).
PIECE = 4 << 20


def preadv_full(fd: int, buffers: list, offset: int) -> int:
    """Reads the file's bytes from ``offset`` on straight into ``buffers`` (writable, contiguous
    bytes), repeating ``preadv`` for whatever the kernel left unfilled. Returns the bytes read:
    fewer than ``buffers`` hold only at the end of the file (the caller's error names it).

    Args:
        fd: the open file.
        buffers: where the bytes go, in order.
        offset: the file offset of the first byte.
    """
    rest = [memoryview(b).cast("B") for b in buffers]
    done = 0
    while rest:
        got = os.preadv(fd, rest, offset + done)
        if not got:
            break
        done += got
        advance(rest, got)
    return done


def advance(buffers: list, n: int) -> None:
    """Drops the first ``n`` bytes of ``buffers`` (byte memoryviews, in place): what is left
    after a ``preadv`` or ``writev`` that moved ``n`` bytes."""
    while buffers and n >= buffers[0].nbytes:
        n -= buffers.pop(0).nbytes
    if buffers:
        buffers[0] = buffers[0][n:]


class FileMap(mmap.mmap):
    """A read-only mapping of a whole regular file that knows its file: ``path``, a descriptor
    ``fd`` of its own (the file's identity, whatever the path comes to name), and the address
    of its first byte, so an array viewing it can be traced back to a file offset."""

    path: str
    fd: int
    address: int
    #: :func:`check_before_read`'s ranges not read yet: start -> (end, check); None: none ever
    pending: dict[int, tuple[int, Callable[[FileMap], None]]] | None = None
    pending_lock: threading.RLock

    def __del__(self) -> None:
        fd = getattr(self, "fd", -1)
        if fd >= 0:
            self.fd = -1
            os.close(fd)


def map_file(path: str, fd: int | None = None, *, sealed: bool = False) -> FileMap | None:
    """A :class:`FileMap` of the regular file ``path`` (None when it is empty). ``fd``: a
    descriptor already open on it (duplicated; the caller still owns it). ``sealed``: the
    mapping cannot be touched at all (``PROT_NONE``), only read through this module: a file
    filled in as its ranges are first read (``store.storage.sparse``)."""
    own = os.dup(fd) if fd is not None else open_regular(path)
    try:
        if os.fstat(own).st_size == 0:
            os.close(own)
            return None
        mm = FileMap(own, 0, prot=0) if sealed else FileMap(own, 0, access=mmap.ACCESS_READ)
    except BaseException:
        os.close(own)
        raise
    mm.path, mm.fd = path, own
    mm.address = np.frombuffer(mm, np.uint8, count=1).__array_interface__["data"][0]
    return mm


def mapped_at(arr: Any) -> tuple[FileMap, int] | None:
    """The :class:`FileMap` ``arr`` views and the file offset of ``arr``'s first element, or
    None when it views none (anonymous memory, bytes)."""
    base = arr
    while base is not None and not isinstance(base, FileMap):
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    if base is None:
        return None
    if isinstance(arr, FileMap):
        return arr, 0
    return base, np.asarray(arr).__array_interface__["data"][0] - base.address


def check_before_read(mm: FileMap, start: int, size: int, check: Callable[[FileMap], None]) -> None:
    """Runs ``check(mm)`` once, before the first read through this module of any byte of
    ``[start, start + size)``: a zip member's CRC-32 costs a pass over its bytes, worth paying
    only for members that are read (a weights-only import never reads the Adam moments). A
    failing check fails every read of the range. Ranges of one mapping do not overlap.

    Args:
        mm: the mapping.
        start: the range's first byte (a file offset).
        size: its length in bytes.
        check: raises when the range's bytes are bad; called with ``mm``, holding its lock.
    """
    if mm.pending is None:
        mm.pending_lock = threading.RLock()
        mm.pending = {}
    with mm.pending_lock:
        mm.pending[start] = (start + size, check)


def check_pending(mm: FileMap, start: int = 0, end: int | None = None) -> None:
    """Runs now the :func:`check_before_read` checks of the ranges overlapping ``[start, end)``
    (default: all). Other threads reading those ranges wait for them.

    Args:
        mm: the mapping.
        start: the first byte of the span.
        end: the end of the span (None: the end of the file).
    """
    if mm.pending is None:
        return
    end = len(mm) if end is None else end
    with mm.pending_lock:  # taken even when none is left: a check still running holds it
        due = sorted((s, e, c) for s, (e, c) in mm.pending.items() if s < end and start < e)
        for s, e, check in due:
            del mm.pending[s]  # the check's own reads of the range pass (this thread, RLock)
            try:
                check(mm)
            except BaseException:
                mm.pending[s] = (e, check)
                raise


def _pread_into(mm: FileMap, offset: int, buf: memoryview, what: str) -> None:
    if mm.pending is not None:  # a check that is running has left ``pending`` already
        check_pending(mm, offset, offset + len(buf))
    got = preadv_full(mm.fd, [buf], offset)
    if got < len(buf):
        raise CheckpointError(
            f"{mm.path}: {what}: bytes [{offset}, {offset + len(buf)}) end at {offset + got}; "
            f"the file was {len(mm)} bytes when it was opened and is "
            f"{os.fstat(mm.fd).st_size} now (truncated while being read?)"
        )


def read_bytes(buf: Any, offset: int, length: int, what: str = "reading") -> bytes:
    """``buf[offset:offset+length]`` as bytes, read with ``pread`` when ``buf`` is mapped.

    Args:
        buf: a FileMap, an array viewing one, or any buffer.
        offset: the first byte.
        length: how many bytes.
        what: what is being read, for the error.
    """
    where = mapped_at(buf)
    if where is None:
        return bytes(memoryview(buf).cast("B")[offset : offset + length])
    mm, start = where
    out = bytearray(length)
    _pread_into(mm, start + offset, memoryview(out), what)
    return bytes(out)


def read_out(arr: np.ndarray, what: str = "reading a tensor") -> np.ndarray:
    """``arr``'s values in memory of their own, read with ``pread`` when ``arr`` views a
    :class:`FileMap` (the mapping itself is never touched); ``arr`` itself otherwise."""
    where = mapped_at(arr)
    if where is None or arr.size == 0:
        return arr
    mm, start = where
    out = np.empty(arr.shape, arr.dtype)
    if arr.flags.c_contiguous:
        _pread_into(mm, start, out.reshape(-1).view(np.uint8).data, what)
        return out
    low, high = byte_bounds(arr)  # addresses; ``start`` is the file offset of element 0
    first = arr.__array_interface__["data"][0]
    raw = np.empty(high - low, np.uint8)
    _pread_into(mm, start + low - first, raw.data, what)
    out[...] = np.ndarray(arr.shape, arr.dtype, buffer=raw, offset=first - low, strides=arr.strides)
    return out


def copy_into(region: np.ndarray, arr: np.ndarray, what: str = "reading a tensor") -> None:
    """``region[...] = arr``, read with ``pread`` straight into ``region`` when ``arr`` views a
    :class:`FileMap` and both are C-contiguous of one shape and dtype.

    Args:
        region: the destination array.
        arr: the source, possibly a view of a FileMap.
        what: what is being read, for the error.
    """
    where = mapped_at(arr)
    if where is None:
        region[...] = arr
    elif (
        arr.flags.c_contiguous
        and region.flags.c_contiguous
        and region.shape == arr.shape
        and region.dtype == arr.dtype
    ):
        _pread_into(where[0], where[1], region.reshape(-1).view(np.uint8).data, what)
    elif arr.flags.c_contiguous and region.flags.c_contiguous and region.shape == arr.shape:
        # a cast (the fp32 master to the bf16 model weight): a piece at a time through one
        # small buffer, never a copy of the whole tensor (its pages faulted in, then cast from
        # main memory): half the time for the same values
        _cast_into(region.reshape(-1), arr.reshape(-1), where, what)
    else:
        region[...] = read_out(arr, what)


def _cast_into(out: np.ndarray, flat: np.ndarray, where: tuple[FileMap, int], what: str) -> None:
    mm, start = where
    step = max(1, PIECE // flat.itemsize)
    piece = np.empty(min(step, flat.size), flat.dtype)
    for at in range(0, flat.size, step):
        n = min(step, flat.size - at)
        _pread_into(mm, start + at * flat.itemsize, piece[:n].view(np.uint8).data, what)
        out[at : at + n] = piece[:n]


def crc32(arr: np.ndarray, value: int = 0, crc=zlib.crc32, what: str = "checking a CRC") -> int:
    """The zip CRC-32 of ``arr``'s bytes (C-contiguous), continuing ``value``; read with
    ``pread`` a piece at a time when ``arr`` views a :class:`FileMap`.

    Args:
        arr: the C-contiguous array whose bytes are checked.
        value: the CRC-32 to continue.
        crc: the CRC-32 function (ISA-L's is faster, same values).
        what: what is being read, for the error.
    """
    where = mapped_at(arr)
    if where is None:
        return crc(arr, value)
    mm, start = where
    size = arr.nbytes
    piece = np.empty(min(size, PIECE), np.uint8)
    for pos in range(0, size, PIECE):
        n = min(PIECE, size - pos)
        _pread_into(mm, start + pos, piece[:n].data, what)
        value = crc(piece[:n], value)
    return value


def take(arr: np.ndarray, index: Any, what: str = "reading a tensor") -> np.ndarray:
    """``arr.reshape(-1)[index]`` for a few flat indices, each element read with ``pread``
    when ``arr`` views a :class:`FileMap` (spot checks of a large mapped tensor).

    Args:
        arr: the tensor, possibly a view of a mapped file.
        index: the flat indices to read.
        what: what is read, for the error of a failed read.
    """
    flat = arr.reshape(-1)
    index = np.asarray(index, np.int64).reshape(-1)
    if mapped_at(arr) is None:
        return flat[index]
    out = np.empty(index.shape, arr.dtype)
    for k, i in enumerate(index.tolist()):
        out[k] = read_out(flat[i : i + 1], what)[0]
    return out
