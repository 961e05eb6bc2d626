"""Layer 2: TensorStore I/O (zarr v3 arrays on any kvstore)."""

from jax_ucp.store.chunking import DEFAULT_INNER_CHUNK_BYTES, inner_chunk_shape, outer_chunk_shape
from jax_ucp.store.zarr3 import (
    ArrayLayout,
    array_spec,
    context,
    create,
    kvstore_driver,
    kvstore_spec,
    open_array,
)
