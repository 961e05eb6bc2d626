"""Rows of a zarr v2 array whose chunks are zstd frames (Orbax's default layout), decoded as a
stream: a chunk is read from its kvstore a few MiB at a time (byte ranges, OCDBT included) and
decoded straight into the rows asked for, so reading holds one slab, never the compressed chunk
nor the decoded one. TensorStore decodes a chunk whole, and Orbax saves a single-device array as
one chunk: reading rows of it through TensorStore held compressed + decoded chunk + the rows
(333 MiB for a 125 MiB array at a 64 MiB budget).

Each frame is decoded to its end, its checksum (when it has one) checked and nothing allowed
after it, before any of its rows is handed out: a chunk whose rows a call covers whole is
decoded into them and then to its end (an edge chunk's rows past the array included); a chunk
read in part is first decoded to its end into a scratch buffer (issue 38). The decoder is the
``zstandard`` wheel's stream reader; the frame's own structure (header, block headers, the
checksum) is walked as its bytes are read, so the value's end is read exactly and a frame cut
short anywhere, its checksum included, is refused. Any other layout: :func:`rows_reader` returns
None and the caller reads through TensorStore.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import IO, cast

import numpy as np
import zstandard

from jax_ucp._src import writer
from jax_ucp._src.errors import SourceError, tensorstore_message

#: Compressed bytes read from the kvstore at once.
PIECE_BYTES = 1 << 20
_SCRATCH_BYTES = 1 << 20  # decoded rows skipped over (a slab asked for out of order)
_MAGIC = b"\x28\xb5\x2f\xfd"  # a zstd frame's first bytes


class _Source:
    """A chunk's compressed bytes read from the kvstore piece by piece, its zstd frame's
    structure walked on the way: ``end`` (the frame's length) is known once its last block
    header is read, and no read goes past the structure still to come (the kvstore refuses a
    range past the value's end and does not say its size)."""

    def __init__(self, kvstore, key: str):
        self.kv, self.key = kvstore, key
        self.offset = 0  # bytes handed to the decoder
        self.next, self.head = 0, b""  # the next header's offset, its bytes read so far
        self.in_frame, self.checksum = False, False  # past the frame header; its flag
        self.end: int | None = None

    def fetch(self, start: int, n: int) -> bytes | None:
        """``n`` bytes at ``start`` (None: the value ends before that)."""
        try:
            r = self.kv.read(self.key, byte_range=slice(start, start + n)).result()
        except ValueError as e:
            if "OUT_OF_RANGE" not in str(e):
                raise
            return None
        return r.value if r.state == "value" else b""

    def read(self, n: int) -> bytes:
        """The decoder's next piece: up to ``n`` bytes, none past the frame's end."""
        if self.end is not None:
            n = min(n, self.end - self.offset)
            if n <= 0:
                return b""
        piece = self.fetch(self.offset, n)
        if piece is None:  # fewer left: read up to the next header's end
            boundary = self.next + (3 if self.in_frame else 5)
            piece = self.fetch(self.offset, max(1, boundary - self.offset))
        if not piece:
            raise SourceError(
                f"chunk {self.key!r} ends after {self.offset} compressed bytes, inside its zstd "
                f"frame (truncated)"
            )
        self._walk(piece)
        self.offset += len(piece)
        return piece

    def _walk(self, piece: bytes) -> None:
        """Parses the frame header and block headers lying in ``piece``."""
        stop = self.offset + len(piece)
        while self.end is None and self.next < stop:
            need = 3 if self.in_frame else 5
            at = self.next + len(self.head) - self.offset
            self.head += piece[at : at + need - len(self.head)]
            if len(self.head) < need:
                return
            head, self.head = self.head, b""
            if not self.in_frame:
                if head[:4] != _MAGIC or head[4] & 0x08:
                    raise SourceError(f"chunk {self.key!r} is not a zstd frame")
                fhd = head[4]
                single = fhd >> 5 & 1
                size = 5 + (1 - single) + (0, 1, 2, 4)[fhd & 3] + (single, 2, 4, 8)[fhd >> 6]
                self.next, self.in_frame, self.checksum = size, True, bool(fhd & 0x04)
                continue
            block = int.from_bytes(head, "little")
            kind, size = block >> 1 & 3, block >> 3
            if kind == 3:
                raise SourceError(f"chunk {self.key!r}: zstd block of reserved type (damaged)")
            self.next += 3 + (1 if kind == 1 else size)
            if block & 1:  # the last block: the checksum follows
                self.end = self.next + 4 * self.checksum


class _Frame:
    """One chunk's zstd frame decoded front to back, its compressed bytes read piece by piece."""

    def __init__(self, kvstore, key: str, nbytes: int):
        self.key, self.nbytes, self.done = key, nbytes, 0  # decoded bytes declared / handed out
        self.source = _Source(kvstore, key)
        self.reader = zstandard.ZstdDecompressor().stream_reader(
            cast("IO[bytes]", self.source),  # read() is what it calls
            read_size=PIECE_BYTES,
            read_across_frames=False,
            closefd=False,
        )

    def _decode(self, target) -> int:
        try:
            return self.reader.readinto(target)
        except zstandard.ZstdError as e:
            raise SourceError(f"chunk {self.key!r}: its zstd frame does not decode ({e})") from None

    def into(self, out, n: int) -> None:
        """Decodes the next ``n`` bytes into the writable buffer ``out`` (None: skips them);
        once the declared bytes are decoded, checks the frame ends there."""
        if self.done + n > self.nbytes:
            raise ValueError(f"chunk {self.key!r}: {self.done + n} bytes asked of {self.nbytes}")
        scratch = memoryview(bytearray(min(_SCRATCH_BYTES, n) if out is None else 0))
        while n:
            got = self._decode(out[:n] if out is not None else scratch[: min(n, len(scratch))])
            if not got:
                raise SourceError(
                    f"chunk {self.key!r} decodes to {self.done} bytes, expected {self.nbytes} "
                    f"(truncated or damaged)"
                )
            self.done, n = self.done + got, n - got
            if out is not None:
                out = out[got:]
        if self.done == self.nbytes:
            self._finish()

    def to_end(self) -> None:
        """Decodes the rest of the frame (rows past the array's end) and checks its end."""
        self.into(None, self.nbytes - self.done)

    def _finish(self) -> None:
        """After the declared bytes: the frame must end there (its checksum checked by the
        decoder as it reads it), with nothing after it."""
        if self._decode(bytearray(1)):
            raise SourceError(
                f"chunk {self.key!r} decodes to more than its {self.nbytes} bytes (damaged)"
            )
        src = self.source
        if src.end is None or src.offset != src.end:
            raise SourceError(f"chunk {self.key!r}: its zstd frame does not end (truncated)")
        if src.fetch(src.end, 1):
            raise SourceError(f"chunk {self.key!r} has bytes after its zstd frame (damaged)")


def rows_reader(array, where: str, name: str) -> Callable[[int, int], np.ndarray] | None:
    """``rows(lo, hi)``: rows ``lo:hi`` of dim 0 of the TensorStore ``array`` (opened on a zarr
    v2 array), decoded from its chunks' zstd frames as a stream (a chunk read in part: twice,
    its first pass checking the whole frame); a damaged chunk is a ``SourceError`` naming
    ``where`` (where its chunks lie) and ``name`` (the array's). None where this does not
    apply: not zarr v2 with only a zstd compressor in C order, chunks that split a row (dims
    after the first), a 0-d or empty array. A chunk not in the store is TensorStore's to read
    (its fill value)."""
    meta = _streamable(array)
    return None if meta is None else _Rows(array, meta, where, name)


class _Rows:
    """``rows(lo, hi)`` of one streamable array; the decoder of the chunk last read is kept
    between calls, so rows asked for in order (as the writer's slabs are) decode each chunk
    once."""

    def __init__(self, array, meta: dict, where: str, name: str):
        self.array, self.where, self.name = array, where, name
        self.chunk_rows = int(meta["chunks"][0])
        self.shape = list(array.shape)
        self.dtype = array.dtype.numpy_dtype
        self.sep = meta.get("dimension_separator") or "."
        self.kvstore = array.kvstore
        self.row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize
        self.current: _Frame | None = None
        self.chunk = -1
        self.checked: set[int] = set()  # chunks whose frames were decoded to their end

    def key(self, index: int) -> str:
        """The store key of chunk ``index`` (chunks never split a row)."""
        return self.sep.join([str(index)] + ["0"] * (len(self.shape) - 1))

    def frame(self, index: int, row: int) -> _Frame | None:
        """The decoder of chunk ``index`` at its row ``row`` (restarted if it passed it); None
        for a chunk not in the store."""
        f = self.current
        if self.chunk != index or f is None or f.done > row * self.row_bytes:
            self.current, self.chunk = None, -1
            key = self.key(index)
            if not _present(self.kvstore, key):
                return None
            # a zarr v2 chunk always has the full chunk shape, the last (edge) one too
            f = _Frame(self.kvstore, key, self.chunk_rows * self.row_bytes)
            self.current, self.chunk = f, index
        if f.done < row * self.row_bytes:
            f.into(None, row * self.row_bytes - f.done)
        return f

    def check_whole(self, index: int) -> None:
        """Chunk ``index``'s frame decoded to its end (its checksum checked) once, before rows
        of a chunk read in part are handed out."""
        if index in self.checked:
            return
        key = self.key(index)
        if _present(self.kvstore, key):
            _Frame(self.kvstore, key, self.chunk_rows * self.row_bytes).to_end()
        self.checked.add(index)

    def __call__(self, lo: int, hi: int) -> np.ndarray:
        out = writer.unpooled_empty((hi - lo, *self.shape[1:]), self.dtype)
        flat = memoryview(out.reshape(-1).view(np.uint8).data)
        at, n, row_bytes = lo, self.chunk_rows, self.row_bytes
        try:
            while at < hi:
                index = at // n
                end = min(hi, (index + 1) * n)
                first, last = index * n, min(self.shape[0], (index + 1) * n)
                if not (at == first and end == last):  # not every row of the chunk in this call
                    self.check_whole(index)
                f = self.frame(index, at - first)
                if f is None:  # TensorStore's to read: its fill value, or its error
                    out[at - lo : end - lo] = self.array[at:end].read().result()
                else:
                    f.into(
                        flat[(at - lo) * row_bytes : (end - lo) * row_bytes], (end - at) * row_bytes
                    )
                    if end == last:  # the rows past the array's end, the frame's end
                        f.to_end()
                        self.checked.add(index)
                at = end
        except (SourceError, ValueError) as e:
            self.current, self.chunk = None, -1
            why = str(e) if isinstance(e, SourceError) else tensorstore_message(e)
            raise SourceError(
                f"{self.where}: reading array {self.name!r} failed (rows {lo}:{hi}; missing, "
                f"truncated or corrupt chunk data): {why}"
            ) from None
        finally:
            del flat
        return out


def _streamable(array) -> dict | None:
    """The zarr v2 metadata of ``array`` when its chunks can be decoded here as a stream: zstd
    alone, C order, whole rows per chunk, little-endian as stored; else None."""
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
        or not chunks[0] > 0
        or list(array.domain.inclusive_min) != [0] * len(shape)
        or meta.get("shape") != shape
    ):
        return None
    declared = str(meta.get("dtype"))
    try:  # little-endian (or single-byte) as stored, or bfloat16 (always little-endian)
        same = declared == "bfloat16" or (
            declared[:1] in "<|" and np.dtype(declared) == array.dtype.numpy_dtype
        )
    except TypeError:
        same = False
    return meta if same and np.little_endian else None


def _present(kvstore, key: str) -> bool:
    """Whether the chunk ``key`` is in the store (an empty value is: its decoder refuses it)."""
    try:
        return kvstore.read(key, byte_range=slice(0, 1)).result().state == "value"
    except ValueError as e:
        if "OUT_OF_RANGE" in str(e):
            return True
        raise
