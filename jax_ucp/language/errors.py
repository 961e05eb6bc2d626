"""Errors raised by the UCP language. All are ``jax_ucp.UCPError``s (and ValueErrors) and name
what they are about."""

from __future__ import annotations

from jax_ucp.errors import UCPError


class LanguageError(UCPError, ValueError):
    """Base class of every error of the UCP language."""


class SpecError(LanguageError):
    """A spec (Python object or TOML file) is malformed; the message names the rule / line."""


class StrictnessError(LanguageError):
    """Strict matching failed: a rule matched nothing, or a tensor is covered by no rule."""


class MergeError(LanguageError):
    """Fragments cannot be merged (disagreeing replicas, wrong shapes, ...); names the tensor."""


class TransformError(LanguageError):
    """A restore-side transform cannot be applied (non-divisible stages, bad axis, ...)."""
