"""The manifest (``ucp.json``): typed metadata for every leaf of a checkpoint.

Versioned JSON.  A reader refuses a newer major ``version`` than it knows instead of guessing,
and every field a reader needs is explicit (global shape, dtype, chunking, codecs, kvstore), so a
checkpoint is self-describing without JAX, without the mesh it was saved from, and without us.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jax_ucp.format import dtypes as dtypes_lib
from jax_ucp.format import keypath as keypath_lib
from jax_ucp.version import __version__

FORMAT_NAME = "jax_ucp"
FORMAT_VERSION = 1
MANIFEST_FILE = "ucp.json"
ARRAYS_DIR = "arrays"

ROLES = ("param", "opt_state", "other")


class ManifestError(ValueError):
    """A manifest is missing, unreadable, or not one this version understands."""


@dataclasses.dataclass(frozen=True)
class SavedSharding:
    """Informational: the mesh and PartitionSpec a tensor was saved from."""

    mesh_axis_names: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    partition_spec: tuple[Any, ...]  # entries: None, axis name, or tuple of axis names

    def to_json(self) -> dict:
        return {
            "mesh": {"axis_names": list(self.mesh_axis_names), "shape": list(self.mesh_shape)},
            "partition_spec": [list(p) if isinstance(p, tuple) else p for p in self.partition_spec],
        }

    @classmethod
    def from_json(cls, d: Mapping) -> SavedSharding:
        return cls(
            mesh_axis_names=tuple(d["mesh"]["axis_names"]),
            mesh_shape=tuple(int(x) for x in d["mesh"]["shape"]),
            partition_spec=tuple(
                tuple(p) if isinstance(p, list) else p for p in d["partition_spec"]
            ),
        )


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One array leaf stored as one zarr v3 array under ``arrays/<dir>``."""

    key: tuple[str, ...]
    key_types: tuple[str, ...]  # per component: 'key' | 'index' | 'attr'
    dir: str  # relative to the checkpoint root, e.g. "arrays/params.w"
    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]  # outer shard = save-time per-device shard
    inner_chunk_shape: tuple[int, ...]
    compression: str | None
    checksum: str | None
    role: str
    sub_role: str | None = None
    logical_axes: tuple[str | None, ...] | None = None
    saved_sharding: SavedSharding | None = None
    provenance: dict | None = None

    entry_type = "tensor"

    @property
    def name(self) -> str:
        return keypath_lib.key_to_str(self.key)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes_lib.to_numpy_dtype(self.dtype).itemsize

    def to_json(self) -> dict:
        d = {
            "entry": "tensor",
            "key": list(self.key),
            "key_types": list(self.key_types),
            "dir": self.dir,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "chunk_shape": list(self.chunk_shape),
            "inner_chunk_shape": list(self.inner_chunk_shape),
            "compression": self.compression,
            "checksum": self.checksum,
            "role": self.role,
            "sub_role": self.sub_role,
            "logical_axes": None if self.logical_axes is None else list(self.logical_axes),
            "saved_sharding": None
            if self.saved_sharding is None
            else self.saved_sharding.to_json(),
            "provenance": self.provenance,
        }
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> TensorEntry:
        dtypes_lib.to_numpy_dtype(d["dtype"])  # validates
        return cls(
            key=tuple(d["key"]),
            key_types=tuple(d.get("key_types") or ["key"] * len(d["key"])),
            dir=d["dir"],
            shape=tuple(int(x) for x in d["shape"]),
            dtype=d["dtype"],
            chunk_shape=tuple(int(x) for x in d["chunk_shape"]),
            inner_chunk_shape=tuple(int(x) for x in d["inner_chunk_shape"]),
            compression=d.get("compression"),
            checksum=d.get("checksum"),
            role=d.get("role", "other"),
            sub_role=d.get("sub_role"),
            logical_axes=None if d.get("logical_axes") is None else tuple(d["logical_axes"]),
            saved_sharding=None
            if d.get("saved_sharding") is None
            else SavedSharding.from_json(d["saved_sharding"]),
            provenance=d.get("provenance"),
        )


_VALUE_TYPES = ("none", "bool", "int", "float", "str")


@dataclasses.dataclass(frozen=True)
class ValueEntry:
    """A non-array leaf (Python scalar, string, None) kept as a typed JSON value."""

    key: tuple[str, ...]
    key_types: tuple[str, ...]
    value: Any
    role: str = "other"
    sub_role: str | None = None

    entry_type = "value"

    @property
    def name(self) -> str:
        return keypath_lib.key_to_str(self.key)

    @property
    def nbytes(self) -> int:
        return 0

    def to_json(self) -> dict:
        v = self.value
        if v is None:
            typed = {"type": "none", "value": None}
        elif isinstance(v, bool):
            typed = {"type": "bool", "value": v}
        elif isinstance(v, int):
            typed = {"type": "int", "value": v}
        elif isinstance(v, float):
            # float.hex is exact and carries nan/inf, which plain JSON cannot.
            typed = {"type": "float", "value": float.hex(v)}
        elif isinstance(v, str):
            typed = {"type": "str", "value": v}
        else:
            raise TypeError(
                f"Leaf {self.name!r}: {type(v).__name__} is not a storable value "
                f"(expected None, bool, int, float, str or an array)."
            )
        return {
            "entry": "value",
            "key": list(self.key),
            "key_types": list(self.key_types),
            "role": self.role,
            "sub_role": self.sub_role,
            **typed,
        }

    @classmethod
    def from_json(cls, d: Mapping) -> ValueEntry:
        t = d["type"]
        if t not in _VALUE_TYPES:
            raise ManifestError(
                f"value leaf {d['key']}: unknown value type {t!r} (expected {_VALUE_TYPES})."
            )
        v = d["value"]
        if t == "float":
            v = float.fromhex(v)
        elif t == "int":
            v = int(v)
        elif t == "bool":
            v = bool(v)
        return cls(
            key=tuple(d["key"]),
            key_types=tuple(d.get("key_types") or ["key"] * len(d["key"])),
            value=v,
            role=d.get("role", "other"),
            sub_role=d.get("sub_role"),
        )


Entry = TensorEntry | ValueEntry


@dataclasses.dataclass
class Manifest:
    """Everything ``ucp.json`` says about a checkpoint."""

    entries: list[Entry]
    kvstore_driver: str = "file"
    created_by: str = ""
    created_at: float = 0.0
    source: dict = dataclasses.field(default_factory=dict)
    version: int = FORMAT_VERSION
    format: str = FORMAT_NAME

    def __post_init__(self):
        seen: dict[tuple, str] = {}
        dirs: dict[str, str] = {}
        for e in self.entries:
            if e.key in seen:
                raise ManifestError(f"Duplicate leaf {e.name!r} in manifest.")
            seen[e.key] = e.name
            if isinstance(e, TensorEntry):
                if e.dir in dirs:
                    raise ManifestError(
                        f"Leaves {dirs[e.dir]!r} and {e.name!r} map to the same directory "
                        f"{e.dir!r}; rename one of them."
                    )
                dirs[e.dir] = e.name

    @property
    def tensors(self) -> list[TensorEntry]:
        return [e for e in self.entries if isinstance(e, TensorEntry)]

    @property
    def values(self) -> list[ValueEntry]:
        return [e for e in self.entries if isinstance(e, ValueEntry)]

    def by_key(self) -> dict[tuple[str, ...], Entry]:
        return {e.key: e for e in self.entries}

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def to_json(self) -> dict:
        return {
            "format": self.format,
            "version": self.version,
            "created_by": self.created_by,
            "created_at": self.created_at,
            "kvstore": {"driver": self.kvstore_driver},
            "source": self.source,
            "entries": [e.to_json() for e in self.entries],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, allow_nan=False)

    @classmethod
    def from_json(cls, d: Mapping, *, where: str = "ucp.json") -> Manifest:
        if not isinstance(d, Mapping) or d.get("format") != FORMAT_NAME:
            raise ManifestError(
                f'{where}: not a jax_ucp manifest (expected "format": '
                f'"{FORMAT_NAME}", found {d.get("format") if isinstance(d, Mapping) else type(d).__name__!r}).'
            )
        version = d.get("version")
        if not isinstance(version, int):
            raise ManifestError(f'{where}: "version" must be an integer, found {version!r}.')
        if version > FORMAT_VERSION:
            raise ManifestError(
                f"{where}: format version {version} is newer than this jax_ucp "
                f"understands (≤ {FORMAT_VERSION}); upgrade jax_ucp to read it."
            )
        try:
            entries = [
                TensorEntry.from_json(e) if e["entry"] == "tensor" else ValueEntry.from_json(e)
                for e in d["entries"]
            ]
            return cls(
                entries=entries,
                kvstore_driver=d.get("kvstore", {}).get("driver", "file"),
                created_by=d.get("created_by", ""),
                created_at=d.get("created_at", 0.0),
                source=d.get("source") or {},
                version=version,
                format=d["format"],
            )
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(
                f"{where}: malformed manifest entry: {type(e).__name__}: {e}"
            ) from e

    @classmethod
    def loads(cls, text: str, *, where: str = "ucp.json") -> Manifest:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ManifestError(f"{where}: corrupt manifest, not valid JSON ({e}).") from e
        return cls.from_json(d, where=where)


def read_manifest(directory: str | os.PathLike) -> Manifest:
    path = os.path.join(os.fspath(directory), MANIFEST_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError as e:
        raise ManifestError(
            f"{path}: no manifest; {directory} is not a jax_ucp checkpoint "
            f"(expected a directory with {MANIFEST_FILE} at its root)."
        ) from e
    return Manifest.loads(text, where=path)


def new_manifest(
    entries: Sequence[Entry], *, source: Mapping | None = None, kvstore_driver: str = "file"
) -> Manifest:
    """The manifest of a new save: entries plus who wrote it, when, and from what."""
    return Manifest(
        entries=list(entries),
        kvstore_driver=kvstore_driver,
        created_by=f"jax_ucp {__version__}",
        created_at=time.time(),
        source=dict(source or {"framework": "jax"}),
    )


def array_dir(key: Sequence[str]) -> str:
    return f"{ARRAYS_DIR}/{keypath_lib.encode_key(key)}"
