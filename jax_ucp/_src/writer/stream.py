"""Streams of host tensors (what importers produce), written one tensor at a time.

``HostItem`` is the one record that flows from an importer into the writer: a tensor (or a JSON
scalar) with its key path, role and provenance. Free of JAX and Orbax: an import is a host-only job.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import mmap
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import msgspec
import numpy as np
import tensorstore as ts

from jax_ucp._src import format as fmt
from jax_ucp._src import store
from jax_ucp._src.format import mapped_file
from jax_ucp._src.format.sizes import DEFAULT_MEMORY_BUDGET
from jax_ucp._src.writer import layout as layout_lib
from jax_ucp._src.writer import shards as shards_lib
from jax_ucp._src.writer.shards import PipelinedWriter

_SCALARS = (type(None), bool, int, float, str)
_E = TypeVar("_E", bound=fmt.Entry)

_MEMORY_BUDGET: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "jax_ucp_memory_budget", default=None
)


def memory_budget() -> int:
    """The bytes of tensor data the running conversion may hold at once (``convert`` /
    ``export``'s ``memory_budget``): the writer's tensors in flight plus what an importer or
    exporter builds. A context variable, so the importers, the writer and the exporters honour
    one budget without threading it through every layer's signatures."""
    return _MEMORY_BUDGET.get() or DEFAULT_MEMORY_BUDGET


@contextlib.contextmanager
def memory_budget_scope(nbytes: int | None):
    """``memory_budget()`` is ``nbytes`` inside (``None``: the default)."""
    token = _MEMORY_BUDGET.set(nbytes)
    try:
        yield
    finally:
        _MEMORY_BUDGET.reset(token)


def unpooled_empty(shape, dtype) -> np.ndarray:
    """``np.empty`` in its own anonymous mapping, unmapped as soon as the array is freed.

    For the tensors an importer builds under the memory budget: glibc keeps freed blocks under
    its dynamic mmap threshold (up to 32 MiB) in the heap, resident after the writer dropped them
    (~60 MiB over a Megatron import measured)."""
    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if n == 0:
        return np.empty(shape, dtype)
    # MAP_PRIVATE: Python's default for mmap(-1) is a shared mapping (RssShmem, not RssAnon)
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(buf, dtype).reshape(shape)


@dataclasses.dataclass(frozen=True)
class Deferred:
    """A tensor an importer must build in anonymous memory (a tensor-parallel merge, chunks read
    into place): ``make()`` is called only once the writer has retired enough tensors for
    ``nbytes`` more to fit in the memory budget (Orbax's ``LimitInFlightBytes`` reserves before
    it reads, likewise), so the tensor being built counts against the same budget."""

    shape: tuple[int, ...] | None  # None: known once built (``bound`` then says how large)
    dtype: np.dtype | None
    make: Callable[[], np.ndarray]
    # bytes at most, when the shape is not known before it is built; with a shape: the bytes
    # its building holds (e.g. with a weight it is checked against), when more than the tensor
    bound: int | None = None
    #: ``rows(start, stop)`` builds rows ``start:stop`` of dim 0 alone (shape known): a tensor
    #: larger than the memory budget is then written in row slabs instead of built whole.
    rows: Callable[[int, int], np.ndarray] | None = None
    #: ``rows`` are independent ranged reads (an object's bytes): several threads may read at once
    ranged: bool = False
    #: ``regions(dests)``: jobs (callables, any thread) reading the ``((start, stop) per dim,
    #: out)`` boxes straight into ``out``, no row built first (a DCP tensor's row can be a GiB)
    regions: Callable[[list], list[Callable[[], None]]] | None = None

    @property
    def nbytes(self) -> int:
        if self.shape is None:
            return int(self.bound or 0)
        n = np.dtype(self.dtype).itemsize * math.prod(int(d) for d in self.shape)
        return max(n, int(self.bound or 0))

    def build(self, name: str) -> np.ndarray:
        value = self.make()
        if self.shape is None:
            if not isinstance(value, np.ndarray) or value.nbytes > self.nbytes:
                raise TypeError(
                    f"HostItem {name!r}: built {getattr(value, 'nbytes', type(value).__name__)} "
                    f"bytes, announced at most {self.nbytes}"
                )
            return value
        if tuple(value.shape) != tuple(self.shape) or value.dtype != np.dtype(self.dtype):
            raise TypeError(
                f"HostItem {name!r}: built {value.dtype}{list(value.shape)}, announced "
                f"{np.dtype(self.dtype)}{list(self.shape)}"
            )
        return value


@dataclasses.dataclass
class HostItem:
    """One tensor (or JSON scalar) of a stream, with what the manifest records about it.

    ``value`` must not be modified once yielded: TensorStore may encode straight from it while
    later items are produced (importers yield read-only memory maps or fresh arrays).
    """

    key: tuple[str, ...]
    value: Any  # np.ndarray (incl. memmap, ml_dtypes), TensorStore, Deferred, or JSON scalar
    role: str = "other"  # "param", "opt_state" or "other" (the manifest's Role)
    sub_role: str | None = None
    provenance: dict | None = None
    logical_axes: tuple | None = None
    frozen: bool = False  # a parameter the run did not train (no optimizer state)
    tied_to: str | None = None  # the same tensor as this "/"-joined key (its state is that one's)
    key_types: tuple[str, ...] | None = None  # per component: "key", "index", "attr"; None: keys
    saved_sharding: fmt.SavedSharding | None = None  # the source's mesh + PartitionSpec, if known


# the HostItem fields a tensor's manifest entry records (``layout.tensor_entry``'s keywords)
_ENTRY_FIELDS = tuple(
    f.name for f in dataclasses.fields(HostItem) if f.name not in ("key", "value", "key_types")
)


def with_progress(
    items: Iterable[HostItem], total: int, progress: Callable[[str, int, int], None] | None
) -> Iterator[HostItem]:
    """``items`` unchanged, calling ``progress(name, done, total)`` after each parameter.

    Parameters (role ``param`` without a sub-role) are what a user waits on; moments and model
    copies follow them.

    Args:
        items: the items of an import.
        total: the number of parameters.
        progress: called as ``progress(name, done, total)`` (None: not at all).
    """
    done = 0
    for item in items:
        yield item
        if item.role == "param" and item.sub_role is None:
            done += 1
            if progress is not None:
                progress(item.key[-1], done, total)


def with_digests(entry: _E, digests: Mapping[str, str] | None) -> _E:
    """``entry`` with the digests of its shard files, when the array has checksums to bind."""
    if isinstance(entry, fmt.TensorEntry) and entry.checksum == "crc32c" and digests is not None:
        return msgspec.structs.replace(entry, shard_digests=dict(sorted(digests.items())))
    return entry


def mapped_deferred(view: np.ndarray, what: str) -> Deferred:
    """A tensor that is a view of a memory-mapped source file, read with ``pread``
    (:func:`jax_ucp._src.format.mapped_file.read_out`) whole or in row slabs once the writer has room:
    the mapping itself is never touched, so a file truncated meanwhile is an error naming it
    (``what`` says which tensor), never SIGBUS."""

    def rows(start: int, stop: int) -> np.ndarray:
        return mapped_file.read_out(view[start:stop], f"{what} rows {start}:{stop}")

    return Deferred(
        tuple(view.shape),
        view.dtype,
        lambda: mapped_file.read_out(view, what),
        rows=rows if view.ndim else None,
    )


def unmapped(value: Any, name: str) -> Any:
    """``value``, or when it is a view of a memory-mapped source file (an importer's tensor
    taken straight from a rank file) a :func:`mapped_deferred` of it: whatever an importer
    yields, the writer never touches a mapping."""
    if isinstance(value, np.ndarray) and mapped_file.mapped_at(value) is not None:
        return mapped_deferred(value, f"tensor {name!r}")
    return value


def _streams(v, budget: int) -> bool:
    """A ``Deferred`` larger than the budget that can build its rows alone."""
    return (
        isinstance(v, Deferred)
        and v.rows is not None
        and v.shape is not None
        and len(v.shape) >= 1
        and v.nbytes > budget
    )


async def _materialised(writer: PipelinedWriter, v, name: str):
    """``v``, built or read once the writer has room for its bytes: a ``Deferred`` (room
    first, then the importer builds it; a view of a source file read out with pread) or a lazy
    TensorStore source; any other value as it is."""
    if isinstance(v, Deferred):
        await writer.reserve(v.nbytes)
        v = v.build(name)
        if isinstance(v, np.ndarray):
            v = mapped_file.read_out(v, f"tensor {name!r}")
    elif isinstance(v, ts.TensorStore):
        await writer.reserve(v.dtype.numpy_dtype.itemsize * math.prod(v.shape))
        v = await v.read()
    return v


async def write_stream(
    directory: os.PathLike | str,
    items: Iterable[HostItem],
    *,
    source: Mapping | None = None,
    compression: str | None = None,
    inner_chunk_bytes: int | None = None,
    sync: bool = True,
    manifest_file: str = fmt.MANIFEST_FILE,
    budget: int | None = None,
) -> None:
    """Writes every item under ``directory``, then ``ucp.json`` (single process: the primary).

    Args:
        directory: the checkpoint directory.
        items: the items to write.
        source: the manifest's source record.
        compression: the arrays' codec (None: the default).
        inner_chunk_bytes: the bytes of an inner chunk.
        sync: fsync each file (False: the caller does: the commit syncs the file
            system once).
        manifest_file: the manifest's file name (another: a shared import's part of it).
        budget: bytes held at once (None: ``memory_budget()``).
    """
    directory = os.fspath(directory)
    options = layout_lib.ArrayOptions(
        compression=compression,
        inner_chunk_bytes=inner_chunk_bytes or store.DEFAULT_INNER_CHUNK_BYTES,
    )
    entries: list[fmt.Entry] = []

    def _prepare(key, key_types, item: HostItem, v) -> layout_lib.PreparedTensor:
        entry_kw = {name: getattr(item, name) for name in _ENTRY_FIELDS}
        return layout_lib.prepare_host_tensor(
            key, key_types, v, options, primary=True, stable_source=True, **entry_kw
        )

    writer = PipelinedWriter(directory, sync=sync, max_bytes=budget or memory_budget())
    try:
        for item in items:
            key = tuple(str(k) for k in item.key)
            key_types = tuple(item.key_types or ("key",) * len(key))
            v = unmapped(item.value, fmt.key_to_str(key))
            if _streams(v, writer.max_bytes):
                p = _prepare(key, key_types, item, np.broadcast_to(np.zeros((), v.dtype), v.shape))
                if shards_lib.can_stream(p, directory):  # row slabs, each within the budget
                    await writer.stream(p, v.rows, writer.max_bytes // 2)
                    entries.append(p.entry)
                    continue
            v = await _materialised(writer, v, fmt.key_to_str(key))
            if isinstance(v, _SCALARS):
                entries.append(
                    layout_lib.value_entry(
                        key, key_types, v, role=item.role, sub_role=item.sub_role
                    )
                )
                continue
            if not isinstance(v, (np.ndarray, np.generic, ts.TensorStore)):
                raise TypeError(
                    f"HostItem {fmt.key_to_str(key)!r}: cannot write a {type(v).__name__}."
                )
            p = _prepare(key, key_types, item, v)
            await writer.add(p)  # returns once in-flight tensors are under the byte cap
            entries.append(p.entry)
            del p, v
        await writer.flush()
    except BaseException:
        await writer.abandon()
        raise
    entries = [with_digests(e, writer.digests.get(e.key)) for e in entries]
    manifest = fmt.new_manifest(
        entries, source=source, kvstore_driver=store.kvstore_driver(directory)
    )
    store.storage_for(directory).write_manifest(manifest, manifest_file)
