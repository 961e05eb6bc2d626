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
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from jax_ucp._src.errors import SourceError
from jax_ucp._src.format import files
from jax_ucp._src.importers.megatron.common import listed, read_file
from jax_ucp._src.store.storage import Storage
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


#: within ``parsed_once()``: each folder's parse, by its absolute path or URL
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


def open_dcp(folder: Storage) -> MegatronDcpCheckpoint:
    """Parse ``.metadata`` (and ``metadata.json`` when present) of ``folder`` into typed,
    checked entries."""
    parsed, key = _PARSED.get(), folder.absolute()
    if parsed is not None and key in parsed:
        return parsed[key]
    base = dcp.open_dcp(folder, MCORE_CLASSES, fsdp_dtensor=True)
    mcore = {}
    if "metadata.json" in (listed(folder) or ()):  # a FIFO, a device or a huge file: an error
        where = folder.join("metadata.json")
        raw = read_file(folder, "metadata.json", MAX_MCORE_METADATA_BYTES)
        try:
            mcore = files.strict_loads(raw)
        except (ValueError, RecursionError) as e:
            raise SourceError(f"{where}: not JSON ({str(e)[:200]})") from None
        if not isinstance(mcore, dict):
            raise SourceError(f"{where}: a JSON {type(mcore).__name__}, expected an object")
    found = MegatronDcpCheckpoint(
        base.storage, base.tensors, base.objects, base.version, mcore_metadata=mcore
    )
    if parsed is not None:
        parsed[key] = found
    return found
