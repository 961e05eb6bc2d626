"""TensorStore zarr v3 arrays: specs, creation, opening.  The only module that knows the codecs.

Layout per array: ``sharding_indexed`` with the outer shard = save-time device shard, inner
chunks bounded in bytes, crc32c on every inner chunk and on the shard index, optional zstd.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorstore as ts

from jax_ucp._src.errors import CheckpointError, RequestError
from jax_ucp._src.format import dtypes, files
from jax_ucp._src.format.manifest import MANIFEST_FILE
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
    kv = storage.storage_for(root).kvstore(*subpath)
    if kv.get("driver") == "file":
        real, real_root = os.path.realpath(kv["path"]), os.path.realpath(root)
        if os.path.commonpath([real, real_root]) != real_root:
            raise CheckpointError(
                f"Array {'/'.join(subpath)!r}: {kv['path']} resolves to {real}, outside the "
                f"checkpoint {real_root}; TensorStore is given no path out of it."
            )
    return kv


def _resolved(kvstore: Mapping[str, Any]) -> None:
    """TensorStore reads a ``file`` kvstore natively, past ``format.files.inside``: its path
    must be its own real path (``storage`` builds it from the resolved checkpoint root), so no
    link and no ``..`` below the root can lead it out of the checkpoint."""
    if kvstore.get("driver") != "file":
        return
    path = str(kvstore.get("path", ""))
    if os.path.realpath(path) != path.rstrip("/"):
        raise CheckpointError(
            f"Array {path}: reached through a link or a '..' (it is "
            f"{os.path.realpath(path)}); TensorStore is given only resolved paths inside the "
            f"checkpoint."
        )


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


#: zstd's levels: the one used is not recorded in the manifest, and decoding does not depend on it
ZSTD_LEVELS = range(-131072, 23)


def layout_of(entry) -> ArrayLayout:
    """The ``ArrayLayout`` a manifest tensor entry implies (the zstd level is not recorded:
    decoding does not depend on it)."""
    return ArrayLayout(
        shape=tuple(entry.shape),
        dtype=entry.dtype,
        chunk_shape=tuple(entry.chunk_shape),
        inner_chunk_shape=tuple(entry.inner_chunk_shape),
        compression=entry.compression,
        checksum=entry.checksum,
    )


def expected_metadata(layout: ArrayLayout) -> dict:
    """What an array's ``zarr.json`` holds for ``layout``, as TensorStore writes it."""
    metadata = array_config({}, layout)["metadata"]
    kind = np.dtype(dtypes.to_numpy_dtype(layout.dtype))
    zero: Any = False if kind == np.bool_ else [0.0, 0.0] if kind.kind == "c" else 0
    return {**metadata, "fill_value": zero, "node_type": "array", "zarr_format": 3}


def check_metadata_file(data: bytes, layout: ArrayLayout, where: str) -> None:
    """``check_metadata`` of an array's ``zarr.json`` as read: when its bytes are the ones
    TensorStore writes for ``layout`` (nearly always) nothing is parsed; else it is parsed
    strictly (a key named twice refused) and compared member for member."""
    if data == written_bytes(layout):
        return
    check_metadata(files.strict_json(data, where, CheckpointError), layout, where)


@functools.lru_cache(maxsize=4096)
def written_bytes(layout: ArrayLayout) -> bytes:
    """The ``zarr.json`` TensorStore writes for ``layout`` (keys sorted, compact, zstd level 3,
    a single-byte type's endianness and the index location left out), byte for byte."""
    single = np.dtype(dtypes.to_numpy_dtype(layout.dtype)).itemsize == 1
    meta = _canonical(expected_metadata(layout), single)
    kind = np.dtype(dtypes.to_numpy_dtype(layout.dtype))
    if kind.kind == "f" or "float" in kind.name:  # floats, bfloat16, float8: "0.0"
        meta["fill_value"] = 0.0
    for codec in meta["codecs"][0]["configuration"]["codecs"]:
        if codec["name"] == "zstd":
            codec["configuration"]["level"] = layout.compression_level
    return json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()


def check_metadata(found: Any, layout: ArrayLayout, where: str) -> None:
    """Holds an array's parsed ``zarr.json`` to what the manifest implies (``layout``), field
    for field: the manifest is the only truth, and a codec, an endianness, a chunk grid, a key
    encoding or a fill value it does not imply (a ``bytes`` codec made big-endian, a
    ``transpose`` added) would read the stored bytes as another tensor without an error.
    Forms TensorStore writes for the same thing are equal (an index at the ``end`` said or
    not, a single-byte type's endianness left out, any zstd level), ``attributes`` and
    ``dimension_names`` are ignored (they name, they do not decode); anything else, an extra
    member included, raises ``CheckpointError`` naming ``where`` and the member.

    Args:
        found: the parsed ``zarr.json``.
        layout: the array as its manifest entry describes it (``layout_of``).
        where: the file, for messages.
    """
    single = np.dtype(dtypes.to_numpy_dtype(layout.dtype)).itemsize == 1
    expected = _canonical(expected_metadata(layout), single)
    if isinstance(found, dict):  # names only: docs/FORMAT.md 4.1 has readers ignore them
        found = {k: v for k, v in found.items() if not _ignored(k, v, len(layout.shape))}
    problem = _difference(expected, _canonical(found, single), "")
    if problem is not None:
        field, want, got = problem
        raise CheckpointError(
            f"{where}: {field or 'the file'} is {got}, but {MANIFEST_FILE} implies {want}. An "
            f"array's zarr.json is bound to {MANIFEST_FILE} (read otherwise, its stored bytes "
            f"would be another tensor): one of the two was edited or replaced; restore the "
            f"checkpoint from a good copy"
        )


_ABSENT = object()


def _ignored(member: str, value: Any, rank: int) -> bool:
    """``attributes`` (an object) and ``dimension_names`` (a name or null per dimension):
    zarr members that change nothing a read gives, which FORMAT.md has readers ignore."""
    if member == "attributes":
        return isinstance(value, dict)
    if member == "storage_transformers":  # none, said as an empty list
        return value == []
    if member == "dimension_names":
        names = value if isinstance(value, list) else []
        return len(names) == rank and all(n is None or isinstance(n, str) for n in names)
    return False


def _canonical(meta: Any, single_byte: bool) -> Any:
    """``meta`` with TensorStore's equivalent spellings made one (a copy; anything not of the
    expected shape is left as it is, for ``_difference`` to name)."""
    if not isinstance(meta, dict):
        return meta
    meta = dict(meta)
    key_encoding = meta.get("chunk_key_encoding")
    if isinstance(key_encoding, dict) and key_encoding.get("configuration") == {"separator": "/"}:
        meta["chunk_key_encoding"] = {k: v for k, v in key_encoding.items() if k != "configuration"}
    codecs = meta.get("codecs")
    if isinstance(codecs, list):
        meta["codecs"] = [_canonical_codec(c, single_byte) for c in codecs]
    return meta


def _canonical_codec(codec: Any, single_byte: bool) -> Any:
    if not isinstance(codec, dict) or not isinstance(codec.get("configuration"), dict):
        return codec
    name, config = codec.get("name"), dict(codec["configuration"])
    if name == "sharding_indexed":
        if config.get("index_location") == "end":
            del config["index_location"]
        for member, single in (("codecs", single_byte), ("index_codecs", False)):
            if isinstance(config.get(member), list):
                config[member] = [_canonical_codec(c, single) for c in config[member]]
    elif name == "bytes" and single_byte and config == {"endian": "little"}:
        return {k: v for k, v in codec.items() if k != "configuration"}
    elif name == "zstd":
        level = config.get("level")
        if type(level) is int and level in ZSTD_LEVELS:
            config["level"] = "any"
        if config.get("checksum", False) is False:
            config["checksum"] = False
    return {**codec, "configuration": config}


def _difference(want: Any, got: Any, path: str) -> tuple[str, str, str] | None:
    """The first field (a JSON path) where ``got`` is not ``want``, with both as JSON text."""
    if isinstance(want, dict) and isinstance(got, dict):
        for k in [*want, *(k for k in got if k not in want)]:
            inner = _difference(want.get(k, _ABSENT), got.get(k, _ABSENT), f"{path}.{k}")
            if inner is not None:
                return inner
        return None
    if isinstance(want, list) and isinstance(got, list):
        if not any(isinstance(v, (dict, list)) for v in [*want, *got]):  # a shape: said whole
            same = len(want) == len(got) and all(map(_same_scalar, want, got))
            return None if same else (path.lstrip("."), _json_text(want), _json_text(got))
        for i in range(max(len(want), len(got))):
            w = want[i] if i < len(want) else _ABSENT
            g = got[i] if i < len(got) else _ABSENT
            inner = _difference(w, g, f"{path}[{i}]")
            if inner is not None:
                return inner
        return None
    if _same_scalar(want, got):
        return None
    return path.lstrip("."), _json_text(want), _json_text(got)


def _same_scalar(a: Any, b: Any) -> bool:
    if a is _ABSENT or b is _ABSENT or isinstance(a, (dict, list)) or isinstance(b, (dict, list)):
        return a is b
    if isinstance(a, bool) or isinstance(b, bool):  # False == 0 in Python, not in a zarr.json
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b  # a fill value 0 or 0.0
    return type(a) is type(b) and a == b


def _json_text(v: Any) -> str:
    if v is _ABSENT:
        return "absent"
    text = json.dumps(v, separators=(",", ":"), default=str)
    return text if len(text) <= 120 else text[:117] + "..."


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


def open_array(
    kvstore: Mapping[str, Any],
    *,
    context: ts.Context | None = None,
    layout: ArrayLayout | None = None,
) -> ts.Future:
    """Opens the existing array in ``kvstore`` (``kvstore_config``) read-only, in ``context``
    (a shared cache pool and file I/O concurrency; None: a fresh ``read_context``).

    With ``layout`` (a manifest entry's, ``layout_of``) TensorStore is told everything about
    the array and reads no ``zarr.json``: the caller has held that file to the manifest
    (``check_metadata``). Without it, TensorStore reads the array's ``zarr.json``."""
    _resolved(kvstore)
    # Missing data is an error, never the fill value (a deleted shard file must not read as 0).
    spec: dict = {"driver": "zarr3", "kvstore": dict(kvstore), "fill_missing_data_reads": False}
    context = context if context is not None else read_context()
    if layout is not None:
        spec = {**array_config(kvstore, layout), "fill_missing_data_reads": False}
        return ts.open(
            spec, open=True, assume_metadata=True, read=True, write=False, context=context
        )
    return ts.open(spec, open=True, read=True, write=False, context=context)


def file_bytes_read() -> int:
    """Bytes this process has read from local files through TensorStore (its own metric)."""
    for metric in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read"):
        return int(metric["values"][0]["value"])
    return 0
