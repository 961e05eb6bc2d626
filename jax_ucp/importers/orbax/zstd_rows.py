"""Rows of a zarr v2 array whose chunks are zstd frames (Orbax's default layout), decoded as a
stream: a chunk is read from its kvstore a few MiB at a time (byte ranges, OCDBT included) and
decoded straight into the rows asked for, so reading holds one slab, never the compressed chunk
nor the decoded one. TensorStore decodes a chunk whole, and Orbax saves a single-device array as
one chunk: reading rows of it through TensorStore held compressed + decoded chunk + the rows
(333 MiB for a 125 MiB array at a 64 MiB budget).

Decoding is the ``zstandard`` wheel's streaming reader. Every frame is decoded to its end — an
edge chunk's rows past the array too — so zstd verifies the frame's content checksum before the
last rows of the chunk are handed out, and the frame's structure is walked alongside
(:class:`_FrameEnd`): the streaming reader stops quietly at a truncated input, so the walk is
what proves the frame complete, checksum included, with nothing after it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import IO, Any, cast

import numpy as np
import zstandard

from jax_ucp import writer
from jax_ucp.errors import SourceError, tensorstore_message

#: Compressed bytes read from the kvstore at once.
PIECE_BYTES = 1 << 20
_SCRATCH_BYTES = 1 << 20  # decoded rows skipped over (a slab asked for out of order)
_MAGIC = b"\x28\xb5\x2f\xfd"  # a zstd frame's first four bytes


ZstdChunkError = SourceError  # a chunk that does not decode to its declared bytes


class _FrameEnd:
    """Follows a zstd frame's structure over the compressed bytes as they pass (header, block
    headers, content checksum) to tell where the frame ends: the streaming decoder does not say
    whether it stopped at the frame's end or at the end of its input."""

    def __init__(self, key: str):
        self.key, self.head, self.skip = key, b"", 0
        self.state = "header"  # header -> block ... -> checksum (last block, checksum) -> end
        self.checksum, self.after = False, 0  # bytes seen after the frame's end

    def feed(self, data: bytes) -> None:
        at = 0
        while at < len(data):
            if self.state == "end":
                self.after += len(data) - at
                return
            if self.skip:
                n = min(self.skip, len(data) - at)
                self.skip, at = self.skip - n, at + n
                if not self.skip and self.state == "checksum":
                    self.state = "end"
                continue
            need = self._need()
            n = min(need - len(self.head), len(data) - at)
            self.head, at = self.head + data[at : at + n], at + n
            if len(self.head) == need:
                self._parsed()

    def _need(self) -> int:
        if self.state == "block":
            return 3
        if len(self.head) < 5:
            return 5
        return zstandard.frame_header_size(self.head + bytes(13))

    def _parsed(self) -> None:
        head, self.head = self.head, b""
        if self.state == "header":
            if head[:4] != _MAGIC:
                raise ZstdChunkError(f"chunk {self.key!r} is not a zstd frame")
            if len(head) == 5:  # the descriptor read: the header's size follows from it
                self.head = head
                return
            self.checksum, self.state = bool(head[4] & 0x04), "block"
            return
        word = int.from_bytes(head, "little")
        last, kind, size = word & 1, (word >> 1) & 3, word >> 3
        if kind == 3:
            raise ZstdChunkError(f"chunk {self.key!r}: reserved zstd block type (damaged)")
        self.skip = 1 if kind == 1 else size
        if last:  # the last block's content, then the checksum, then the frame's end
            self.skip += 4 if self.checksum else 0
            self.state = "checksum" if self.skip else "end"


class _Source:
    """The compressed bytes of one chunk as a file the decoder reads, piece by piece from the
    kvstore (which refuses a range past the value's end and does not say its size: the rest
    is then read to the end, fewer than ``PIECE_BYTES`` bytes)."""

    def __init__(self, kvstore, key: str):
        self.kv, self.key, self.offset, self.eof = kvstore, key, 0, False
        self.frame = _FrameEnd(key)

    def read(self, n: int = -1) -> bytes:
        if self.eof or n == 0:
            return b""
        n = PIECE_BYTES if n is None or n < 0 else min(n, PIECE_BYTES)
        try:
            r = self.kv.read(self.key, byte_range=slice(self.offset, self.offset + n)).result()
        except ValueError as e:
            if "OUT_OF_RANGE" not in str(e):
                raise
            r = self.kv.read(self.key, byte_range=slice(self.offset, None)).result()
        piece = r.value if r.state == "value" else b""
        self.eof = len(piece) < n
        self.offset += len(piece)
        self.frame.feed(piece)
        return piece


class _Frame:
    """One chunk's zstd frame decoded front to back, its compressed bytes read piece by piece."""

    def __init__(self, kvstore, key: str, nbytes: int, where: str):
        self.key, self.where = key, where
        self.nbytes, self.done = nbytes, 0  # decoded bytes declared / handed out so far
        self.source = _Source(kvstore, key)
        self.reader = zstandard.ZstdDecompressor().stream_reader(
            cast(IO[bytes], self.source),  # it calls read() only
            read_size=PIECE_BYTES,
            read_across_frames=False,
            closefd=False,
        )

    def _decode(self, target, size: int) -> int:
        """Decodes up to ``size`` bytes into ``target``; fewer only where the input ends."""
        view, got = memoryview(target)[:size], 0
        try:
            while got < size:
                n = self.reader.readinto(view[got:])
                if not n:
                    break
                got += n
        except zstandard.ZstdError as e:
            raise ZstdChunkError(f"chunk {self.key!r} is not a valid zstd frame ({e})") from None
        finally:
            view.release()
        return got

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

    def finish(self) -> None:
        """Decodes what is left of the frame (an edge chunk's rows past the array) to its end."""
        if self.done < self.nbytes:
            self.into(None, self.nbytes - self.done)

    def _finish(self) -> None:
        """After the declared bytes: the frame must end there (its checksum verified by zstd on
        the way), complete, with nothing after it."""
        if self._decode(bytearray(1), 1):
            raise ZstdChunkError(
                f"chunk {self.key!r} decodes to more than its {self.nbytes} bytes (damaged)"
            )
        frame = self.source.frame
        if frame.state == "end" and not self.source.eof:
            self.source.read(1)  # one byte more in the value: something after the frame
        if frame.state != "end":
            raise ZstdChunkError(
                f"chunk {self.key!r} ends after {self.source.offset} compressed bytes, before "
                f"its zstd frame's end{' and content checksum' if frame.checksum else ''} "
                f"(truncated)"
            )
        if frame.after:
            raise ZstdChunkError(f"chunk {self.key!r} has bytes after its zstd frame (damaged)")


def rows_reader(
    array, where: str, name: str, error: type[Exception]
) -> Callable[[int, int], np.ndarray] | None:
    """``rows(lo, hi)``: rows ``lo:hi`` of dim 0 of the TensorStore ``array`` (opened on a zarr
    v2 array), decoded from its chunks' zstd frames as a stream; rows asked for in order (as the
    writer's slabs are) decode each chunk once. None where this does not apply: not zarr v2 with only a zstd compressor in C order, chunks that split a row (dims after the
    first), a 0-d or empty array. A chunk that is not in the store is TensorStore's to read
    (its fill value).

    Args:
        array: the opened array.
        where: where its chunks lie (for errors).
        name: the array's name (for errors).
        error: the exception raised for a damaged chunk (names the array and file).
    """
    if array.rank < 1 or 0 in array.shape:
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
                    if end == shape[0]:  # the edge chunk: its frame decoded and checked to its end
                        f.finish()
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
