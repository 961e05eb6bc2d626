"""The exporters' side of the read engine: tensors of a UCP checkpoint as ``Deferred`` arrays,
read row slab by row slab (``reader.read_rows``, at most half the memory budget each) only when
a writer writes their bytes, so an export holds one slab at a time whatever the tensor size."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from jax_ucp import format as fmt
from jax_ucp import writer
from jax_ucp.errors import ExportError
from jax_ucp.restoring import reader


@dataclasses.dataclass(frozen=True)
class Deferred:
    """An array of known shape and dtype whose values ``slabs()`` yields as consecutive slabs of
    rows (one array for a 0-d tensor), read only when a writer writes them."""

    shape: tuple[int, ...]
    dtype: np.dtype
    slabs: Callable[[], Iterable[np.ndarray]]


def pieces(value: np.ndarray | Deferred, where: str) -> Iterator[np.ndarray]:
    """The C-ordered little-endian data of ``value`` (an array, or a ``Deferred``'s slabs), each
    slab checked against the planned shape and dtype (``ExportError`` naming ``where``)."""
    if not isinstance(value, Deferred):
        value = Deferred(tuple(value.shape), value.dtype, lambda a=value: [a])
    rows = 0
    for slab in value.slabs():
        if slab.dtype != value.dtype or (slab.shape[1:] if slab.ndim else ()) != value.shape[1:]:
            raise ExportError(
                f"{where}: read {slab.dtype}{list(slab.shape)}, planned "
                f"{np.dtype(value.dtype)}{list(value.shape)}"
            )
        rows += slab.shape[0] if slab.ndim else 1
        yield np.ascontiguousarray(slab, dtype=slab.dtype.newbyteorder("<"))
        del slab
    if rows != (value.shape[0] if value.shape else 1) and math.prod(value.shape):
        raise ExportError(f"{where}: read {rows} rows, planned {list(value.shape)}")


@dataclasses.dataclass
class Source:
    """Reads the checkpoint's tensors as ``Deferred`` arrays, counting them for ``progress``."""

    root: str
    manifest: fmt.Manifest
    available: Any
    casting: str = "same_kind"
    progress: Callable[[str, int, int], None] | None = None
    total: int = 0
    done: int = 0

    def tensor(self, key: tuple[str, ...], dtype: Any = None, name: str = "") -> Deferred:
        """Tensor ``key`` (as ``dtype``; None: as saved), ``progress`` called once it is read
        (under ``name``; with an empty name, not counted)."""
        found = self.available[key]
        dtype = found.dtype if dtype is None else np.dtype(dtype)
        return Deferred(tuple(found.shape), dtype, lambda: self._slabs(key, dtype, name))

    def _slabs(self, key, dtype, name: str) -> Iterator[np.ndarray]:
        yield from reader.read_rows(
            self.root,
            self.manifest,
            key,
            available=self.available,
            dtype=dtype,
            casting=self.casting,
            max_bytes=max(writer.memory_budget() // 2, 1),
        )
        if name:
            self.done += 1
            if self.progress is not None:
                self.progress(name, self.done, self.total)
