"""The library's exception base, as the format layer exports it (defined in ``jax_ucp._src.errors``)."""

from __future__ import annotations

from jax_ucp._src.errors import UCPError

__all__ = ["UCPError"]
