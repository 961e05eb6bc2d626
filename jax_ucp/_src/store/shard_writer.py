"""Writes whole zarr v3 shard files from host memory, byte for byte what TensorStore writes
(``shard_file`` describes the layout and when it applies: ``can_write``).

How a non-sync write reaches the disk (``start_writeback``; measured side by side in
``benchmarks/bench_durable_write.py``, docs/BENCHMARKS.md "Durable writes"): each file's
write-back is started with ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` once it is written, and
nothing waits for it until the commit's one syncfs (``store.storage.local.make_durable``), which alone
makes the files durable before the checkpoint is renamed into place. Why: dirty pages stay
bounded (tens of MiB at the end of a 1 or 4 GB save's writes, against up to 2.9 GB when nothing
is started, which every writer on the host is then throttled by) and the commit's syncfs has
little left to wait for. ``posix_fadvise(DONTNEED)``, used before, started the same write-back
but dropped no page (they are still dirty or under write-back when it runs) and paid for trying;
fsync per file waits for the disk one file at a time: the slowest in each run it was in.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import crc32c as crc32c_lib
import numpy as np

from jax_ucp._src.format import mapped_file
from jax_ucp._src.store import host_memory
from jax_ucp._src.store.shard_file import (
    chunks_are_contiguous,
    digest_of_trailers,
    encodable_dtype,
    shard_key,
)
from jax_ucp._src.store.zarr3 import ArrayLayout

_IOV_MAX = 512  # buffers per writev call (Linux allows 1024)
SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start write-back of dirty pages, wait for nothing


def can_encode(layout: ArrayLayout, data) -> bool:
    """Whether ``data`` (one whole shard) is laid out so that ``encode`` gives its file."""
    return (
        isinstance(data, np.ndarray)
        and data.size > 0
        and tuple(data.shape) == tuple(layout.chunk_shape)
        and encodes(layout, data.dtype)
    )


def encodes(layout: ArrayLayout, dtype: np.dtype) -> bool:
    """Whether a shard of ``layout`` holding ``dtype`` (at least 1-d) is written here: no
    compression, whole-byte little-endian values, inner chunks consecutive in the shard."""
    return (
        sys.byteorder == "little"
        and layout.compression is None
        and layout.checksum in (None, "crc32c")
        and len(layout.chunk_shape) >= 1
        and encodable_dtype(dtype)
        and chunks_are_contiguous(layout.chunk_shape, layout.inner_chunk_shape)
    )


def can_write(layout: ArrayLayout, data, kvstore: Mapping[str, Any]) -> bool:
    """Whether ``data`` (one whole shard) can be written here instead of by TensorStore.

    Args:
        layout: the array's layout
        data: one whole shard's data
        kvstore: where the array is (``kvstore_config``)
    """
    return kvstore.get("driver") == "file" and can_encode(layout, data)


def encode(data: np.ndarray, layout: ArrayLayout) -> list:
    """The shard file as a list of buffers (views of ``data`` plus the small crc/index pieces)."""
    checksum = layout.checksum == "crc32c"
    chunk_bytes = math.prod(layout.inner_chunk_shape) * data.dtype.itemsize
    parts = chunk_parts(data, layout)
    return parts + index_parts(len(parts) // (2 if checksum else 1), chunk_bytes, checksum)


def chunk_parts(data: np.ndarray, layout: ArrayLayout) -> list:
    """The inner chunks of ``data`` (whole inner chunks, consecutive in the shard) as the file
    holds them: each chunk's bytes (a view), then its crc32c trailer when the layout has one."""
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    chunk_bytes = math.prod(layout.inner_chunk_shape) * data.dtype.itemsize
    parts: list = []
    for i in range(0, flat.size, chunk_bytes):
        parts.append(flat[i : i + chunk_bytes])
        if layout.checksum == "crc32c":
            parts.append(struct.pack("<I", crc32c_lib.crc32c(parts[-1].data)))
    return parts


def index_parts(n: int, chunk_bytes: int, checksum: bool) -> list:
    """The shard index (index_location end) of ``n`` inner chunks of ``chunk_bytes`` stored in
    order, each with a crc32c trailer when ``checksum``, then the index's own trailer.

    Args:
        n: how many inner chunks the shard holds.
        chunk_bytes: the encoded bytes of each.
        checksum: each chunk and the index carry a crc32c trailer.
    """
    stored = chunk_bytes + (4 if checksum else 0)
    index = np.empty((n, 2), "<u8")
    index[:, 0] = np.arange(n, dtype=np.uint64) * stored
    index[:, 1] = stored
    index_bytes = index.tobytes()
    return [index_bytes] + ([struct.pack("<I", crc32c_lib.crc32c(index_bytes))] if checksum else [])


def digest_of_parts(parts: list) -> str:
    """``digest_of_trailers`` of a shard being written (the trailers are every other part)."""
    return digest_of_trailers(b"".join(parts[1:-2:2]))


def digest_of_data(data: np.ndarray, layout: ArrayLayout) -> str:
    """The digest of the shard file TensorStore writes for ``data`` (``can_encode``, crc32c):
    for object stores, where the file is not ours to write or cheap to read back."""
    return digest_of_parts(encode(data, layout))


def write(
    array_dir: str,
    chunk_position: Sequence[int],
    data: np.ndarray,
    layout: ArrayLayout,
    *,
    sync: bool = True,
) -> str | None:
    """Writes the shard at ``chunk_position`` of the array in ``array_dir``; returns its digest
    (``digest_of_trailers``; None without checksums).

    ``sync``: the file's data is on disk on return (its directories are the caller's to fsync);
    else only its write-back is started, durable at the caller's one syncfs before the commit.

    Args:
        array_dir: the array's directory
        chunk_position: the shard's position in the chunk grid
        data: the shard's data (``can_write`` said yes)
        layout: the array's layout
        sync: fsync the file before returning
    """
    parts = encode(data, layout)
    with opened(array_dir, chunk_position, sync=sync) as fd:
        write_parts(fd, parts)
    return digest_of_parts(parts) if layout.checksum == "crc32c" else None


@contextlib.contextmanager
def opened(array_dir: str, chunk_position: Sequence[int], *, sync: bool):
    """The shard file at ``chunk_position`` of the array in ``array_dir``, created or truncated
    and open for writing; when the block ends, fsynced or its write-back started.

    Args:
        array_dir: the array's directory
        chunk_position: the shard's position in the chunk grid
        sync: fsync the file (else only start its write-back)
    """
    path = os.path.join(array_dir, *shard_key(chunk_position).split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        yield fd
        if sync:
            os.fsync(fd)
        else:
            start_writeback(fd)
    finally:
        os.close(fd)


@functools.cache
def sync_file_range():
    """libc's ``sync_file_range`` (Linux), or None where there is none (macOS, other libcs)."""
    fn = host_memory.libc_function("sync_file_range")
    if fn is None:
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


def start_writeback(fd: int) -> None:
    """Starts writing what was written at ``fd`` to the disk, without waiting (the module's
    docstring says why). Only a hint: durability is the commit's syncfs, so where there is no
    ``sync_file_range`` or it fails (a file system without it), nothing else is done."""
    fn = sync_file_range()
    if fn is not None:
        fn(fd, 0, 0, SYNC_FILE_RANGE_WRITE)


def write_parts(fd: int, parts: list) -> None:
    """Writes the buffers ``parts`` in order at ``fd``'s position (writev, repeated for what a
    short write left)."""
    for i in range(0, len(parts), _IOV_MAX):
        rest = [memoryview(p).cast("B") for p in parts[i : i + _IOV_MAX]]
        while rest:
            n = os.writev(fd, rest)
            if n <= 0:
                raise OSError(f"write returned {n} with {sum(v.nbytes for v in rest)} bytes left")
            mapped_file.advance(rest, n)
