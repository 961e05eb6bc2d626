"""The library's exception base, as the format layer exports it (defined in ``jax_ucp.errors``)."""

from __future__ import annotations

from jax_ucp.errors import UCPError

__all__ = ["UCPError"]
