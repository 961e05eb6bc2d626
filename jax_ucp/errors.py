"""The library's exceptions (and its one import warning): every error jax_ucp raises on bad input derives from ``UCPError``.

A leaf module (it imports nothing of jax_ucp), so every layer — the pure-logic UCP language
included — can derive its errors from it, and callers catch one class. The few general classes
here are for refusals that belong to no single file format or layer; each also derives from the
builtin it replaced, so callers catching ``ValueError`` / ``TypeError`` / ``KeyError`` keep
working. Errors about one kind of file live beside its reader (``ManifestError``,
``SafetensorsError``, ``DcpError``, ...), and derive from ``UCPError`` too."""

from __future__ import annotations


class UCPError(Exception):
    """A checkpoint, a source checkpoint or a request that jax_ucp refuses, with a message that
    names the file and the tensor or field, and what was expected vs found."""


class RequestError(UCPError, ValueError):
    """The arguments of a call are refused: an option out of range, options that exclude each
    other, an option that needs another (``rules=`` without ``mesh=``)."""


class UnsupportedError(UCPError, TypeError, ValueError):
    """Well-formed input outside what jax_ucp supports: a dtype or a Python value the format
    cannot store, a model configuration the built-in models do not implement. (A ``TypeError``
    for values and dtypes, a ``ValueError`` for configurations, as before it existed.)"""


class NotFoundError(UCPError, KeyError):
    """A name asked for does not exist (a bundled sample, ...); the message lists what does."""

    def __str__(self) -> str:
        """The message as given (``KeyError.__str__`` would quote it like a key)."""
        return Exception.__str__(self)


class SetupError(UCPError, RuntimeError):
    """The running process cannot do what was asked (too few devices, ...); the message says how
    to set it up."""


class ExportError(UCPError, ValueError):
    """A universal checkpoint cannot be exported in the asked format (a dtype the target format
    cannot hold, a name it cannot carry, a destination inside the source, ...)."""


class OptimizerOrderWarning(UserWarning):
    """An imported optimizer's state was matched to parameters by position (index i -> i-th
    parameter), which the checkpoint cannot confirm, and parameters of one shape could be
    swapped unseen; the manifest's ``source.notes`` records the same. Save the optimizer with
    ``param_names`` (or keyed by name) to make the mapping checkable."""
