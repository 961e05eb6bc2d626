"""An Orbax item's arrays: Orbax's own metadata of the tree (each array's name, shape, dtype
and chunks), each array opened with the TensorStore spec Orbax reads it with
(``ocp.type_handlers.get_json_tspec_read``), its chunks checked against its shape before any is
decoded, and handed to the writer unread (a ``writer.Deferred``): Orbax's default zstd chunks
are decoded as a stream into the rows written (``zstd_rows``), other layouts read by TensorStore
reserve the array and the chunks it decodes at once, as many as the memory budget leaves room
for."""

from __future__ import annotations

import asyncio
import base64
import functools
import math
import os
import re
import sys
import types
from collections.abc import Iterator
from typing import Any

from jax_ucp._src import writer
from jax_ucp._src.errors import (
    SourceError,
    is_tensorstore_io_error,
    tensorstore_message,
    tensorstore_status,
)
from jax_ucp._src.format import SavedSharding, keypath, role_of
from jax_ucp._src.importers.orbax import zstd_rows
from jax_ucp._src.importers.orbax.layout import PYTREE_METADATA, STRINGS_FILE, read_json
from jax_ucp._src.store.storage import Storage

_SHARDING = "_sharding"  # Orbax's record of each jax.Array's sharding

# the array a TensorStore error names: ``Error reading "params.w/.zarray"``
_ARRAY_IN_MESSAGE = re.compile(r'"([^"]+?)/(?:\.zarray|zarr\.json|[0-9]+(?:[./][0-9]+)*)"')


def tree_metadata(item: Storage, ocdbt: bool):
    """Orbax's own metadata of an item (its tree, each array's shape, dtype and chunks), read
    through the item's ``Storage``; a missing or damaged file is an error naming the item and
    the file, not TensorStore's spec."""
    from etils import epath
    from orbax.checkpoint._src.metadata import tree as orbax_tree

    path = item.root
    raw = read_json(item, PYTREE_METADATA)  # a key named twice: refused (Orbax keeps the last)
    _quiet_closed_loop()  # Orbax's loop closes as it returns; TensorStore may complete later
    try:
        internal = orbax_tree.InternalTreeMetadata.from_json(raw)
        internal.use_ocdbt = ocdbt
        handlers: Any = _Handlers(item)  # the registry Orbax asks: only its get()
        tree = internal.as_custom_metadata(epath.Path(item.absolute()), handlers)
        return orbax_tree.build_default_tree_metadata(tree, use_zarr3=internal.use_zarr3)
    except (KeyError, TypeError, AttributeError, IndexError) as e:  # Orbax parsing _METADATA
        raise SourceError(
            f"{item.join(PYTREE_METADATA)}: not Orbax's tree metadata (Orbax's reader "
            f"failed: {type(e).__name__}: {str(e)[:200]})"
        ) from None
    except ValueError as e:
        if tensorstore_status(e) is None:  # Orbax's own parse ("7 is not a valid KeyType")
            raise SourceError(
                f"{item.join(PYTREE_METADATA)}: not Orbax's tree metadata (Orbax's "
                f"reader failed: {str(e)[:200]})"
            ) from None
        if not is_tensorstore_io_error(e):
            raise
        m = _ARRAY_IN_MESSAGE.search(str(e))
        array = m and m.group(1).removeprefix(item.join(""))  # a file's name: relative
        what = f"the metadata of array {array!r}" if m else "Orbax's metadata"
        raise SourceError(
            f"{path}: cannot read {what} (missing, truncated or corrupt file): "
            f"{tensorstore_message(e)}"
        ) from None


class _Handlers:
    """Orbax's type handlers, the metadata of its arrays and scalars read through ``item``
    (Orbax's own handlers open them at the item's path)."""

    def __init__(self, item: Storage):
        self.item = item
        self.shardings = read_json(item, _SHARDING) if item.exists(_SHARDING) else {}

    def get(self, ty: str) -> Any:
        import orbax.checkpoint as ocp

        if ty not in ("jax.Array", "np.ndarray", "scalar"):
            return ocp.type_handlers.get_type_handler(ty)
        return types.SimpleNamespace(metadata=functools.partial(self.metadata, ty))

    async def metadata(self, typestr: str, infos) -> list:
        import orbax.checkpoint as ocp
        import tensorstore as ts
        from orbax.checkpoint._src.metadata import sharding
        from orbax.checkpoint._src.serialization import tensorstore_utils

        specs = [
            read_spec(self.item, i.name, i.is_ocdbt_checkpoint, i.use_zarr3, i.ts_context)
            for i in infos
        ]
        opened = [ts.open(s, open=True, context=i.ts_context) for s, i in zip(specs, infos)]
        out = []
        for t, info in zip(await asyncio.gather(*opened), infos):
            coded = self.shardings.get(base64.urlsafe_b64encode(info.name.encode()).decode())
            saved = sharding.from_serialized_string(coded) if coded else None
            m = tensorstore_utils.array_metadata_from_tensorstore(
                t, info, saved if typestr == "jax.Array" else None
            )
            if typestr == "scalar":
                m = ocp.metadata.ScalarMetadata(name=m.name, directory=m.directory, dtype=m.dtype)
            out.append(m)
        return out


def read_spec(item: Storage, name: str, ocdbt: bool, zarr3: bool, context) -> dict:
    """Orbax's TensorStore read spec of array ``name``, its kvstore the item's ``Storage``."""
    import orbax.checkpoint as ocp
    from etils import epath

    info = ocp.type_handlers.ParamInfo(
        name=name,
        parent_dir=epath.Path("/item"),  # Orbax's spec of a local item, its kvstore replaced
        is_ocdbt_checkpoint=ocdbt,
        use_zarr3=zarr3,
        ts_context=context,
    )
    tspec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=ocdbt)
    if ocdbt:  # the database is the item's; the array a key in it
        tspec["kvstore"].update(base=item.kvstore(), manifest=item.kvstore())
    else:
        tspec["kvstore"] = item.kvstore(name)
    return tspec


def _quiet_closed_loop() -> None:
    """Leaves one harmless report out of Python's error hooks: when Orbax's metadata read fails
    on a damaged file, Orbax closes its event loop while TensorStore still completes the other
    arrays' futures, whose callbacks then find the loop closed and print a traceback after the
    one clear error (TensorStore reports it through the unraisable hook or, in some builds and
    timings, ``PyErr_Print`` and so ``sys.excepthook``: CI saw the latter). Installed (wrapping
    the hooks before it) before Orbax's metadata is read: a read that succeeds can leave such
    callbacks too (a damaged array found later; CI saw it under load); only a closed-loop error
    raised inside asyncio itself is left out, every other report goes to the hook before."""
    if getattr(sys.unraisablehook, "__name__", None) == "_closed_loop_left_out":
        return
    before, before_print = sys.unraisablehook, sys.excepthook

    def _closed_loop_left_out(report) -> None:
        if not _late_closed_loop(report.exc_value, report.exc_traceback):
            before(report)

    def _closed_loop_not_printed(kind, e, tb) -> None:
        if not _late_closed_loop(e, tb):
            before_print(kind, e, tb)

    sys.unraisablehook, sys.excepthook = _closed_loop_left_out, _closed_loop_not_printed


def _late_closed_loop(e: BaseException | None, tb) -> bool:
    """Whether an error is asyncio's own "Event loop is closed" called from native code: every
    frame of its traceback is asyncio's (a user's code hitting a closed loop is still shown)."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    asyncio_only = bool(frames) and all(
        os.path.basename(os.path.dirname(c.co_filename)) == "asyncio" for c in frames
    )
    closed = isinstance(e, RuntimeError) and str(e) == "Event loop is closed"
    return closed and asyncio_only and frames[-1].co_name == "_check_closed"


def metadata_file(item: Storage, name: str, ocdbt: bool, zarr3: bool) -> str:
    """Where an array's zarr metadata lies (inside the OCDBT database, for OCDBT).

    Args:
        item: the Orbax checkpoint (item) directory.
        name: the array's name in it.
        ocdbt: the arrays are in an OCDBT database (the path is then only named).
        zarr3: zarr v3 (``zarr.json``) rather than v2 (``.zarray``).
    """
    meta = f"{name}/{'zarr.json' if zarr3 else '.zarray'}"
    return f"{item.root} (OCDBT entry {meta})" if ocdbt else item.join(meta)


def check_chunks(where: str, name: str, shape: tuple[int, ...], chunks) -> None:
    """Refuses, before anything is read or decoded, an array whose declared chunks (each of
    ``chunks``: the read and the write chunk shape) are larger than the array in any dimension:
    Orbax writes each device's shard as a chunk, never larger than the array, while one chunk of
    2**29 elements declared for 16 floats (a 64 KB zstd file) would decode into 2 GiB.

    Args:
        where: the file or database the array is in (for the error).
        name: the array's name (for the error).
        shape: the array's declared shape.
        chunks: the declared chunk shapes (read and write).
    """
    for chunk in chunks:
        if chunk is None:  # TensorStore reports no such chunk (a 0-d array)
            continue
        chunk = tuple(int(c) for c in chunk)
        if len(chunk) != len(shape) or any(c > max(d, 1) for c, d in zip(chunk, shape)):
            raise SourceError(
                f"{where}: array {name!r} of shape {shape} declares chunks of shape {chunk}, "
                f"larger than the array; an Orbax chunk is at most the array's shape (refused "
                f"before decoding it: the file is damaged or forged)"
            )


def _decoding(shape, itemsize: int, chunk, budget: int) -> tuple[int, int]:
    """(chunks TensorStore may decode at once, the bytes reading the array holds): the array
    itself plus its decoded chunks in flight, as many as fit in ``budget`` beside the array
    (at least one, at most one per CPU)."""
    array = itemsize * math.prod(shape)
    chunk_bytes = itemsize * math.prod(chunk)
    count = math.prod(-(-d // max(c, 1)) for d, c in zip(shape, chunk))
    at_once = max(1, min(count, os.cpu_count() or 1, (budget - array) // max(chunk_bytes, 1)))
    return at_once, array + at_once * chunk_bytes


def _by_rows(shape, itemsize: int, chunk, budget: int) -> bool:
    """Whether an array larger than ``budget`` is read in row slabs (re-chunked by the writer):
    when its saved chunks are small enough for a slab and the chunks decoded beside it to fit
    (one decoded chunk at most a quarter of the budget). An array saved as one chunk larger
    than that (Orbax's default for a single-device array) is read whole: every slab would
    decode the whole chunk again, as costly in memory as the whole read."""
    chunk_bytes = itemsize * math.prod(min(c or d, d) for d, c in zip(shape, chunk))
    return len(shape) >= 1 and 0 < chunk_bytes <= budget // 4


def flatten(tree) -> list[tuple[tuple[str, ...], tuple[str, ...], Any]]:
    """(key, key types, leaf metadata): sequence positions stay "index" components, so a
    restore without a target rebuilds Orbax's lists and tuples as lists (FORMAT.md 5.2)."""
    import jax

    out = []
    # None leaves kept: Orbax's record of an empty node (optax's EmptyState), so a tree exported
    # back to Orbax has the structure an Orbax restore target expects
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]:
        parts = [keypath.component_of(p) for p in path]
        out.append((tuple(n for _, n in parts), tuple(t for t, _ in parts), leaf))
    return out


def _saved_sharding(leaf) -> SavedSharding | None:
    """The NamedSharding Orbax recorded for an array (its mesh axis names and sizes and its
    PartitionSpec), so ``restore(path, mesh=...)`` reuses it as it does a JAX save's; None for
    any other sharding or a record that does not fit the array."""
    meta = getattr(leaf, "sharding", None)
    if meta is None or type(meta).__name__ != "NamedShardingMetadata":
        return None
    try:
        names = tuple(str(n) for n in meta.axis_names)
        sizes = tuple(int(n) for n in meta.shape)
        spec = tuple(
            p if p is None or isinstance(p, str) else tuple(str(n) for n in p)
            for p in meta.partition_spec
        )
    except (TypeError, ValueError):
        return None
    used = [n for p in spec if p is not None for n in ((p,) if isinstance(p, str) else p)]
    if len(names) != len(sizes) or len(spec) > len(leaf.shape) or not set(used) <= set(names):
        return None
    return SavedSharding.of(names, sizes, spec)


def host_items(leaves) -> Iterator[writer.HostItem]:
    """The writer's items of the planned leaves, built lazily (arrays left unread)."""
    contexts: dict[bool, Any] = {}
    strings: dict[str, dict] = {}
    for key, key_types, name, item, leaf, ocdbt, zarr3 in leaves:
        path = item.root
        provenance: dict = {"file": name, "tensors": [name]}
        if leaf is None:
            value, provenance = None, {"values": [f"{name} (an empty node)"]}
        elif type(leaf).__name__ == "StringMetadata":
            if path not in strings:
                strings[path] = read_json(item, STRINGS_FILE)
            value = strings[path].get(leaf.name) if isinstance(strings[path], dict) else None
            if not isinstance(value, str):
                raise SourceError(f"{path}/{STRINGS_FILE}: no string for leaf {leaf.name!r}")
        else:
            value = _array(leaf, name, item, ocdbt, zarr3, contexts)
        yield writer.HostItem(
            key,
            value,
            *role_of(key),
            provenance,
            key_types=key_types,
            saved_sharding=_saved_sharding(leaf) if isinstance(value, writer.Deferred) else None,
        )


def _array(leaf, name: str, item: Storage, ocdbt: bool, zarr3: bool, contexts: dict):
    """An array leaf as a ``writer.Deferred``, read once the writer has room for it (zstd chunks
    decoded as a stream into the rows, else through TensorStore); a scalar leaf as its value."""
    import orbax.checkpoint as ocp
    import tensorstore as ts

    kind = type(leaf).__name__
    if kind not in ("ArrayMetadata", "ScalarMetadata"):
        raise SourceError(
            f"{item.root}: leaf {leaf.name!r} has Orbax metadata {kind}; jax_ucp imports arrays, "
            f"scalars and strings"
        )
    if ocdbt not in contexts:
        # Orbax's context keeps up to 100 MB of OCDBT data in its cache pool: nothing here
        # is read twice, and the budget leaves no room for it (~50 MiB measured)
        contexts[ocdbt] = ts.Context(
            ts.Context.Spec({"cache_pool#ocdbt": {"total_bytes_limit": 0}}),
            ocp.type_handlers.get_ts_context(use_ocdbt=ocdbt),
        )
    tspec = read_spec(item, leaf.name, ocdbt, zarr3, contexts[ocdbt])
    where = metadata_file(item, leaf.name, ocdbt, zarr3)
    # where the chunks lie: the array's directory, or the data files of the OCDBT database
    data = item.join(leaf.name)
    data = f"{item.root} (OCDBT data files under d/ and ocdbt.process_*/d/)" if ocdbt else data
    array = _open(tspec, contexts[ocdbt], where, name, tuple(leaf.shape))
    if kind == "ScalarMetadata":  # a Python scalar in the saved tree: a manifest value
        return _read(array, data, name).item()
    shape, dtype = tuple(array.shape), array.dtype.numpy_dtype
    streamed = zstd_rows.rows_reader(array, data, name)
    if streamed is not None:  # zstd chunks decoded as a stream, straight into the rows
        return writer.Deferred(
            shape, dtype, functools.partial(streamed, 0, shape[0]), rows=streamed
        )
    chunk = tuple(array.chunk_layout.read_chunk.shape or shape)
    budget = writer.memory_budget()
    at_once, holds = _decoding(shape, dtype.itemsize, chunk, budget)
    if at_once < (os.cpu_count() or 1):  # fewer decoded chunks at once than TensorStore's
        limit = ts.Context.Spec({"data_copy_concurrency": {"limit": at_once}})
        array = _open(tspec, ts.Context(limit, contexts[ocdbt]), where, name, shape)
    read = functools.partial(_read, array, data, name)
    rows = read if _by_rows(shape, dtype.itemsize, chunk, budget) else None
    # read once the writer has room for the array and its decoded chunks
    return writer.Deferred(shape, dtype, read, bound=holds, rows=rows)


def _open(tspec, context, where: str, name: str, shape: tuple[int, ...]):
    """The array opened with Orbax's read spec (its metadata alone is read), its shape and
    chunks checked before any chunk is."""
    import tensorstore as ts

    try:
        array = ts.open(tspec, context=context, open=True, read=True).result()
    except Exception as e:
        raise SourceError(
            f"{where}: cannot open array {name!r}: {tensorstore_message(e)}"
        ) from None
    if tuple(array.shape) != tuple(shape):
        raise SourceError(
            f"{where}: array {name!r} has shape {tuple(array.shape)}, its metadata says "
            f"{tuple(shape)}"
        )
    layout = array.chunk_layout
    check_chunks(where, name, tuple(shape), [layout.read_chunk.shape, layout.write_chunk.shape])
    check_codecs(where, name, array.spec().to_json())
    return array


#: byte-to-byte codecs (zarr v3) and v2 compressors an import decodes: each compresses or
#: checksums, none changes which element a byte is (a damaged stream is an error)
_STREAM_CODECS = frozenset(("zstd", "gzip", "blosc", "crc32c"))
_V2_COMPRESSORS = frozenset(("zstd", "gzip", "zlib", "blosc", "lz4", "bz2", "lzma"))


def check_codecs(where: str, name: str, spec: dict) -> None:
    """Refuses an array whose codecs could read its bytes as other values without any error:
    in an Orbax checkpoint the codecs are data, so only those the importer positively
    understands are decoded. Orbax writes C order, little-endian ``bytes`` (or a zarr v2
    dtype ``<``), an optional compressor, crc32c and sharding; a ``transpose`` codec, Fortran
    order, big-endian bytes or a v2 filter (delta, scale-offset, astype, ...) from an edited
    ``zarr.json`` / ``.zarray`` would give a transposed, byte-swapped or rescaled tensor with
    every checksum intact.

    Args:
        where: the array's metadata file (or OCDBT entry), for the error.
        name: the array's name, for the error.
        spec: the opened array's TensorStore spec (``array.spec().to_json()``).
    """
    meta = spec.get("metadata") or {}
    if spec.get("driver") == "zarr3":
        found = _unknown_v3_codec(meta.get("codecs"), meta.get("data_type"))
    else:
        found = _unknown_v2_codec(meta)
    if found is not None:
        raise SourceError(
            f"{where}: array {name!r}: {found}; an import decodes only the codecs Orbax writes "
            f"(C order, little-endian bytes, a compressor, crc32c, sharding): this one would "
            f"read the stored bytes as other values (refused: the file is edited or foreign)"
        )


def _unknown_v3_codec(codecs, data_type) -> str | None:
    if not isinstance(codecs, list):
        return f"codecs {str(codecs)[:100]!r} are not a list"
    for codec in codecs:
        codec = codec if isinstance(codec, dict) else {"name": codec}
        kind, config = codec.get("name"), codec.get("configuration") or {}
        if kind == "sharding_indexed":
            for member in ("codecs", "index_codecs"):
                inner = _unknown_v3_codec(config.get(member), data_type)
                if inner is not None:
                    return inner
        elif kind == "bytes":
            if config.get("endian", "little") != "little":
                return f"codec bytes with endian {config.get('endian')!r}"
        elif kind not in _STREAM_CODECS:
            return f"codec {str(kind)[:60]!r}"
    return None


def _unknown_v2_codec(meta: dict) -> str | None:
    compressor = meta.get("compressor")
    if compressor is not None and (compressor or {}).get("id") not in _V2_COMPRESSORS:
        return f"compressor {str((compressor or {}).get('id'))[:60]!r}"
    if meta.get("filters"):
        return f"filters {str(meta.get('filters'))[:100]}"
    if meta.get("order", "C") != "C":
        return f"order {str(meta.get('order'))[:10]!r} (not C)"
    dtype = meta.get("dtype")
    if isinstance(dtype, str) and dtype[:1] == ">":
        return f"big-endian dtype {dtype!r}"
    if not isinstance(dtype, str):  # a structured dtype: fields, offsets
        return f"dtype {str(dtype)[:100]}"
    return None


def _read(array, where: str, name: str, lo: int | None = None, hi: int | None = None):
    """The whole array, or rows ``lo:hi`` of dim 0 alone (decoding only the chunks holding
    them); a missing, truncated or corrupt chunk file is an error naming the array, where its
    chunks lie and the file TensorStore names."""
    import tensorstore as ts

    try:
        if lo is None or hi is None:
            return array.read().result()
        # read into a private mapping unmapped once written (``writer.unpooled_empty``): a slab
        # TensorStore allocates stays resident in glibc's heap after it is freed
        out = writer.unpooled_empty((hi - lo, *array.shape[1:]), array.dtype.numpy_dtype)
        view = array[lo:hi].translate_to[(0,) * array.rank]
        ts.array(out, copy=False, write=True).write(view).result()
        return out
    except ValueError as e:
        rows = "" if lo is None else f"rows {lo}:{hi} of "
        raise SourceError(
            f"{where}: reading {rows}array {name!r} failed (missing, truncated or corrupt chunk "
            f"data): {tensorstore_message(e)}"
        ) from None
