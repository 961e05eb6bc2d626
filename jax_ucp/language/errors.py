"""Errors raised by the UCP language (defined in ``jax_ucp.errors``): all are
``jax_ucp.UCPError``s (and ValueErrors) and name what they are about."""

from __future__ import annotations

from jax_ucp.errors import LanguageError, MergeError, SpecError, StrictnessError, TransformError

__all__ = ["LanguageError", "MergeError", "SpecError", "StrictnessError", "TransformError"]
