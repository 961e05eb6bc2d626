"""What a save decides before writing: array layouts and manifest entries, from host or device data.

Shared by JAX saves (``saving.plan``) and host streams (importers); free of JAX and Orbax so
a conversion, a host-only job, never pays their import.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import tensorstore as ts

from jax_ucp._src import format as fmt
from jax_ucp._src import store
from jax_ucp._src.errors import RequestError


@dataclasses.dataclass(frozen=True)
class ArrayOptions:
    """How arrays are laid out on disk: compression, inner-chunk size, checksums."""

    compression: str | None = None  # None or "zstd" (see README: why off by default)
    compression_level: int = 3
    inner_chunk_bytes: int = store.DEFAULT_INNER_CHUNK_BYTES
    checksum: str | None = "crc32c"


@dataclasses.dataclass
class PreparedTensor:
    """A tensor ready to write: its manifest entry, its array layout and this process's writes."""

    entry: fmt.TensorEntry
    layout: store.ArrayLayout
    # (index into the global array, host data or a zero-arg producer) for this process to write
    writes: list[tuple[tuple, Any]]
    # The host data stays unmodified while TensorStore may hold it (a private copy, a read-only
    # memory map): TensorStore then encodes straight from it instead of copying it first, which
    # saves a copy of every tensor (docs/DEEPSPEED.md, performance).
    stable_source: bool = False


def array_layout(
    shape, dtype_name: str, shard_shape, itemsize: int, options: ArrayOptions
) -> store.ArrayLayout:
    """The zarr layout of one array: one shard file per ``shard_shape``, inner chunks within.

    Args:
        shape: the array's shape.
        dtype_name: its dtype's name.
        shard_shape: the shape each shard file holds.
        itemsize: bytes per element.
        options: the save's options (chunking, compression, checksum).
    """
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
    key_types,
    layout: store.ArrayLayout,
    *,
    role: str = "other",
    sub_role: str | None = None,
    logical_axes=None,
    saved_sharding=None,
    provenance=None,
    frozen: bool = False,
    tied_to: str | None = None,
    key_impl: str | None = None,
) -> fmt.TensorEntry:
    """The manifest entry of one array (logical axes padded to its rank, as PartitionSpecs are).

    Args:
        key: the key path.
        key_types: each key component's container type.
        layout: the array's layout.
        role: param, opt_state, ... (see the format).
        sub_role: e.g. ``model`` for a model-precision copy.
        logical_axes: the logical axis names.
        saved_sharding: the mesh and PartitionSpec it was saved with.
        provenance: where an import read it.
        frozen: a parameter not trained.
        tied_to: the parameter whose weight this one shares (recorded in the manifest).
        key_impl: the JAX PRNG key implementation of a typed key array's stored key data.
    """
    if logical_axes is not None and len(logical_axes) < len(layout.shape):
        # PartitionSpec semantics: unnamed trailing dimensions; none named at all → unknown.
        logical_axes = (
            tuple(logical_axes) + (None,) * (len(layout.shape) - len(logical_axes))
            if any(n is not None for n in logical_axes)
            else None
        )
    if logical_axes is not None and len(logical_axes) != len(layout.shape):
        raise RequestError(
            f"Leaf {fmt.key_to_str(key)!r}: {len(logical_axes)} logical axis names "
            f"{tuple(logical_axes)} for an array of shape {layout.shape}."
        )
    return fmt.TensorEntry(
        key=tuple(key),
        key_types=tuple(key_types),
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
        frozen=frozen,
        tied_to=tied_to,
        key_impl=key_impl,
    )


def value_entry(
    key, key_types, value, *, role: str = "other", sub_role: str | None = None
) -> fmt.ValueEntry:
    """The manifest entry of a JSON scalar leaf, type-checked now (naming the leaf).

    Args:
        key: the key path.
        key_types: each key component's container type.
        value: the JSON scalar.
        role: param, opt_state, ... (see the format).
        sub_role: a finer role, if any.
    """
    return fmt.ValueEntry.of(key, key_types, value, role=role, sub_role=sub_role)


def prepare_host_tensor(
    key,
    key_types,
    value,
    options: ArrayOptions,
    *,
    primary: bool,
    stable_source: bool = False,
    **entry_kw,
) -> PreparedTensor:
    """A numpy array or TensorStore view: one shard, written by the primary process only.

    Args:
        key: the key path.
        key_types: each key component's container type.
        value: a numpy array or TensorStore view.
        options: the save's options.
        primary: this process writes it.
        stable_source: ``value`` is not modified while written (no copy needed).
        **entry_kw: :func:`tensor_entry`'s keywords.
    """
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
        tensor_entry(key, key_types, layout, **entry_kw), layout, writes, stable_source
    )
