"""TensorStore zarr v3 arrays: specs, creation, opening.  The only module that knows the codecs.

Layout per array: ``sharding_indexed`` with the outer shard = save-time device shard, inner
chunks bounded in bytes, crc32c on every inner chunk and on the shard index, optional zstd.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Mapping
from typing import Any

import tensorstore as ts

from jax_ucp._src.errors import RequestError
from jax_ucp._src.store import storage

COMPRESSIONS = (None, "zstd")


@dataclasses.dataclass(frozen=True)
class ArrayLayout:
    """How one tensor is stored: global shape and dtype, the outer shard (the save-time
    per-device shard, one writer per file) and the inner chunk (the unit a reader fetches and
    checksums), codecs. Everything ``zarr.json`` says, in one value both writers and readers use,
    so what is written and what a reader expects cannot drift apart."""

    shape: tuple[int, ...]
    dtype: str  # canonical name (format.dtypes)
    chunk_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...]
    compression: str | None = None
    compression_level: int = 3
    checksum: str | None = "crc32c"

    @property
    def inner_chunk_count(self) -> int:
        """Inner chunks per shard file (entries of its index)."""
        return math.prod(c // i for c, i in zip(self.chunk_shape, self.inner_chunk_shape))

    def __post_init__(self):
        if self.compression not in COMPRESSIONS:
            raise RequestError(
                f"compression must be one of {COMPRESSIONS}, got {self.compression!r}."
            )
        if self.checksum not in (None, "crc32c"):
            raise RequestError(f"checksum must be 'crc32c' or None, got {self.checksum!r}.")


def kvstore_config(root: str | os.PathLike | Mapping[str, Any], *subpath: str) -> dict:
    """A kvstore spec for ``root`` joined with ``subpath``: a local path or any TensorStore kvstore."""
    if isinstance(root, Mapping):
        return storage.kvstore_join(root, *subpath)
    return storage.storage_for(root).kvstore(*subpath)


def kvstore_driver(root) -> str:
    """The TensorStore kvstore driver of a checkpoint root (``file``, ``s3``, ``gcs``, ...)."""
    spec = root if isinstance(root, Mapping) else storage.storage_for(root).kvstore()
    return str(spec.get("driver", "file"))


def _codecs(layout: ArrayLayout) -> list:
    bytes_le = {"name": "bytes", "configuration": {"endian": "little"}}
    crc = [{"name": "crc32c"}] if layout.checksum else []
    zstd = {"name": "zstd", "configuration": {"level": layout.compression_level}}
    return [
        {
            "name": "sharding_indexed",
            "configuration": {
                "chunk_shape": list(layout.inner_chunk_shape),
                "codecs": [bytes_le, *([zstd] if layout.compression == "zstd" else []), *crc],
                "index_codecs": [bytes_le, *crc],
                "index_location": "end",
            },
        }
    ]


def array_config(kvstore: Mapping[str, Any], layout: ArrayLayout) -> dict:
    """The TensorStore spec (JSON) of a zarr v3 array with ``layout`` in ``kvstore``."""
    return {
        "driver": "zarr3",
        "kvstore": dict(kvstore),
        # Chunks equal to the fill value are still written: the bytes on disk are the checkpoint
        # (bit-exact -0.0 / NaN payloads, and a shard file per writer that readers can count on).
        "store_data_equal_to_fill_value": True,
        "metadata": {
            "shape": list(layout.shape),
            "data_type": layout.dtype,
            "chunk_grid": {
                "name": "regular",
                "configuration": {"chunk_shape": list(layout.chunk_shape)},
            },
            "chunk_key_encoding": {"name": "default"},
            "codecs": _codecs(layout),
        },
    }


# Enough to keep shard indices (and partly read inner chunks) while one restore runs: without a
# cache every inner-chunk read re-fetches its shard's index (restores measurably slower).
READ_CACHE_BYTES = 64 << 20


def _context_spec(cache_bytes: int, sync: bool = True) -> dict:
    return {
        "cache_pool": {"total_bytes_limit": cache_bytes},
        "file_io_sync": sync,
        # fsync-bound writes need many in flight (Orbax uses the same limit).
        "file_io_concurrency": {"limit": 128},
        # Decoding + crc32c of inner chunks overlaps with disk reads only with more threads than
        # cores (benchmarks/bench_save_restore.py).
        "data_copy_concurrency": {"limit": max(8, 4 * (os.cpu_count() or 2))},
    }


@functools.cache
def context(sync: bool = True) -> ts.Context:
    """The shared write context: no cache (a save never re-reads), fsync for durability.

    ``sync=False`` is for writers that make the whole directory durable before committing it
    (``handler.commit``): one syncfs instead of an fsync per file.
    """
    return ts.Context(_context_spec(0, sync))


def read_context() -> ts.Context:
    """A fresh context per restore: its cache lives exactly as long as the restore."""
    return ts.Context(_context_spec(READ_CACHE_BYTES))


def create(
    kvstore: Mapping[str, Any], layout: ArrayLayout, *, primary: bool = True, sync: bool = True
) -> ts.Future:
    """Opens an array for writing; only the primary process writes ``zarr.json``.

    Other processes ``assume_metadata`` and never touch the metadata file, so writers on different
    hosts share no file at all.

    Args:
        kvstore: where the array goes (``kvstore_config``)
        layout: its shape, dtype, chunking, codecs
        primary: this process writes ``zarr.json`` (the others assume it)
        sync: TensorStore fsyncs what it writes
    """
    spec = array_config(kvstore, layout)
    if primary:
        return ts.open(spec, create=True, open=False, context=context(sync))
    return ts.open(spec, open=True, assume_metadata=True, context=context(sync))


def open_array(kvstore: Mapping[str, Any], *, context: ts.Context | None = None) -> ts.Future:
    """Opens the existing array in ``kvstore`` (``kvstore_config``) read-only, in ``context``
    (a shared cache pool and file I/O concurrency; None: a fresh ``read_context``)."""
    # Missing data is an error, never the fill value (a deleted shard file must not read as 0).
    spec: dict = {"driver": "zarr3", "kvstore": dict(kvstore), "fill_missing_data_reads": False}
    context = context if context is not None else read_context()
    return ts.open(spec, open=True, read=True, write=False, context=context)


def file_bytes_read() -> int:
    """Bytes this process has read from local files through TensorStore (its own metric)."""
    for metric in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read"):
        return int(metric["values"][0]["value"])
    return 0
