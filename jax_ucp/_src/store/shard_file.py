"""The zarr v3 shard files jax_ucp writes itself and reads itself: their layout, shared by
``shard_writer`` (whole shards from host memory, byte for byte what TensorStore writes) and
``shard_reader`` (regions read back with pread and the hardware crc32c).

Why not TensorStore's own reads and writes: its wheel computes crc32c in software, several times
slower than the ``crc32c`` package, which uses the CPU's instruction and releases the GIL (the
measured difference: docs/BENCHMARKS.md, "Save and restore onto another mesh").
Our layouts make this simple: a shard is written whole by one writer, uncompressed, and its
inner chunks (trailing dimensions whole, one dimension cut, earlier ones 1; see ``chunking``) are
consecutive byte ranges of the C-ordered shard. So the file is: every chunk's bytes, each
followed by its crc32c, then the shard index (``[offset, nbytes]`` uint64 per chunk,
little-endian) and its crc32c (``index_location: end``). TensorStore still creates every array
(``zarr.json``); tests check that the files are identical to the ones TensorStore writes and that
reads equal TensorStore's. Anything else (compression, lazy TensorStore sources and views,
non-file kvstores, sub-byte dtypes) goes through TensorStore.
"""

from __future__ import annotations

import itertools
import math
import struct
import sys
from collections.abc import Sequence

import crc32c as crc32c_lib
import numpy as np

from jax_ucp._src.errors import CheckpointError
from jax_ucp._src.format import dtypes
from jax_ucp._src.store.zarr3 import ArrayLayout


def encodable_dtype(dtype: np.dtype) -> bool:
    """Whether the dtype's zarr "bytes" encoding is its little-endian memory: a dtype of the
    format in native or little-endian order, but int4 (two values a byte: packed by TensorStore,
    as any sub-byte type)."""
    return dtype.name in _WHOLE_BYTES and (dtype.itemsize == 1 or dtype.byteorder in ("=", "<"))


_WHOLE_BYTES = frozenset(dtypes.SUPPORTED) - {"int4"}


def chunks_are_contiguous(shard_shape: Sequence[int], inner: Sequence[int]) -> bool:
    """True if each inner chunk is one consecutive byte range of the C-ordered shard, in grid order."""
    cut = max((i for i, (s, c) in enumerate(zip(shard_shape, inner)) if c != s), default=None)
    if cut is None:
        return True
    return all(c == 1 for c in inner[:cut]) and shard_shape[cut] % inner[cut] == 0


def shard_key(chunk_position: Sequence[int]) -> str:
    """zarr v3 "default" chunk key encoding ("/"-separated)."""
    return "/".join(["c", *(str(int(i)) for i in chunk_position)])


def grid_keys(shape: Sequence[int], chunk_shape: Sequence[int]) -> list[str]:
    """Keys of every shard of an array's chunk grid (none for a zero-size array)."""
    if 0 in shape:
        return []
    grid = (range(-(-n // c)) for n, c in zip(shape, chunk_shape))
    return [shard_key(pos) for pos in itertools.product(*grid)]


def digest_of_trailers(trailers: bytes) -> str:
    """The shard digest recorded in the manifest: crc32c of the inner chunks' crc32c trailers,
    concatenated in index order (8 hex digits). Readers check it from the file's own trailers,
    so a shard file swapped with another one, or left from an older save, is detected."""
    return f"{crc32c_lib.crc32c(trailers):08x}"


_MISSING = (1 << 64) - 1


def parse_index(raw: bytes, path: str, n_chunks: int, crc: bool, limit: int | None):
    """The shard index from its bytes (crc32c included), validated.

    Args:
        raw: the index bytes (its crc32c last when ``crc``)
        path: the shard file, for messages
        n_chunks: inner chunks in the shard
        crc: the index carries a crc32c
        limit: where the data ends (None: unknown, reads past the end fail later)
    """
    if crc:
        (stored,) = struct.unpack("<I", raw[-4:])
        if crc32c_lib.crc32c(raw[:-4]) != stored:
            raise CheckpointError(f"{path}: crc32c checksum mismatch in the shard index (corrupt)")
        raw = raw[:-4]
    index = np.frombuffer(raw, "<u8").reshape(n_chunks, 2)
    missing = index[:, 0] == _MISSING
    if missing.any():
        i = int(np.argmax(missing))
        raise CheckpointError(
            f"{path}: inner chunk {i} was never written (the shard is incomplete; jax_ucp never "
            f"reads missing data as fill values)"
        )
    past = limit is not None and (index[:, 0] + index[:, 1] > limit).any()
    if past or (index[:, 1] < (4 if crc else 0)).any():
        raise CheckpointError(f"{path}: shard index points past the data (truncated or corrupt)")
    return index


def index_offset(inner_chunk_shape, dtype, n_chunks: int, compression: str | None) -> int | None:
    """Where the shard index starts in a shard with crc32c chunks, when the layout fixes it
    (uncompressed, whole-byte dtype: every chunk its bytes + 4); else None.

    Args:
        inner_chunk_shape: the inner chunks' shape
        dtype: the array's dtype
        n_chunks: inner chunks per shard
        compression: the codec (None: uncompressed)
    """
    dtype = np.dtype(dtype)
    if compression is not None or not encodable_dtype(dtype):
        return None
    return n_chunks * (math.prod(inner_chunk_shape) * dtype.itemsize + 4)


def check_digest(path: str, found: str, expected: str | None, tensor: str) -> None:
    """Refuses a shard file the manifest does not list (``expected`` None) or whose digest is
    not the one it lists for ``tensor``.

    Args:
        path: the shard file, for messages
        found: its digest
        expected: the manifest's (None: not listed)
        tensor: the tensor's name, for messages
    """
    if expected is None:
        raise CheckpointError(
            f"Tensor {tensor!r}: {path} is not a shard the manifest lists for it (a stray or "
            f"misplaced file)"
        )
    if found != expected:
        raise CheckpointError(
            f"Tensor {tensor!r}: {path} is not the shard file this checkpoint saved there (digest "
            f"{found}, the manifest says {expected}): swapped with another shard, or left from "
            f"another save"
        )


def readable(layout: ArrayLayout) -> bool:
    """Whether ``shard_reader.ShardReader`` reads an array of ``layout`` (else TensorStore
    does): uncompressed, of a whole-byte dtype on a little-endian host, of rank 1 or more and no
    zero extent, every shard whole (no edge shards) and cut into whole inner chunks."""
    shape, chunks, inner = layout.shape, layout.chunk_shape, layout.inner_chunk_shape
    return (
        layout.compression is None
        and bool(shape)
        and 0 not in shape
        and len(chunks) == len(inner) == len(shape)
        and not any(s % c for s, c in zip(shape, chunks))
        and not any(c % i for c, i in zip(chunks, inner))
        and encodable_dtype(np.dtype(dtypes.to_numpy_dtype(layout.dtype)))
        and sys.byteorder == "little"
    )
