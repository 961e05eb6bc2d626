"""TensorStore's errors as one readable line.

TensorStore raises a plain ``ValueError`` whose text starts with an absl status code and ends
with a dump of the whole spec (``[tensorstore_spec='{…}']``, ``[source locations='…']``), and
Orbax adds its kvstore as ``Tensorstore KvStore: KvStore({…})``: hundreds of characters that
name no tensor. Callers that know the tensor and the file wrap the short text in their own
error; the command line recognises what is left over as an I/O error, not a bug."""

from __future__ import annotations

import errno
import re

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


def is_io_error(e: BaseException) -> bool:
    """A TensorStore error about the files or the machine (missing, truncated, corrupt, no space,
    no permission), not about how it was called."""
    return isinstance(e, ValueError) and str(e).startswith(tuple(c + ": " for c in _IO_STATUS))


def message(e: BaseException) -> str:
    """``e``'s text without the spec dumps, on one line, at most 600 characters; an OS error code
    TensorStore attaches becomes its name (``ENOSPC``)."""
    text = str(e)
    code = os_errno(e)
    text = _OS_ERROR.sub(f" ({errno.errorcode.get(code, code)})" if code else "", text)
    for dump in _DUMPS:
        text = dump.sub("", text)
    text = " ".join(text.split())
    return text if len(text) <= _MAX_CHARS else text[: _MAX_CHARS - 1] + "…"


def os_errno(e: BaseException) -> int | None:
    """The OS error code (``errno.ENOSPC``, …) TensorStore attached to ``e``, if any."""
    code = _OS_ERROR.search(str(e))
    return int(code.group(1)) if code else None
