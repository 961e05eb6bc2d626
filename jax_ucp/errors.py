"""The library's exceptions (and its one import warning): every error jax_ucp raises on bad input derives from ``UCPError``.

A leaf module (it imports nothing of jax_ucp), so every layer — the pure-logic UCP language
included — can derive its errors from it, and callers catch one class. The few general classes
here are for refusals that belong to no single file format or layer; each also derives from the
builtin it replaced, so callers catching ``ValueError`` / ``TypeError`` / ``KeyError`` keep
working. Errors about one kind of file live beside its reader (``ManifestError``,
``SafetensorsError``, ``DcpError``, ...), and derive from ``UCPError`` too.

TensorStore's own errors are plain ``ValueError``s whose text starts with an absl status code and
ends with a dump of the whole spec (``[tensorstore_spec='{…}']``; Orbax adds its kvstore as
``Tensorstore KvStore: KvStore({…})``): hundreds of characters that name no tensor. Every layer
that knows the tensor and the file wraps ``tensorstore_message(e)`` in its own error; the command
line recognises what is left over (``is_tensorstore_io_error``) as an I/O error, not a bug."""

from __future__ import annotations

import errno
import re


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


class CheckpointReplacedError(UCPError, OSError):
    """The checkpoint was replaced (a concurrent forced save swapped in a new one) while it was
    being read: nothing is wrong with either checkpoint; read it again. Never raised for a
    checkpoint that is itself damaged (that is a ``CheckpointError``)."""


class OptimizerOrderWarning(UserWarning):
    """An imported optimizer's state was matched to parameters by position (index i -> i-th
    parameter), which the checkpoint cannot confirm, and parameters of one shape could be
    swapped unseen; the manifest's ``source.notes`` records the same. Save the optimizer with
    ``param_names`` (or keyed by name) to make the mapping checkable."""


# absl status codes (TensorStore's prefix) that say something about the files or the machine,
# never about how TensorStore was called
_IO_STATUS = (
    "NOT_FOUND",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "OUT_OF_RANGE",
    "DATA_LOSS",
    "UNAVAILABLE",
    "FAILED_PRECONDITION",
    "ALREADY_EXISTS",
    "DEADLINE_EXCEEDED",
)
_DUMPS = (
    re.compile(r"\s*\[tensorstore_spec='.*", re.S),  # always last
    re.compile(r"\s*\[source locations='[^\]]*'\]"),
    re.compile(r"\s*Tensorstore KvStore: KvStore\(\{.*", re.S),  # Orbax's, always last
)
_OS_ERROR = re.compile(r"\s*\[os_error_code='?(\d+)'?\]")
_MAX_CHARS = 600


def is_tensorstore_io_error(e: BaseException) -> bool:
    """A TensorStore error about the files or the machine (missing, truncated, corrupt, no space,
    no permission), not about how it was called."""
    return tensorstore_status(e) in _IO_STATUS


# What TensorStore tells by type: nothing (every status is a plain ``ValueError``, 0.1.86); by its
# status code: the kind of failure; by text only: a digest mismatch within ``DATA_LOSS`` (a
# truncated shard is ``DATA_LOSS`` too). tests/store/test_tensorstore_errors.py provokes each
# failure and pins what is read here, so a TensorStore that words it otherwise fails there.
_STATUS = re.compile(r"([A-Z][A-Z_]+): ")
DIGEST_MISMATCH = "Digest mismatch"


def tensorstore_status(e: BaseException) -> str | None:
    """The absl status code TensorStore's error ``e`` starts with ("DATA_LOSS", "NOT_FOUND",
    ...); None for any other exception."""
    match = _STATUS.match(str(e)) if isinstance(e, ValueError) else None
    return match.group(1) if match else None


def tensorstore_failure(e: BaseException) -> str:
    """What a failed TensorStore read of checkpoint data means: "corrupt" (a crc32c digest
    mismatch), "missing" (a chunk or file not found) or "other" (truncated, unreadable, ...)."""
    status = tensorstore_status(e)
    if status == "DATA_LOSS" and DIGEST_MISMATCH in str(e):
        return "corrupt"
    return "missing" if status == "NOT_FOUND" else "other"


def tensorstore_message(e: BaseException) -> str:
    """``e``'s text without the spec dumps, on one line, at most 600 characters; an OS error code
    TensorStore attaches becomes its name (``ENOSPC``)."""
    text = str(e)
    code = _tensorstore_errno(e)
    text = _OS_ERROR.sub(f" ({errno.errorcode.get(code, code)})" if code else "", text)
    for dump in _DUMPS:
        text = dump.sub("", text)
    text = " ".join(text.split())
    return text if len(text) <= _MAX_CHARS else text[: _MAX_CHARS - 1] + "…"


def _tensorstore_errno(e: BaseException) -> int | None:
    """The OS error code (``errno.ENOSPC``, …) TensorStore attached to ``e``, if any."""
    code = _OS_ERROR.search(str(e))
    return int(code.group(1)) if code else None
