"""``ucp.json`` as one typed model: what each field may be, decoded by msgspec in C.

The model is the per-field rules of the format, and the published JSON Schema is generated from
it (``python -m jax_ucp._src.format.manifest_model`` rewrites ``ucp_manifest.v1.schema.json``; a
test holds the checked-in file equal to the generated one). The entries are these Structs: what
a schema cannot say of one entry (rules across its fields) their ``__post_init__`` checks, in
decoding; ``manifest.py`` checks the rest (tree leaves against entries, nesting, duplicates).
"""

from __future__ import annotations

import functools
import json
import math
import re
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Never

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType
from msgspec.structs import astuple, force_setattr

from jax_ucp._src.errors import CheckpointError, RequestError
from jax_ucp._src.format import display
from jax_ucp._src.format import dtypes as dtypes_lib
from jax_ucp._src.format import keypath as keypath_lib

FORMAT_NAME = "jax_ucp"
FORMAT_VERSION = 1
SCHEMA_FILE = Path(__file__).with_name("ucp_manifest.v1.schema.json")

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
    KeyType = Role = DType = ValueType = Compression = Checksum = KeyImpl = str
    Absent = Never
else:
    KeyType = Literal["key", "index", "attr"]
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
KEY_TYPES = ("key", "index", "attr")
MAX_INT_DIGITS = 64  # Python values may be large ints (2**70); a 5000-digit one is an attack
_FLOAT_HEX_RE = re.compile(FLOAT_HEX_PATTERN)


class _Model(Struct, forbid_unknown_fields=True, gc=False):
    """Strict (an unknown field is an error) and untracked by the cyclic GC (JSON holds no
    cycles): 100 000 entries cost neither a GC pass nor a GC header each."""


class Mesh(Struct, forbid_unknown_fields=True, gc=False, frozen=True):
    """The mesh a tensor was saved from."""

    axis_names: tuple[str, ...]
    shape: Dims


class SavedSharding(Struct, forbid_unknown_fields=True, gc=False, frozen=True):
    """Informational: the mesh and PartitionSpec a tensor was saved from (hashable: equal ones
    are one object in the entries)."""

    mesh: Mesh
    partition_spec: tuple[str | tuple[str, ...] | None, ...]

    @classmethod
    def of(cls, axis_names: Sequence[str], shape: Sequence[int], spec: Sequence) -> SavedSharding:
        """A mesh's axis names and sizes and a PartitionSpec (None, a name or names each)."""
        return cls(Mesh(tuple(axis_names), tuple(shape)), tuple(spec))

    @property
    def mesh_axis_names(self) -> tuple[str, ...]:
        return self.mesh.axis_names

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return self.mesh.shape


class _Entry(Struct, forbid_unknown_fields=True, gc=False, frozen=True, omit_defaults=True):
    """What both kinds of entry have: a key path (``name``: ``a/b/c``) and key types (absent in
    the text: all "key")."""

    @property
    def name(self) -> str:
        """The key path as ``a/b/c`` (how messages and the CLI name a leaf)."""
        return keypath_lib.key_to_str(self.key)  # pyright: ignore[reportAttributeAccessIssue]

    def to_json(self) -> dict:
        """The JSON form recorded in ``ucp.json`` (a tensor's ``frozen``, ``tied_to`` and
        ``key_impl`` left out at their defaults, a value's float as ``float.hex``, exact)."""
        d = msgspec.json.decode(ENCODER.encode(self))
        if d.get("type") == "float":
            d["value"] = float.hex(self.value)  # pyright: ignore[reportAttributeAccessIssue]
        return d

    def _absent(self, defaults: tuple[tuple[str, Any], ...]) -> None:
        """Fills each member the text left out (UNSET) with what it means, counting them for
        the duplicate-key check (``decode``); key types shared between entries."""
        n = 0
        for field, default in defaults:
            if getattr(self, field) is UNSET:
                force_setattr(self, field, default)
                n += 1
        key, types = self.key, self.key_types  # pyright: ignore[reportAttributeAccessIssue]
        if types is UNSET:
            types, n = ("key",) * len(key), n + 1
        elif len(types) != len(key):
            expected = f"a list of {len(key)} of {list(KEY_TYPES)}"
            raise ValueError(_fault("key_types", expected, list(types)))
        force_setattr(self, "key_types", _KEY_TYPES.get(types) or _remember(_KEY_TYPES, types))
        COUNTS.absent = getattr(COUNTS, "absent", 0) + n


class TensorEntry(_Entry, display.Tabular, tag="tensor", tag_field="entry", frozen=True):
    """One array leaf stored as one zarr v3 array under ``arrays/<dir>``."""

    key: Key
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

    entry_type = "tensor"

    def __post_init__(self):
        """The rules across fields (a member the text left out: None; what entries share, the
        key's names, shapes and saved shardings, one object for all)."""
        self._absent(_TENSOR_DEFAULTS)
        force_setattr(self, "key", tuple(map(sys.intern, self.key)))
        shapes = self.shape, self.chunk_shape, self.inner_chunk_shape
        known = _SHAPES.get(shapes)
        if known is None:
            _check_shapes(*shapes)
            known = _remember(_SHAPES, shapes)
        force_setattr(self, "shape", known[0])
        force_setattr(self, "chunk_shape", known[1])
        force_setattr(self, "inner_chunk_shape", known[2])
        force_setattr(self, "dtype", _CANONICAL.get(self.dtype, self.dtype))
        if self.logical_axes is not None and len(self.logical_axes) != len(self.shape):
            expected = f"{len(self.shape)} names"
            raise ValueError(_fault("logical_axes", expected, list(self.logical_axes)))
        saved = self.saved_sharding
        if saved is not None:
            shared = _SHARDINGS.get(saved) or _remember(_SHARDINGS, saved)
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
        return math.prod(self.shape) * _itemsize(self.dtype)

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
            "saved_mesh": None if saved is None else display.mesh_text(*astuple(saved.mesh)),
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

    key: Key
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

    entry_type = "value"
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
_TENSOR_DEFAULTS = tuple(
    (f, None)
    for f in ("compression", "checksum", "sub_role", "logical_axes", "saved_sharding")
    + ("provenance", "shard_digests")
)
_VALUE_DEFAULTS = (("role", "other"), ("sub_role", None))


#: members the text left out, filled in by ``__post_init__`` (``manifest.no_duplicate_keys``)
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


def _remember(memo: dict, value: Any) -> Any:
    """``memo[value] = value``, the memo emptied first when full (a hostile manifest of all
    different shapes keeps it bounded); returns ``value``."""
    if len(memo) >= 4096:
        memo.clear()
    memo[value] = value
    return value


# Values many entries share, built once: (shape, chunk_shape, inner) triples, key types and
# saved shardings (decoded by type: equal means the same, no True == 1).
_SHAPES: dict[tuple, tuple] = {}
_KEY_TYPES: dict[tuple, tuple] = {}
_SHARDINGS: dict[SavedSharding, SavedSharding] = {}
# one str object per dtype name for every entry (the parsed JSON has one per occurrence)
_CANONICAL: dict[Any, str] = {name: name for name in dtypes_lib.SUPPORTED}


@functools.cache
def _itemsize(dtype: str) -> int:
    return dtypes_lib.to_numpy_dtype(dtype).itemsize


# The value's JSON type by the entry's "type" (the reader checks it too: a Struct has one tag).
VALUE_SCHEMAS: dict[str, dict] = {
    "none": {"type": "null"},
    "bool": {"type": "boolean"},
    "int": {"type": "integer"},
    "float": {"type": "string", "pattern": FLOAT_HEX_PATTERN},
    "str": {"type": "string"},
}

Child = tuple[str, KeyType, "TreeNode"]


class LeafNode(_Model, tag="leaf", tag_field="type"):
    """A leaf of the saved tree: one entry."""


Scalar = str | int | float | bool | None


class _Container(_Model):
    children: list[Child]
    class_: str | UnsetType = msgspec.field(default=UNSET, name="class")
    metadata: (
        Annotated[
            dict[str, Scalar | list[Scalar]],
            Meta(
                description="An nnx.Variable's metadata (out_sharding, an RNG stream's tag, "
                "...): names to JSON scalars or lists of them, set again on the Variable a "
                "restore without a target rebuilds. Absent for every other node."
            ),
        ]
        | UnsetType
    ) = UNSET


class DictNode(_Container, tag="dict", tag_field="type"):
    """A dict; children as [name, key type, node]."""


class ListNode(_Container, tag="list", tag_field="type"):
    """A list; children as [name, key type, node]."""


class TupleNode(_Container, tag="tuple", tag_field="type"):
    """A tuple; children as [name, key type, node]."""


class NamedTupleNode(_Container, tag="namedtuple", tag_field="type"):
    """A NamedTuple of class 'module:qualname' (rebuilt only from an allow-list of modules)."""

    class_: str = msgspec.field(name="class")


class ObjectNode(_Container, tag="object", tag_field="type"):
    """Another pytree class 'module:qualname' (rebuilt only from an allow-list of modules)."""

    class_: str = msgspec.field(name="class")


TreeNode = LeafNode | DictNode | ListNode | TupleNode | NamedTupleNode | ObjectNode
TREE_NODE_TYPES = ("leaf", "dict", "list", "tuple", "namedtuple", "object")


class KvStore(_Model):
    """The TensorStore kvstore the arrays were written with (arrays are found by 'dir')."""

    driver: str


if TYPE_CHECKING:  # a decoded manifest holds its tree as the dicts of its JSON
    SavedTree = dict | None
else:
    SavedTree = TreeNode | UnsetType | None
#: writes entries, and re-encodes a decoded manifest (``manifest.no_duplicate_keys``)
ENCODER = msgspec.json.Encoder()

#: what a member the text leaves out means (documented in the schema). An entry's are filled in
#: by its ``__post_init__``, counted: a key named twice is found by counting the members.
DEFAULTS: dict[str, dict[str, Any]] = {
    "Manifest": {"created_by": "", "created_at": 0.0, "source": {}, "tree": None},
    "TensorEntry": dict(_TENSOR_DEFAULTS),  # frozen, tied_to, key_impl: msgspec's own defaults
    "ValueEntry": dict(_VALUE_DEFAULTS),
}


_SCHEMA_NAMES = {
    "Manifest": "ManifestModel",
    "TensorEntry": "TensorModel",
    "ValueEntry": "ValueModel",
    "SavedSharding": "SavedShardingModel",
}


def json_schema() -> dict:
    """The JSON Schema of ``ucp.json``, generated from ``manifest.Manifest`` (plus the one rule
    a Struct cannot carry: a value entry's ``value`` by its ``type``)."""
    from jax_ucp._src.format.manifest import Manifest  # the root, built on these types

    text = msgspec.json.encode(msgspec.json.schema(Manifest)).decode()
    for name, published in _SCHEMA_NAMES.items():  # the entries' names when it was published
        text = text.replace(f'"{name}"', f'"{published}"').replace(f'/{name}"', f'/{published}"')
    schema = json.loads(text)
    for part in schema["$defs"].values():  # the docstrings, without their indentation
        if "description" in part:
            part["description"] = " ".join(part["description"].split())
    for name, defaults in DEFAULTS.items():  # what an absent member means, documented
        part = schema["$defs"][_SCHEMA_NAMES.get(name, name)]
        for field, default in defaults.items():
            part["properties"][field]["default"] = default
    value = schema["$defs"]["ValueModel"]
    value["allOf"] = [
        {"if": {"properties": {"type": {"const": t}}}, "then": {"properties": {"value": s}}}
        for t, s in VALUE_SCHEMAS.items()
    ]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "jax_ucp/ucp_manifest.v1.schema.json",
        "title": f"jax_ucp manifest (ucp.json), format version {FORMAT_VERSION}",
        **schema,
    }


def schema_text() -> str:
    """What ``ucp_manifest.v1.schema.json`` holds: indented, what fits on one line on one."""

    def dump(v: Any, indent: str) -> str:
        inner, flat = indent + " ", json.dumps(v, ensure_ascii=False)
        if len(flat) + len(indent) <= 96:
            return flat
        if isinstance(v, dict):
            items = [f"{inner}{json.dumps(k)}: {dump(x, inner)}" for k, x in v.items()]
            return "{\n" + ",\n".join(items) + f"\n{indent}}}"
        if isinstance(v, list) and any(isinstance(x, (dict, list)) for x in v):
            return "[\n" + ",\n".join(inner + dump(x, inner) for x in v) + f"\n{indent}]"
        return json.dumps(v, ensure_ascii=False)

    return dump(json_schema(), "") + "\n"


if __name__ == "__main__":  # regenerates the checked-in schema
    SCHEMA_FILE.write_text(schema_text(), encoding="utf-8")
    sys.stdout.write(f"wrote {SCHEMA_FILE}\n")
