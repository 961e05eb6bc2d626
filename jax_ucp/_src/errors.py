"""The library's exceptions (and its one import warning): one small tree under ``UCPError``,
grouped by what the user does about the error.

A leaf module (it imports nothing of jax_ucp), so every layer — the pure-logic UCP language
included — raises these, and callers catch one class. Each class derives from one builtin besides
``UCPError`` (``except ValueError`` / ``OSError`` / ``RuntimeError`` keeps working). There are no
aliases, and no public subclasses: a distinction only jax_ucp's own code catches is a subclass in
the layer that raises it (``torchfiles.allow_list.TorchFileError``,
``importers.megatron.common.MegatronImportError``, ``multihost.agreement.ProcessLostError``).

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
    """Fix the call: an argument or option refused (out of range, of the wrong kind, options that
    exclude each other), a dtype or value the format cannot store, a model configuration the
    built-in models do not implement, a tensor that does not divide the mesh axes it is split
    over or a rule naming what the checkpoint or mesh lacks, several Adam states a target moment
    could belong to (give the roots' targets), a pytree whose keys cannot be written or matched, a
    destination that would overwrite its source, an export the target format cannot hold, an
    object-store URL or option that cannot be used, a sample that does not exist, a process with
    too few devices for what was asked."""


class SourceError(UCPError, ValueError):
    """A checkpoint to import (torch, DCP, DeepSpeed, Megatron, Orbax, safetensors) is missing or
    not one, or is malformed, inconsistent or unsupported, a torch file truncated or corrupt, a
    pickle asking for something outside the allow-list (nothing was executed), or its import
    would leave tensors unaccounted for; names the file and the tensor."""


class CheckpointError(UCPError, ValueError):
    """A jax_ucp checkpoint cannot be read or restored as asked: not a checkpoint, a manifest
    missing, unreadable or of another version, a tensor absent, of another shape, or not
    castable as asked; or its bytes are not what its header or manifest promises (a shard
    missing, truncated, failing its crc32c or swapped in from another save, a mapped file that
    shrank while read: replace the file from a good copy). Names the tensor, the file, expected
    vs found."""


class UnsafeFileError(UCPError, OSError):
    """A path refused for safety: not a regular file (a FIFO, a device, a symlink where none
    belongs), a file larger than the caller allows, or a name read from a checkpoint that would
    lead outside it (absolute, ``..``, NUL, a symlink whose target lies outside)."""


class SaveConflictError(UCPError, OSError):
    """Another writer is in the way: a save to the same path is in progress, the destination
    holds something jax_ucp did not write (refused untouched, even with force), or a concurrent
    forced save replaced the checkpoint while it was being read (nothing is damaged: read it
    again)."""


class MultiProcessError(UCPError, RuntimeError):
    """Another process of a multi-process job failed (its error is quoted), died or did not
    answer in time: a checkpoint written by several processes, a tensor read once across them."""


class LanguageError(UCPError, ValueError):
    """A UCP-language spec (Python object or TOML file) is malformed, strict matching failed,
    fragments cannot be merged, or a restore-side transform cannot be applied; names the rule,
    line or tensor."""


class ResumeWarning(UserWarning):
    """``restore(run_root, step="latest", fallback=True)`` passed over a committed step that
    could not be read (named, with why) for an older one."""


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
_OS_ERROR = re.compile(r"\s*\[os_error_code='?([0-9]+)'?\]")
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
    mismatch), "missing" (a chunk or file not found), "denied" (the file is there but this user
    may not read it: not corruption) or "other" (truncated, unreadable, ...)."""
    status = tensorstore_status(e)
    if (
        isinstance(e, PermissionError)
        or status == "PERMISSION_DENIED"
        or (isinstance(e, ValueError) and "Permission denied" in str(e))
    ):
        return "denied"
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
