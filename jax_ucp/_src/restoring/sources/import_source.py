"""The items of an import plan as a source of the read engine (``ImportSource``): what
``import_open`` opens for a restore straight from a source ``convert`` reads (torch DCP,
torch.save files, DeepSpeed, Megatron, verl, Orbax, ...), read in place of the UCP checkpoint
convert would write. No copy is written anywhere.

An import plan's items are what convert's writer consumes (``writer.HostItem``): a key, a role,
and a value that is read only when asked (a memory-mapped view of a source file read with
``pread``, a lazy TensorStore view, or a ``writer.Deferred`` that builds the tensor, whole or row
by row). The tensors are seen as the converted checkpoint would hold them (its keys, key types,
dtypes, saved shardings and logical axes, its values), so a direct restore gives what convert +
restore gives. Typed against the items' fields alone: this module imports no importer.

Each process reads only the rows its devices' slices cover (a column cut reads its rows whole,
once, in blocks of at most ``BLOCK_BYTES``): a value read by ranges (a view of a mapped file, as
Hugging Face safetensors are, read with ``pread``; a ``Deferred`` whose rows are ranged reads of an
object) straight into each region of whole rows, the other rows range by range; a spec's
transpose / merge of such rank-2 tensors by ``gathered.Gathered``. A ``Deferred`` without row reads (a ZeRO-3 flat
partition spanning many tensors, a tensor-parallel merge) is built whole on each process that
needs any part of it, and one whose shape is known only once built (a Megatron legacy merge) is
built when the source is opened. A torch zip member's CRC-32 is checked as its bytes are first
read (``format.mapped_file``). JAX-free.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np
import tensorstore as ts

from jax_ucp._src import format as fmt
from jax_ucp._src import writer
from jax_ucp._src.errors import CheckpointError, SourceError
from jax_ucp._src.format import mapped_file
from jax_ucp._src.format.sizes import format_size
from jax_ucp._src.restoring.engine import TensorSource
from jax_ucp._src.restoring.model import Available, spec_views
from jax_ucp._src.restoring.sources.gathered import Gathered, gather_map
from jax_ucp._src.store import shard_reader

BLOCK_BYTES = 8 << 20  # bytes of whole rows read at once, then cut into the regions needing them
VIEW_CHUNK_BYTES = 4 << 20  # rows per chunk of a TensorStore view (a spec's transforms)
_SCALARS = (type(None), bool, int, float, str)  # what the writer records as a value
_VIEW_CONTEXT = ts.Context({"cache_pool": {"total_bytes_limit": 0}})


@dataclasses.dataclass
class _Tensor:
    """One imported tensor: its value as the importer gave it, read only when asked."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    value: Any  # np.ndarray (maybe a view of a mapped file), ts.TensorStore or writer.Deferred
    files: str
    item: Any  # the HostItem: key types, saved sharding, logical axes


class ImportSource(TensorSource):
    """The tensors of an import plan, read in place: rows read by the value's own means (``pread``
    of a mapped file, a TensorStore read, a ``Deferred``'s ``rows``) and cut into each region;
    a ``Deferred`` without rows built whole once per tensor read. Nothing to open or verify
    first (``TensorSource``'s defaults): the plan's values are open, and the source's own
    checks (a torch zip member's CRC-32) run as its bytes are read."""

    metadata = "source files"

    def __init__(self, path: str, where: str, items: Iterable):
        self.path, self.where = path, where
        self.tensors: dict[tuple[str, ...], _Tensor] = {}
        self.values: list[fmt.ValueEntry] = []
        self._builds = threading.Lock()  # an importer's Deferreds are built one at a time
        self._built: dict[tuple[str, ...], np.ndarray] = {}  # built to learn their shape
        self.gathers: dict[tuple[str, ...], tuple[Any, Any]] = {}  # key -> ``gather_map``'s
        seen: set[tuple[str, ...]] = set()
        for item in items:
            key = tuple(str(k) for k in item.key)
            name = fmt.key_to_str(key)
            if key in seen:
                raise SourceError(f"{where}: the import yields {name!r} twice.")
            seen.add(key)
            value = item.value  # a view of a mapped file is read with pread (``rows``)
            if isinstance(value, _SCALARS):
                key_types = tuple(item.key_types or ("key",) * len(key))
                self.values.append(
                    fmt.ValueEntry.of(key, key_types, value, role=item.role, sub_role=item.sub_role)
                )
                continue
            self.tensors[key] = self._tensor(key, name, value, item)

    def _tensor(self, key, name: str, value, item) -> _Tensor:
        p = item.provenance or {}
        files = ", ".join(map(str, p.get("files") or ())) or (
            ":".join(filter(None, (p.get("file"), p["tensors"][0])))  # a step: no file
            if len(p.get("tensors") or ()) == 1
            else self.path
        )
        if isinstance(value, writer.Deferred) and value.shape is None:
            with self._builds:  # its shape is known once built: kept until read
                built = mapped_file.read_out(value.build(name), f"tensor {name!r}")
            self._built[key] = built
            shape, dtype = tuple(built.shape), built.dtype
        elif isinstance(value, writer.Deferred):
            shape, dtype = tuple(value.shape or ()), np.dtype(value.dtype)
        elif isinstance(value, ts.TensorStore):
            shape, dtype = tuple(value.shape), value.dtype.numpy_dtype
        elif isinstance(value, (np.ndarray, np.generic)):
            value = value if isinstance(value, np.ndarray) else np.asarray(value)
            shape, dtype = tuple(value.shape), value.dtype
        else:
            raise TypeError(f"HostItem {name!r}: cannot read a {type(value).__name__}.")
        fmt.dtype_name(dtype)  # a dtype a checkpoint can hold, as the writer checks
        return _Tensor(name, shape, np.dtype(dtype), value, files, item)

    def close(self) -> None:
        """Drops the importer's values (its mappings and open files go with them)."""
        self.tensors.clear()
        self._built.clear()

    def available(self, spec=None) -> dict[tuple[str, ...], Available]:
        """What a restore may ask for: the imported tensors, or the views ``spec`` makes."""
        stored = {k: self._stored(k, t) for k, t in self.tensors.items()}
        if spec is None:
            return stored
        out = {}
        for view, plan in spec_views(spec, stored):
            if not view.stored and all(map(self.ranged, view.sources)):  # rank-2 rows: gathered?
                ts_ = [self.tensors[k] for k in view.sources]
                found = gather_map(plan, [t.shape for t in ts_], [t.dtype for t in ts_])
                if found is not None:
                    self.gathers[view.key] = found
            out[view.key] = view
        return out

    @staticmethod
    def _stored(key, t: _Tensor) -> Available:
        """A tensor read as it is: region by region."""
        item = t.item
        return Available(
            key=key,
            key_types=tuple(item.key_types or ("key",) * len(key)),
            shape=t.shape,
            dtype=t.dtype,
            sources=(key,),
            build=lambda opened: opened[key],
            saved_sharding=item.saved_sharding,
            logical_axes=item.logical_axes,
            stored=True,
        )

    # --- TensorSource
    def files(self, found: Available) -> str:
        parts = [self.tensors[k].files for k in found.sources[:3]]
        more = len(found.sources) - 3
        return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")

    def holder(self, found: Available) -> str:
        return f"{self.where} ({self.files(found)})"

    def reader(self, found: Available):
        if found.key in self.gathers:
            (which, rows), read = self.gathers[found.key], [self.rows(k) for k in found.sources]
            return Gathered(read, which, rows, found.shape, found.dtype)
        if found.stored and found.shape:
            return _Reader(self, found.sources[0])
        return found.build({k: self.view(k) for k in found.sources})

    def check_fits(self, found: Available, limit: int, what: str) -> None:
        for key in found.sources:  # a Deferred without rows is built whole
            t = self.tensors[key]
            whole = isinstance(t.value, writer.Deferred) and t.value.rows is None
            if whole and t.value.nbytes > limit:
                raise CheckpointError(
                    f"Tensor {found.name!r} ({t.files}): the import builds {t.name!r} whole, "
                    f"{format_size(t.value.nbytes)}, more than {what} ({format_size(limit)}). "
                    f"Restore it on a host with more memory, or select= other tensors."
                )

    # --- reading
    def ranged(self, key) -> bool:
        """Whether tensor ``key``'s rows are independent reads, any rows from any thread: a
        view of a mapped file (``pread``), a ``Deferred`` whose rows are ranged reads."""
        v = self.tensors[key].value
        ranged = isinstance(v, writer.Deferred) and v.ranged and v.rows is not None
        return isinstance(v, np.ndarray) or ranged

    def rows(self, key) -> tuple[Any, int]:
        """``(read(a, b, out=None) -> rows a:b, rows per block)`` of tensor ``key``: ``read``
        fills ``out`` when given (a view of a mapped file ``pread`` straight into it), else gives
        an array (for a mapped view a scratch buffer, valid until the thread's next read). A
        value that cannot give rows alone gives all of them as one block, built once."""
        t = self.tensors[key]
        v, what = t.value, f"tensor {t.name!r}"
        inner = math.prod(t.shape[1:]) * t.dtype.itemsize
        block = max(1, BLOCK_BYTES // max(1, inner))
        if isinstance(v, np.ndarray):
            mapped = mapped_file.mapped_at(v) is not None

            def mapped_rows(a, b, out=None):
                if out is None:
                    out = shard_reader.scratch((b - a) * inner).view(t.dtype)
                    out = out.reshape((b - a, *t.shape[1:]))
                mapped_file.copy_into(out, v[a:b], what)
                if mapped:
                    shard_reader.count_bytes_read(out.nbytes)
                return out

            return mapped_rows, block
        if isinstance(v, ts.TensorStore):
            return (lambda a, b, out=None: _into(v[a:b].read().result(), out)), block
        if v.rows is not None:
            if v.ranged:
                return (lambda a, b, out=None: _into(v.rows(a, b), out)), block

            def built_rows(a, b, out=None):
                with self._builds:
                    return _into(mapped_file.read_out(v.rows(a, b), what), out)

            # slabs as convert's writer streams them: a slab starting inside a torch DCP chunk
            # reads (and CRC-checks) that whole chunk, so few and large, within the budget
            slab = max(BLOCK_BYTES, writer.memory_budget() // 2)
            return built_rows, max(1, slab // max(1, inner))
        whole = self._whole(key)
        return (lambda a, b, out=None: _into(whole[a:b], out)), max(1, t.shape[0])

    def _whole(self, key) -> np.ndarray:
        """A ``Deferred`` without rows built whole (once, if built when opened)."""
        built = self._built.pop(key, None)
        if built is not None:
            return built
        t = self.tensors[key]
        with self._builds:
            return mapped_file.read_out(t.value.build(t.name), f"tensor {t.name!r}")

    def view(self, key) -> ts.TensorStore:
        """A lazy TensorStore view of tensor ``key`` (the source of a spec's views)."""
        t = self.tensors[key]
        if isinstance(t.value, ts.TensorStore):
            return t.value
        if not t.shape or (isinstance(t.value, writer.Deferred) and t.value.rows is None):
            out = np.empty(t.shape, t.dtype)
            _Reader(self, key).read_into([(tuple((0, n) for n in t.shape), out)]).result()
            return ts.array(out)
        read, per_block = self.rows(key)
        inner = math.prod(t.shape[1:]) * t.dtype.itemsize
        chunk = max(1, min(t.shape[0], VIEW_CHUNK_BYTES // max(1, inner)))
        if isinstance(t.value, writer.Deferred):  # its slabs: a torch DCP chunk read once each
            chunk = min(t.shape[0], per_block)

        def fill(domain, array, params):
            del params
            box = [(d.inclusive_min, d.exclusive_max) for d in domain]
            if array.flags.c_contiguous and all(c == (0, n) for c, n in zip(box[1:], t.shape[1:])):
                read(*box[0], array)  # whole rows: straight into TensorStore's chunk
                return
            rows = read(*box[0])
            array[...] = rows[(slice(None), *(slice(a, b) for a, b in box[1:]))]

        return ts.virtual_chunked(
            fill,
            dtype=ts.dtype(t.dtype.name),
            domain=ts.IndexDomain(shape=list(t.shape)),
            chunk_layout=ts.ChunkLayout(read_chunk_shape=[chunk, *t.shape[1:]]),
            context=_VIEW_CONTEXT,
        )


class _Reader:
    """One imported tensor read region by region (a ``sharding.RegionReader``): the rows the
    regions cover, read in blocks once each and cut into every region needing them."""

    def __init__(self, source: ImportSource, key):
        t = source.tensors[key]
        self._source, self._key = source, key
        self.shape, self.dtype = t.shape, t.dtype

    def read_into(self, dests) -> shard_reader.PendingReads:
        dests = [
            (region, out)
            for region, out in dests
            if 0 not in shard_reader.check_destination(region, out, self.shape, self.dtype)
        ]
        if not dests:
            return shard_reader.PendingReads([])
        if not self.shape:
            pool = shard_reader.read_pool()
            return shard_reader.PendingReads([pool.submit(self._scalar, dests)])
        value = self._source.tensors[self._key].value
        if isinstance(value, writer.Deferred) and value.regions is not None:
            pool = shard_reader.read_pool()  # the regions read in place, chunk by chunk
            return shard_reader.PendingReads([pool.submit(j) for j in value.regions(dests)])
        read, per_block = self._source.rows(self._key)
        tasks = []
        if self._source.ranged(
            self._key
        ):  # whole rows read straight into their region; the others range by range
            whole = [all(c == (0, n) for c, n in zip(r[1:], self.shape[1:])) for r, _ in dests]
            for (region, out), _ in filter(lambda d: d[1], zip(dests, whole)):
                for r in range(0, len(out), per_block):
                    part = out[r : r + per_block]
                    tasks.append((read, region[0][0] + r, region[0][0] + r + len(part), part))
            dests = [d for d, w in zip(dests, whole) if not w]
            ranges = {region[0] for region, _ in dests}  # no range merged into a neighbour's
            blocks = sorted(
                {(r, min(r + per_block, b)) for a, b in ranges for r in range(a, b, per_block)}
            )
        else:
            blocks = shard_reader.row_blocks(dests, per_block)
        tasks += [(_read_block, read, a, b, dests) for a, b in blocks]
        pool = shard_reader.read_pool()
        return shard_reader.PendingReads([pool.submit(*task) for task in tasks])

    def _scalar(self, dests) -> None:
        t = self._source.tensors[self._key]
        v = t.value
        if isinstance(v, writer.Deferred):
            value = self._source._whole(self._key) if v.rows is None else v.rows(0, 1)
        elif isinstance(v, ts.TensorStore):
            value = v.read().result()
        else:
            value = mapped_file.read_out(v, f"tensor {t.name!r}")
        for _, out in dests:
            out[...] = value


def _read_block(read, a: int, b: int, dests) -> None:
    """Rows ``[a, b)`` read once, cut into every region that needs some of them."""
    block = read(a, b)
    for region, out in dests:
        lo, hi = max(a, region[0][0]), min(b, region[0][1])
        if lo >= hi:
            continue
        src = (slice(lo - a, hi - a), *(slice(s, e) for s, e in region[1:]))
        out[lo - region[0][0] : hi - region[0][0]] = block[src]


def _into(rows, out):
    """``rows`` (an array-like), copied into ``out`` when given."""
    if out is None:
        return np.asarray(rows)
    out[...] = rows
    return out
