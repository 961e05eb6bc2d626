"""megatron-core ``torch_dist`` checkpoints: the torch DCP reader plus megatron-core's pieces.

The generic reader (``.metadata`` through the safe unpickler, chunk tiling checks, byte-range
reads) is :mod:`jax_ucp._src.torchfiles.dcp`, shared with the plain torch DCP importer. Here:
the classes megatron-core 0.13-0.15 subclass in ``.metadata`` (``MCoreSavePlan``,
``MCoreMetadata``), read as the torch classes they extend, and megatron-core's
``metadata.json`` (``sharded_backend`` & co.), kept as :attr:`MegatronDcpCheckpoint.mcore_metadata`.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jax_ucp._src.errors import SourceError
from jax_ucp._src.format import files
from jax_ucp._src.torchfiles import allow_list, dcp
from jax_ucp._src.torchfiles.dcp import DcpCheckpoint, DcpChunk, DcpTensor, check_coverage

__all__ = [
    "MCORE_CLASSES",
    "DcpCheckpoint",
    "DcpChunk",
    "DcpTensor",
    "MegatronDcpCheckpoint",
    "check_coverage",
    "open_dcp",
]

_MCORE = "megatron.core.dist_checkpointing.strategies.torch."

#: megatron-core 0.13-0.15 subclass two torch classes: MCoreSavePlan (0.13, 0.14) in the cached
#: save plans, MCoreMetadata (0.15) as the whole ``.metadata``.
MCORE_CLASSES: dict[str, Any] = {
    _MCORE + "MCoreSavePlan": allow_list.standin_class(_MCORE + "MCoreSavePlan"),
    _MCORE + "MCoreMetadata": dcp.DCP_CLASSES["torch.distributed.checkpoint.metadata.Metadata"],
}

#: Largest ``metadata.json`` read (megatron-core writes a few hundred bytes).
MAX_MCORE_METADATA_BYTES = 1 << 20


@dataclass
class MegatronDcpCheckpoint(DcpCheckpoint):
    """A torch_dist checkpoint: torch DCP's ``.metadata`` plus megatron-core's ``metadata.json``."""

    mcore_metadata: dict = field(default_factory=dict)  # metadata.json


#: within ``parsed_once()``: each folder's parse, by real path
_PARSED: contextvars.ContextVar[dict[str, MegatronDcpCheckpoint] | None] = contextvars.ContextVar(
    "megatron_dcp_parsed", default=None
)


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """Within it ``open_dcp`` parses a folder once (verl's hand-over reads the names its plan
    reads again)."""
    token = _PARSED.set({})
    try:
        yield
    finally:
        _PARSED.reset(token)


def open_dcp(path: os.PathLike | str) -> MegatronDcpCheckpoint:
    """Parse ``.metadata`` (and ``metadata.json`` when present) into typed, checked entries."""
    parsed, key = _PARSED.get(), os.path.realpath(path)
    if parsed is not None and key in parsed:
        return parsed[key]
    base = dcp.open_dcp(path, MCORE_CLASSES, fsdp_dtensor=True)  # read by .fsdp_dtensor
    mcore = {}
    mj = Path(path) / "metadata.json"
    if os.path.lexists(mj):  # a FIFO, a device or a huge file there is an error, not "none"
        try:
            mcore = files.strict_loads(
                files.read_regular(files.in_own_folder(mj), MAX_MCORE_METADATA_BYTES)
            )
        except files.UnsafeFileError as e:  # names the file
            raise SourceError(str(e)) from None
        except (ValueError, RecursionError) as e:
            raise SourceError(f"{mj}: not JSON ({str(e)[:200]})") from None
        if not isinstance(mcore, dict):
            raise SourceError(f"{mj}: a JSON {type(mcore).__name__}, expected an object")
    found = MegatronDcpCheckpoint(
        base.path, base.tensors, base.objects, base.version, mcore_metadata=mcore
    )
    if parsed is not None:
        parsed[key] = found
    return found
