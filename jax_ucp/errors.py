"""The library's exception base: every error jax_ucp raises on bad input derives from it.

A leaf module (it imports nothing of jax_ucp), so every layer — the pure-logic UCP language
included — can derive its errors from it, and callers catch one class."""

from __future__ import annotations


class UCPError(Exception):
    """A checkpoint, a source checkpoint or a request that jax_ucp refuses, with a message that
    names the file and the tensor or field, and what was expected vs found."""
