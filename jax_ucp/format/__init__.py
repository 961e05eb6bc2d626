"""Layer 1: what is on disk. No JAX, no I/O beyond JSON."""

from jax_ucp.format import files
from jax_ucp.format.dtypes import ZARR_NATIVE, dtype_name, to_numpy_dtype
from jax_ucp.format.errors import UCPError
from jax_ucp.format.keypath import KeyPath, decode_key, encode_key, key_to_str
from jax_ucp.format.manifest import (
    ARRAYS_DIR,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    Entry,
    Manifest,
    ManifestError,
    SavedSharding,
    TensorEntry,
    ValueEntry,
    array_dir,
    new_manifest,
    read_manifest_file,
    role_of,
)
