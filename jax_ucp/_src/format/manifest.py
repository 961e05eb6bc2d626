"""The manifest (``ucp.json``): typed metadata for every leaf of a checkpoint.

Versioned JSON.  A reader refuses a newer major ``version`` than it knows instead of guessing,
and every field a reader needs is explicit (global shape, dtype, chunking, codecs, kvstore), so a
checkpoint is self-describing without JAX, without the mesh it was saved from, and without us.

The manifest and its entries are msgspec Structs, decoded from the text in C: the per-field rules
are their types (the published JSON Schema is generated from them, ``format.schema``), the rules
across fields their ``__post_init__``, in decoding; the saved tree's are ``format.tree_record``'s.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import re
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal, Never

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType
from msgspec.structs import force_setattr

from jax_ucp._src import bulk
from jax_ucp._src.errors import CheckpointError, RequestError
from jax_ucp._src.format import display, files, tree_record
from jax_ucp._src.format import dtypes as dtypes_lib
from jax_ucp._src.format import keypath as keypath_lib
from jax_ucp._src.format.sizes import format_size
from jax_ucp._src.format.tree_record import KEY_TYPES, TOO_DEEP, KeyType
from jax_ucp._src.version import __version__

FORMAT_NAME = "jax_ucp"
FORMAT_VERSION = 1
MANIFEST_FILE = "ucp.json"
ARRAYS_DIR = "arrays"

# The end of the text in Python's regexes and ECMA-262's alike (Python's `$` admits a final
# newline, so "arrays/w\n" would pass).
_END = r"(?![\s\S])"
DIR_PATTERN = r"^arrays/(?!\.\.?" + _END + r")[A-Za-z0-9_%~.\-]+" + _END
SHARD_KEY_PATTERN = r"^c(/[0-9]+)*" + _END
DIGEST_PATTERN = r"^[0-9a-f]{8}" + _END
FLOAT_HEX_PATTERN = r"^-?(0x[0-9a-fA-F](\.[0-9a-fA-F]*)?p[+-]?[0-9]+|inf|nan)" + _END

Dim = Annotated[int, Meta(ge=0, lt=2**62)]
PositiveDim = Annotated[int, Meta(ge=1, lt=2**62)]
Dims = Annotated[tuple[Dim, ...], Meta(max_length=64)]
PositiveDims = Annotated[tuple[PositiveDim, ...], Meta(max_length=64)]
if TYPE_CHECKING:  # a checker sees what code builds and reads: names as str, never UNSET
    Role = DType = ValueType = Compression = Checksum = KeyImpl = str
    Absent = Never
else:
    Role = Literal["param", "opt_state", "other"]
    DType = Literal[tuple(dtypes_lib.SUPPORTED)]
    ValueType = Literal["none", "bool", "int", "float", "str"]
    Compression, Checksum = Literal["zstd"], Literal["crc32c"]
    KeyImpl = Annotated[
        Literal["threefry2x32", "rbg", "unsafe_rbg"],
        Meta(
            description="A typed PRNG key array (jax.random.key, an NNX Rngs stream): the JAX "
            "key implementation whose key data this tensor stores (uint32, one key's data in "
            "the last dimensions: (2,) for threefry2x32, (4,) for rbg and unsafe_rbg). A "
            "restore wraps the data back into keys. Absent for every other tensor."
        ),
    ]
    Absent = UnsetType
#: the default of a member that may be absent (the decoded entry holds what absence means)
ABSENT: Any = UNSET
Key = Annotated[
    tuple[str, ...], Meta(min_length=1, description="The leaf's key path, one name a level.")
]
KeyTypes = Annotated[
    tuple[KeyType, ...],
    Meta(description="The kind of container each key component indexes; absent: all 'key'."),
]
MAX_INT_DIGITS = 64  # Python values may be large ints (2**70); a 5000-digit one is an attack
_FLOAT_HEX_RE = re.compile(FLOAT_HEX_PATTERN)


class _Strict(Struct, forbid_unknown_fields=True, gc=False, frozen=True):
    """Strict (an unknown field is an error) and untracked by the cyclic GC (JSON holds no
    cycles): 100 000 entries cost neither a GC pass nor a GC header each."""


class KvStore(_Strict, frozen=True):
    """The TensorStore kvstore the arrays were written with (arrays are found by 'dir')."""

    driver: str


class Mesh(_Strict, frozen=True):
    """The mesh a tensor was saved from."""

    axis_names: tuple[str, ...]
    shape: Dims


class SavedSharding(_Strict, frozen=True):
    """Informational: the mesh and PartitionSpec a tensor was saved from (hashable: equal ones
    are one object in the entries)."""

    mesh: Mesh
    partition_spec: tuple[str | tuple[str, ...] | None, ...]

    @classmethod
    def of(cls, axis_names: Sequence[str], shape: Sequence[int], spec: Sequence) -> SavedSharding:
        """A mesh's axis names and sizes and a PartitionSpec (None, a name or names each)."""
        return cls(Mesh(tuple(axis_names), tuple(shape)), tuple(spec))


class _Entry(_Strict, frozen=True, omit_defaults=True):
    """What both kinds of entry have: a key path (``name``: ``a/b/c``) and key types (absent in
    the text: all "key")."""

    key: Key

    @property
    def name(self) -> str:
        """The key path as ``a/b/c`` (how messages and the CLI name a leaf)."""
        return keypath_lib.key_to_str(self.key)

    def to_json(self) -> dict:
        """The JSON form recorded in ``ucp.json`` (a tensor's ``frozen``, ``tied_to`` and
        ``key_impl`` left out at their defaults, a value's float as ``float.hex``, exact)."""
        d = msgspec.to_builtins(self)
        if d.get("type") == "float":
            d["value"] = float.hex(self.value)  # pyright: ignore[reportAttributeAccessIssue]
        return d

    def _absent(self, defaults: dict[str, Any]) -> None:
        """Fills each member the text left out (UNSET) with what it means, counting them for
        the duplicate-key check (``no_duplicate_keys``); key types shared between entries."""
        n = 0
        for field, default in defaults.items():
            if getattr(self, field) is UNSET:
                force_setattr(self, field, default)
                n += 1
        key, types = self.key, self.key_types  # pyright: ignore[reportAttributeAccessIssue]
        if types is UNSET:
            types, n = ("key",) * len(key), n + 1
        elif len(types) != len(key):
            expected = f"a list of {len(key)} of {list(KEY_TYPES)}"
            raise ValueError(_fault("key_types", expected, list(types)))
        force_setattr(self, "key_types", _SHARED.get(types) or _remember(types))
        COUNTS.absent = getattr(COUNTS, "absent", 0) + n


class TensorEntry(_Entry, display.Tabular, tag="tensor", tag_field="entry", frozen=True):
    """One array leaf stored as one zarr v3 array under ``arrays/<dir>``."""

    dir: Annotated[
        str,
        Meta(
            pattern=DIR_PATTERN,
            description="The array's directory relative to the checkpoint: 'arrays/' + the "
            "escaped key path (docs/FORMAT.md). Readers locate the array by it.",
        ),
    ]
    shape: Dims
    dtype: DType
    chunk_shape: Annotated[PositiveDims, Meta(description="The outer (shard file) chunk.")]
    inner_chunk_shape: Annotated[PositiveDims, Meta(description="Divides chunk_shape.")]
    role: Role
    key_types: KeyTypes | Absent = ABSENT
    compression: Compression | Absent | None = ABSENT
    checksum: Checksum | Absent | None = ABSENT
    sub_role: str | Absent | None = ABSENT
    logical_axes: tuple[str | None, ...] | Absent | None = ABSENT
    saved_sharding: SavedSharding | Absent | None = ABSENT
    provenance: dict[str, Any] | Absent | None = ABSENT
    shard_digests: (
        Annotated[
            dict[
                Annotated[str, Meta(pattern=SHARD_KEY_PATTERN)],
                Annotated[str, Meta(pattern=DIGEST_PATTERN)],
            ],
            Meta(
                description='Shard file key ("c/0/1") -> crc32c, 8 lowercase hex digits, of '
                "its inner chunks' crc32c trailers in index order."
            ),
        ]
        | Absent
        | None
    ) = ABSENT
    frozen: bool = False
    tied_to: str | None = None
    key_impl: KeyImpl | None = None

    def __post_init__(self):
        """The rules across fields (a member the text left out: None; what entries share, the
        key's names, shapes and saved shardings, one object for all)."""
        self._absent(_TENSOR_DEFAULTS)
        force_setattr(self, "key", tuple(map(sys.intern, self.key)))
        shapes = self.shape, self.chunk_shape, self.inner_chunk_shape
        known = _SHARED.get(shapes)
        if known is None:
            _check_shapes(*shapes)
            known = _remember(shapes)
        force_setattr(self, "shape", known[0])
        force_setattr(self, "chunk_shape", known[1])
        force_setattr(self, "inner_chunk_shape", known[2])
        if self.logical_axes is not None and len(self.logical_axes) != len(self.shape):
            expected = f"{len(self.shape)} names"
            raise ValueError(_fault("logical_axes", expected, list(self.logical_axes)))
        saved = self.saved_sharding
        if saved is not None:
            shared = _SHARED.get(saved) or _remember(saved)
            force_setattr(self, "saved_sharding", shared)
        if self.key_impl is not None:
            key_shape = KEY_IMPLS[self.key_impl]
            stored = self.shape[len(self.shape) - len(key_shape) :]
            if self.dtype != "uint32" or stored != key_shape:
                expected = f"uint32 key data of shape (..., {', '.join(map(str, key_shape))}) for"
                found = f"{self.dtype} of shape {list(self.shape)}"
                raise ValueError(f"key_impl: expected {expected} {self.key_impl!r}, found {found}.")

    @property
    def nbytes(self) -> int:
        """Bytes of the array (shape × itemsize)."""
        return math.prod(self.shape) * dtypes_lib.to_numpy_dtype(self.dtype).itemsize

    def to_row(self) -> dict[str, Any]:
        """One row of ``Manifest.to_rows``: name, shape, dtype, bytes, role, logical axes,
        saved PartitionSpec and mesh, and where an import read it from."""
        saved = self.saved_sharding
        return {
            "name": self.name,
            "shape": tuple(self.shape),
            "dtype": self.dtype,
            "bytes": self.nbytes,
            "role": self.role + (f"/{self.sub_role}" if self.sub_role else ""),
            "logical_axes": self.logical_axes,
            "saved_spec": None if saved is None else saved.partition_spec,
            "saved_mesh": None
            if saved is None
            else display.mesh_text(saved.mesh.axis_names, saved.mesh.shape),
            "source": ", ".join((self.provenance or {}).get("tensors", [])[:3]) or None,
        }

    def table(self):
        return f"tensor {self.name}", [], [self.to_row()], ENTRY_COLUMNS


#: what a table of tensors shows (``to_rows`` has a few more)
ENTRY_COLUMNS = ("name", "shape", "dtype", "role", "logical_axes", "saved_spec")
#: JAX's PRNG key implementations a ``key_impl`` may name, with the shape of one key's data
KEY_IMPLS = {"threefry2x32": (2,), "rbg": (4,), "unsafe_rbg": (4,)}


class ValueEntry(_Entry, tag="value", tag_field="entry", frozen=True):
    """A non-array leaf (Python None, bool, int, float or str) kept as a typed JSON value."""

    type: ValueType
    value: Annotated[
        Any,
        Meta(
            description="none: null; bool: true/false; int: a JSON integer (at most 64 digits); "
            'float: the float.hex() string ("0x1.8p+0", "inf", "nan"); str: a JSON string.'
        ),
    ]
    key_types: KeyTypes | Absent = ABSENT
    role: Role | Absent = ABSENT
    sub_role: str | Absent | None = ABSENT

    nbytes = 0  # a value holds no array bytes

    def __post_init__(self):
        """The value checked against its type (a float's hex string read)."""
        self._absent(_VALUE_DEFAULTS)
        expected, valid = _VALUE_TYPES[self.type]
        if not valid(self.value):
            raise ValueError(_fault("value", expected, self.value))
        if self.type == "float":
            try:
                force_setattr(self, "value", float.fromhex(self.value))
            except (ValueError, OverflowError):
                raise ValueError(_fault("value", expected, self.value)) from None

    @classmethod
    def of(cls, key, key_types, value, role: str = "other", sub_role: str | None = None):
        """The entry of a Python value (None, bool, int, float, str), refused naming the leaf."""
        name = keypath_lib.key_to_str(key)
        kind = next((t for t, k in _PY_TYPES.items() if isinstance(value, k)), None)
        if kind is None:
            raise RequestError(
                f"Leaf {name!r}: {type(value).__name__} is not a storable value "
                f"(expected None, bool, int, float, str or an array)."
            )
        if kind == "int" and abs(value) >= 10**MAX_INT_DIGITS:
            raise CheckpointError(
                f"Leaf {name!r}: an int of more than {MAX_INT_DIGITS} digits is not "
                f"storable as a value; save it as an array or a string."
            )
        if kind == "str":
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise CheckpointError(
                    f"Leaf {name!r}: value: not encodable as UTF-8 ({e.reason} at {e.start})."
                ) from None
        value = float.hex(value) if kind == "float" else value  # as the text holds it
        return cls(tuple(key), kind, value, tuple(key_types), role, sub_role)

    def __reduce__(self):  # a copy is built as the entry was, from the Python value
        return ValueEntry.of, (self.key, self.key_types, self.value, self.role, self.sub_role)


_PY_TYPES = {"none": type(None), "bool": bool, "int": int, "float": float, "str": str}
# JSON "type" of a value entry -> (what its "value" must be, the check)
_VALUE_TYPES = {
    "none": ("null", lambda v: v is None),
    "bool": ("a JSON boolean", lambda v: isinstance(v, bool)),
    "int": ("a JSON integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": ("a float.hex string", lambda v: isinstance(v, str) and _FLOAT_HEX_RE.fullmatch(v)),
    "str": ("a JSON string", lambda v: isinstance(v, str)),
}
_TENSOR_DEFAULTS: dict[str, Any] = dict.fromkeys(
    ("compression", "checksum", "sub_role", "logical_axes", "saved_sharding")
    + ("provenance", "shard_digests")
)
_VALUE_DEFAULTS = {"role": "other", "sub_role": None}
_HEAD_DEFAULTS = {"created_by": "", "created_at": 0.0, "source": {}, "tree": None}
#: what a member the text leaves out means (documented in the schema), filled in by
#: ``__post_init__`` (an entry's ``frozen``, ``tied_to`` and ``key_impl``: msgspec's defaults)
DEFAULTS = {
    "Manifest": _HEAD_DEFAULTS,
    "TensorEntry": _TENSOR_DEFAULTS,
    "ValueEntry": _VALUE_DEFAULTS,
}
#: members the text left out, filled in by ``__post_init__``: a key named twice is found by
#: counting the members (``no_duplicate_keys``)
COUNTS = threading.local()


def _fault(field: str, expected: str, found: Any) -> str:
    """A refusal of one field, as ``__post_init__`` raises it (``manifest`` names the entry)."""
    return f"{field}: expected {expected}, found {short(found)}."


def short(value: Any, limit: int = 80) -> str:
    """A bounded repr: a hostile value's repr is never built in full."""
    if isinstance(value, (dict, list)):
        return f"a JSON {'object' if isinstance(value, dict) else 'array'} of {len(value)} items"
    if isinstance(value, str):
        return repr(value[:limit] + ("…" if len(value) > limit else ""))
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**limit:
        return "a very large integer"
    return repr(value)[:limit]


def _check_shapes(shape: tuple, chunk_shape: tuple, inner: tuple) -> None:
    """An entry's shape, chunk_shape and inner_chunk_shape, checked together."""
    if not (len(shape) == len(chunk_shape) == len(inner)):
        expected = f"{len(shape)} dimensions like shape {list(shape)}"
        raise ValueError(_fault("chunk_shape", expected, list(chunk_shape)))
    if any(c > max(n, 1) for n, c in zip(shape, chunk_shape)):
        # a chunk larger than its array would make a reader allocate for nothing
        expected = f"extents at most shape {list(shape)} (1 for a zero-size dimension)"
        raise ValueError(_fault("chunk_shape", expected, list(chunk_shape)))
    if any(c % i for c, i in zip(chunk_shape, inner)):
        expected = f"extents dividing chunk_shape {list(chunk_shape)}"
        raise ValueError(_fault("inner_chunk_shape", expected, list(inner)))


def _remember(value: Any) -> Any:
    """``_SHARED[value] = value``, the memo emptied first when full (a hostile manifest of all
    different shapes keeps it bounded); returns ``value``."""
    if len(_SHARED) >= 4096:
        _SHARED.clear()
    _SHARED[value] = value
    return value


# Values many entries share, built once: (shape, chunk_shape, inner) triples, key types and
# saved shardings (decoded by type: equal means the same, no True == 1; none equals another's).
_SHARED: dict = {}


#: writes entries, and re-encodes a decoded manifest (``no_duplicate_keys``)
ENCODER = msgspec.json.Encoder()


# optax state fields recorded as an opt_state leaf's sub-role
OPTAX_STATE_NAMES = ("mu", "nu", "count", "trace", "ema", "master")


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


# Bounds on what a manifest may be: a hostile ucp.json must fail fast, not exhaust the host
# (and ``tree_record``'s nesting).
MAX_MANIFEST_BYTES = 512 << 20
Entry = TensorEntry | ValueEntry


#: ``source`` member of an item the Orbax handler saved as a step's item: ``"<step folder>/<item>"``
#: as the run names them (docs/FORMAT.md, section 1.2), so a resume can tell a step's item from
#: another step's swapped or copied in
ORBAX_ITEM = "orbax_item"


def torch_optimizer_record(source: dict) -> dict:
    """A manifest source's record of the torch optimizer (``source.optimizer``:
    ``param_groups``, its state names, DeepSpeed's config), {} when there is none. Another kind
    of value there (an earlier jax_ucp's Megatron layout name or flag, now
    ``optimizer_layout``) is none, never read as a record."""
    value = source.get("optimizer")
    return value if isinstance(value, dict) else {}


class Manifest(msgspec.Struct, display.Tabular, forbid_unknown_fields=True, dict=True):
    """The manifest at the root of a jax_ucp checkpoint: one entry per leaf of the saved tree.
    docs/FORMAT.md is the normative definition; the reader also checks cross-field rules a
    schema cannot express (key_types as long as key, chunk extents dividing, logical_axes as
    long as shape, unique keys and dirs, tree leaves matching entries) and bounds (file size,
    nesting, integer length)."""

    format: Literal["jax_ucp"]
    version: Annotated[int, Meta(ge=1, le=FORMAT_VERSION)]
    save_id: Annotated[str, Meta(description="Unique per save; shard digests are tied to it.")]
    kvstore: KvStore
    entries: list[TensorEntry | ValueEntry]
    created_by: str | Absent = ABSENT
    created_at: float | Absent = ABSENT
    source: Annotated[dict[str, Any], Meta(description="Free-form provenance.")] | Absent = ABSENT
    # The saved pytree's containers (dict/list/tuple/NamedTuple nodes, child names) as the dicts
    # of its JSON, so a restore without a target rebuilds e.g. optax states; None for imports.
    tree: tree_record.SavedTree = ABSENT
    # Not stored: what a reader noticed (``jax_ucp.inspect`` sets it), e.g. a container class it
    # will not rebuild; each a sentence naming the node.
    if TYPE_CHECKING:
        notices: list[str] = msgspec.field(default_factory=list)
    else:
        notices = ()

    def __post_init__(self):
        """Fills what the text left out (counted, as for entries); refuses two entries with one
        key path or one array directory, and JSON nested too deep (a decoded tree is checked as
        its dicts are built, ``_with_tree``)."""
        for field, default in _HEAD_DEFAULTS.items():
            if getattr(self, field) is UNSET:  # a fresh {} for the source
                setattr(self, field, {} if field == "source" else default)
                COUNTS.absent = getattr(COUNTS, "absent", 0) + 1
        seen: set[tuple] = set()
        dirs: dict[str, Entry] = {}
        for e in self.entries:
            if e.key in seen:
                raise CheckpointError(f"Duplicate leaf {e.name!r} in manifest.")
            seen.add(e.key)
            if type(e) is TensorEntry:
                if e.dir in dirs:
                    raise CheckpointError(
                        f"Leaves {dirs[e.dir].name!r} and {e.name!r} map to the same directory "
                        f"{e.dir!r}; rename one of them."
                    )
                dirs[e.dir] = e
                if e.provenance and tree_record.deeper(e.provenance, 4) is not None:
                    raise CheckpointError(f"{e.name!r}: provenance: {TOO_DEEP}")
        if tree_record.deeper(self.source, 2) is not None:
            raise CheckpointError(f"source: {TOO_DEEP}")

    @property
    def tensors(self) -> list[TensorEntry]:
        """The tensor entries, in manifest order."""
        return [e for e in self.entries if type(e) is TensorEntry]

    @property
    def values(self) -> list[ValueEntry]:
        """The saved Python values, in manifest order."""
        return [e for e in self.entries if type(e) is ValueEntry]

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
        meshes = collections.Counter(s.mesh for e in self.tensors if (s := e.saved_sharding))
        return [display.mesh_text(m.axis_names, m.shape) for m, _ in meshes.most_common()]

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
        if self.source.get("path"):  # an import
            framework = self.source.get("framework") or self.source.get("format") or "torch"
            lines.append(f"imported from {framework}: {self.source['path']}")
        return lines

    def table(self):
        rows = [e.to_row() for e in self.tensors]
        return "jax_ucp checkpoint", self.summary_lines(), rows, ENTRY_COLUMNS

    def __repr__(self) -> str:
        return (
            f"Manifest({len(self.tensors)} tensors, {len(self.values)} values, "
            f"{format_size(self.nbytes)}, format v{self.version})"
        )

    def dumps(self) -> str:
        """``ucp.json``'s text, refused when nested deeper than a reader accepts or holding a
        NaN. One field a line, the tree on one line and one entry a line (msgspec's encoding),
        each compact: readable and greppable (a tensor per line) at 57 % of the indented size,
        which a 100 000-tensor checkpoint parses in proportion."""

        def compact(field: str, v: Any) -> str:
            try:
                return json.dumps(v, separators=(",", ":"), allow_nan=False)
            except ValueError:  # NaN or an infinity that a record took from a source's file
                raise CheckpointError(
                    f"{MANIFEST_FILE} to be written: {field!r} holds NaN or an infinity, which "
                    f"JSON cannot hold"
                ) from None

        head = {"format": self.format, "version": self.version, "save_id": self.save_id}
        head |= {"created_by": self.created_by, "created_at": self.created_at}
        head |= {"kvstore": {"driver": self.kvstore.driver}, "source": self.source}
        head |= {} if self.tree is None else {"tree": self.tree}
        fields = [f" {json.dumps(k)}: {compact(k, v)}" for k, v in head.items()]
        # msgspec would write a NaN as null: the records checked (as msgspec's types) first
        compact("entries", msgspec.to_builtins([e.provenance for e in self.tensors]))
        lines = ENCODER.encode_lines(
            [e if type(e) is TensorEntry else e.to_json() for e in self.entries]
        )
        entries = lines[:-1].decode().replace("\n", ",\n  ")
        return "{\n" + ",\n".join([*fields, f' "entries": [\n  {entries}\n ]']) + "\n}\n"

    @classmethod
    def loads(cls, text: str | bytes, *, where: str = MANIFEST_FILE) -> Manifest:
        """Parsed from ``ucp.json``'s text, strictly (size, depth, integers bounded); errors
        name ``where`` and the field."""
        return _with_tree(_decoded(text) or _decoded_slowly(text, where), where)


_REQUIRED = [f.encode_name for f in msgspec.structs.fields(Manifest) if f.required]
DECODER = msgspec.json.Decoder(Manifest)


def _decoded(text: str | bytes) -> Manifest | None:
    """``text`` decoded by msgspec, or None where it refuses it (or holds a long run of
    digits): the slow path then finds the error and names the field."""
    if _long_digit_run(text):
        return None
    with bulk.cyclic_gc_paused(), contextlib.suppress(*_REFUSALS):
        COUNTS.absent = 0
        decoded = DECODER.decode(text)
        return decoded if no_duplicate_keys(text, decoded, COUNTS.absent) else None
    return None


def no_duplicate_keys(text: str | bytes, decoded: Manifest, absent: int) -> bool:
    """Whether every JSON object of ``text`` names each key once, as far as two counts in C
    tell (False: the slow path decides, refusing a key named twice, ``"value":7,"value":8``).

    msgspec keeps the last of two equal keys silently, another reader the first. Re-encoded,
    the decoded manifest holds each member the text had once, and the ``absent`` ones it left
    out (each filled in by ``__post_init__``; an entry's ``frozen``, ``tied_to`` and
    ``key_impl`` left out at their defaults, as written), and the same strings: so the text has
    as many ":" as the re-encoding less ``absent`` exactly when no key was named twice, unless
    a string spells a ":" as an escape (``\u003a``: one ":" more in the re-encoding): the slow
    path then too.
    """
    colon, escape = (b":", b"\\u003") if isinstance(text, bytes) else (":", "\\u003")
    if escape in text:  # type: ignore[operator]
        return False
    encode, entries = ENCODER.encode, decoded.entries
    head = {f: getattr(decoded, f) for f in decoded.__struct_fields__ if f != "entries"}
    found = encode(head).count(b":") + 1  # and "entries":
    for start in range(0, len(entries), _ENCODED_AT_ONCE):  # never a second copy of the text
        found += encode(entries[start : start + _ENCODED_AT_ONCE]).count(b":")
    return text.count(colon) == found - absent  # type: ignore[arg-type]


_ENCODED_AT_ONCE = 4096  # entries re-encoded together (about 2 MB of JSON at once)


def _decoded_slowly(text: str | bytes, where: str) -> Manifest:
    """``text`` that msgspec refused or could not vouch for, decoded by ``json`` (with its
    duplicate-key rule and error messages) and converted by msgspec again: the manifest, or
    the error naming the field and what the text holds there."""
    try:
        text = text.decode("utf-8") if isinstance(text, bytes) else text
        d = json.JSONDecoder(
            parse_int=_bounded_int,
            parse_constant=files.no_json_constant,
            object_pairs_hook=files.unique_keys,
        ).decode(text)
    except RecursionError:  # the C scanner's own guard, far below the stack's end
        raise CheckpointError(f"{where}: {TOO_DEEP}") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{where}: not UTF-8 text ({e}).") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{where}: corrupt manifest, not valid JSON ({e}).") from None
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
        found = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise CheckpointError(
            f'{where}: not a jax_ucp manifest (expected "format": "{FORMAT_NAME}", '
            f"found {short(found)})."
        )
    version = d.get("version")
    if type(version) is int and version > FORMAT_VERSION:  # may have fields we do not know
        raise CheckpointError(
            f"{where}: format version {version} is newer than this jax_ucp "
            f"understands (≤ {FORMAT_VERSION}); upgrade jax_ucp to read it."
        )
    missing = next((f for f in _REQUIRED if f not in d), None)
    if missing is not None:  # before an unknown field: what is missing, then what is extra
        raise CheckpointError(f"{where}: missing field {missing!r}.")
    try:
        with bulk.cyclic_gc_paused():
            return msgspec.convert(d, Manifest)
    except msgspec.ValidationError as e:
        raise _refused(str(e), d, where) from None


_REFUSALS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError)


def read_manifest_file(directory: str | os.PathLike) -> Manifest:
    """The manifest file of the checkpoint in the local ``directory``, strictly validated
    (``store.read_manifest`` reads one anywhere, object stores included).

    Only a regular file is read (a FIFO or device is refused without blocking) and at most
    ``MAX_MANIFEST_BYTES`` of it; every error names the file and the field.
    """
    path = os.path.join(os.fspath(directory), MANIFEST_FILE)
    try:
        # never a link out of the checkpoint (another checkpoint's manifest)
        data = files.read_regular(files.inside(directory, MANIFEST_FILE, path), MAX_MANIFEST_BYTES)
    except FileNotFoundError as e:
        raise CheckpointError(
            f"{path}: no manifest; {directory} is not a jax_ucp checkpoint "
            f"(expected a directory with {MANIFEST_FILE} at its root)."
        ) from e
    except files.UnsafeFileError as e:
        raise CheckpointError(str(e)) from None
    decoded = _decoded(data) or _decoded_slowly(data, path)
    del data  # the bytes freed before the tree's dicts are built (50 MB for 100 000 tensors)
    return _with_tree(decoded, path)


def _with_tree(m: Manifest, where: str) -> Manifest:
    """``m`` with its decoded tree as the dicts of its JSON, checked; errors name ``where``."""
    if m.tree is not None and type(m.tree) is not dict:
        try:
            with bulk.cyclic_gc_paused():
                m.tree = tree_record.tree_dicts(m.tree, {e.key for e in m.entries})
        except CheckpointError as e:
            raise CheckpointError(f"{where}: {e}") from None
    return m


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
        FORMAT_NAME,
        FORMAT_VERSION,
        uuid.uuid4().hex,
        KvStore(kvstore_driver),
        list(entries),
        f"jax_ucp {__version__}",
        time.time(),
        dict(source or {"framework": "jax"}),
        tree,
    )


def array_dir(key: Sequence[str]) -> str:
    """Where a tensor's zarr array lives, relative to the checkpoint (``arrays/<encoded key>``)."""
    return f"{ARRAYS_DIR}/{keypath_lib.encode_key(key)}"


def _refused(message: str, d: Any, where: str) -> CheckpointError:
    """msgspec's refusal (``Expected `int` >= 0 - at `$.entries[2].shape[0]` ``) as the
    project's error: the file, the entry (index and key path), the field, what was expected
    and what was found."""
    message, _, at = message.rpartition(" - at `") if " - at `" in message else (message, 0, "")
    at, value_of_map, _ = at.partition("[...]")  # msgspec does not say which: the first it got
    path: list = [n or int(i) for n, i in re.findall(r"\.([A-Za-z_]+)|\[([0-9]+)\]", at)]
    node, got = _at(d, path), message.rpartition("got `")[2][:-1]
    if value_of_map and isinstance(node, dict):
        path += [k for k, v in node.items() if _JSON_TYPES.get(type(v)) == got][:1]
    own = re.match(r"([a-z_]+): ", message)  # a rule across fields (``__post_init__``)
    if own:
        path, message = [*path, own[1]], message[own.end() :]
    field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)[1:]
    key = _at(d, [*path[:2], "key"]) if path[:1] == ["entries"] and len(path) > 1 else None
    if isinstance(key, list) and key and all(isinstance(k, str) for k in key):
        field = field.replace("]", f"] ({keypath_lib.key_to_str(tuple(key))!r})", 1)
    name = (f"{where}: {field}" if field else where) + (" key" if at.startswith("key`") else "")
    found = short(_at(d, path))
    if message.startswith("Object missing required field"):
        return CheckpointError(f"{name}: missing field {message.split('`')[1]!r}.")
    if message.startswith("Object contains unknown field"):
        return CheckpointError(f"{name}: unknown field {short(message[31:-1], 40)}.")
    if message.startswith("Expected "):  # `int` >= 0, `array` of length <= 64, `str` matching
        expected = message[9:].partition(", got")[0].replace("`", "")
    elif message.startswith("Invalid"):  # a Literal: what it may be
        last = next(p for p in reversed(path) if isinstance(p, str))
        expected = f"one of {list(_CHOICES['tree' if path[0] == 'tree' else 0].get(last, ()))}"
    else:  # a rule of the model's own, in its words
        return CheckpointError(f"{name}: {message}")
    return CheckpointError(f"{name}: expected {expected}, found {found}.")


_JSON_TYPES = {dict: "object", list: "array", str: "str", int: "int", float: "float", bool: "bool"}
_CHOICES: dict = {  # a Literal's values, by the field's name (in the tree, or an entry's)
    "tree": {"type": tuple(tree_record.NODE_TAGS.values()), "children": KEY_TYPES},
    0: {"entry": ("tensor", "value"), "type": tuple(_VALUE_TYPES)}
    | {"role": ("param", "opt_state", "other"), "dtype": dtypes_lib.SUPPORTED}
    | {"key_types": KEY_TYPES, "key_impl": tuple(KEY_IMPLS)}
    | {"compression": (None, "zstd"), "checksum": (None, "crc32c")},
}


def _at(node: Any, path: Sequence) -> Any:
    """What ``path`` (names and indices) leads to in decoded JSON, None where it does not."""
    for p in path:
        try:
            node = node[p]
        except (KeyError, IndexError, TypeError):
            return None
    return node


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits (at most {MAX_INT_DIGITS} allowed)")
    return int(text)


def _long_digit_run(text: str | bytes) -> bool:
    """Whether ``text`` holds more than ``MAX_INT_DIGITS`` ASCII digits in a row (JSON numbers
    have no other digits), found by mapping digits to ``0`` and everything else to a space
    in slices of its UTF-8 bytes (``str.find``, not a regex: ~40x faster on 50 MB)."""
    run, step = b"0" * (MAX_INT_DIGITS + 1), 1 << 20
    for start in range(0, len(text), step):  # the slices overlap by a run's length
        part = text[start : start + step + MAX_INT_DIGITS]
        if isinstance(part, str):
            part = part.encode("utf-8", "surrogatepass")
        if run in part.translate(_DIGITS_AS_ZERO):
            return True
    return False


_DIGITS_AS_ZERO = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
