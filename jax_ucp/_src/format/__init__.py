"""Layer 1: what is on disk. No JAX, no I/O beyond JSON."""

from jax_ucp._src.errors import UCPError
from jax_ucp._src.format import files
from jax_ucp._src.format.dtypes import dtype_name, to_numpy_dtype
from jax_ucp._src.format.keypath import encode_key, key_to_str
from jax_ucp._src.format.manifest import (
    ARRAYS_DIR,
    FORMAT_VERSION,
    KEY_IMPLS,
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    ORBAX_ITEM,
    Entry,
    Manifest,
    SavedSharding,
    TensorEntry,
    ValueEntry,
    array_dir,
    new_manifest,
    read_manifest_file,
    role_of,
)
from jax_ucp._src.format.tree_record import MAX_TREE_DEPTH, check_tree_depth
