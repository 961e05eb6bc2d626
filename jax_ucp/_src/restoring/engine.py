"""The read engine of every restore, whatever the source: ``read_from`` checks each request
before any data is read, opens every tensor at once, reads within a memory budget and finishes
each tensor (casts checked, host memory counted). A source (``TensorSource``) only says where a
tensor's bytes are and what to check first. JAX-free (results on a sharding are assembled by
``sharding.PendingArray``, which loads JAX when a request carries one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import ml_dtypes
import numpy as np
import tensorstore as ts

from jax_ucp._src import format as fmt
from jax_ucp._src import sharding as sharding_lib
from jax_ucp._src import store
from jax_ucp._src.errors import CheckpointError, tensorstore_failure, tensorstore_message
from jax_ucp._src.format.sizes import DEFAULT_MEMORY_BUDGET, format_size
from jax_ucp._src.options import user_stacklevel
from jax_ucp._src.restoring import replicated
from jax_ucp._src.restoring.model import (
    Available,
    Request,
    check_tensor_request,
    not_found,
    value_as_array,
)


class TensorSource(Protocol):
    """What the read engine (``read_from``) reads tensors from: a UCP checkpoint's arrays
    (``ucp_source.CheckpointSource``), an import's items read in place
    (``import_source.ImportSource``); the idea of torch DCP's ``StorageReader``. The engine plans,
    budgets, checks memory, reads and finishes; a source only says where a tensor's bytes are
    and what to check first."""

    path: str  # the checkpoint (a directory, URL or file)
    where: str  # names it in errors: "the checkpoint <dir>"
    metadata: str  # what declares a tensor's shape there, for errors ("ucp.json")

    def files(self, found: Available) -> str: ...  # the files ``found`` is read from, for errors

    def reader(self, found: Available) -> sharding_lib.RegionReader | ts.TensorStore: ...

    def holder(self, found: Available) -> str:
        """What holds ``found``, in errors about a request that does not fit it."""
        return self.where

    def prepare(self, tensors: Sequence[Available]) -> None:
        """Called once with every tensor to read, before any read (opens them together)."""

    def check_fits(self, found: Available, limit: int, what: str) -> None:
        """Refuses, before allocating, a tensor whose reader alone needs more than ``limit``
        bytes of host memory (``what`` limits them)."""

    def verify(self, found: Available, reader: Any) -> None:
        """Checks ``found``'s files before its reads start."""

    def unit_rows(self, found: Available) -> int:
        """Rows of ``found`` read together (split no finer across processes)."""
        return 1


@dataclasses.dataclass(frozen=True)
class OpenedSource:
    """A source opened for one restore: what it holds (``available``: key → ``Available``,
    a spec's views included), its saved Python values and, for a UCP checkpoint, its saved
    containers (``tree``: ``manifest.tree``; None to nest by key)."""

    source: TensorSource
    available: Mapping
    values: Sequence[fmt.ValueEntry] = ()
    tree: Any = None


def read_from(
    source: TensorSource,
    requests: Sequence[Request],
    available: Mapping,
    values: Mapping | None = None,
    *,
    casting: str = "same_kind",
    memory_budget: int | None = None,
    replicated_read: str | None = None,
) -> list:
    """The one read loop of every restore, whatever the source: each request checked before
    any data is read, every tensor opened at once, then each read with at most
    ``memory_budget`` of host buffers in flight (a tensor's reads start once the budget has
    room, one tensor at least; the oldest is turned into its result, its host buffers freed,
    to make room) and the bytes results keep in host memory checked against the host's.

    Args:
      source: where the tensors are read from.
      requests: what to read, one result per request, in order.
      available: key → ``Available``, what may be read.
      values: key → ``fmt.ValueEntry``, the saved Python values.
      casting: numpy's casting rule for the requests' dtypes.
      memory_budget: host bytes of read buffers in flight (None: 256 MiB).
      replicated_read: "each" (None) or "once" (``restoring.replicated``).
    """
    plan = [_plan_item(source, req, available, values or {}, casting) for req in requests]
    with store.host_memory.trimming():  # freed read buffers returned to the system
        return _read_all(source, plan, casting, memory_budget, replicated_read)


def _read_all(source: TensorSource, plan: list, casting, memory_budget, replicated_read) -> list:
    """``read_from``'s reads, once every request is checked (``plan``)."""
    tensors = [(i, item[1], item[2]) for i, item in enumerate(plan) if item[0] == "tensor"]
    source.prepare([found for _, _, found in tensors])
    reads = _Reads(source, casting, memory_budget, len(plan))
    # Tensors every process of a multi-process job needs whole: each reads a share, all-gather.
    once = replicated.select(tensors) if replicated_read == "once" else []
    if once:
        shared = replicated.read_once(
            once,
            reads.source_of,
            budget=reads.window.max_bytes,
            check=reads.check,
            unit_rows=source.unit_rows,
        )
        for done in shared:
            reads.finish(done)
    read_once = {position for position, _, _ in once}
    try:
        for position, item in enumerate(plan):
            if position in read_once:
                continue
            if item[0] == "value":
                reads.out[position] = item[1]
            else:
                reads.start(position, item[1], item[2])
        for done in reads.window.drain():
            reads.finish(done)
    except BaseException:  # the reads still in flight end before the error leaves this call
        for *_, pending in reads.window.drain():
            with contextlib.suppress(Exception):
                pending.result()
        raise
    return reads.out


class _Reads:
    """The reads of one ``read_from`` call: the window of buffers in flight, the results, the
    bytes they keep in host memory."""

    def __init__(self, source: TensorSource, casting: str, memory_budget, n: int):
        self.source, self.casting = source, casting
        self.out: list = [None] * n
        self.window = store.InFlightBytes(
            DEFAULT_MEMORY_BUDGET if memory_budget is None else int(memory_budget)
        )
        self.kept = 0  # bytes of the results so far that stay in host memory (numpy, CPU)
        self.limit = store.host_memory.host_memory_limit()

    def source_of(self, found: Available):
        """``found``'s checked reader (also ``replicated.read_once``'s): its files verified, its
        chunks known to fit this host (``TensorSource.check_fits``)."""
        reader = self.source.reader(found)
        self.source.verify(found, reader)
        if self.limit is not None:
            self.source.check_fits(found, *self.limit)
        return reader

    def check(self, found: Available, pending) -> None:
        """Refuses, before allocating, a tensor whose buffers cannot fit this host (a manifest
        may declare 2**40 elements), or whose result would take the host-resident results
        past it; counts the bytes its result keeps in host memory."""
        keeps = pending.result_bytes if pending.on_host else 0
        if self.limit is not None:
            bytes_, what = self.limit
            if pending.host_bytes > bytes_:
                raise self._memory_error(found, pending, f"exceeds {what} ({format_size(bytes_)})")
            if self.kept + keeps > bytes_:
                raise self._memory_error(
                    found,
                    pending,
                    f"would take the {format_size(self.kept)} this restore already holds in host "
                    f"memory past {what} ({format_size(bytes_)})",
                )
        self.kept += keeps

    def _memory_error(self, found: Available, pending, why: str) -> CheckpointError:
        return CheckpointError(
            f"Tensor {found.name!r} ({self.source.files(found)}): restoring it needs "
            f"{format_size(pending.host_bytes)} of host memory (shape {found.shape}, {pending.dtype}, "
            f"the slices this process reads), which {why}. Restore it sharded over more "
            f"processes, select= other tensors, or check the checkpoint's "
            f"{self.source.metadata} (it declares this shape)."
        )

    def start(self, position: int, req: Request, found: Available) -> None:
        """Starts one tensor's reads once the budget has room for them."""
        reader = self.source_of(found)
        dtype = np.dtype(req.dtype) if req.dtype is not None else found.dtype
        shape = found.shape
        if req.rows is not None:  # a slab: its rows' bytes alone are read and held
            lo, hi = req.rows
            shape = (hi - lo, *shape[1:])
            if isinstance(reader, ts.TensorStore):
                reader = reader[lo:hi].translate_to[0]
            else:  # a region reader: a UCP shard reader, an imported tensor's
                reader = _Rows(reader, lo, hi)
        pending = sharding_lib.PendingArray(reader, shape, dtype, req.sharding)
        self.check(found, pending)
        for done in self.window.make_room(pending.read_bytes):
            self.finish(done)
        try:
            pending.start()
        except MemoryError:
            raise self._memory_error(found, pending, "could not be allocated") from None
        self.window.add((position, req, found, pending), pending.read_bytes)

    def finish(self, done) -> None:
        """Waits for one tensor's reads, stores its result (its read buffers are then freed)."""
        position, req, found, pending = done
        try:
            result = pending.result()
        except fmt.UCPError as e:  # names the file already
            raise tensor_error(found.name, e) from e
        except Exception as e:
            raise CheckpointError(
                f"Tensor {found.name!r}: reading {self.source.files(found)} failed "
                f"({_READ_FAILURES[tensorstore_failure(e)]}): {tensorstore_message(e)}"
            ) from e
        if isinstance(pending, sharding_lib.PendingArray):
            pending.release()
        if pending.overflowed:
            self._overflow(found, pending)
        if req.python_type is not None and getattr(result, "shape", None) == ():
            result = req.python_type(np.asarray(result).item())
        self.out[position] = result

    def _overflow(self, found: Available, pending) -> None:
        """A narrowing float cast that overflowed: an error under ``same_kind`` (values would
        change, as float → int does), a warning naming the tensor under ``unsafe``."""
        target = pending.dtype
        largest = np.finfo(target).max if target.kind == "c" else ml_dtypes.finfo(target).max
        message = (
            f"Tensor {found.name!r} ({self.source.files(found)}): {pending.overflowed} of its "
            f"values (of {math.prod(found.shape)}) overflow {target} (largest finite {largest}) "
            f"converting from {found.dtype}: they became inf or NaN."
        )
        if self.casting != "unsafe":
            raise CheckpointError(
                f"{message} A {self.casting!r} cast keeps every value's magnitude; pass "
                f"casting='unsafe' to convert anyway, or restore as {found.dtype}."
            )
        warnings.warn(message, RuntimeWarning, stacklevel=user_stacklevel())


class _Rows:
    """A region reader seen from row ``lo`` on: regions of a slab read as the tensor's."""

    def __init__(self, source: sharding_lib.RegionReader, lo: int, hi: int):
        self._source, self._lo, self.dtype = source, lo, source.dtype
        self.shape = (hi - lo, *source.shape[1:])  # a ``sharding.RegionReader``

    def read_into(self, dests):
        lo = self._lo
        return self._source.read_into(
            [(((a + lo, b + lo), *rest), out) for ((a, b), *rest), out in dests]
        )


def tensor_error(name: str, e: BaseException) -> CheckpointError:
    """``e`` as a ``CheckpointError`` naming tensor ``name`` once (a store error, e.g. a shard
    digest's, may name it already)."""
    prefix, message = f"Tensor {name!r}: ", str(e)
    return CheckpointError(message if message.startswith(prefix) else prefix + message)


_READ_FAILURES = {  # ``errors.tensorstore_failure`` → what a failed read tells the user
    "corrupt": "crc32c checksum mismatch: the data is corrupt",
    "missing": "missing data: the checkpoint is incomplete",
    "denied": "permission denied: the file is there but this user may not read it",
    "other": "corrupt or truncated data?",
}


def _plan_item(source: TensorSource, req: Request, available: Mapping, values: Mapping, casting):
    """``("value", the saved value)`` or ``("tensor", req, the Available)`` for one request,
    after every check that needs no data (the name exists, ``check_tensor_request``)."""
    key = tuple(map(str, req.key))  # int vs str components (lists vs dicts of indices)
    found = available.get(key, values.get(key))
    name = fmt.key_to_str(req.key)
    if found is None:
        raise not_found(name, source.where, available)
    if isinstance(found, fmt.ValueEntry):
        value = found.value
        if req.wants_array:
            value = value_as_array(name, source.where, value, req, casting)
        return ("value", value)
    check_tensor_request(name, req, found, lambda: source.holder(found), casting)
    return ("tensor", req, found)
