"""The manifest of a jax_ucp checkpoint, as ``jax_ucp.inspect`` returns it (docs/FORMAT.md).

The code is in ``jax_ucp._src``."""

from jax_ucp._src.format import Manifest as Manifest
from jax_ucp._src.format import TensorEntry as TensorEntry
from jax_ucp._src.format import UCPError as UCPError
from jax_ucp._src.format import ValueEntry as ValueEntry
from jax_ucp._src.format import encode_key as encode_key

__all__ = [
    "Manifest",
    "TensorEntry",
    "UCPError",
    "ValueEntry",
    "encode_key",
]
