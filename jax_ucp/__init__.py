"""jax_ucp: Universal Checkpointing for JAX on Orbax.

Save distributed (each process writes its own shards), land every tensor as one consolidated
zarr v3 array, restore onto any mesh; import DeepSpeed / Megatron checkpoints.

Every name is loaded on first use (PEP 562) from the module ``_src.lazy_names.PUBLIC`` names:
importers and the ``convert`` command are host-only and start without paying JAX's and Orbax's
import (~1 s). ``__init__.pyi`` names them for type checkers.
"""

from __future__ import annotations

from jax_ucp._src.lazy_names import PUBLIC as _PUBLIC
from jax_ucp._src.lazy_names import lazy_attributes as _lazy_attributes

__all__ = sorted(_PUBLIC)  # pyright: ignore[reportUnsupportedDunderAll]  # the stub lists them

__getattr__, _ = _lazy_attributes(globals(), _PUBLIC)


def __dir__() -> list[str]:
    """The public API only (not this module's imports and helpers)."""
    return list(__all__)
