"""A save whose host copies stay within ``memory_budget``: copied, written, freed, batch by batch.

Without a budget an async save copies every replica-0 shard to host before ``mngr.save``
returns (``plan._Snapshots``): as many host bytes as the process's part of the state. With one
(as Orbax's ``transfer_concurrent_bytes``, which its 0.12.8 regulator sets from the last save's
peak), the stall copies only the first shards, up to the budget, and keeps the rest referenced:

* on CPU devices a numpy view of the device buffer (no copy). A buffer with such a view is never
  donated in place or freed: a later ``jit(donate_argnums=)`` of the array leaves it whole (XLA
  writes the result elsewhere) and ``delete()`` keeps the memory until the view is dropped, so
  what is written is what ``mngr.save`` was given;
* on accelerators the ``jax.Array`` itself, copied to host when the writer has room. Donating or
  deleting it before ``wait_until_finished()`` fails the save with an error naming the tensor
  (never a wrong checkpoint), as Orbax documents for its own limit.

The commit then writes in order within an ``InFlightBytes`` window of the budget: a batch of
shards is copied (the stall's copies first), written and freed before the next is admitted.
A single device shard larger than the budget is refused when the save is called, naming it (a
shard is one file, written whole); host numpy leaves of an async save are copied whole in the
stall, as without a budget (they are mutable).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jax_ucp._src import format as fmt
from jax_ucp._src import store
from jax_ucp._src.errors import CheckpointError, RequestError
from jax_ucp._src.format.sizes import format_size
from jax_ucp._src.writer import PreparedTensor, write_tensor


def on_cpu(data: jax.Array) -> bool:
    """A shard held in host memory already (CPU devices): a view of it pins its buffer, where
    an accelerator's shard must be copied to host."""
    return all(d.platform == "cpu" for d in data.devices())


def _index_str(index: tuple) -> str:
    """``[0:512, :]``: a shard's place in the global array, as errors name it."""
    parts = [
        ":" if sl.start is None and sl.stop is None else f"{sl.start or 0}:{sl.stop}"
        for sl in index
    ]
    return "[" + ", ".join(parts) + "]"


class _Held:
    """A shard's host data for the writer, produced when the writer takes it, dropped after."""

    def __init__(self, name: str, index: tuple, array: jax.Array | None = None):
        self.name, self.index = name, index
        self.array = array  # a private copy (set by ``start``), or the device shard itself
        self.device = array is not None

    def __call__(self) -> np.ndarray:
        array = self.array
        if array is None or array.is_deleted():
            raise CheckpointError(
                f"Tensor {self.name!r}: shard {_index_str(self.index)} was deleted or donated "
                f"before the save copied it to host. With memory_budget= the shards past the "
                f"budget are read from the device during the commit: wait_until_finished() "
                f"before donating the saved arrays, or raise memory_budget."
            )
        return np.asarray(array)  # on an accelerator: the host copy, dropped after the write

    def release(self) -> None:
        array, self.array = self.array, None
        if array is not None and not self.device:
            array.delete()  # the private copy's memory goes back now, not at the next GC


class BudgetedShards:
    """Decides, shard by shard in save order, what the stall copies and what stays referenced.

    Args:
      budget: host bytes of shard data in flight at once.
      copy: an async save (the caller goes on): private copies up to the budget.
    """

    def __init__(self, budget: int, *, copy: bool):
        self.budget, self.copy = int(budget), copy
        self.copied_bytes = 0  # copied in the stall (at most ``budget``)
        self.referenced_bytes = 0  # left on the device, copied or read by the commit
        self._pending: list[tuple[_Held, jax.Array]] = []
        self._prefetched = 0
        # the stall copies a prefix of the shards in save order: the commit's window admits it
        # first, so copies not yet written and batches in flight never overlap
        self._full = False

    def prefetch(self, data: jax.Array) -> bool:
        """Whether to start ``data``'s device→host transfer now (called in save order before
        ``add``): the prefix the stall copies."""
        if self._prefetched + data.nbytes > self.budget:
            self._prefetched = self.budget
            return False
        self._prefetched += data.nbytes
        return True

    def _copies(self, data: jax.Array) -> bool:
        if not self.copy or self._full or self.copied_bytes + data.nbytes > self.budget:
            self._full = True
            return False
        self.copied_bytes += data.nbytes
        return True

    def add(self, name: str, index: tuple, data: jax.Array) -> Any:
        """The writer's data for one shard: a producer (``_Held``) or a view of a CPU buffer.

        Args:
          name: the tensor's name, for errors.
          index: the shard's place in the global array.
          data: the shard (a single-device ``jax.Array``).
        """
        if data.nbytes > self.budget:
            raise RequestError(
                f"Tensor {name!r}: its shard {_index_str(index)} holds "
                f"{format_size(data.nbytes)} ({data.dtype}{list(data.shape)}), more than "
                f"memory_budget={format_size(self.budget)}; a shard is written whole, so raise "
                f"memory_budget or shard the array more finely."
            )
        copied = self._copies(data)
        if on_cpu(data):
            if copied:
                held = _Held(name, index)
                self._pending.append((held, data))
                return held
            if self.copy:
                self.referenced_bytes += data.nbytes
            return np.asarray(data)  # no copy: the view pins the buffer (module docstring)
        if copied:
            return np.asarray(data)  # the transfer started at ``prefetch``
        self.referenced_bytes += data.nbytes
        return _Held(name, index, data)  # copied by the writer, when it has room

    def start(self) -> None:
        """Enqueues the stall's private copies (one batched ``device_put``; returns at once)."""
        if self._pending:
            shards = [d for _, d in self._pending]
            copies = jax.device_put(shards, [s.sharding for s in shards], may_alias=False)
            for (held, _), c in zip(self._pending, copies):
                held.array = c
        self._pending = []


def _write_nbytes(p: PreparedTensor, index: tuple) -> int:
    shape = p.layout.shape
    if not index:
        n = math.prod(shape)
    else:
        n = math.prod(len(range(*sl.indices(d))) for sl, d in zip(index, shape))
    return int(n) * fmt.to_numpy_dtype(p.layout.dtype).itemsize


def _groups(p: PreparedTensor, budget: int):
    """``p``'s writes in consecutive groups of at most ``budget`` bytes (a write larger than it
    alone) -> [(writes, bytes)]; one empty group when this process writes none (the primary
    still creates the array)."""
    groups: list[tuple[list, int]] = []
    current: list = []
    size = 0
    for index, data in p.writes:
        n = _write_nbytes(p, index)
        if current and size + n > budget:
            groups.append((current, size))
            current, size = [], 0
        current.append((index, data))
        size += n
    if current or not groups:
        groups.append((current, size))
    return groups


def _release(writes: list) -> None:
    """A settled batch's host data freed (private copies deleted now, views dropped)."""
    for _, data in writes:
        if isinstance(data, _Held):
            data.release()
    writes.clear()


async def write_within_budget(
    root,
    prepared: Sequence[PreparedTensor],
    *,
    primary: bool,
    budget: int,
    sync: bool = True,
    max_in_flight: int = 64,
) -> dict[str, dict[str, str]]:
    """``plan.write_all`` with at most ``budget`` bytes of shards in flight, in save order (the
    module's docstring says how); returns {tensor dir: {shard key: digest}} as ``write_all``.

    Args:
        root: the checkpoint directory.
        prepared: the tensors, laid out (writes from ``BudgetedShards``).
        primary: this process creates the arrays.
        budget: bytes of shard data in flight.
        sync: fsync each file (False: the caller makes the directory durable).
        max_in_flight: write batches at once.
    """
    window: store.InFlightBytes[tuple[asyncio.Future, str, list]] = store.InFlightBytes(
        budget, max_items=max_in_flight
    )
    digests: dict[str, dict[str, str]] = {}
    partial: set[str] = set()  # a tensor with a batch that had no digests has none

    async def finish(item) -> None:
        task, array_dir, writes = item
        try:
            result = await task
        finally:
            _release(writes)
        if result is None:
            partial.add(array_dir)
        else:
            digests.setdefault(array_dir, {}).update(result)

    try:
        for p in prepared:
            for i, (writes, nbytes) in enumerate(_groups(p, budget)):
                for old in window.make_room(nbytes):
                    await finish(old)
                part = dataclasses.replace(p, writes=writes)
                task = asyncio.ensure_future(
                    write_tensor(root, part, primary=primary and i == 0, sync=sync)
                )
                window.add((task, p.entry.dir, writes), nbytes)
                del part
        for old in window.drain():
            await finish(old)
    except BaseException:  # every write settles before the caller cleans up
        rest = list(window.drain())
        await asyncio.gather(*(t for t, _, _ in rest), return_exceptions=True)
        for _, _, writes in rest:
            _release(writes)
        raise
    return {d: v for d, v in digests.items() if d not in partial}
