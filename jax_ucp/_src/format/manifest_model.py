"""``ucp.json`` as one typed model: what each field may be, decoded by msgspec in C.

The model is the per-field rules of the format, and the published JSON Schema is generated from
it (``python -m jax_ucp._src.format.manifest_model`` rewrites ``ucp_manifest.v1.schema.json``; a
test holds the checked-in file equal to the generated one). ``manifest.py`` turns a decoded model
into its entries and checks what a schema cannot say (cross-field rules, tree leaves against
entries, nesting).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from jax_ucp._src.format import dtypes as dtypes_lib

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
KeyType = Literal["key", "index", "attr"]
Role = Literal["param", "opt_state", "other"]
DType = Literal[tuple(dtypes_lib.SUPPORTED)]  # pyright: ignore[reportInvalidTypeForm]
Key = Annotated[
    tuple[str, ...], Meta(min_length=1, description="The leaf's key path, one name a level.")
]
KeyTypes = Annotated[
    tuple[KeyType, ...],
    Meta(description="The kind of container each key component indexes; absent: all 'key'."),
]
ValueType = Literal["none", "bool", "int", "float", "str"]


class _Model(Struct, forbid_unknown_fields=True, gc=False):
    """Strict (an unknown field is an error) and untracked by the cyclic GC (JSON holds no
    cycles): 100 000 entries cost neither a GC pass nor a GC header each."""


class Mesh(Struct, forbid_unknown_fields=True, gc=False, frozen=True):
    """The mesh a tensor was saved from."""

    axis_names: tuple[str, ...]
    shape: Dims


class SavedShardingModel(Struct, forbid_unknown_fields=True, gc=False, frozen=True):
    """Informational: the mesh and PartitionSpec a tensor was saved from (hashable: equal ones
    are one object in the entries)."""

    mesh: Mesh
    partition_spec: tuple[str | tuple[str, ...] | None, ...]


class TensorModel(_Model, tag="tensor", tag_field="entry"):
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
    dtype: DType  # pyright: ignore[reportInvalidTypeForm]
    chunk_shape: Annotated[PositiveDims, Meta(description="The outer (shard file) chunk.")]
    inner_chunk_shape: Annotated[PositiveDims, Meta(description="Divides chunk_shape.")]
    role: Role
    key_types: KeyTypes | UnsetType = UNSET
    compression: Literal["zstd"] | UnsetType | None = UNSET
    checksum: Literal["crc32c"] | UnsetType | None = UNSET
    sub_role: str | UnsetType | None = UNSET
    logical_axes: tuple[str | None, ...] | UnsetType | None = UNSET
    saved_sharding: SavedShardingModel | UnsetType | None = UNSET
    provenance: dict[str, Any] | UnsetType | None = UNSET
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
        | UnsetType
        | None
    ) = UNSET
    frozen: bool | UnsetType = UNSET
    tied_to: str | UnsetType | None = UNSET
    key_impl: (
        Annotated[
            Literal["threefry2x32", "rbg", "unsafe_rbg"],
            Meta(
                description="A typed PRNG key array (jax.random.key, an NNX Rngs stream): the "
                "JAX key implementation whose key data this tensor stores (uint32, one key's "
                "data in the last dimensions: (2,) for threefry2x32, (4,) for rbg and "
                "unsafe_rbg). A restore wraps the data back into keys. Absent for every other "
                "tensor."
            ),
        ]
        | UnsetType
        | None
    ) = UNSET


#: JAX's PRNG key implementations a ``key_impl`` may name, with the shape of one key's data
KEY_IMPLS = {"threefry2x32": (2,), "rbg": (4,), "unsafe_rbg": (4,)}


class ValueModel(_Model, tag="value", tag_field="entry"):
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
    key_types: KeyTypes | UnsetType = UNSET
    role: Role | UnsetType = UNSET
    sub_role: str | UnsetType | None = UNSET


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


class ManifestModel(_Model):
    """The manifest at the root of a jax_ucp checkpoint: one entry per leaf of the saved tree.
    docs/FORMAT.md is the normative definition; the reader also checks cross-field rules a
    schema cannot express (key_types as long as key, chunk extents dividing, logical_axes as
    long as shape, unique keys and dirs, tree leaves matching entries) and bounds (file size,
    nesting, integer length)."""

    format: Literal["jax_ucp"]
    version: Annotated[int, Meta(ge=1, le=FORMAT_VERSION)]
    save_id: Annotated[str, Meta(description="Unique per save; shard digests are tied to it.")]
    kvstore: KvStore
    entries: list[TensorModel | ValueModel]
    created_by: str | UnsetType = UNSET
    created_at: float | UnsetType = UNSET
    source: Annotated[dict[str, Any], Meta(description="Free-form provenance.")] | UnsetType = UNSET
    tree: TreeNode | UnsetType | None = UNSET


DECODER = msgspec.json.Decoder(ManifestModel)
#: re-encodes a decoded model: a member the text lacked (UNSET) is left out, so its ":"s are
#: those of the members the text had, each once (``manifest.no_duplicate_keys``)
ENCODER = msgspec.json.Encoder()

#: what a member the text leaves out means. Absent members are UNSET in the model (never their
#: default), so which members a text had is known: a key named twice is found by counting them.
DEFAULTS: dict[str, dict[str, Any]] = {
    "ManifestModel": {"created_by": "", "created_at": 0.0, "source": {}, "tree": None},
    "TensorModel": {
        "compression": None,
        "checksum": None,
        "sub_role": None,
        "logical_axes": None,
        "saved_sharding": None,
        "provenance": None,
        "shard_digests": None,
        "frozen": False,
        "tied_to": None,
        "key_impl": None,
    },
    "ValueModel": {"role": "other", "sub_role": None},
}


def json_schema() -> dict:
    """The JSON Schema of ``ucp.json``, generated from :class:`ManifestModel` (plus the one rule
    a Struct cannot carry: a value entry's ``value`` by its ``type``)."""
    schema = msgspec.json.schema(ManifestModel)
    for part in schema["$defs"].values():  # the docstrings, without their indentation
        if "description" in part:
            part["description"] = " ".join(part["description"].split())
    for name, defaults in DEFAULTS.items():  # what an absent member means, documented
        part = schema if name == "ManifestModel" else schema["$defs"][name]
        part = part if "properties" in part else schema["$defs"][name]
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
