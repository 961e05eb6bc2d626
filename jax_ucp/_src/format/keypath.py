"""Key paths ⇄ directory names.

A leaf is addressed by a tuple of string components (dict keys, sequence indices, attribute
names).  Source names contain dots and slashes (``decoder.layers.0.weight``), so each component
is escaped reversibly before the components are joined with ``.``; names too long for a file
system are shortened with a hash suffix (the manifest keeps the full key, so nothing is lost).
"""

from __future__ import annotations

import hashlib
import re
import string
from collections.abc import Sequence
from typing import Any

from jax_ucp._src.errors import RequestError

KeyPath = tuple[str, ...]

_SAFE = frozenset(string.ascii_letters + string.digits + "_-")
# Most file systems allow 255 bytes per name; keep room for tmp suffixes.
MAX_DIR_NAME = 200
_HASH_LEN = 16


def escape_component(component: str) -> str:
    """Percent-escapes every byte outside ``[A-Za-z0-9_-]`` (so '.', '/', '%' never appear raw)."""
    escaped = "".join(chr(b) if chr(b) in _SAFE else f"%{b:02X}" for b in component.encode("utf-8"))
    # An empty component would produce '..' sequences; give it a visible, reversible form.
    return escaped or "%"


def unescape_component(escaped: str) -> str:
    """The inverse of ``escape_component``: a key component from its directory-name form."""
    if escaped == "%":
        return ""
    raw = escaped.encode("latin-1")  # one byte per character (a wider one is a ValueError)
    return re.sub(rb"%(.{0,2})", lambda m: bytes([int(m[1], 16)]), raw, flags=re.S).decode("utf-8")


def encode_key(key: Sequence[str]) -> str:
    """The directory name of a key path: escaped components joined by '.', hashed if too long."""
    if not key:
        raise RequestError("A key path needs at least one component (a bare leaf has no name).")
    name = ".".join(escape_component(str(c)) for c in key)
    if len(name) <= MAX_DIR_NAME:
        return name
    digest = hashlib.sha256(name.encode("utf-8")).hexdigest()[:_HASH_LEN]
    return f"{name[: MAX_DIR_NAME - _HASH_LEN - 1]}~{digest}"


def decode_key(name: str) -> KeyPath:
    """Inverse of :func:`encode_key` for names that were not shortened."""
    if "~" in name:
        raise RequestError(
            f"Directory name {name!r} was shortened with a hash; read its key from ucp.json."
        )
    return tuple(unescape_component(part) for part in name.split("."))


def key_to_str(key: Sequence[str]) -> str:
    """A human-readable name for messages and tables (not guaranteed unambiguous)."""
    return "/".join(map(str, key))


def component_of(entry: Any) -> tuple[str, str]:
    """(type, name) of one JAX key-path entry: type is 'key' (dict), 'index' (sequence) or 'attr'."""
    # Imported lazily-typed to keep this module free of JAX: duck-type on JAX's key classes.
    if hasattr(entry, "key"):  # DictKey / FlattenedIndexKey
        key_type = "index" if type(entry).__name__ == "FlattenedIndexKey" else "key"
        return key_type, str(entry.key)
    if hasattr(entry, "idx"):  # SequenceKey
        return "index", str(entry.idx)
    if hasattr(entry, "name"):  # GetAttrKey
        return "attr", str(entry.name)
    return "key", str(entry)
