"""Byte sizes as users write them ("256MiB", "1GiB", "500MB", "1048576")."""

from __future__ import annotations

import re

from jax_ucp.format.errors import UCPError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 10**3,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 10**12,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


class SizeError(UCPError, ValueError):
    """A byte size that cannot be read, or is not positive."""


def parse_size(value: int | str, what: str = "memory_budget") -> int:
    """``value`` in bytes: an int, or a number with a unit (KiB/MiB/GiB/TiB are powers of 1024,
    KB/MB/GB/TB of 1000; a bare K/M/G/T means the binary unit, as ``ulimit`` and ``free`` do)."""
    if isinstance(value, bool):
        raise SizeError(f"{what}: expected a number of bytes, got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        m = _SIZE.fullmatch(str(value))
        unit = m and _UNITS.get(m.group(2).lower())
        if m is None or unit is None:
            raise SizeError(
                f"{what}: cannot read {value!r} as a size (expected e.g. 268435456, 256MiB, 1GiB)"
            )
        size = int(float(m.group(1)) * unit)
    if size <= 0:
        raise SizeError(f"{what}: must be a positive number of bytes, got {value!r}")
    return size
