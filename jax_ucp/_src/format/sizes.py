"""Byte sizes as users write them ("256MiB", "1GiB", "500MB", "1048576")."""

from __future__ import annotations

import operator
import re

from jax_ucp._src.errors import RequestError

# K, M, G, T: with "iB" or bare, powers of 1024; with "B", of 1000
_UNITS = {"": 1, "b": 1} | {
    prefix + suffix: scale
    for i, prefix in enumerate("kmgt", start=1)
    for suffix, scale in (("", 1 << 10 * i), ("ib", 1 << 10 * i), ("b", 10 ** (3 * i)))
}
_SIZE = re.compile(r"\s*(-?[0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*")


#: ``memory_budget``'s default everywhere (restore, plan, verify, convert, export, the writer):
#: bytes of tensor data in flight at once.
DEFAULT_MEMORY_BUDGET = 256 << 20


def parse_size(value: int | str, what: str = "memory_budget") -> int:
    """``value`` in bytes: an int, or a number with an optional unit ("5G", "256MiB", "1.5GB":
    KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB of 1000; a bare K/M/G/T means the binary
    unit, as ``ulimit`` and ``free`` do). Every byte-size option goes through it; ``what``
    names the option in the error."""
    if isinstance(value, bool):
        raise RequestError(f"{what}: expected a number of bytes, got {value!r}")
    if isinstance(value, float) and value.is_integer():  # 2e9, as before
        size = int(value)
    elif not isinstance(value, str):
        try:
            size = operator.index(value)  # an int, numpy's included
        except TypeError:
            raise RequestError(
                f"{what}: expected a number of bytes or a string such as '256MiB', got "
                f"{type(value).__name__} {value!r}"
            ) from None
    else:
        m = _SIZE.fullmatch(value)
        unit = m and _UNITS.get(m.group(2).lower())
        if m is None or unit is None:
            raise RequestError(
                f"{what}: cannot read {value!r} as a size (expected e.g. 268435456, 256MiB, 1GiB)"
            )
        size = int(float(m.group(1)) * unit)
    if size <= 0:
        raise RequestError(f"{what}: must be a positive number of bytes, got {value!r}")
    return size


def format_size(n: float) -> str:
    """A byte count in binary units, as errors and the CLI print it: ``512 B``, ``1.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):  # noqa: B007 (printed: where it stopped)
        if n < 1024:
            break
        n /= 1024
    else:
        unit = "PiB"
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"


def parse_optional_size(value: int | str | None, what: str) -> int | None:
    """``parse_size``, with None (the caller's default) kept as None."""
    return None if value is None else parse_size(value, what)
