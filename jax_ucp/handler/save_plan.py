"""From a JAX pytree to what goes on disk: manifest entries and the shard writes of this process.

Split from the I/O so the blocking part of an async save is only this: deciding the layout and
copying this process's replica-0 shards to host memory.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from jax_ucp import format as fmt
from jax_ucp import sharding as sharding_lib
from jax_ucp.handler import tree as tree_lib
from jax_ucp.writer import (
    PreparedTensor,
    SaveOptions,
    array_layout,
    prepare_host_tensor,
    tensor_entry,
    value_entry,
    write_tensor,
)

_VALUE_TYPES = (type(None), bool, int, float, str)
# optax state fields that hold per-parameter optimizer state, and the step counter.
_OPTAX_STATE_NAMES = ("mu", "nu", "count", "trace", "ema", "master")


def role_of(key: Sequence[str]) -> tuple[str, str | None]:
    """The manifest role of a JAX leaf, from the conventional top-level names of a train state.

    ``params`` → param; ``model_params`` → param/model; ``opt_state`` (or ``optimizer``/``opt``)
    → opt_state with the optax field (``mu``, ``nu``, ``count``, ...) as sub-role; else other.
    """
    top = key[0] if key else None
    if top == "params":
        return "param", None
    if top == "model_params":
        return "param", "model"
    if top in ("opt_state", "optimizer", "opt"):
        sub = next((c for c in key[1:] if c in _OPTAX_STATE_NAMES), None)
        return "opt_state", sub
    return "other", None


def shards_to_write(array: jax.Array) -> list:
    """(index, shard data) for the addressable shards this process must write: replica 0 only."""
    return [(s.index, s.data) for s in array.addressable_shards if s.replica_id == 0]


def _on_cpu(data: jax.Array) -> bool:
    return all(d.platform == "cpu" for d in data.devices())


class _Snapshots:
    """Private copies of CPU shards for an async save, made by the runtime, not in the stall.

    On CPU ``np.asarray`` aliases the device buffer, which a donated or deleted array would
    change under an async save, so the save needs its own copy. One batched
    ``jax.device_put(..., may_alias=False)`` enqueues every copy and returns at once; the
    runtime orders a later donation's in-place write after it. The writer threads wait for each
    copy (``np.asarray``) when they write that shard. On accelerators the device→host transfer
    is already the copy.
    """

    def __init__(self):
        self._shards: list[jax.Array] = []
        self._copies: list[jax.Array] | None = None

    def add(self, data: jax.Array):
        """A zero-argument producer of ``data``'s private host copy (valid after ``start``)."""
        position = len(self._shards)
        self._shards.append(data)
        return lambda: np.asarray(self._copies[position])

    def start(self) -> None:
        if self._shards:
            self._copies = jax.device_put(
                self._shards, [s.sharding for s in self._shards], may_alias=False
            )
        self._shards = []


def prepare_tree(
    tree, options: SaveOptions, *, primary: bool, copy: bool, logical_axes: Any = None
) -> tuple[list[fmt.Entry], list[PreparedTensor]]:
    """Manifest entries for every leaf and this process's writes (device→host copies done here)."""
    leaves, _ = tree_lib.flatten(tree)
    for key, _, leaf in leaves:  # before anything is written or copied
        value, _ = tree_lib.unbox(leaf)
        if isinstance(value, jax.Array) and value.is_deleted():
            raise tree_lib.TreeError(
                f"Leaf {fmt.key_to_str(key)!r}: the jax.Array (shape {tuple(value.shape)}, "
                f"{value.dtype}) has been deleted or donated (e.g. to a jit with "
                f"donate_argnums) and holds no data; save the array the step returned."
            )
    for _, _, leaf in leaves:  # start every device→host transfer before waiting on any
        if isinstance(leaf, jax.Array) and (primary or not leaf.is_fully_addressable):
            for _, data in shards_to_write(leaf):
                data.copy_to_host_async()
    names_by_key = tree_lib.variable_axes(tree)  # nnx.Variable metadata
    if logical_axes is not None:
        names_by_key.update(tree_lib.flatten_axes(logical_axes))
    # Optimizer state that mirrors the params tree (opt_state/0/mu/<param path>, EMA, trace...)
    # inherits the logical axes of the parameter whose path it ends with and whose shape it
    # has, however it was built (boxed params with unboxed moments is the usual flax pattern),
    # so rules shard moments like their parameters.
    by_param_path: dict[tuple, tuple[tuple, tuple]] = {}
    for key, _, leaf in leaves:
        if len(key) > 1 and key[0] == "params":
            value, boxed = tree_lib.unbox(leaf)
            names = names_by_key.get(key, boxed)
            if names is not None:
                by_param_path[key[1:]] = (tuple(names), tuple(getattr(value, "shape", ())))

    def inherited(key, shape):
        for i in range(1, len(key)):
            found = by_param_path.get(key[i:])
            if found is not None and found[1] == tuple(shape):
                return found[0]
        return None

    entries: list[fmt.Entry] = []
    prepared: list[PreparedTensor] = []
    snapshots = _Snapshots()
    for key, key_types, leaf in leaves:
        if not key:
            raise ValueError("Cannot save a bare leaf: wrap it in a dict, e.g. {'x': value}.")
        leaf, boxed_names = tree_lib.unbox(leaf)
        role, sub_role = role_of(key)
        names = names_by_key.get(key, boxed_names)
        if names is None and by_param_path and key[0] != "params":
            names = inherited(key, getattr(leaf, "shape", ()))
        if isinstance(leaf, _VALUE_TYPES) and not isinstance(leaf, np.generic):
            entries.append(value_entry(key, key_types, leaf, role=role, sub_role=sub_role))
            continue
        if isinstance(leaf, jax.Array):
            shape = tuple(leaf.shape)
            layout = array_layout(
                shape,
                fmt.dtype_name(leaf.dtype),
                leaf.sharding.shard_shape(shape),
                np.dtype(leaf.dtype).itemsize,
                options,
            )
            # A process-local array (e.g. a step counter made on each host's first device) exists once
            # per process: only the primary writes it, or two processes would write one shard file.
            local_copy = jax.process_count() > 1 and leaf.is_fully_addressable
            writes = []
            if primary or not local_copy:
                for index, data in shards_to_write(leaf):
                    host = snapshots.add(data) if (copy and _on_cpu(data)) else np.asarray(data)
                    writes.append((index, host))
            p = PreparedTensor(
                tensor_entry(
                    key,
                    key_types,
                    layout,
                    role=role,
                    sub_role=sub_role,
                    logical_axes=names,
                    saved_sharding=sharding_lib.describe(leaf.sharding),
                ),
                layout,
                writes,
                stable_source=copy,
            )  # async saves write private host copies
        elif isinstance(leaf, (np.ndarray, np.generic, ts.TensorStore)):
            if copy and primary and not isinstance(leaf, ts.TensorStore):
                leaf = np.array(leaf, copy=True)
            p = prepare_host_tensor(
                key,
                key_types,
                leaf,
                options,
                primary=primary,
                logical_axes=names,
                stable_source=copy,
                role=role,
                sub_role=sub_role,
            )
        else:
            raise TypeError(
                f"Leaf {fmt.key_to_str(key)!r}: cannot save a {type(leaf).__module__}."
                f"{type(leaf).__qualname__} (expected jax.Array, numpy array, "
                f"tensorstore.TensorStore, or None/bool/int/float/str)."
            )
        entries.append(p.entry)
        prepared.append(p)
    snapshots.start()
    return entries, prepared


async def write_all(
    root,
    prepared: Sequence[PreparedTensor],
    *,
    primary: bool,
    max_in_flight: int = 64,
    sync: bool = True,
) -> dict[str, dict[str, str]]:
    """All of this process's shards of a jax save, many tensors at once.

    Returns {tensor dir: {shard key: digest}} for the shards this process wrote. Waits for
    every write even after one fails, so cleanup never races a write in flight.
    """
    sem = asyncio.Semaphore(max_in_flight)

    async def one(p):
        async with sem:
            return await write_tensor(root, p, primary=primary, sync=sync)

    results = await asyncio.gather(*(one(p) for p in prepared), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return {p.entry.dir: r for p, r in zip(prepared, results) if r is not None}


def missing_shards(entry: fmt.TensorEntry, digests: dict[str, str]) -> list[str]:
    """Shard keys of ``entry``'s chunk grid that no process reported writing."""
    if 0 in entry.shape:
        return []
    grid = [range(-(-n // c)) for n, c in zip(entry.shape, entry.chunk_shape)]
    keys = ("/".join(["c", *map(str, pos)]) for pos in itertools.product(*grid))
    return [k for k in keys if k not in digests]
