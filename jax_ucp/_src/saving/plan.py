"""From a JAX pytree to what goes on disk: manifest entries and the shard writes of this process.

Split from the I/O so the blocking part of an async save is only this: deciding the layout and
copying this process's replica-0 shards to host memory.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any, cast

import jax
import numpy as np
import tensorstore as ts

from jax_ucp._src import format as fmt
from jax_ucp._src import sharding as sharding_lib
from jax_ucp._src import tree as tree_lib
from jax_ucp._src.errors import RequestError
from jax_ucp._src.saving import budget as budget_lib
from jax_ucp._src.sharding import restored_axes
from jax_ucp._src.writer import (
    ArrayOptions,
    PreparedTensor,
    array_layout,
    prepare_host_tensor,
    tensor_entry,
    value_entry,
    write_tensor,
)

_VALUE_TYPES = (type(None), bool, int, float, str)


def shards_to_write(array: jax.Array, primary: bool = True) -> list:
    """(index, shard data) for the addressable shards this process must write: replica 0 only.
    A process-local array (e.g. a step counter made on each host's first device) exists once
    per process: only the primary writes it, or two processes would write one shard file."""
    if not primary and jax.process_count() > 1 and array.is_fully_addressable:
        return []
    return [(s.index, s.data) for s in array.addressable_shards if s.replica_id == 0]


def _copy_into(dsts, srcs, flag):
    # A select, not an identity: XLA runs zero-flop programs inline in the caller (the copy
    # would then be in the stall) and may drop an identity's aliasing; ``flag`` is True at run
    # time, so every output is the source, bit for bit, written into the donated buffer.
    return [jax.numpy.where(flag, s, d) for d, s in zip(dsts, srcs)]


_COPY_INTO = jax.jit(_copy_into, donate_argnums=0)


def _signature(arrays) -> tuple:
    return tuple((tuple(a.shape), str(a.dtype)) for a in arrays)


class HostCopyPool:
    """Private host copies of CPU shards, kept between async saves and written over by the next.

    A fresh copy lands in freshly mapped memory: the kernel faults in and zeroes every page,
    which cost more than the copy itself (2 GiB: 3.84 s async vs 1.42 s blocking). The next save
    of the same shapes donates these buffers to a jitted copy instead, so the runtime still
    orders the copy before a later donation of the saved arrays, now into memory already
    mapped. Buffers come back only after a save wrote them (``release``); the pool keeps at most
    the last save's copies (one copy of the process's replica-0 shards) until ``close``.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._free: dict[Any, list[jax.Array]] = {}  # device -> copies, in the order saved
        self._compiled: dict[tuple, Any] = {}  # (device, signature) -> compiled _copy_into
        self._flags: dict[Any, jax.Array] = {}
        self._compiling: threading.Thread | None = None
        self.reused_bytes = 0  # of the last save: copied into pooled buffers
        self.fresh_bytes = 0  # of the last save: copied into new buffers

    def copies(self, shards: list[jax.Array]) -> list[jax.Array]:
        """Enqueues a private copy of every shard (single-device CPU arrays), returns at once."""
        with self._lock:
            free, self._free = self._free, {}
        out: list[jax.Array | None] = [None] * len(shards)
        by_device: dict[Any, list[int]] = {}
        for i, s in enumerate(shards):
            by_device.setdefault(next(iter(s.devices())), []).append(i)
        fresh: list[int] = []
        self.reused_bytes = self.fresh_bytes = 0
        for device, positions in by_device.items():
            pooled = free.pop(device, [])
            sig = _signature(shards[i] for i in positions)
            compiled = self._compiled.get((device, sig))
            # Same shapes in the same order (the same tree saved again) and compiled already
            # (in the background after the last save): one dispatch for the device's shards.
            if compiled is not None and _signature(pooled) == sig:
                flag = self._flags.get(device)
                if flag is None:
                    flag = self._flags[device] = jax.device_put(np.True_, device)
                for i, c in zip(positions, compiled(pooled, [shards[i] for i in positions], flag)):
                    out[i] = c
                self.reused_bytes += sum(shards[i].nbytes for i in positions)
            else:
                fresh.extend(positions)
        if fresh:
            new = jax.device_put(
                [shards[i] for i in fresh], [shards[i].sharding for i in fresh], may_alias=False
            )
            for i, c in zip(fresh, new):
                out[i] = c
            self.fresh_bytes = sum(shards[i].nbytes for i in fresh)
        return cast(list[jax.Array], out)  # every position filled above

    def release(self, copies: list[jax.Array]) -> None:
        """After the save that made ``copies`` wrote them: they become the pool (the previous
        pool, if any is left, is dropped); the copy for their shapes compiles in the background."""
        by_device: dict[Any, list[jax.Array]] = {}
        for c in copies:
            if c.is_deleted():
                continue
            # jax/dtypes.py re-exports issubdtype without "as", which hides it from pyright
            if not jax.dtypes.issubdtype(c.dtype, jax.dtypes.extended):  # pyright: ignore[reportPrivateImportUsage]
                by_device.setdefault(next(iter(c.devices())), []).append(c)
        with self._lock:
            self._free = by_device
            todo = [
                (d, _signature(cs))
                for d, cs in by_device.items()
                if (d, _signature(cs)) not in self._compiled
            ]
        if todo:  # shapes only: the thread holds no buffer
            self._compiling = threading.Thread(
                target=self._compile, args=(todo,), name="ucp-copy-compile"
            )
            self._compiling.start()

    def ready(self, timeout: float | None = None) -> bool:
        """Waits for the background compile of the pooled copy; True once the next save of the
        same shapes will reuse the pool."""
        if self._compiling is not None:
            self._compiling.join(timeout)
        with self._lock:
            return bool(self._free) and all(
                (d, _signature(cs)) in self._compiled for d, cs in self._free.items()
            )

    def _compile(self, todo) -> None:
        for device, signature in todo:
            sharding = jax.sharding.SingleDeviceSharding(device)
            abstract = [
                jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in signature
            ]
            flag = jax.ShapeDtypeStruct((), np.bool_, sharding=sharding)
            try:
                compiled = _COPY_INTO.lower(abstract, abstract, flag).compile()
            except Exception:  # a dtype XLA cannot select on: those saves copy afresh
                continue
            with self._lock:
                while len(self._compiled) >= 64:  # trees that change shape: keep the newest
                    self._compiled.pop(next(iter(self._compiled)))
                self._compiled[(device, signature)] = compiled

    def close(self) -> None:
        """Drops the pooled copies (the memory goes back once nothing else holds them)."""
        with self._lock:
            self._free = {}
        self._compiled.clear()
        self._flags.clear()


class _Snapshots:
    """Private copies of CPU shards for an async save, made by the runtime, not in the stall.

    On CPU ``np.asarray`` aliases the device buffer, which a donated or deleted array would
    change under an async save, so the save needs its own copy. Every copy is enqueued at once
    (a batched ``jax.device_put(..., may_alias=False)``, or a pooled buffer donated to a jitted
    copy, see ``HostCopyPool``) and returns at once; the runtime orders a later donation's
    in-place write after it. The writer threads wait for each copy (``np.asarray``) when they
    write that shard. On accelerators the device→host transfer is already the copy.
    """

    def __init__(self, pool: HostCopyPool | None = None):
        self._shards: list[jax.Array] = []
        self._copies: list[jax.Array] | None = None
        self._pool = pool

    def add(self, data: jax.Array):
        """A zero-argument producer of ``data``'s private host copy (valid after ``start``)."""
        position = len(self._shards)
        self._shards.append(data)

        def host_copy():
            assert self._copies is not None, "start() has not run"
            return np.asarray(self._copies[position])

        return host_copy

    def start(self) -> list[jax.Array]:
        if self._shards:
            if self._pool is not None:
                self._copies = self._pool.copies(self._shards)
            else:
                self._copies = jax.device_put(
                    self._shards, [s.sharding for s in self._shards], may_alias=False
                )
        self._shards = []
        return list(self._copies or [])


def prepare_tree(
    tree,
    options: ArrayOptions,
    *,
    primary: bool,
    copy: bool,
    logical_axes: Any = None,
    pool: HostCopyPool | None = None,
    copies_out: list | None = None,
    budget: int | None = None,
) -> tuple[list[fmt.Entry], list[PreparedTensor]]:
    """Manifest entries for every leaf and this process's writes (device→host copies done here).

    Args:
      tree: the pytree to save.
      options: the layout options (compression, inner chunks, checksum).
      primary: this process writes what exists once (process-local arrays, host data).
      copy: an async save: CPU shards and host arrays get private copies (the caller goes on).
      logical_axes: a pytree of logical axis-name tuples (same structure), or None.
      pool: where an async save's private copies come from (None: new memory).
      copies_out: receives those copies, for ``pool.release`` once they are written.
      budget: host bytes of shard copies at once (``budget.BudgetedShards``; None: unbounded,
        every copy made here). Write with ``write_all(budget=)``; ``pool`` is then unused.
    """
    fmt.check_tree_depth(tree)  # what save writes, restore reads
    leaves, _ = tree_lib.flatten(tree)
    _refuse_deleted(leaves)  # before anything is written or copied
    leaves, key_impls = _keys_as_data(leaves)
    variable_roles = tree_lib.variable_roles(tree)
    bounded = None if budget is None else budget_lib.BudgetedShards(budget, copy=copy)
    for _, _, leaf in leaves:  # start every device→host transfer before waiting on any
        if isinstance(leaf, jax.Array) and (primary or not leaf.is_fully_addressable):
            for _, data in shards_to_write(leaf):
                if bounded is None or bounded.prefetch(data):
                    data.copy_to_host_async()
    axis_names = _AxisNames(tree, leaves, logical_axes)
    entries: list[fmt.Entry] = []
    prepared: list[PreparedTensor] = []
    snapshots = _Snapshots(pool)
    for key, key_types, leaf in leaves:
        if not key:
            raise RequestError("Cannot save a bare leaf: wrap it in a dict, e.g. {'x': value}.")
        leaf, boxed_names = tree_lib.unbox(leaf)
        role, sub_role = fmt.role_of(key)
        kind = variable_roles.get(key)  # an NNX Param / OptState wherever it sits in the tree
        if kind is not None and kind != role:
            role, sub_role = (
                kind,
                fmt.role_of(("opt_state", *key))[1] if kind == "opt_state" else None,
            )
        if isinstance(leaf, _VALUE_TYPES) and not isinstance(leaf, np.generic):
            entries.append(value_entry(key, key_types, leaf, role=role, sub_role=sub_role))
            continue
        names = axis_names.of(key, boxed_names, getattr(leaf, "shape", ()), leaf)
        tagged = dict(role=role, sub_role=sub_role, logical_axes=names, key_impl=key_impls.get(key))
        if isinstance(leaf, jax.Array):
            if bounded is not None:  # copied or referenced by ``bounded``
                name = fmt.key_to_str(key)
                writes = [(i, bounded.add(name, i, d)) for i, d in shards_to_write(leaf, primary)]
            else:
                writes = _device_writes(leaf, primary=primary, copy=copy, snapshots=snapshots)
            p = _prepare_device_array(key, key_types, leaf, options, writes, copy, tagged)
        elif isinstance(leaf, (np.ndarray, np.generic, ts.TensorStore)):
            if copy and primary and not isinstance(leaf, ts.TensorStore):
                leaf = np.array(leaf, copy=True)
            p = prepare_host_tensor(
                key, key_types, leaf, options, primary=primary, stable_source=copy, **tagged
            )
        else:
            raise RequestError(
                f"Leaf {fmt.key_to_str(key)!r}: cannot save a {type(leaf).__module__}."
                f"{type(leaf).__qualname__} (expected jax.Array, numpy array, "
                f"tensorstore.TensorStore, or None/bool/int/float/str)."
            )
        entries.append(p.entry)
        prepared.append(p)
    copies = snapshots.start()
    if bounded is not None:
        bounded.start()
    if copies_out is not None:
        copies_out.extend(copies)
    return entries, prepared


def _keys_as_data(leaves) -> tuple[list, dict[tuple[str, ...], str]]:
    """``leaves`` with each typed PRNG key array (``jax.random.key``, an NNX ``Rngs`` stream)
    replaced by its key data (uint32, one key's data last), and {key: its implementation's
    name}, recorded as the entry's ``key_impl`` so a restore wraps the data back into keys."""
    out, impls = [], {}
    for key, key_types, leaf in leaves:
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):  # pyright: ignore[reportPrivateImportUsage]
            impl = str(jax.random.key_impl(leaf))
            if impl not in fmt.KEY_IMPLS:
                raise RequestError(
                    f"Leaf {fmt.key_to_str(key)!r}: a PRNG key of implementation {impl!r}; a "
                    f"checkpoint records keys of {sorted(fmt.KEY_IMPLS)} (save "
                    f"jax.random.key_data(key) to keep its data as uint32)."
                )
            impls[key] = impl
            leaf = jax.random.key_data(leaf)
        out.append((key, key_types, leaf))
    return out, impls


def _refuse_deleted(leaves) -> None:
    """A deleted or donated jax.Array holds no data: refused before anything is written."""
    for key, _, leaf in leaves:
        value, _ = tree_lib.unbox(leaf)
        if isinstance(value, jax.Array) and value.is_deleted():
            raise RequestError(
                f"Leaf {fmt.key_to_str(key)!r}: the jax.Array (shape {tuple(value.shape)}, "
                f"{value.dtype}) has been deleted or donated (e.g. to a jit with "
                f"donate_argnums) and holds no data; save the array the step returned."
            )


class _AxisNames:
    """The logical axis names recorded for each leaf: ``logical_axes=``, nnx.Variable metadata
    or flax boxes.

    Optimizer state that mirrors the params tree (opt_state/0/mu/<param path>, EMA, trace...)
    inherits the logical axes of the parameter whose path it ends with and whose shape it has,
    however it was built (boxed params with unboxed moments is the usual flax pattern), so
    rules shard moments like their parameters.
    """

    def __init__(self, tree, leaves, logical_axes):
        self._by_key: dict[tuple[str, ...], tuple | None] = dict(tree_lib.variable_axes(tree))
        if logical_axes is not None:
            self._by_key.update(tree_lib.flatten_axes(logical_axes))
        self._by_param_path: dict[tuple, tuple[tuple, tuple]] = {}
        for key, _, leaf in leaves:
            if len(key) > 1 and key[0] == "params":
                value, boxed = tree_lib.unbox(leaf)
                names = self._by_key.get(key, boxed)
                if names is None:
                    names = restored_axes.names_of(key, value)
                if names is not None:
                    shape = tuple(getattr(value, "shape", ()))
                    self._by_param_path[key[1:]] = (tuple(names), shape)

    def of(self, key, boxed_names, shape, leaf=None):
        """The names of leaf ``key`` (of ``shape``; ``boxed_names`` from its flax box; ``leaf``
        the array, for the names a restore placed it by: ``sharding.restored_axes``)."""
        names = self._by_key.get(key, boxed_names)
        if names is None and leaf is not None:  # the names a restore placed it by
            names = restored_axes.names_of(key, leaf)
        if names is not None or not self._by_param_path or key[0] == "params":
            return names
        for i in range(1, len(key)):
            found = self._by_param_path.get(key[i:])
            if found is not None and found[1] == tuple(shape):
                return found[0]
        return None


def _device_writes(leaf: jax.Array, *, primary: bool, copy: bool, snapshots: _Snapshots):
    """This process's (index, host data) writes of ``leaf``: its replica-0 shards, a private
    copy's producer for an async save of CPU shards."""
    return [
        (index, snapshots.add(data) if (copy and budget_lib.on_cpu(data)) else np.asarray(data))
        for index, data in shards_to_write(leaf, primary)
    ]


def _prepare_device_array(key, key_types, leaf: jax.Array, options, writes, copy, tagged):
    """A jax.Array's entry (layout from its sharding's shard shape) and writes."""
    shape = tuple(leaf.shape)
    layout = array_layout(
        shape,
        fmt.dtype_name(leaf.dtype),
        leaf.sharding.shard_shape(shape),
        np.dtype(leaf.dtype).itemsize,
        options,
    )
    entry = tensor_entry(
        key, key_types, layout, saved_sharding=sharding_lib.describe(leaf.sharding), **tagged
    )
    return PreparedTensor(entry, layout, writes, stable_source=copy)  # async: private copies


async def write_all(
    root,
    prepared: Sequence[PreparedTensor],
    *,
    primary: bool,
    max_in_flight: int = 64,
    sync: bool = True,
    budget: int | None = None,
) -> dict[str, dict[str, str]]:
    """All of this process's shards of a jax save, many tensors at once.

    Returns {tensor dir: {shard key: digest}} for the shards this process wrote. Waits for
    every write even after one fails, so cleanup never races a write in flight.

    Args:
        root: the checkpoint directory.
        prepared: the tensors, laid out.
        primary: this process creates the arrays.
        max_in_flight: tensors written at once.
        sync: fsync each file (False: the caller makes the directory durable).
        budget: prepared with ``prepare_tree(budget=)``: at most these bytes of shards in
          flight, written in order (``budget.write_within_budget``).
    """
    if budget is not None:
        return await budget_lib.write_within_budget(
            root, prepared, primary=primary, budget=budget, sync=sync, max_in_flight=max_in_flight
        )
    sem = asyncio.Semaphore(max_in_flight)

    async def one(p):
        async with sem:
            return await write_tensor(root, p, primary=primary, sync=sync)

    results = await asyncio.gather(*(one(p) for p in prepared), return_exceptions=True)
    digests = {}
    for p, r in zip(prepared, results):
        if isinstance(r, BaseException):
            raise r
        if r is not None:
            digests[p.entry.dir] = r
    return digests
