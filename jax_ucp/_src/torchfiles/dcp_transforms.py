"""torch DCP's stream transforms (``transform_descriptors``) undone without torch: ZStandard
(``stream.zstd/1``, any 1.x as torch takes it), one frame per entry, decoded into at most ``limit``
bytes; any other descriptor is refused by name."""

from __future__ import annotations

from collections.abc import Sequence

import zstandard

from jax_ucp._src.errors import SourceError

#: torch's ZStandard extension (``ZStandard.registry_name()``).
ZSTD = "stream.zstd"
_MAGIC = b"\x28\xb5\x2f\xfd"  # a zstd frame's first bytes (RFC 8878)


def check_descriptors(descriptors: Sequence[str], where: str) -> None:
    """Refuse any descriptor torch's own registry would not decode here, by name."""
    for d in descriptors:
        name, _, version = d.partition("/")
        if name != ZSTD or version.partition(".")[0] != "1":
            raise SourceError(
                f"{where}: unsupported transform descriptor {d[:100]!r} (supported: "
                f"{ZSTD}/1, torch's ZStandard extension)"
            )


def undo(data: bytes, descriptors: Sequence[str], limit: int, where: str) -> bytes:
    """``data`` with each transform undone in the recorded order, each within ``limit``.

    Args:
        data: the storage entry's bytes.
        descriptors: its ``transform_descriptors``.
        limit: the most bytes the decoded entry may hold.
        where: names the entry in errors."""
    check_descriptors(descriptors, where)
    for _ in descriptors:
        data = _zstd(data, limit, where)
    return data


def _zstd(data: bytes, limit: int, where: str) -> bytes:
    if data[:4] != _MAGIC:
        raise SourceError(
            f"{where}: transform {ZSTD}/1, but its bytes do not start a zstd frame "
            f"({data[:4].hex() or 'empty'})"
        )
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise SourceError(f"{where}: corrupt zstd frame header ({e})") from None
    if declared > limit:
        raise SourceError(
            f"{where}: its zstd frame declares {declared} decoded bytes, more than the {limit} "
            f"the entry may hold (a decompression bomb?): refused before decoding"
        )
    end = frame_end(data, where)
    if end != len(data):
        raise SourceError(
            f"{where}: {len(data) - end} bytes after its zstd frame (of {end} bytes); torch "
            f"writes one frame per entry"
        )
    try:
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=limit)
    except zstandard.ZstdError as e:
        raise SourceError(
            f"{where}: its zstd frame does not decode within the {limit} bytes the entry may "
            f"hold (a decompression bomb, or a corrupt frame: {e})"
        ) from None


def frame_end(data: bytes, where: str) -> int:
    """The length of the zstd frame ``data`` starts with: header, blocks, checksum."""
    try:
        pos = zstandard.frame_header_size(data)
    except zstandard.ZstdError as e:
        raise SourceError(f"{where}: corrupt zstd frame header ({e})") from None
    checksum = 4 if data[4] & 0x04 else 0
    while True:
        if pos + 3 > len(data):
            raise SourceError(f"{where}: its zstd frame is cut short at byte {len(data)}")
        header = int.from_bytes(data[pos : pos + 3], "little")
        last, kind, size = header & 1, (header >> 1) & 3, header >> 3
        if kind == 3:
            raise SourceError(f"{where}: corrupt zstd frame (a reserved block type at {pos})")
        pos += 3 + (1 if kind == 1 else size)  # an RLE block: one byte repeated
        if last:
            end = pos + checksum
            if end > len(data):
                raise SourceError(f"{where}: its zstd frame is cut short at byte {len(data)}")
            return end
