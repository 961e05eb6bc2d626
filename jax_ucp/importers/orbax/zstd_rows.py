"""Rows of a zarr v2 array whose chunks are zstd frames (Orbax's default layout), decoded as a
stream: a chunk is read from its kvstore a few MiB at a time (byte ranges, OCDBT included) and
decoded straight into the rows asked for, so reading holds one slab, never the compressed chunk
nor the decoded one. TensorStore decodes a chunk whole, and Orbax saves a single-device array as
one chunk: reading rows of it through TensorStore held compressed + decoded chunk + the rows
(333 MiB for a 125 MiB array at a 64 MiB budget).

libzstd is called through ctypes (the decoder TensorStore bundles is not exposed); without it, or
for any other layout, :func:`rows_reader` returns None and the caller reads through TensorStore.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_ucp import writer
from jax_ucp.errors import SourceError, tensorstore_message

#: Compressed bytes read from the kvstore at once.
PIECE_BYTES = 1 << 20
_SCRATCH_BYTES = 1 << 20  # decoded rows skipped over (a slab asked for out of order)


ZstdChunkError = SourceError  # a chunk that does not decode to its declared bytes


class _Buffer(ctypes.Structure):  # ZSTD_inBuffer and ZSTD_outBuffer have one layout
    _fields_ = [("ptr", ctypes.c_void_p), ("size", ctypes.c_size_t), ("pos", ctypes.c_size_t)]


@functools.cache
def _lib() -> Any:
    """libzstd, or None when it cannot be loaded."""
    name = ctypes.util.find_library("zstd")
    if name is None:
        return None
    void, size, buffer = ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(_Buffer)
    signatures = {  # name: (argument types, result type)
        "ZSTD_createDStream": ([], void),
        "ZSTD_freeDStream": ([void], size),
        "ZSTD_initDStream": ([void], size),
        "ZSTD_decompressStream": ([void, buffer, buffer], size),
        "ZSTD_isError": ([size], ctypes.c_uint),
        "ZSTD_getErrorName": ([size], ctypes.c_char_p),
    }
    try:
        lib = ctypes.CDLL(name)
        for function, (argtypes, restype) in signatures.items():
            getattr(lib, function).argtypes = argtypes
            getattr(lib, function).restype = restype
    except (OSError, AttributeError):
        return None
    return lib


class _Frame:
    """One chunk's zstd frame decoded front to back, its compressed bytes read piece by piece."""

    def __init__(self, kvstore, key: str, nbytes: int, where: str):
        self.lib, self.kv, self.key, self.where = _lib(), kvstore, key, where
        self.nbytes, self.done = nbytes, 0  # decoded bytes declared / handed out so far
        self.stream = self.lib.ZSTD_createDStream()
        if not self.stream:
            raise MemoryError("ZSTD_createDStream failed")
        # zstd's hint: the input it needs next, never past the frame's end
        self.hint = self._check(self.lib.ZSTD_initDStream(self.stream))
        self.offset, self.ended, self.near_end = 0, False, False  # compressed bytes read so far
        self.piece, self.inbuf = b"", _Buffer(None, 0, 0)

    def __del__(self):
        if getattr(self, "stream", None):
            self.lib.ZSTD_freeDStream(self.stream)
            self.stream = None

    def _check(self, ret: int) -> int:
        if self.lib.ZSTD_isError(ret):
            raise ZstdChunkError(
                f"chunk {self.key!r} is not a valid zstd frame "
                f"({self.lib.ZSTD_getErrorName(ret).decode()})"
            )
        return ret

    def _read(self, n: int) -> bytes | None:
        """``n`` compressed bytes from ``offset`` (None: the value ends before that)."""
        try:
            r = self.kv.read(self.key, byte_range=slice(self.offset, self.offset + n)).result()
        except ValueError as e:
            if "OUT_OF_RANGE" not in str(e):
                raise
            return None
        return r.value if r.state == "value" else b""

    def _refill(self) -> None:
        """The next piece of compressed bytes: ``PIECE_BYTES``, or zstd's hint once fewer are
        left (the kvstore refuses a range past the value's end and does not say its size)."""
        piece = None if self.near_end else self._read(PIECE_BYTES)
        if piece is None:
            self.near_end = True
            piece = self._read(max(1, self.hint))
        if not piece:
            raise ZstdChunkError(
                f"chunk {self.key!r} ends after {self.offset} compressed bytes, {self.done} of "
                f"{self.nbytes} decoded (truncated)"
            )
        self.piece = piece
        self.offset += len(piece)
        self.inbuf = _Buffer(ctypes.cast(ctypes.c_char_p(piece), ctypes.c_void_p), len(piece), 0)

    def _decode(self, target, size: int) -> int:
        """Decodes up to ``size`` bytes into ``target``; fewer only where the frame ends."""
        ptr = (ctypes.c_char * len(target)).from_buffer(target)
        out = _Buffer(ctypes.addressof(ptr), size, 0)
        while out.pos < size and not self.ended:
            if self.inbuf.pos == self.inbuf.size:
                self._refill()
            self.hint = self._check(
                self.lib.ZSTD_decompressStream(
                    self.stream, ctypes.byref(out), ctypes.byref(self.inbuf)
                )
            )
            self.ended = self.hint == 0  # the frame is over and flushed
        del ptr
        return out.pos

    def into(self, out, n: int) -> None:
        """Decodes the next ``n`` bytes into the writable buffer ``out`` (None: skips them)."""
        if self.done + n > self.nbytes:
            raise ValueError(f"chunk {self.key!r}: {self.done + n} bytes asked of {self.nbytes}")
        scratch = bytearray(min(_SCRATCH_BYTES, n)) if out is None else None
        while n:
            got = self._decode(scratch, min(n, len(scratch))) if scratch else self._decode(out, n)
            if not got:
                raise ZstdChunkError(
                    f"chunk {self.key!r} decodes to {self.done} bytes, expected {self.nbytes} "
                    f"(truncated or damaged)"
                )
            self.done, n = self.done + got, n - got
            if out is not None:
                out = out[got:]
        if self.done == self.nbytes:
            self._finish()

    def _finish(self) -> None:
        """After the declared bytes: the frame must end there, with nothing after it."""
        if not self.ended and self._decode(bytearray(1), 1):
            raise ZstdChunkError(
                f"chunk {self.key!r} decodes to more than its {self.nbytes} bytes (damaged)"
            )
        if self.inbuf.size - self.inbuf.pos or self._read(1):
            raise ZstdChunkError(f"chunk {self.key!r} has bytes after its zstd frame (damaged)")
        self.piece, self.inbuf = b"", _Buffer(None, 0, 0)


def rows_reader(
    array, where: str, name: str, error: type[Exception]
) -> Callable[[int, int], np.ndarray] | None:
    """``rows(lo, hi)``: rows ``lo:hi`` of dim 0 of the TensorStore ``array`` (opened on a zarr
    v2 array), decoded from its chunks' zstd frames as a stream; rows asked for in order (as the
    writer's slabs are) decode each chunk once. None where this does not apply: no libzstd, not
    zarr v2 with only a zstd compressor in C order, chunks that split a row (dims after the
    first), a 0-d or empty array. A chunk that is not in the store is TensorStore's to read
    (its fill value).

    Args:
        array: the opened array.
        where: where its chunks lie (for errors).
        name: the array's name (for errors).
        error: the exception raised for a damaged chunk (names the array and file).
    """
    if _lib() is None or array.rank < 1 or 0 in array.shape:
        return None
    spec = array.spec().to_json()
    meta = spec.get("metadata") or {}
    chunks = [int(c) for c in meta.get("chunks") or ()]
    shape = [int(d) for d in array.shape]
    compressor = meta.get("compressor") or {}
    if (
        spec.get("driver") != "zarr"
        or meta.get("zarr_format") != 2
        or compressor.get("id") != "zstd"
        or meta.get("filters")
        or meta.get("order") != "C"
        or len(chunks) != len(shape)
        or chunks[1:] != shape[1:]
        or not 0 < chunks[0]
        or list(array.domain.inclusive_min) != [0] * len(shape)
        or meta.get("shape") != shape
    ):
        return None
    dtype = array.dtype.numpy_dtype
    declared = str(meta.get("dtype"))
    try:  # little-endian (or single-byte) as stored, or bfloat16 (always little-endian)
        same = declared == "bfloat16" or (declared[:1] in "<|" and np.dtype(declared) == dtype)
    except TypeError:
        same = False
    if not same or not np.little_endian:
        return None
    sep = meta.get("dimension_separator") or "."
    kvstore = array.kvstore
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    state: dict[str, Any] = {"frame": None, "chunk": -1}

    def frame(index: int, row: int) -> _Frame | None:
        """The decoder of chunk ``index`` at its row ``row`` (restarted if it passed it); None
        for a chunk not in the store."""
        f = state["frame"]
        if state["chunk"] != index or f is None or f.done > row * row_bytes:
            state["frame"], state["chunk"] = None, -1
            key = sep.join([str(index)] + ["0"] * (len(shape) - 1))
            if not _present(kvstore, key):
                return None
            # a zarr v2 chunk always has the full chunk shape, the last (edge) one too
            f = _Frame(kvstore, key, chunks[0] * row_bytes, where)
            state["frame"], state["chunk"] = f, index
        if f.done < row * row_bytes:
            f.into(None, row * row_bytes - f.done)
        return f

    def rows(lo: int, hi: int) -> np.ndarray:
        out = writer.unpooled_empty((hi - lo, *shape[1:]), dtype)
        flat = memoryview(out.reshape(-1).view(np.uint8).data)
        at = lo
        try:
            while at < hi:
                index = at // chunks[0]
                end = min(hi, (index + 1) * chunks[0])
                f = frame(index, at - index * chunks[0])
                if f is None:  # TensorStore's to read: its fill value, or its error
                    out[at - lo : end - lo] = array[at:end].read().result()
                else:
                    f.into(
                        flat[(at - lo) * row_bytes : (end - lo) * row_bytes], (end - at) * row_bytes
                    )
                at = end
        except (ZstdChunkError, ValueError) as e:
            state["frame"], state["chunk"] = None, -1
            why = str(e) if isinstance(e, ZstdChunkError) else tensorstore_message(e)
            raise error(
                f"{where}: reading array {name!r} failed (rows {lo}:{hi}; missing, truncated "
                f"or corrupt chunk data): {why}"
            ) from None
        finally:
            del flat
        return out

    return rows


def _present(kvstore, key: str) -> bool:
    """Whether the chunk ``key`` is in the store (an empty value is: its decoder refuses it)."""
    try:
        return kvstore.read(key, byte_range=slice(0, 1)).result().state == "value"
    except ValueError as e:
        if "OUT_OF_RANGE" in str(e):
            return True
        raise
