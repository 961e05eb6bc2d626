"""A UCP checkpoint as a source of the read engine: ``CheckpointSource`` (each array opened
once, read by ``store.shard_reader`` or TensorStore, shard files and objects checked against the
manifest's digests first), what it offers (``available_tensors``, a spec's views included), and
the reads exporters, verify and diff make of it (``read``, ``read_rows``). JAX-free.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from jax_ucp._src import bulk, store
from jax_ucp._src import format as fmt
from jax_ucp._src.errors import CheckpointError, tensorstore_message
from jax_ucp._src.format.sizes import format_size
from jax_ucp._src.restoring.engine import OpenedSource, TensorSource, read_from, tensor_error
from jax_ucp._src.restoring.model import Available, Request, spec_views
from jax_ucp._src.store import shard_file, shard_reader

#: an array's ``zarr.json`` as jax_ucp writes it is well under 1 KiB plus ~40 bytes a dimension;
#: a larger one is not this save's, and TensorStore's JSON parser recurses without a bound (a
#: 200 KB ``zarr.json`` nested 100 000 deep crashed the process with SIGSEGV)
MAX_ZARR_JSON_BYTES = 16 << 10
ZARR_JSON = "zarr.json"


def open_checkpoint(root: store.storage.Storage, spec=None) -> OpenedSource:
    """The checkpoint ``root`` (``locate.find_checkpoint``) opened for a restore: its manifest
    read, what it offers (``spec``'s views of it, or its tensors) and its values."""
    with bulk.cyclic_gc_paused():  # an object or more per tensor, none dropped
        manifest = root.read_manifest()
        return OpenedSource(
            CheckpointSource(root),
            available_tensors(manifest, spec),
            manifest.values,
            tree=manifest.tree if spec is None else None,
        )


def available_tensors(manifest: fmt.Manifest, spec=None) -> dict[tuple[str, ...], Available]:
    """What a restore may ask for: the saved tensors, or the views ``spec`` makes of them."""
    stored = {
        e.key: Available(
            key=e.key,
            key_types=e.key_types,
            shape=e.shape,
            dtype=fmt.to_numpy_dtype(e.dtype),
            sources=(e,),
            build=lambda opened, k=e.key: opened[k],
            saved_sharding=e.saved_sharding,
            logical_axes=e.logical_axes,
            stored=True,
        )
        for e in manifest.tensors
    }
    if spec is None:
        return stored
    from jax_ucp._src.language.recorded import spec_with_recorded_settings

    spec = spec_with_recorded_settings(spec, manifest.source)  # by name: the source's heads
    return {view.key: view for view, _ in spec_views(spec, stored, manifest.source)}


def read(
    root: str | store.storage.Storage,
    manifest: fmt.Manifest,
    requests: Sequence[Request],
    *,
    available: Mapping | None = None,
    casting: str = "same_kind",
    memory_budget: int | None = None,
) -> list:
    """``engine.read_from`` the checkpoint at ``root`` (a restore's options go through
    ``restore_entry``): jax.Array (a request with a sharding), np.ndarray, or the saved Python
    value, in request order.

    Args:
      root: the checkpoint directory (holding ucp.json).
      manifest: its manifest.
      requests: what to read, one result per request.
      available: what may be read (``available_tensors``); None: computed from the manifest.
      casting: numpy's casting rule for the requests' dtypes.
      memory_budget: host bytes of read buffers in flight (None: 256 MiB).
    """
    return read_from(
        CheckpointSource(root),
        requests,
        available if available is not None else available_tensors(manifest),
        {e.key: e for e in manifest.values},
        casting=casting,
        memory_budget=memory_budget,
    )


def read_rows(
    root: str,
    manifest: fmt.Manifest,
    key: tuple[str, ...],
    *,
    available: Mapping,
    dtype: np.dtype | None = None,
    casting: str = "same_kind",
    max_bytes: int,
) -> Iterator[np.ndarray]:
    """Tensor ``key`` as consecutive slabs of rows (the first axis), each read as ``read`` reads
    (digests, crc32c, casting) and holding at most ``max_bytes`` of read and converted data
    (one row at least; whole inner chunks where the stored layout allows): a writer streams a
    tensor of any size in bounded memory. A 0-d or empty tensor is one slab."""
    found = available[key]
    out_dtype = found.dtype if dtype is None else np.dtype(dtype)
    for rows in row_ranges(found, out_dtype, max_bytes):
        request = Request(key, dtype=out_dtype, rows=rows)
        (slab,) = read(
            root,
            manifest,
            [request],
            available=available,
            casting=casting,
            memory_budget=max_bytes,
        )
        yield slab
        del slab


def row_ranges(found: Available, dtype: np.dtype, max_bytes: int) -> list:
    """The ``rows`` of each slab ``read_rows`` reads (``[None]``: the whole tensor at once).

    Args:
        found: the tensor as found in the checkpoint.
        dtype: the dtype it is read into (a cast holds both copies of a row).
        max_bytes: bytes a slab may hold.
    """
    shape = found.shape
    if not shape or not math.prod(shape):
        return [None]
    row = math.prod(shape[1:]) * (found.dtype.itemsize + (dtype != found.dtype) * dtype.itemsize)
    step = max(1, max_bytes // max(row, 1))
    inner = found.sources[0].inner_chunk_shape[0] if found.stored and found.sources else 1
    if step > inner:  # whole inner chunks: none decoded twice
        step -= step % inner
    return [(lo, min(lo + step, shape[0])) for lo in range(0, shape[0], step)]


class CheckpointSource(TensorSource):
    """A UCP checkpoint's arrays: each opened once, concurrently, with errors that name tensor
    and file; read by ``store.shard_reader`` where the layout allows (hardware crc32c, shard
    digests), by TensorStore elsewhere (after checking every shard file it will open)."""

    metadata = fmt.MANIFEST_FILE

    def __init__(self, root: str | store.storage.Storage):
        self.storage = store.storage_for(root)  # chosen once: every array is opened through it
        self.root = self.path = root = self.storage.root
        self.where = f"the checkpoint {root}"
        self.sweep = self.storage.local_path() is None  # shards checked at once (``prepare``)
        self._context = store.zarr3.read_context()
        # per array: its zarr.json's bytes (None: missing) or their fetch (``ObjectFetch``), then
        # its checked layout, then the TensorStore array opened
        self._futures: dict[tuple, tuple[fmt.TensorEntry, Any]] = {}
        self._kv: ts.KvStore | None = None  # an object store's, opened once

    def files(self, found: Available) -> str:
        return ", ".join(os.path.join(self.root, s.dir) for s in found.sources)

    def prepare(self, tensors: Sequence[Available]) -> None:
        """Every array opened at once; in an object store every shard object's digest checked
        at once, before any read."""
        sources = {s.key: s for found in tensors for s in found.sources}
        for src in sources.values():
            self._open(src)  # an object's zarr.json fetched in two steps, nobody waiting
        if self.sweep:  # those read by ``ShardReader`` are checked as they are read
            by_tensorstore = {
                s.key: s
                for found in tensors
                if not self._objects_read(found)
                for s in found.sources
            }
            verify_shard_objects(self.storage, by_tensorstore.values())

    def _objects_read(self, found: Available) -> bool:
        """Whether ``found`` is read from an object store by ``ShardReader``'s ranged GETs,
        each shard's digest checked from the trailers those fetch (no sweep of its own)."""
        entry = found.sources[0]
        return (
            found.stored
            and self.storage.kvstore().get("driver") in ("s3", "gcs")
            and entry.checksum == "crc32c"
            and entry.shard_digests is not None
            and shard_file.readable(store.zarr3.layout_of(entry))
        )

    def _open(self, entry: fmt.TensorEntry) -> None:
        """Starts reading the array's ``zarr.json`` (checked against the manifest by ``_get``)."""
        if entry.key in self._futures:
            return
        kv = self.storage.kvstore(entry.dir)
        if kv.get("driver") != "file":  # every array's zarr.json fetched at once
            if self._kv is None:
                self._kv = ts.KvStore.open(self.storage.kvstore()).result()
            name = f"{entry.dir.strip('/')}/{ZARR_JSON}"
            # a byte past the limit first: a larger object is refused, never fetched
            self._futures[entry.key] = (entry, ObjectFetch(name, self._kv))
            return
        zarr_json = os.path.join(kv["path"], ZARR_JSON)
        try:  # never hand TensorStore a FIFO or a device, nor an array linked out of the root
            self.storage.inside(f"{entry.dir}/{ZARR_JSON}", fmt.MANIFEST_FILE)
            data: bytes | None = fmt.files.read_regular(zarr_json, MAX_ZARR_JSON_BYTES)
        except FileNotFoundError:
            data = None
        except fmt.files.UnsafeFileError as e:  # a FIFO, a device, a link out, too large
            raise tensor_error(entry.name, e) from None
        self._futures[entry.key] = (entry, data)

    def _checked(self, key) -> store.ArrayLayout:
        """The array's layout as its manifest entry implies it, once its ``zarr.json`` was found
        to say the same, member for member (``store.zarr3.check_metadata_file``)."""
        entry, pending = self._futures[key]
        if isinstance(pending, (store.ArrayLayout, ts.TensorStore)):
            return store.zarr3.layout_of(entry)
        where = self.storage.join(entry.dir, ZARR_JSON)
        data = pending if isinstance(pending, bytes) else None
        if isinstance(pending, ObjectFetch):
            try:
                data = pending.result(self._kv)
            except Exception as e:
                raise CheckpointError(
                    f"Tensor {entry.name!r}: cannot read {where}: {tensorstore_message(e)}"
                ) from e
        if data is None:
            raise CheckpointError(
                f"Tensor {entry.name!r} is listed in {fmt.MANIFEST_FILE} but its array "
                f"metadata {where} is missing."
            )
        if len(data) > MAX_ZARR_JSON_BYTES:
            raise CheckpointError(
                f"Tensor {entry.name!r}: {where}: more than the {MAX_ZARR_JSON_BYTES} bytes an "
                f"array's metadata takes; not the file this checkpoint wrote (replace it from a "
                f"good copy)"
            )
        layout = store.zarr3.layout_of(entry)
        try:
            store.zarr3.check_metadata_file(data, layout, where)
        except fmt.UCPError as e:
            raise tensor_error(entry.name, e) from None
        self._futures[key] = (entry, layout)
        return layout

    def _get(self, key) -> ts.TensorStore:
        """The array opened with what its manifest entry implies (``_checked``): TensorStore is
        told nothing the manifest does not say and reads no ``zarr.json``."""
        layout = self._checked(key)
        entry, opened = self._futures[key]
        if isinstance(opened, ts.TensorStore):
            return opened
        kv = self.storage.kvstore(entry.dir)
        try:
            t = store.open_array(kv, context=self._context, layout=layout).result()
        except Exception as e:
            raise CheckpointError(
                f"Tensor {entry.name!r}: cannot open {self.storage.join(entry.dir)}: "
                f"{tensorstore_message(e)}"
            ) from e
        self._futures[key] = (entry, t)
        return t

    def reader(self, found: Available):
        """``store.shard_reader`` where the stored array's layout allows it (no TensorStore
        array opened), else TensorStore's array or the view built of them."""
        entry = found.sources[0]
        kv = self.storage.kvstore(entry.dir)
        if found.stored and kv.get("driver") == "file":
            layout = self._checked(entry.key)
            if shard_file.readable(layout):  # else TensorStore reads it
                return shard_reader.ShardReader(
                    kv["path"],
                    layout,
                    fmt.to_numpy_dtype(entry.dtype),
                    digests=entry.shard_digests,
                    tensor=entry.name,
                    root=self.storage.kvstore()["path"],  # spelled as kv["path"] is
                )
        if self._objects_read(found):  # its zarr.json checked while its chunks are fetched
            if self._kv is None:
                self._kv = ts.KvStore.open(self.storage.kvstore()).result()
            return shard_reader.ShardReader(
                self.storage.join(entry.dir),
                store.zarr3.layout_of(entry),
                fmt.to_numpy_dtype(entry.dtype),
                digests=entry.shard_digests,
                tensor=entry.name,
                objects=(self._kv, f"{entry.dir.strip('/')}/"),
                check=functools.partial(self._checked, entry.key),
            )
        return found.build({s.key: self._get(s.key) for s in found.sources})

    def check_fits(self, found: Available, limit: int, what: str) -> None:
        for src in found.sources:  # a reader decodes whole inner chunks
            chunk = math.prod(src.inner_chunk_shape) * fmt.to_numpy_dtype(src.dtype).itemsize
            if src.shape and chunk > limit:
                raise CheckpointError(
                    f"Tensor {found.name!r} ({os.path.join(self.root, src.dir)}): its inner "
                    f"chunks of shape {src.inner_chunk_shape} take {format_size(chunk)} each, more "
                    f"than {what} ({format_size(limit)}); a reader decodes whole chunks. Check the "
                    f"checkpoint's {fmt.MANIFEST_FILE} and zarr.json (they declare this chunking)."
                )

    def verify(self, found: Available, reader) -> None:
        """Read by TensorStore: every shard file it may open checked first (object stores
        were checked at once, by ``prepare``)."""
        if not self.sweep and not isinstance(reader, shard_reader.ShardReader):
            for src in found.sources:
                verify_shard_files(self.storage, src)

    def unit_rows(self, found: Available) -> int:
        """The stored array is split on its inner chunks."""
        return max(1, int(found.sources[0].inner_chunk_shape[0])) if found.stored else 1


class ObjectFetch:
    """An object's content, fetched in two steps: a byte past ``MAX_ZARR_JSON_BYTES`` (present:
    too large), then the whole object, started as soon as the first answers (nobody waits)."""

    def __init__(self, name: str, kv):
        self.name, self._lock = name, threading.Lock()  # TensorStore's thread and the caller's
        self.whole: ts.Future | None = None
        self.settled: tuple[bool, bytes | None] | None = None  # (too large, content)
        self.beyond = kv.read(name, byte_range=slice(MAX_ZARR_JSON_BYTES, MAX_ZARR_JSON_BYTES + 1))
        self.beyond.add_done_callback(lambda _: self.advance(kv, quietly=True))

    def advance(self, kv, quietly: bool = False) -> None:
        """The second GET issued once the first answered (``quietly``: its error left to
        ``result``). Waited for without the lock: TensorStore runs the callback above before it
        wakes a waiter, so a waiter holding the lock would never wake."""
        try:
            got = self.beyond.result()
        except ValueError:  # the range starts past the end (OUT_OF_RANGE): a small object
            got = None
        except Exception:
            if quietly:
                return
            raise
        with self._lock:
            if self.whole is None and self.settled is None:
                if got is None:
                    self.whole = kv.read(self.name)
                else:
                    self.settled = (got.state == "value", None)

    def result(self, kv) -> bytes | None:
        """The content (None: no such object); more than the limit: ``limit + 1`` bytes."""
        self.advance(kv)
        if self.settled is None:
            assert self.whole is not None
            got = self.whole.result()
            self.settled = (False, bytes(got.value) if got.state == "value" else None)
        too_large, content = self.settled
        return b" " * (MAX_ZARR_JSON_BYTES + 1) if too_large else content


def verify_shard_files(storage: store.storage.Storage, entry: fmt.TensorEntry) -> None:
    """Before TensorStore reads ``entry`` from a local directory: each shard file exists, is a
    regular file, and (with checksums) is the one the manifest lists (its digest), so a swapped,
    stale or missing shard is an error naming the file, and a FIFO never blocks the read (an
    object store's shards: ``verify_shard_objects``, at once)."""
    kv = storage.kvstore(entry.dir)
    n_chunks = _chunks_per_shard(entry)
    for key in shard_file.grid_keys(entry.shape, entry.chunk_shape):
        path = os.path.join(kv["path"], *key.split("/"))
        with _shard_checked(entry, "file", path):
            storage.inside(f"{entry.dir}/{key}", "shard file")
            if entry.checksum == "crc32c" and entry.shard_digests is not None:
                found = shard_reader.file_digest(path, n_chunks)
                shard_file.check_digest(path, found, entry.shard_digests.get(key), entry.name)
            else:
                fmt.files.check_regular(path)


def _chunks_per_shard(entry: fmt.TensorEntry) -> int:
    return math.prod(c // i for c, i in zip(entry.chunk_shape, entry.inner_chunk_shape))


@contextlib.contextmanager
def _shard_checked(entry: fmt.TensorEntry, kind: str, where: str):
    """A missing shard (``kind``: file or object) or a failed check as an error naming the
    tensor."""
    try:
        yield
    except FileNotFoundError:
        raise CheckpointError(
            f"Tensor {entry.name!r}: shard {kind} {where} is missing (the checkpoint is "
            f"incomplete)."
        ) from None
    except fmt.UCPError as e:
        raise tensor_error(entry.name, e) from None


def verify_shard_objects(storage: store.storage.Storage, entries) -> None:
    """``verify_shard_files`` for many tensors in an object store at once: each shard object's
    digest from its index and chunk trailers, read as byte ranges, all objects' requests issued
    together (two round trips for a whole restore, where one object after another took two
    each)."""
    entries = [e for e in entries if e.checksum == "crc32c" and e.shard_digests is not None]
    if not entries:
        return
    kvstore = ts.KvStore.open(storage.kvstore()).result()
    shards, owners = [], []
    for entry in entries:
        n_chunks = _chunks_per_shard(entry)
        data_bytes = shard_file.index_offset(
            entry.inner_chunk_shape,
            fmt.to_numpy_dtype(entry.dtype),
            n_chunks,
            entry.compression,
        )
        for key in shard_file.grid_keys(entry.shape, entry.chunk_shape):
            where = storage.join(entry.dir, key)
            shards.append((kvstore, f"{entry.dir.strip('/')}/{key}", n_chunks, where, data_bytes))
            owners.append((entry, key, where))
    for start in range(0, len(shards), _OBJECTS_PER_SWEEP):
        found = shard_reader.object_digests(shards[start : start + _OBJECTS_PER_SWEEP])
        for (entry, key, where), digest in zip(owners[start:], found):
            with _shard_checked(entry, "object", where):
                if isinstance(digest, BaseException):
                    raise digest
                shard_file.check_digest(where, digest, entry.shard_digests.get(key), entry.name)


# Shard objects whose digests are read together (each holds its index in memory meanwhile).
_OBJECTS_PER_SWEEP = 4096
