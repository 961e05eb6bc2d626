"""The manifest (``ucp.json``): typed metadata for every leaf of a checkpoint.

Versioned JSON.  A reader refuses a newer major ``version`` than it knows instead of guessing,
and every field a reader needs is explicit (global shape, dtype, chunking, codecs, kvstore), so a
checkpoint is self-describing without JAX, without the mesh it was saved from, and without us.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import os
import re
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from jax_ucp._src import bulk
from jax_ucp._src.errors import CheckpointError, RequestError
from jax_ucp._src.format import display, files
from jax_ucp._src.format import dtypes as dtypes_lib
from jax_ucp._src.format import keypath as keypath_lib
from jax_ucp._src.format.sizes import format_size
from jax_ucp._src.version import __version__

FORMAT_NAME = "jax_ucp"
FORMAT_VERSION = 1
MANIFEST_FILE = "ucp.json"
ARRAYS_DIR = "arrays"

ROLES = ("param", "opt_state", "other")
# optax state fields recorded as an opt_state leaf's sub-role
OPTAX_STATE_NAMES = ("mu", "nu", "count", "trace", "ema", "master")
KEY_TYPES = ("key", "index", "attr")
COMPRESSIONS = (None, "zstd")
CHECKSUMS = (None, "crc32c")


def role_of(key: Sequence[str]) -> tuple[str, str | None]:
    """The manifest role of a JAX leaf, from the conventional top-level names of a train state.

    ``params`` → param; ``model_params`` → param/model; ``opt_state`` (or ``optimizer``/``opt``)
    → opt_state with the optax field (``mu``, ``nu``, ``count``, ...) as sub-role; else other.
    One rule for a JAX save and an Orbax import, so both give a tree path the same role.
    """
    top = key[0] if key else None
    if top == "params":
        return "param", None
    if top == "model_params":
        return "param", "model"
    if top in ("opt_state", "optimizer", "opt"):
        sub = next((c for c in key[1:] if c in OPTAX_STATE_NAMES), None)
        return "opt_state", sub
    return "other", None


# Bounds on what a manifest may be: a hostile ucp.json must fail fast, not exhaust the host.
MAX_MANIFEST_BYTES = 512 << 20
MAX_JSON_DEPTH = 512  # a recorded tree structure nests 3 JSON levels per pytree level
#: containers nested in a saved tree: what ``ucp.json`` can record within ``MAX_JSON_DEPTH``
#: (checked at save, so what ``save`` writes ``restore`` reads)
MAX_TREE_DEPTH = MAX_JSON_DEPTH // 3
MAX_INT_DIGITS = 64  # Python values may be large ints (2**70); a 5000-digit one is an attack
_DIR_RE = re.compile(r"arrays/[A-Za-z0-9_%~.\-]+")
_DIGEST_RE = re.compile(r"[0-9a-f]{8}")
_SHARD_KEY_RE = re.compile(r"c(/[0-9]+)*")
# Every key and every digest of one shard_digests map at once, joined by newlines (neither
# pattern admits one): two regex calls per tensor instead of two per shard file, which was half
# of reading a manifest with 447 000 shard files (benchmarks/bench_plan_scale.py).
_SHARD_KEYS_RE = re.compile(r"c(/[0-9]+)*(\nc(/[0-9]+)*)*")
_DIGESTS_RE = re.compile(r"[0-9a-f]{8}(\n[0-9a-f]{8})*")
_FLOAT_HEX_RE = re.compile(r"-?(0x[0-9a-fA-F](\.[0-9a-fA-F]*)?p[+-]?[0-9]+|inf|nan)")


@dataclasses.dataclass(frozen=True)
class SavedSharding:
    """Informational: the mesh and PartitionSpec a tensor was saved from."""

    mesh_axis_names: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    partition_spec: tuple[Any, ...]  # entries: None, axis name, or tuple of axis names

    def to_json(self) -> dict:
        """The JSON form recorded in ``ucp.json``."""
        return {
            "mesh": {"axis_names": list(self.mesh_axis_names), "shape": list(self.mesh_shape)},
            "partition_spec": [list(p) if isinstance(p, tuple) else p for p in self.partition_spec],
        }

    @classmethod
    def from_json(cls, d: Any, where: str = "saved_sharding") -> SavedSharding:
        """Parsed from its JSON form, strictly; errors name ``where``."""
        d = _object(
            d, where, required=("mesh", "partition_spec"), allowed=("mesh", "partition_spec")
        )
        mesh = _object(
            d["mesh"],
            f"{where}.mesh",
            required=("axis_names", "shape"),
            allowed=("axis_names", "shape"),
        )
        names = _str_list(mesh["axis_names"], f"{where}.mesh.axis_names")
        shape = _dims(mesh["shape"], f"{where}.mesh.shape")
        spec = d["partition_spec"]
        if not isinstance(spec, list):
            _fail(f"{where}.partition_spec", "a list", spec)
        entries = tuple(
            p
            if p is None or isinstance(p, str)
            else tuple(_str_list(p, f"{where}.partition_spec[{i}]"))
            for i, p in enumerate(spec)
        )
        return cls(mesh_axis_names=tuple(names), mesh_shape=shape, partition_spec=entries)


@dataclasses.dataclass(frozen=True)
class TensorEntry(display.Tabular):
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
    # Shard file key ("c/0/1") -> crc32c (8 hex digits) of the crc32c trailers of its inner
    # chunks in index order: binds each file to its tensor, position and save. None when the
    # array has no checksums (nothing cheap to bind to).
    shard_digests: Mapping[str, str] | None = None
    # A parameter the run did not train (requires_grad=False): no optimizer state exists for it.
    frozen: bool = False
    # A parameter that is the same tensor as another (a tied lm_head.weight and its embedding):
    # the other's key, "/"-joined. Its optimizer state is the other's.
    tied_to: str | None = None
    # A typed PRNG key array (``jax.random.key``, an NNX ``Rngs`` stream): the JAX key
    # implementation (``KEY_IMPLS``) whose key data (uint32, its key shape last) this stores;
    # a restore wraps the data back into keys (``jax.random.wrap_key_data``).
    key_impl: str | None = None

    entry_type = "tensor"

    @functools.cached_property
    def name(self) -> str:
        """The key path as ``a/b/c`` (how messages and the CLI name a tensor; built once)."""
        return keypath_lib.key_to_str(self.key)

    @property
    def nbytes(self) -> int:
        """Bytes of the array (shape × itemsize)."""
        return math.prod(self.shape) * _itemsize(self.dtype)

    def to_row(self) -> dict[str, Any]:
        """One row of :meth:`Manifest.to_rows`: name, shape, dtype, bytes, role, logical axes,
        saved PartitionSpec and mesh, and where an import read it from."""
        saved = self.saved_sharding
        return {
            "name": self.name,
            "shape": tuple(self.shape),
            "dtype": self.dtype,
            "bytes": self.nbytes,
            "role": self.role + (f"/{self.sub_role}" if self.sub_role else ""),
            "logical_axes": None if self.logical_axes is None else tuple(self.logical_axes),
            "saved_spec": None if saved is None else tuple(saved.partition_spec),
            "saved_mesh": None
            if saved is None
            else display.mesh_text(saved.mesh_axis_names, saved.mesh_shape),
            "source": ", ".join((self.provenance or {}).get("tensors", [])[:3]) or None,
        }

    def table(self):
        return f"tensor {self.name}", [], [self.to_row()], _ENTRY_COLUMNS

    def to_json(self) -> dict:
        """The JSON form recorded in ``ucp.json``: every field, in declaration order, except
        ``frozen``, ``tied_to`` and ``key_impl`` at their defaults (manifests without them stay
        unchanged)."""
        d: dict = {"entry": self.entry_type}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in _OMITTED_AT_DEFAULT and v == f.default:
                continue
            if isinstance(v, SavedSharding):
                v = v.to_json()
            d[f.name] = (
                list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, Mapping) else v
            )
        return d

    @classmethod
    def from_json(cls, d: Any, where: str = "entry") -> TensorEntry:
        """Parsed from its JSON form, strictly; errors name ``where`` and the field.

        Each check is a cheap test whose message is built only when it fails, and what entries
        share (shapes, key types, the saved sharding) is parsed once and shared: a manifest of
        100 000 entries parses in proportion, its entries holding one copy of each."""
        if not (isinstance(d, dict) and _TENSOR_REQUIRED_SET <= d.keys() <= _TENSOR_FIELDS_SET):
            _object(d, where, required=_TENSOR_REQUIRED, allowed=_TENSOR_FIELDS)
        key, key_types = _key(d, where)
        dtype = d["dtype"]
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            _enum(dtype, f"{_named(where, key)}.dtype", dtypes_lib.SUPPORTED)
        shape, chunk_shape, inner = _shapes(d, where, key)
        directory = _directory(d["dir"], where, key)
        checksum = d.get("checksum")
        if checksum not in CHECKSUMS:
            _enum(checksum, f"{_named(where, key)}.checksum", CHECKSUMS)
        digests = _shard_digests(d.get("shard_digests"), where, key)
        logical = d.get("logical_axes")
        if logical is not None:
            logical = _opt_str_list(logical, f"{_named(where, key)}.logical_axes")
            if len(logical) != len(shape):
                _fail(
                    f"{_named(where, key)}.logical_axes", f"{len(shape)} names", d["logical_axes"]
                )
        provenance = d.get("provenance")
        if provenance is not None:
            _object(provenance, f"{_named(where, key)}.provenance")
        frozen = d.get("frozen", False)
        if not isinstance(frozen, bool):
            _fail(f"{_named(where, key)}.frozen", "a JSON bool", frozen)
        tied_to = d.get("tied_to")
        if tied_to is not None and not isinstance(tied_to, str):
            _string(tied_to, f"{_named(where, key)}.tied_to")
        key_impl = d.get("key_impl")
        if key_impl is not None:
            _key_impl(key_impl, d["dtype"], shape, _named(where, key))
        compression = d.get("compression")
        if compression not in COMPRESSIONS:
            _enum(compression, f"{_named(where, key)}.compression", COMPRESSIONS)
        role = d["role"]
        if not isinstance(role, str) or role not in _ROLES:
            _enum(role, f"{_named(where, key)}.role", ROLES)
        sub_role = d.get("sub_role")
        if sub_role is not None and not isinstance(sub_role, str):
            _string(sub_role, f"{_named(where, key)}.sub_role")
        saved = d.get("saved_sharding")
        if saved is not None:
            saved = _saved_sharding(saved, where, key)
        entry = object.__new__(cls)  # every field set here: __init__'s 17 frozen setattrs
        entry.__dict__.update(  # would double the cost of a parse; the fields are checked
            key=key,
            key_types=key_types,
            dir=directory,
            shape=shape,
            dtype=_CANONICAL[dtype],
            chunk_shape=chunk_shape,
            inner_chunk_shape=inner,
            compression=_CANONICAL.get(compression),
            checksum=_CANONICAL.get(checksum),
            role=_CANONICAL[role],
            sub_role=sub_role,
            logical_axes=None if logical is None else tuple(logical),
            saved_sharding=saved,
            provenance=provenance,
            shard_digests=digests,
            frozen=frozen,
            tied_to=tied_to,
            key_impl=key_impl,
        )
        return entry


_OMITTED_AT_DEFAULT = frozenset(("frozen", "tied_to", "key_impl"))
#: JAX's PRNG key implementations a ``key_impl`` may name, with the shape of one key's data
#: (the stored tensor's last dimensions): a manifest names nothing else.
KEY_IMPLS = {"threefry2x32": (2,), "rbg": (4,), "unsafe_rbg": (4,)}


def _key_impl(v: Any, dtype: Any, shape: tuple[int, ...], where: str) -> None:
    """A ``key_impl`` checked against the tensor it describes: a known implementation, and
    uint32 key data whose last dimensions are one key's."""
    _enum(v, f"{where}.key_impl", tuple(KEY_IMPLS))
    key_shape = KEY_IMPLS[v]
    if dtype != "uint32" or tuple(shape[len(shape) - len(key_shape) :]) != key_shape:
        _fail(
            f"{where}.key_impl",
            f"uint32 key data of shape (..., {', '.join(map(str, key_shape))}) for {v!r}",
            f"{dtype} of shape {list(shape)}",
        )


_TENSOR_REQUIRED = (
    "entry",
    "key",
    "dir",
    "shape",
    "dtype",
    "chunk_shape",
    "inner_chunk_shape",
    "role",
)
_TENSOR_FIELDS = _TENSOR_REQUIRED + tuple(
    f.name for f in dataclasses.fields(TensorEntry) if f.name not in _TENSOR_REQUIRED
)
_TENSOR_REQUIRED_SET, _TENSOR_FIELDS_SET = frozenset(_TENSOR_REQUIRED), frozenset(_TENSOR_FIELDS)


# JSON "type" of a value entry -> (what its "value" must be, the check)
_VALUE_TYPES = {
    "none": ("null", lambda v: v is None),
    "bool": ("a JSON boolean", lambda v: isinstance(v, bool)),
    "int": ("a JSON integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": ("a float.hex string", lambda v: isinstance(v, str) and _FLOAT_HEX_RE.fullmatch(v)),
    "str": ("a JSON string", lambda v: isinstance(v, str)),
}


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
        """The key path as ``a/b/c``."""
        return keypath_lib.key_to_str(self.key)

    @property
    def nbytes(self) -> int:
        """0: a value holds no array bytes."""
        return 0

    def to_json(self) -> dict:
        """The JSON form recorded in ``ucp.json`` (floats as ``float.hex``, exact)."""
        v = self.value
        if v is None:
            typed = {"type": "none", "value": None}
        elif isinstance(v, bool):
            typed = {"type": "bool", "value": v}
        elif isinstance(v, int):
            if abs(v) >= 10**MAX_INT_DIGITS:
                raise CheckpointError(
                    f"Leaf {self.name!r}: an int of more than {MAX_INT_DIGITS} digits is not "
                    f"storable as a value; save it as an array or a string."
                )
            typed = {"type": "int", "value": v}
        elif isinstance(v, float):
            # float.hex is exact and carries nan/inf, which plain JSON cannot.
            typed = {"type": "float", "value": float.hex(v)}
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise CheckpointError(
                    f"Leaf {self.name!r}: value: not encodable as UTF-8 ({e.reason} at {e.start})."
                ) from None
            typed = {"type": "str", "value": v}
        else:
            raise RequestError(
                f"Leaf {self.name!r}: {type(v).__name__} is not a storable value "
                f"(expected None, bool, int, float, str or an array)."
            )
        return {
            "entry": self.entry_type,
            "key": list(self.key),
            "key_types": list(self.key_types),
            "role": self.role,
            "sub_role": self.sub_role,
            **typed,
        }

    @classmethod
    def from_json(cls, d: Any, where: str = "entry") -> ValueEntry:
        """Parsed from its JSON form, strictly; errors name ``where`` and the field."""
        _object(d, where, required=("entry", "key", "type", "value"), allowed=_VALUE_FIELDS)
        key, key_types = _key(d, where)
        w = _named(where, key)
        t = _enum(d["type"], f"{w}.type", tuple(_VALUE_TYPES))
        v = d["value"]
        expected, valid = _VALUE_TYPES[t]
        if not valid(v):
            _fail(f"{w}.value", expected, v)
        if t == "float":
            try:
                v = float.fromhex(v)
            except (ValueError, OverflowError):
                _fail(f"{w}.value", expected, d["value"])
        return cls(
            key=key,
            key_types=key_types,
            value=v,
            role=_enum(d.get("role", "other"), f"{w}.role", ROLES),
            sub_role=None if d.get("sub_role") is None else _string(d["sub_role"], f"{w}.sub_role"),
        )


_VALUE_FIELDS = ("entry", "key", "key_types", "role", "sub_role", "type", "value")
#: what a table of tensors shows (``to_rows`` has a few more)
_ENTRY_COLUMNS = ("name", "shape", "dtype", "role", "logical_axes", "saved_spec")


Entry = TensorEntry | ValueEntry


@dataclasses.dataclass
class Manifest(display.Tabular):
    """Everything ``ucp.json`` says about a checkpoint."""

    entries: list[Entry]
    save_id: str = ""  # unique per save: shard digests and concurrent readers are tied to it
    kvstore_driver: str = "file"
    created_by: str = ""
    created_at: float = 0.0
    source: dict = dataclasses.field(default_factory=dict)
    # The saved pytree's container structure (dict/list/tuple/NamedTuple nodes, child names),
    # so a restore without a target rebuilds e.g. optax states; None for imports.
    tree: dict | None = None
    version: int = FORMAT_VERSION
    format: str = FORMAT_NAME
    # Not stored: what a reader noticed (``jax_ucp.inspect`` fills it), e.g. a container class
    # it will not rebuild. Each a full sentence naming the tree node.
    notices: list[str] = dataclasses.field(default_factory=list, compare=False, repr=False)

    def __post_init__(self):
        """Refuses two entries with one key path or one array directory."""
        seen: set[tuple] = set()
        dirs: dict[str, Entry] = {}
        for e in self.entries:
            if e.key in seen:
                raise CheckpointError(f"Duplicate leaf {e.name!r} in manifest.")
            seen.add(e.key)
            if isinstance(e, TensorEntry):
                if e.dir in dirs:
                    raise CheckpointError(
                        f"Leaves {dirs[e.dir].name!r} and {e.name!r} map to the same directory "
                        f"{e.dir!r}; rename one of them."
                    )
                dirs[e.dir] = e

    @property
    def tensors(self) -> list[TensorEntry]:
        """The tensor entries, in manifest order."""
        return [e for e in self.entries if isinstance(e, TensorEntry)]

    @property
    def values(self) -> list[ValueEntry]:
        """The saved Python values, in manifest order."""
        return [e for e in self.entries if isinstance(e, ValueEntry)]

    def by_key(self) -> dict[tuple[str, ...], Entry]:
        """Key path -> entry."""
        return {e.key: e for e in self.entries}

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor."""
        return sum(e.nbytes for e in self.entries)

    @property
    def saved_meshes(self) -> list[str]:
        """The meshes the tensors were saved from (``fsdp=2 × tp=4``), most used first."""
        meshes = collections.Counter(
            (s.mesh_axis_names, s.mesh_shape) for e in self.tensors if (s := e.saved_sharding)
        )
        counts: collections.Counter[str] = collections.Counter()
        for (names, shape), n in meshes.items():  # each mesh's text built once
            counts[display.mesh_text(names, shape)] += n
        return [text for text, _ in counts.most_common()]

    def to_rows(self) -> list[dict[str, Any]]:
        """One dict per tensor (:meth:`TensorEntry.to_row`), then one per saved value (name,
        value, role): ``pandas.DataFrame(m.to_rows())`` without jax_ucp depending on pandas."""
        rows = [e.to_row() for e in self.tensors]
        rows += [{"name": e.name, "value": e.value, "role": e.role} for e in self.values]
        return rows

    def summary_lines(self) -> list[str]:
        """What a display shows above the table: sizes, the saved mesh, the source."""
        lines = [
            f"{len(self.tensors)} tensors, {len(self.values)} values, {format_size(self.nbytes)} "
            f"(format v{self.version}, {self.created_by})"
        ]
        meshes = self.saved_meshes
        if meshes:
            lines.append("saved mesh: " + "; ".join(meshes))
        source = self.source or {}
        if source.get("path"):  # an import
            framework = source.get("framework") or source.get("format") or "torch"
            lines.append(f"imported from {framework}: {source['path']}")
        return lines

    def table(self):
        rows = [e.to_row() for e in self.tensors]
        return "jax_ucp checkpoint", self.summary_lines(), rows, _ENTRY_COLUMNS

    def __repr__(self) -> str:
        return (
            f"Manifest({len(self.tensors)} tensors, {len(self.values)} values, "
            f"{format_size(self.nbytes)}, format v{self.version})"
        )

    def to_json(self) -> dict:
        """The JSON form of ``ucp.json``."""
        return {
            "format": self.format,
            "version": self.version,
            "save_id": self.save_id,
            "created_by": self.created_by,
            "created_at": self.created_at,
            "kvstore": {"driver": self.kvstore_driver},
            "source": self.source,
            **({"tree": self.tree} if self.tree is not None else {}),
            "entries": [e.to_json() for e in self.entries],
        }

    def dumps(self) -> str:
        """``ucp.json``'s text, refused when nested deeper than a reader accepts. One field a
        line, the tree on one line and one entry a line, each compact: readable and greppable
        (a tensor per line) at 57 % of the indented size, which a 100 000-tensor checkpoint
        parses in proportion."""
        d = self.to_json()
        _check_nesting(d, f"{MANIFEST_FILE} to be written (the saved tree nests too deep)")

        def compact(v) -> str:
            return json.dumps(v, separators=(",", ":"), allow_nan=False)

        fields = [f" {json.dumps(k)}: {compact(v)}" for k, v in d.items() if k != "entries"]
        entries = ",\n  ".join(compact(e) for e in d["entries"])
        body = ",\n".join([*fields, f' "entries": [\n  {entries}\n ]'])
        return "{\n" + body + "\n}\n"

    @classmethod
    def from_json(cls, d: Any, *, where: str = MANIFEST_FILE) -> Manifest:
        """Parsed from its JSON form, strictly; errors name ``where`` and the field."""
        if not isinstance(d, Mapping) or d.get("format") != FORMAT_NAME:
            found = d.get("format") if isinstance(d, Mapping) else type(d).__name__
            raise CheckpointError(
                f'{where}: not a jax_ucp manifest (expected "format": "{FORMAT_NAME}", '
                f"found {_short(found)})."
            )
        version = d.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            _fail(f"{where}: version", "an integer ≥ 1", version)
        if version > FORMAT_VERSION:
            raise CheckpointError(
                f"{where}: format version {version} is newer than this jax_ucp "
                f"understands (≤ {FORMAT_VERSION}); upgrade jax_ucp to read it."
            )
        _object(d, where, required=_MANIFEST_REQUIRED, allowed=_MANIFEST_FIELDS)
        kvstore = _object(
            d["kvstore"], f"{where}: kvstore", required=("driver",), allowed=("driver",)
        )
        entries_json = d["entries"]
        if isinstance(entries_json, _ParsedEntries):  # by loads, as they were decoded
            if entries_json.error is not None:
                raise entries_json.error
            entries = entries_json.entries
        elif not isinstance(entries_json, list):
            _fail(f"{where}: entries", "a list", entries_json)
        else:
            entries = [_entry(e, f"{where}: entries[{i}]") for i, e in enumerate(entries_json)]
        created_at = d.get("created_at", 0.0)
        if isinstance(created_at, bool) or not isinstance(created_at, (int, float)):
            _fail(f"{where}: created_at", "a number", created_at)
        tree = d.get("tree")
        if tree is not None:
            leaves, keys = _tree_leaves(tree, f"{where}: tree", where), {e.key for e in entries}
            if leaves != keys:
                odd = sorted(leaves ^ keys)[:3]
                raise CheckpointError(
                    f"{where}: tree: its leaves and the entries differ (e.g. "
                    f"{[keypath_lib.key_to_str(k) for k in odd]}); expected exactly one leaf per entry."
                )
        try:  # Manifest's own checks (a key or directory twice) name the file too
            return cls(
                entries=entries,
                save_id=_string(d["save_id"], f"{where}: save_id"),
                kvstore_driver=_string(kvstore["driver"], f"{where}: kvstore.driver"),
                created_by=_string(d.get("created_by", ""), f"{where}: created_by"),
                created_at=float(created_at),
                source=_object(d.get("source", {}), f"{where}: source"),
                tree=tree,
                version=version,
                format=d["format"],
            )
        except CheckpointError as e:
            if str(e).startswith(where):
                raise
            raise CheckpointError(f"{where}: {e}") from None

    @classmethod
    def loads(cls, text: str | bytes, *, where: str = MANIFEST_FILE) -> Manifest:
        """Parsed from ``ucp.json``'s text (size, depth, integers bounded); errors name ``where``.

        Each entry becomes its ``TensorEntry`` as soon as it is decoded, so the decoded JSON of
        all entries (~4 KB an entry) is never held at once: a 100 000-entry manifest peaks at
        its text and its entries."""
        if isinstance(text, bytes):
            text = _manifest_text(text, where=where)
        # Integers are bounded by a hook only when the text holds a run of digits that long
        # (the hook costs a Python call per integer: seconds for 100 000 entries).
        decoder = json.JSONDecoder(
            parse_int=_bounded_int if _long_digit_run(text) else None,
            parse_constant=_no_constant,
        )
        with bulk.cyclic_gc_paused():
            try:
                d = _decode(text, decoder, where)
            except RecursionError:  # the C scanner's own guard, far below the stack's end
                raise CheckpointError(
                    f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels."
                ) from None
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{where}: corrupt manifest, not valid JSON ({e}).") from None
            except CheckpointError:
                raise
            except ValueError as e:
                raise CheckpointError(f"{where}: {e}") from None
            _check_nesting(d, where)
            return cls.from_json(d, where=where)


class _ParsedEntries:
    """The ``entries`` array as ``Manifest.loads`` decoded it: each element's entry (until the
    first that fails, whose error ``from_json`` raises where it checks the entries), and
    whether an element's provenance nests too deep (raised before any field is checked)."""

    def __init__(self, where: str):
        self.where = where
        self.entries: list[Entry] = []
        self.error: CheckpointError | None = None
        self.too_deep = False

    def add_from(self, scan, text: str, i: int) -> int:
        """The element at ``i`` decoded and added; the index after it."""
        element, i = _scan(scan, text, i)
        self.add(element)
        return i

    def add(self, element: Any) -> None:
        """One decoded element: checked and kept as its entry, its JSON dropped."""
        if self.error is not None or self.too_deep:
            return  # an error is raised anyway; the rest is only decoded (valid JSON or not)
        if isinstance(element, dict) and _deeper(element.get("provenance"), 4) is not None:
            self.too_deep = True
            return
        try:
            self.entries.append(_entry(element, f"{self.where}: entries[{len(self.entries)}]"))
        except CheckpointError as e:
            self.error = e


def _entry(e: Any, where: str) -> Entry:
    """One element of ``entries``, by its ``entry`` kind."""
    kind = e.get("entry") if isinstance(e, Mapping) else None
    if kind == "tensor":
        return TensorEntry.from_json(e, where)
    if kind == "value":
        return ValueEntry.from_json(e, where)
    _fail(f"{where}.entry", '"tensor" or "value"', kind)


_WHITESPACE = re.compile(r"[ \t\n\r]*")  # JSON's own (json.decoder.WHITESPACE)
_scanstring = json.decoder.scanstring  # pyright: ignore[reportAttributeAccessIssue]


def _skip(text: str, i: int) -> int:
    """The index of the first character at or after ``i`` that is not JSON whitespace."""
    found = _WHITESPACE.match(text, i)
    return found.end() if found else i


def _decode(text: str, decoder: json.JSONDecoder, where: str) -> Any:
    """``decoder.decode(text)``, except that the top-level object's ``entries`` array (each
    occurrence: the last one counts, as for any key) comes back as ``_ParsedEntries``. Every
    value is decoded by ``decoder`` itself (its strings, numbers, hooks and nesting guard);
    only the top-level object and that array are walked here, as ``json`` walks them."""
    scan = decoder.scan_once  # pyright: ignore[reportAttributeAccessIssue]  # json's scanner
    i = _skip(text, 0)
    if not text.startswith("{", i):
        return decoder.decode(text)  # not an object: no entries to stream
    out: dict[str, Any] = {}

    def member(i: int) -> int:
        if not text.startswith('"', i):
            raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, i)
        name, i = _scanstring(text, i + 1)
        i = _skip(text, i)
        if not text.startswith(":", i):
            raise json.JSONDecodeError("Expecting ':' delimiter", text, i)
        i = _skip(text, i + 1)
        if name == "entries" and text.startswith("[", i):  # each element its entry, as decoded
            parsed = out[name] = _ParsedEntries(where)
            return _items(text, i + 1, "]", lambda i: parsed.add_from(scan, text, i))
        out[name], i = _scan(scan, text, i)
        return i

    i = _skip(text, _items(text, i + 1, "}", member))
    if i != len(text):
        raise json.JSONDecodeError("Extra data", text, i)
    return out


def _items(text: str, i: int, close: str, item) -> int:
    """Walks the comma-separated items of the array or object whose opening bracket ends at
    ``i``, ``item(i)`` decoding each (returning the index after it); the index after ``close``."""
    i = _skip(text, i)
    if text.startswith(close, i):
        return i + 1
    while True:
        i = _skip(text, item(i))
        if text.startswith(close, i):
            return i + 1
        if not text.startswith(",", i):
            raise json.JSONDecodeError("Expecting ',' delimiter", text, i)
        i = _skip(text, i + 1)


def _scan(scan, text: str, i: int) -> tuple[Any, int]:
    """One JSON value at ``i`` and the index after it."""
    try:
        return scan(text, i)
    except StopIteration as e:
        raise json.JSONDecodeError("Expecting value", text, e.value) from None


_MANIFEST_REQUIRED = ("format", "version", "save_id", "kvstore", "entries")
_MANIFEST_FIELDS = _MANIFEST_REQUIRED + ("created_by", "created_at", "source", "tree")
TREE_NODE_TYPES = ("leaf", "dict", "list", "tuple", "namedtuple", "object")


def read_manifest_file(directory: str | os.PathLike) -> Manifest:
    """The manifest file of the checkpoint in the local ``directory``, strictly validated
    (``store.read_manifest`` reads one anywhere, object stores included).

    Only a regular file is read (a FIFO or device is refused without blocking) and at most
    ``MAX_MANIFEST_BYTES`` of it; every error names the file and the field.
    """
    path = os.path.join(os.fspath(directory), MANIFEST_FILE)
    try:  # never a link out of the checkpoint (another checkpoint's manifest)
        data = files.read_regular(files.inside(directory, MANIFEST_FILE, path), MAX_MANIFEST_BYTES)
    except FileNotFoundError as e:
        raise CheckpointError(
            f"{path}: no manifest; {directory} is not a jax_ucp checkpoint "
            f"(expected a directory with {MANIFEST_FILE} at its root)."
        ) from e
    except files.UnsafeFileError as e:
        raise CheckpointError(str(e)) from None
    text = _manifest_text(data, where=path)
    del data  # the bytes freed before the entries are built (50 MB for 100 000 tensors)
    return Manifest.loads(text, where=path)


def _manifest_text(data: bytes, *, where: str = MANIFEST_FILE) -> str:
    """``ucp.json``'s bytes as text (strict UTF-8); errors name ``where``."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{where}: not UTF-8 text ({e}).") from None


def new_manifest(
    entries: Sequence[Entry],
    *,
    source: Mapping | None = None,
    kvstore_driver: str = "file",
    tree: dict | None = None,
) -> Manifest:
    """The manifest of a new save: entries plus who wrote it, when, and from what.

    Args:
        entries: every tensor and value entry
        source: where an import came from (format, path, ...), if it is one
        kvstore_driver: ``file`` or the object store's driver
        tree: the pytree's structure (node types), for restoring without a target
    """
    return Manifest(
        entries=list(entries),
        save_id=uuid.uuid4().hex,
        kvstore_driver=kvstore_driver,
        created_by=f"jax_ucp {__version__}",
        created_at=time.time(),
        source=dict(source or {"framework": "jax"}),
        tree=tree,
    )


def array_dir(key: Sequence[str]) -> str:
    """Where a tensor's zarr array lives, relative to the checkpoint (``arrays/<encoded key>``)."""
    return f"{ARRAYS_DIR}/{keypath_lib.encode_key(key)}"


# --- strict field checks (the JSON schema, in code: the reader is never looser than it) -------


@functools.cache
def _itemsize(dtype: str) -> int:
    return dtypes_lib.to_numpy_dtype(dtype).itemsize


def _short(value: Any, limit: int = 80) -> str:
    """A bounded repr: a hostile value's repr is never built in full."""
    if isinstance(value, (dict, list)):
        return f"a JSON {'object' if isinstance(value, dict) else 'array'} of {len(value)} items"
    if isinstance(value, str):
        return repr(value[:limit] + ("…" if len(value) > limit else ""))
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**limit:
        return "a very large integer"
    return repr(value)[:limit]


def _fail(where: str, expected: str, found: Any) -> NoReturn:
    raise CheckpointError(f"{where}: expected {expected}, found {_short(found)}.")


def _object(
    d: Any, where: str, required: tuple[str, ...] = (), allowed: tuple[str, ...] | None = None
) -> dict:
    if not isinstance(d, dict):
        _fail(where, "a JSON object", d)
    if required and not d.keys() >= _as_set(required):
        missing = next(k for k in required if k not in d)
        raise CheckpointError(f"{where}: missing field {missing!r}.")
    if allowed is not None and not d.keys() <= _as_set(allowed):
        extra = [k for k in d if k not in allowed]
        if extra:
            names = ", ".join(_short(k, 40) for k in extra[:5])
            raise CheckpointError(
                f"{where}: unknown field(s) [{names}] (known: {', '.join(allowed)})."
            )
    return d


def _tree_leaves(tree: Any, where: str, file: str) -> set[tuple[str, ...]]:
    """The key paths of the saved tree's leaves, each node checked on the way (walked without
    recursion; at most ``MAX_JSON_DEPTH`` JSON levels deep, 3 a pytree level, below the
    manifest's own 2). Errors name the node as ``where.children[i][2]...``, built only then."""
    leaves: set[tuple[str, ...]] = set()
    stack: list[tuple[Any, tuple[str, ...], tuple[int, ...]]] = [(tree, (), ())]
    while stack:
        d, prefix, path = stack.pop()
        if _is_leaf_node(d):
            leaves.add(prefix)
            continue
        level = 2 + 3 * len(path)  # of the node; its children list is one deeper, each child two
        if level + 1 > MAX_JSON_DEPTH and (level > MAX_JSON_DEPTH or _deeper(d, level) is not None):
            raise CheckpointError(f"{file}: JSON nested deeper than {MAX_JSON_DEPTH} levels.")
        if not (  # the usual container node, else every check with its message
            type(d) is dict
            and d.keys() <= _PLAIN_NODE_FIELDS
            and isinstance(d.get("type"), str)
            and d["type"] in _PLAIN_NODE_TYPES
            and type(d.get("children")) is list
        ):
            w = where + "".join(f".children[{i}][2]" for i in path)
            if _tree_node(d, w) == "leaf":
                leaves.add(prefix)
                continue
        pending = []
        for i, child in enumerate(d["children"]):
            if not (isinstance(child, list) and len(child) == 3 and isinstance(child[0], str)):
                w = where + "".join(f".children[{i}][2]" for i in path)
                _fail(f"{w}.children[{i}]", "[name, key type, node]", child)
            if child[1] not in KEY_TYPES:
                w = where + "".join(f".children[{i}][2]" for i in path)
                _enum(child[1], f"{w}.children[{i}][1]", KEY_TYPES)
            if _is_leaf_node(child[2]):
                leaves.add((*prefix, child[0]))
            else:
                pending.append((child[2], (*prefix, child[0]), (*path, i)))
        stack.extend(reversed(pending))
    return leaves


def _is_leaf_node(d: Any) -> bool:
    return type(d) is dict and len(d) == 1 and d.get("type") == "leaf"


def _tree_node(d: Any, where: str) -> str:
    """One node of the saved tree checked (not its children's nodes); returns its type."""
    kind = _enum(_object(d, where, required=("type",))["type"], f"{where}.type", TREE_NODE_TYPES)
    if kind == "leaf":
        _object(d, where, allowed=("type",))
        return kind
    _object(
        d, where, required=("type", "children"), allowed=("type", "children", "class", "metadata")
    )
    if kind in ("namedtuple", "object"):
        _string(d.get("class"), f"{where}.class")
    if "metadata" in d:  # an nnx.Variable's: names to JSON scalars or lists of them
        metadata = _object(d["metadata"], f"{where}.metadata")
        for name, v in metadata.items():
            if not _is_scalar(v) and not (isinstance(v, list) and all(map(_is_scalar, v))):
                _fail(f"{where}.metadata.{name}", "a JSON scalar or a list of them", v)
    if not isinstance(d["children"], list):
        _fail(f"{where}.children", "a list", d["children"])
    return kind


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (str, bool, int, float))


_PLAIN_NODE_FIELDS = frozenset(("type", "children"))
_PLAIN_NODE_TYPES = frozenset(("dict", "list", "tuple"))


def _string(v: Any, where: str) -> str:
    if not isinstance(v, str):
        _fail(where, "a string", v)
    return v


def _enum(v: Any, where: str, allowed: Sequence) -> Any:
    if isinstance(v, bool) or v not in allowed:
        _fail(where, f"one of {list(allowed)}", v)
    return v


def _dims(v: Any, where: str, positive: bool = False) -> tuple[int, ...]:
    lo = 1 if positive else 0
    if not isinstance(v, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) and lo <= x < 2**62 for x in v
    ):
        _fail(where, f"a list of integers ≥ {lo}", v)
    if len(v) > 64:
        _fail(where, "at most 64 dimensions", v)
    return tuple(v)


def _str_list(v: Any, where: str) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        _fail(where, "a list of strings", v)
    return v


def _opt_str_list(v: Any, where: str) -> list:
    if not isinstance(v, list) or not all(x is None or isinstance(x, str) for x in v):
        _fail(where, "a list of strings or nulls", v)
    return v


def _key(d: dict, where: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """An entry's key path and its key types (absent: all "key"); the key types of many
    entries are one shared tuple."""
    v = d["key"]
    if not isinstance(v, list) or not v:
        _fail(f"{where}.key", "a non-empty list of strings", v)
    if _STR_ONLY.issuperset(map(type, v)):  # names repeat across entries: one object each
        key = tuple(map(sys.intern, v))
    else:
        key = tuple(_str_list(v, f"{where}.key"))
    types = d.get("key_types")
    if types is None and "key_types" not in d:
        types = ["key"] * len(key)
    if isinstance(types, list) and _STR_ONLY.issuperset(map(type, types)):
        shared = _KEY_TYPES.get(tuple(types))
        if shared is not None and len(shared) == len(key):
            return key, shared
    n = len(key)
    if not isinstance(types, list) or len(types) != n or not all(t in KEY_TYPES for t in types):
        _fail(f"{_named(where, key)}.key_types", f"a list of {n} of {list(KEY_TYPES)}", types)
    return key, _remember(_KEY_TYPES, tuple(types), tuple(types))


def _directory(v: Any, where: str, key: tuple[str, ...]) -> str:
    """An entry's ``dir``: ``arrays/<escaped key>``, one level below ``arrays``."""
    if not isinstance(v, str) or not _DIR_RE.fullmatch(v) or v.split("/", 1)[1] in (".", ".."):
        w = f"{_named(where, key)}.dir"
        _fail(w, "'arrays/<escaped key>' (no '/', no '..')", _string(v, w))
    return v


def _shard_digests(v: Any, where: str, key: tuple[str, ...]) -> dict[str, str] | None:
    """An entry's ``shard_digests`` (a copy): shard key -> 8 hex digits."""
    if v is None:
        return None
    if not isinstance(v, dict):
        _object(v, f"{_named(where, key)}.shard_digests")
    for k, digest in () if _digests_valid(v) else v.items():  # two regex calls, not two a shard
        if (
            not _SHARD_KEY_RE.fullmatch(k)
            or not isinstance(digest, str)
            or not _DIGEST_RE.fullmatch(digest)
        ):
            _fail(f"{_named(where, key)}.shard_digests", "shard key -> 8 hex digits", {k: digest})
    return dict(v)


def _digests_valid(digests: Mapping) -> bool:
    """Every key of ``digests`` a shard key and every value 8 hex digits (False also when the
    map is empty or one is not: the caller's per-item check then names the culprit)."""
    values = list(digests.values())
    if not values or not all(type(v) is str for v in values):
        return False
    keys, digest_text = "\n".join(digests), "\n".join(values)  # JSON object keys are strings
    if keys.count("\n") != len(values) - 1 or digest_text.count("\n") != len(values) - 1:
        return False  # a newline inside a key or a digest: never valid, found item by item
    return bool(_SHARD_KEYS_RE.fullmatch(keys) and _DIGESTS_RE.fullmatch(digest_text))


def _named(where: str, key: tuple[str, ...]) -> str:
    """How errors name an entry: ``where`` and its key path."""
    return f"{where} ({keypath_lib.key_to_str(key)!r})"


def _shapes(
    d: dict, where: str, key: tuple[str, ...]
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """An entry's shape, chunk_shape and inner_chunk_shape, checked together (and shared: a
    triple of plain ints seen before was valid, so it is not checked again)."""
    lists = d["shape"], d["chunk_shape"], d["inner_chunk_shape"]
    if all(type(v) is list for v in lists) and _INT_ONLY.issuperset(
        map(type, lists[0] + lists[1] + lists[2])
    ):  # exact ints: equal tuples are the same dimensions (True == 1 is ruled out)
        known = _SHAPES.get((tuple(lists[0]), tuple(lists[1]), tuple(lists[2])))
        if known is not None:
            return known
    w = _named(where, key)
    shape = _dims(d["shape"], f"{w}.shape")
    chunk_shape = _dims(d["chunk_shape"], f"{w}.chunk_shape", positive=True)
    inner = _dims(d["inner_chunk_shape"], f"{w}.inner_chunk_shape", positive=True)
    if not (len(shape) == len(chunk_shape) == len(inner)):
        _fail(
            f"{w}.chunk_shape",
            f"{len(shape)} dimensions like shape {list(shape)}",
            d["chunk_shape"],
        )
    if any(c > max(n, 1) for n, c in zip(shape, chunk_shape)):
        _fail(  # a chunk larger than its array would make a reader allocate for nothing
            f"{w}.chunk_shape",
            f"extents at most shape {list(shape)} (1 for a zero-size dimension)",
            d["chunk_shape"],
        )
    if any(c % i for c, i in zip(chunk_shape, inner)):
        _fail(
            f"{w}.inner_chunk_shape",
            f"extents dividing chunk_shape {list(chunk_shape)}",
            d["inner_chunk_shape"],
        )
    triple = (shape, chunk_shape, inner)
    if all(type(x) is int for x in shape + chunk_shape + inner):
        _remember(_SHAPES, triple, triple)
    return triple


def _sharding_key(v: Any) -> tuple | None:
    """A hashable form of a saved_sharding's JSON that tells types apart (``True`` from ``1``),
    when it has its one valid layout; else None (parsed without the memo)."""
    if type(v) is not dict or v.keys() != _SHARDING_FIELDS:
        return None
    mesh, spec = v["mesh"], v["partition_spec"]
    if type(mesh) is not dict or mesh.keys() != _MESH_FIELDS or type(spec) is not list:
        return None
    names, shape = mesh["axis_names"], mesh["shape"]
    if type(names) is not list or type(shape) is not list:
        return None
    parts: list = []
    for p in spec:
        if type(p) is list:
            if not _STR_ONLY.issuperset(map(type, p)):
                return None
            parts.append(tuple(p))
        elif p is None or type(p) is str:
            parts.append(p)
        else:
            return None
    if not _STR_ONLY.issuperset(map(type, names)) or not _INT_ONLY.issuperset(map(type, shape)):
        return None
    return tuple(names), tuple(shape), tuple(parts)


def _saved_sharding(v: Any, where: str, key: tuple[str, ...]) -> SavedSharding:
    """An entry's saved_sharding: the shared one parsed before, else parsed (and shared)."""
    k = _sharding_key(v)
    known = _SHARDINGS.get(k) if k is not None else None
    if known is None:
        known = SavedSharding.from_json(v, f"{_named(where, key)}.saved_sharding")
        if k is not None:
            _remember(_SHARDINGS, k, known)
    return known


def _remember(memo: dict, key: Any, value: Any) -> Any:
    """``memo[key] = value``, the memo emptied first when full (a hostile manifest of all
    different shapes keeps it bounded); returns ``value``."""
    if len(memo) >= _MEMO_SIZE:
        memo.clear()
    memo[key] = value
    return value


@functools.cache
def _as_set(names: tuple[str, ...]) -> frozenset[str]:
    """``names`` as a frozenset (cached: the field lists are a handful of tuples)."""
    return frozenset(names)


# Values many entries share, parsed once: (shape, chunk_shape, inner) triples, key types and
# saved shardings, each of plain JSON types so that equal means the same (no True == 1).
_MEMO_SIZE = 4096
_SHAPES: dict[tuple, tuple] = {}
_KEY_TYPES: dict[tuple, tuple] = {}
_SHARDINGS: dict[tuple, SavedSharding] = {}
_SHARDING_FIELDS = frozenset(("mesh", "partition_spec"))
_MESH_FIELDS = frozenset(("axis_names", "shape"))
_INT_ONLY = frozenset((int,))
_STR_ONLY = frozenset((str,))
_DTYPES = frozenset(dtypes_lib.SUPPORTED)
_ROLES = frozenset(ROLES)
# one str object per name for every entry (the parsed JSON has one per occurrence)
_CANONICAL: dict[Any, str] = {
    name: name for name in (*dtypes_lib.SUPPORTED, *ROLES, *COMPRESSIONS[1:], *CHECKSUMS[1:])
}


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits (at most {MAX_INT_DIGITS} allowed)")
    return int(text)


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def check_tree_depth(tree: Any) -> None:
    """Refuses a tree whose dicts, lists and tuples nest deeper than :data:`MAX_TREE_DEPTH`,
    walking it without recursion, before anything recursive (flattening, the manifest) runs:
    ``ucp.json`` could not record it, and a reader would refuse it."""
    path = _deeper(tree, 1, MAX_TREE_DEPTH, (Mapping, list, tuple))
    if path is not None:
        raise RequestError(
            f"the tree nests containers deeper than {MAX_TREE_DEPTH} levels (at "
            f"{path[:120]!r}...): {MANIFEST_FILE} records at most {MAX_JSON_DEPTH} JSON "
            f"levels, so such a checkpoint could not be restored; flatten part of the tree"
        )


def _long_digit_run(text: str) -> bool:
    """Whether ``text`` holds more than ``MAX_INT_DIGITS`` ASCII digits in a row (JSON numbers
    have no other digits), found by mapping digits to ``0`` and everything else to a space
    in slices of its UTF-8 bytes (``str.find``, not a regex: ~40x faster on 50 MB)."""
    run, step = b"0" * (MAX_INT_DIGITS + 1), 1 << 20
    for start in range(0, len(text), step):  # the slices overlap by a run's length
        part = text[start : start + step + MAX_INT_DIGITS].encode("utf-8", "surrogatepass")
        if run in part.translate(_DIGITS_AS_ZERO):
            return True
    return False


_DIGITS_AS_ZERO = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))


def _check_nesting(d: Any, where: str) -> None:
    """Refuses a manifest nesting deeper than ``MAX_JSON_DEPTH``. Only its free-form parts can
    nest (the tree, the source record, each entry's provenance): every other field is checked
    against its one shape by ``from_json``, so only those are walked (without recursion; the
    tree as ``from_json`` checks it, the provenance of streamed entries as they are decoded)."""
    if not isinstance(d, dict):
        return
    stack: list[tuple[Any, int]] = [(d.get("source"), 2)]  # the tree: as it is checked
    entries = d.get("entries")
    if isinstance(entries, list):
        stack += [(e.get("provenance"), 4) for e in entries if isinstance(e, dict)]
    if (isinstance(entries, _ParsedEntries) and entries.too_deep) or any(
        _deeper(node, depth) is not None for node, depth in stack
    ):
        raise CheckpointError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels.")


def _deeper(node: Any, depth: int, limit: int = MAX_JSON_DEPTH, kinds: tuple = (dict, list)):
    """Where ``node`` (at level ``depth``) holds a container (``kinds``) nested deeper than
    ``limit``, as ``/key/index/...`` (built only then), or None. Walked without recursion."""
    stack: list[tuple[Any, int, Any]] = [(node, depth, None)] if isinstance(node, kinds) else []
    while stack:
        node, depth, at = stack.pop()
        if depth > limit:
            keys = []
            while at is not None:
                at, key = at
                keys.append(f"/{key}")
            return "".join(reversed(keys))
        pairs = node.items() if isinstance(node, Mapping) else enumerate(node)
        stack.extend((v, depth + 1, (at, k)) for k, v in pairs if isinstance(v, kinds))
    return None
