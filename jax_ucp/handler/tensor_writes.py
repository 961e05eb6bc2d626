"""What a save writes, without JAX: manifest entries, array layouts and pipelined shard writes.

Shared by JAX saves (``save_plan``) and host streams (importers). Kept free of JAX and Orbax so
that an import — a host-only job — starts in a fraction of a second instead of paying ~1 s of
JAX/Orbax import on every conversion.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorstore as ts

from jax_ucp import format as fmt
from jax_ucp import store
from jax_ucp.store import shard_file


@dataclasses.dataclass(frozen=True)
class SaveOptions:
    compression: str | None = None  # None or "zstd" (see README: why off by default)
    compression_level: int = 3
    inner_chunk_bytes: int = store.DEFAULT_INNER_CHUNK_BYTES
    checksum: str | None = "crc32c"


@dataclasses.dataclass
class PreparedTensor:
    entry: fmt.TensorEntry
    layout: store.ArrayLayout
    # (index into the global array, host data or a zero-arg producer) for this process to write
    writes: list[tuple[tuple, Any]]
    # The host data stays unmodified while TensorStore may hold it (a private copy, a read-only
    # memory map): TensorStore then encodes straight from it instead of copying it first, which
    # cut a 2.2 GB import from 2.6-2.9 s to 2.0-2.2 s on 2 cores.
    stable_source: bool = False


def array_layout(
    shape, dtype_name: str, shard_shape, itemsize: int, options: SaveOptions
) -> store.ArrayLayout:
    return store.ArrayLayout(
        shape=tuple(int(d) for d in shape),
        dtype=dtype_name,
        chunk_shape=store.outer_chunk_shape(shard_shape),
        inner_chunk_shape=store.inner_chunk_shape(shard_shape, itemsize, options.inner_chunk_bytes),
        compression=options.compression,
        compression_level=options.compression_level,
        checksum=options.checksum,
    )


def tensor_entry(
    key,
    kinds,
    layout: store.ArrayLayout,
    *,
    role=None,
    sub_role=None,
    logical_axes=None,
    saved_sharding=None,
    provenance=None,
) -> fmt.TensorEntry:
    if role is None:
        role, inferred_sub = fmt.infer_role(key)
        sub_role = sub_role if sub_role is not None else inferred_sub
    if logical_axes is not None and len(logical_axes) < len(layout.shape):
        # PartitionSpec semantics: unnamed trailing dimensions; none named at all → unknown.
        logical_axes = (
            tuple(logical_axes) + (None,) * (len(layout.shape) - len(logical_axes))
            if any(n is not None for n in logical_axes)
            else None
        )
    if logical_axes is not None and len(logical_axes) != len(layout.shape):
        raise ValueError(
            f"Leaf {fmt.key_to_str(key)!r}: {len(logical_axes)} logical axis names "
            f"{tuple(logical_axes)} for an array of shape {layout.shape}."
        )
    return fmt.TensorEntry(
        key=tuple(key),
        key_kinds=tuple(kinds),
        dir=fmt.array_dir(key),
        shape=layout.shape,
        dtype=layout.dtype,
        chunk_shape=layout.chunk_shape,
        inner_chunk_shape=layout.inner_chunk_shape,
        compression=layout.compression,
        checksum=layout.checksum,
        role=role,
        sub_role=sub_role,
        logical_axes=None if logical_axes is None else tuple(logical_axes),
        saved_sharding=saved_sharding,
        provenance=provenance,
    )


def value_entry(key, kinds, value, *, role=None, sub_role=None) -> fmt.ValueEntry:
    if role is None:
        role, sub_role = fmt.infer_role(key)
    entry = fmt.ValueEntry(
        key=tuple(key), key_kinds=tuple(kinds), value=value, role=role, sub_role=sub_role
    )
    entry.to_json()  # type check now, with the leaf's name, not at manifest time
    return entry


def prepare_host_tensor(
    key,
    kinds,
    value,
    options: SaveOptions,
    *,
    primary: bool,
    stable_source: bool = False,
    **entry_kw,
) -> PreparedTensor:
    """A numpy array or TensorStore view: one shard, written by the primary process only."""
    if isinstance(value, ts.TensorStore):
        shape, np_dtype = tuple(value.shape), value.dtype.numpy_dtype
        data: Any = lambda v=value: v.read().result()
    else:
        value = np.asarray(value)
        shape, np_dtype, data = value.shape, value.dtype, value
    layout = array_layout(
        shape, fmt.dtype_name(np_dtype), shape, np.dtype(np_dtype).itemsize, options
    )
    writes = [(tuple(slice(None) for _ in shape), data)] if primary else []
    return PreparedTensor(
        tensor_entry(key, kinds, layout, **entry_kw), layout, writes, stable_source
    )


def _write_error(p: PreparedTensor, kv, e: Exception) -> IOError:
    return OSError(
        f"Writing tensor {p.entry.name!r} (shape {p.layout.shape}, {p.layout.dtype}) "
        f"to {kv.get('path', kv)}: {e}"
    )


async def write_tensor(root, p: PreparedTensor, *, primary: bool, sync: bool = True) -> None:
    """Creates (primary) or attaches to (others) the array and writes this process's shards.

    ``sync=False``: nothing is fsynced; the caller makes the directory durable before committing
    it (``commit.make_durable``).
    """
    kv = store.kvstore_spec(root, p.entry.dir)
    try:
        t = await store.create(kv, p.layout, primary=primary, sync=sync)
        for c in _issue_writes(t, p, kv, sync):
            await c
    except Exception as e:
        raise _write_error(p, kv, e) from e


def _chunk_position(index, chunk_shape) -> tuple[int, ...] | None:
    """Grid position of the shard that ``index`` (a tuple of slices) covers exactly, else None."""
    if len(index) != len(chunk_shape):
        return None
    pos = []
    for sl, c in zip(index, chunk_shape):
        start = sl.start or 0
        if start % c:
            return None
        pos.append(start // c)
    return tuple(pos)


def _issue_writes(t: ts.TensorStore, p: PreparedTensor, kv: Mapping[str, Any], sync: bool) -> list:
    """Starts every shard write of ``p``; whole shards of host memory go through ``shard_file``."""
    commits = []
    loop = asyncio.get_running_loop()
    for index, data in p.writes:
        if callable(data):
            data = data()
        if p.layout.shape and 0 in p.layout.shape:
            continue  # nothing to store for a zero-size array; zarr.json says it all
        position = _chunk_position(index, p.layout.chunk_shape) if index else None
        if position is not None and shard_file.can_write(p.layout, data, kv):
            commits.append(
                loop.run_in_executor(
                    shard_file.pool(),
                    functools.partial(
                        shard_file.write, kv["path"], position, data, p.layout, sync=sync
                    ),
                )
            )
            continue
        target = t[index] if index else t
        commits.append(
            target.write(data, can_reference_source_data_indefinitely=p.stable_source).commit
        )
    return commits


class PipelinedWriter:
    """Keeps a bounded number of host tensors in flight (single process, primary).

    An importer produces the next tensor while TensorStore is still creating and writing the
    previous ones (each create fsyncs its zarr.json, so awaiting them one by one dominated
    imports); the byte and count caps bound the memory that pipelining adds.
    """

    def __init__(
        self, root, *, max_bytes: int = 256 << 20, max_tensors: int = 64, sync: bool = True
    ):
        self.root = str(root)
        self.sync = sync
        self.max_bytes, self.max_tensors = max_bytes, max_tensors
        self._pending: list[tuple[asyncio.Task, int]] = []
        self._bytes = 0

    async def add(self, p: PreparedTensor) -> None:
        task = asyncio.ensure_future(write_tensor(self.root, p, primary=True, sync=self.sync))
        self._pending.append((task, p.entry.nbytes))
        self._bytes += p.entry.nbytes
        await asyncio.sleep(0)  # let the new task issue its create before the next tensor is made
        while self._pending and (
            self._bytes > self.max_bytes or len(self._pending) > self.max_tensors
        ):
            await self._retire_oldest()
        # Surface a failure early instead of after the whole stream was produced.
        for task, _ in self._pending:
            if task.done() and task.exception() is not None:
                raise task.exception()

    async def _retire_oldest(self) -> None:
        task, nbytes = self._pending.pop(0)
        await task
        self._bytes -= nbytes

    async def flush(self) -> None:
        while self._pending:
            await self._retire_oldest()

    async def abandon(self) -> None:
        """After a failure: let in-flight writes settle so cleanup does not race them."""
        if self._pending:
            await asyncio.gather(*(t for t, _ in self._pending), return_exceptions=True)
        self._pending.clear()


def build_manifest(
    entries: list[fmt.Entry], *, kvstore_driver: str = "file", source: Mapping | None = None
) -> fmt.Manifest:
    from jax_ucp import __version__

    return fmt.Manifest(
        entries=list(entries),
        kvstore_driver=kvstore_driver,
        created_by=f"jax_ucp {__version__}",
        created_at=fmt.manifest.now(),
        source=dict(source or {"framework": "jax"}),
    )
