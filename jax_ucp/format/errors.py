"""The library's exception base: every error jax_ucp raises on bad input derives from it."""

from __future__ import annotations


class UCPError(Exception):
    """A checkpoint, a source checkpoint or a request that jax_ucp refuses, with a message that
    names the file and the tensor or field, and what was expected vs found."""
