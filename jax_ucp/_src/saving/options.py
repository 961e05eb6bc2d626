"""``jax_ucp.save``'s and ``UCPSave``'s options, JAX-free: ``api`` builds them before the save
engine (which loads JAX) is imported, so ``jax-ucp verify``/``latest`` start without JAX."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax_ucp._src.errors import RequestError
from jax_ucp._src.format.sizes import parse_optional_size
from jax_ucp._src.options import field_namer

__all__ = ["SaveArgs", "SaveOptions"]


@dataclasses.dataclass
class SaveArgs:
    """What to save and how, checked when constructed (``UCPSave`` is these as Orbax's args),
    so a wrong option fails in the caller's line, not later in a background write.

    Attributes:
      item: pytree of jax.Array / numpy arrays / Python scalars, strings, None (flax
        ``nn.Partitioned`` / ``LogicallyPartitioned`` boxes included).
      logical_axes: optional pytree (same structure) of flax-style logical axis-name tuples,
        recorded so a restore can map them with new rules; flax boxes in ``item`` are
        recorded automatically.
      compression: None (default: the fastest save and restore) or "zstd" (smaller on disk;
        the trade-off is measured in docs/BENCHMARKS.md, "Compression").
      compression_level: zstd level (-131072..22; default 3), used with "zstd".
      inner_chunk_bytes: bound on inner chunks: bytes or e.g. "1MiB" (what a reader fetches
        at least); None: the store's default.
      checksum: "crc32c" (default: every inner chunk and shard index verified on read) or None
        (corruption then goes undetected; restores no faster here: docs/BENCHMARKS.md).
      source: provenance recorded in the manifest (a JSON object).
      memory_budget: host bytes of shard data in flight: an int or a size such as "1GiB"
        (None: unbounded, every shard copied to host before an async save returns). With it,
        an async save copies only the first shards up to it and the commit copies, writes and
        frees the rest batch by batch (``jax_ucp._src.saving.budget``); a single device shard
        larger than it is an error naming the tensor.
    """

    item: Any
    logical_axes: Any = None
    compression: str | None = None
    compression_level: int = 3
    inner_chunk_bytes: int | str | None = None
    checksum: str | None = "crc32c"
    source: dict | None = None
    memory_budget: int | str | None = None

    def __post_init__(self):
        field, level = field_namer(self), self.compression_level  # save(x=) or UCPSave.x
        if self.compression not in (None, "zstd"):
            raise RequestError(
                f"{field('compression')}: expected None or 'zstd', got {self.compression!r}."
            )
        if isinstance(level, bool) or not isinstance(level, int) or not -131072 <= level <= 22:
            raise RequestError(
                f"{field('compression_level')}: expected an int in -131072..22 (zstd's levels), "
                f"got {level!r}."
            )
        try:  # an int or a size such as "1MiB", as every byte-size option
            self.inner_chunk_bytes = parse_optional_size(
                self.inner_chunk_bytes, field("inner_chunk_bytes")
            )
            self.memory_budget = parse_optional_size(self.memory_budget, field("memory_budget"))
        except RequestError as e:
            raise RequestError(f"{e}.") from None
        if self.checksum not in ("crc32c", None):
            raise RequestError(
                f"{field('checksum')}: expected 'crc32c' or None, got {self.checksum!r}."
            )
        if self.source is not None and not isinstance(self.source, dict):
            raise RequestError(
                f"{field('source')}: expected None or a dict (a JSON object), got "
                f"{type(self.source).__name__}."
            )


@dataclasses.dataclass
class SaveOptions(SaveArgs):
    """``jax_ucp.save``'s arguments after the path (``options.keywords_of``): ``SaveArgs``
    and ``force``.

    Attributes:
      force: replace a jax_ucp checkpoint at the path (kept whole until the new one is in
        place; a committed object-store checkpoint is never replaced).
    """

    _: dataclasses.KW_ONLY
    force: bool = False
