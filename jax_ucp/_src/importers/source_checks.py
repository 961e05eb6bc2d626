"""What ``verify(SRC)`` of a torch source (no jax_ucp checkpoint) can say of it: the import
planned and every tensor read run the readers' own checks (files and layout, zip CRC-32s, DCP
chunk coverage, megatron-core's ``integrity.json``, ZeRO ranks); what the files record no check
of is said as such, never passed over in silence."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

#: frameworks (the import record's ``framework``) whose tensors are torch.save zip members
_ZIPPED = {"torch_files", "deepspeed", "verl", "torch_checkpointing", "torchtune", "olmo_core"}
#: frameworks whose tensors are torch DCP chunks (``.metadata`` + ``__R_S.distcp``)
_DCP = {"torch_dcp", "olmo_core"}


@dataclasses.dataclass
class SourceCheck:
    """``checked``: what was checked of the source, each a sentence; ``unchecked``: what its
    files record no check of, and why; ``format``: the format it was read as; ``tensors``: how
    many tensors its import holds (0: the import was refused)."""

    format: str
    checked: list[str]
    unchecked: list[str]
    tensors: int = 0


def source_check(record: Mapping[str, Any], checkpoint_format: str) -> SourceCheck:
    """What the import of a source (its record, ``source`` of the manifest convert would
    write) checked of it and what it could not, once every tensor was read."""
    framework = str(record.get("framework") or checkpoint_format)
    checked = [
        f"the {framework} import planned: every file it reads found, its layout checked, every "
        f"tensor of it imported or listed in source.skipped"
    ]
    unchecked = []
    dcp = framework in _DCP or record.get("format") == "torch_dist"
    if dcp:
        checked.append(
            "each tensor's DCP chunks cover its global shape (.metadata), and a chunk in "
            "torch.save's zip form matches its CRC-32"
        )
        unchecked.append(
            "a DCP chunk written raw (no zip around it) records no checksum: its bytes were "
            "read, not verified"
        )
    if framework in _ZIPPED or record.get("format") == "legacy":
        checked.append("each torch.save storage read matches the CRC-32 its zip records")
    if framework == "deepspeed" and record.get("dp_world_size") is not None:
        checked.append(
            f"the ZeRO optimizer files of all {record['dp_world_size']} data-parallel ranks"
        )
    if framework == "megatron":
        if record.get("integrity"):
            checked.append(f"integrity.json: {record['integrity']}")
        elif record.get("format") == "torch_dist":
            unchecked.append(
                "no integrity.json (megatron-core writes it with verify_integrity=True): "
                "its files were not hashed"
            )
    if _holds_safetensors(record):
        unchecked.append(
            "safetensors files record no checksum: their headers were checked, their bytes "
            "read, not verified"
        )
    skipped = record.get("skipped")
    if isinstance(skipped, Mapping) and skipped:
        shown = ", ".join(list(map(str, skipped))[:3])
        more = ", ..." if len(skipped) > 3 else ""
        unchecked.append(
            f"{len(skipped)} entries the import does not take (source.skipped: {shown}{more}) "
            f"were not read"
        )
    unchecked.append(
        "that the values are the run's: torch's files record no checksum of them at save time "
        "(beyond zip CRC-32s); a converted checkpoint is compared with the framework's own "
        "loader by verify CKPT --against SRC"
    )
    return SourceCheck(checkpoint_format, checked, unchecked)


def _holds_safetensors(record: Mapping[str, Any]) -> bool:
    if record.get("framework") == "safetensors":
        return True
    listed = record.get("files")
    return isinstance(listed, (list, tuple)) and any(
        str(f).endswith(".safetensors") for f in listed
    )
