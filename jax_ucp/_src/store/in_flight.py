"""A bound on the bytes of work in flight, retired oldest first.

Modelled on Orbax's ``LimitInFlightBytes`` (``orbax/checkpoint/_src/serialization/limits.py``):
work reserves its bytes before it starts and releases them when it is done. Orbax's reads finish
in any order and wait on a condition variable; a restore, ``verify`` and an import's pipelined
writes hand their results back in order, so here the room for new work is made by finishing the
oldest. Unlike Orbax's, one item larger than the whole budget is admitted (alone): a tensor
larger than ``memory_budget`` is still read.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class InFlightBytes(Generic[T]):
    """The items in flight and their bytes, at most ``max_bytes`` (and ``max_items``) at once.

    The caller finishes what ``make_room`` hands back before it starts new work, then ``add``s
    it; ``drain`` hands back the rest at the end::

        window = InFlightBytes(budget)
        for work in works:
            for old in window.make_room(work.nbytes):
                finish(old)
            window.add(start(work), work.nbytes)
        for old in window.drain():
            finish(old)

    The same loop serves asyncio code (``await`` inside the ``for``).

    Args:
      max_bytes: bytes the items in flight may hold together (one item may exceed it alone).
      max_items: at most this many items in flight (None: no count bound).
    """

    def __init__(self, max_bytes: int, *, max_items: int | None = None):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}.")
        if max_items is not None and max_items <= 0:
            raise ValueError(f"max_items must be positive, got {max_items}.")
        self.max_bytes = int(max_bytes)
        self.max_items = max_items
        self._items: collections.deque[tuple[T, int]] = collections.deque()
        self._bytes = 0

    @property
    def bytes(self) -> int:
        """Bytes reserved by the items in flight."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        """The items in flight, oldest first (they stay in flight)."""
        return (item for item, _ in self._items)

    def make_room(self, nbytes: int) -> Iterator[T]:
        """Releases the oldest items, one at a time, until ``nbytes`` more fit (or none is left).

        Args:
          nbytes: the bytes the next item will reserve.

        Yields:
          Each released item, for the caller to finish before the next one is released.
        """
        while self._items and (
            self._bytes + nbytes > self.max_bytes
            or (self.max_items is not None and len(self._items) >= self.max_items)
        ):
            yield self._release_oldest()

    def add(self, item: T, nbytes: int) -> None:
        """Reserves ``nbytes`` for ``item`` (started by the caller once ``make_room`` is done).

        Args:
          item: what the caller finishes when it is handed back.
          nbytes: the bytes it holds until then.
        """
        self._items.append((item, int(nbytes)))
        self._bytes += int(nbytes)

    def drain(self) -> Iterator[T]:
        """Releases every item, oldest first."""
        while self._items:
            yield self._release_oldest()

    def _release_oldest(self) -> T:
        item, nbytes = self._items.popleft()
        self._bytes -= nbytes
        return item
