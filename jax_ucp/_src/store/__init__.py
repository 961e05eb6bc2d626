"""Layer 2: TensorStore I/O (zarr v3 arrays on any kvstore) and whole-shard file I/O."""

from jax_ucp._src.store import (
    host_memory,
    shard_file,
    shard_reader,
    shard_writer,
    storage,
    zarr3,
)
from jax_ucp._src.store.chunking import (
    DEFAULT_INNER_CHUNK_BYTES,
    inner_chunk_shape,
    outer_chunk_shape,
)
from jax_ucp._src.store.in_flight import InFlightBytes
from jax_ucp._src.store.storage import read_manifest, storage_for
from jax_ucp._src.store.zarr3 import (
    ArrayLayout,
    array_config,
    create,
    file_bytes_read,
    kvstore_config,
    kvstore_driver,
    open_array,
)


def bytes_read() -> int:
    """Bytes this process has read from local checkpoint files, through every reader path."""
    return file_bytes_read() + shard_reader.bytes_read()
