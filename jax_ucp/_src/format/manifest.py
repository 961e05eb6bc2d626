"""The manifest (``ucp.json``): typed metadata for every leaf of a checkpoint.

Versioned JSON.  A reader refuses a newer major ``version`` than it knows instead of guessing,
and every field a reader needs is explicit (global shape, dtype, chunking, codecs, kvstore), so a
checkpoint is self-describing without JAX, without the mesh it was saved from, and without us.
"""

from __future__ import annotations

import collections
import contextlib
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

import msgspec
from msgspec import UNSET

from jax_ucp._src import bulk
from jax_ucp._src.errors import CheckpointError, RequestError
from jax_ucp._src.format import display, files
from jax_ucp._src.format import dtypes as dtypes_lib
from jax_ucp._src.format import keypath as keypath_lib
from jax_ucp._src.format import manifest_model as model
from jax_ucp._src.format.sizes import format_size
from jax_ucp._src.version import __version__

FORMAT_NAME = model.FORMAT_NAME
FORMAT_VERSION = model.FORMAT_VERSION
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
_FLOAT_HEX_RE = re.compile(model.FLOAT_HEX_PATTERN)


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
        return _saved_sharding(_converted(d, model.SavedShardingModel, where))


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
        """Parsed from its JSON form, strictly; errors name ``where`` and the field."""
        return _tensor_entry(_converted(d, model.TensorModel, where), where)


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
        return _value_entry(_converted(d, model.ValueModel, where), where)


#: what a table of tensors shows (``to_rows`` has a few more)
_ENTRY_COLUMNS = ("name", "shape", "dtype", "role", "logical_axes", "saved_spec")


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

        def compact(v, field: str) -> str:
            try:
                return json.dumps(v, separators=(",", ":"), allow_nan=False)
            except ValueError:  # NaN or an infinity that a record took from a source's file
                raise CheckpointError(
                    f"{MANIFEST_FILE} to be written: {field!r} holds NaN or an infinity, which "
                    f"JSON cannot hold"
                ) from None

        fields = [f" {json.dumps(k)}: {compact(v, k)}" for k, v in d.items() if k != "entries"]
        entries = ",\n  ".join(compact(e, "entries") for e in d["entries"])
        body = ",\n".join([*fields, f' "entries": [\n  {entries}\n ]'])
        return "{\n" + body + "\n}\n"

    @classmethod
    def from_json(cls, d: Any, *, where: str = MANIFEST_FILE) -> Manifest:
        """Parsed from its JSON form, strictly; errors name ``where`` and the field."""
        _check_header(d, where)
        return cls._from_model(_converted(d, model.ManifestModel, where, top=True), where)

    @classmethod
    def loads(cls, text: str | bytes, *, where: str = MANIFEST_FILE) -> Manifest:
        """Parsed from ``ucp.json``'s text (size, depth, integers bounded); errors name ``where``.

        msgspec decodes the text straight into the typed model (in C, each entry a compact
        Struct); a text it refuses is decoded again by ``json`` (with its duplicate-key rule and
        error messages) and checked field by field for the error naming the field."""
        decoded = _decoded(text)
        if decoded is not None:
            return cls._from_model(decoded, where)
        if isinstance(text, bytes):
            text = _manifest_text(text, where=where)
        decoder = json.JSONDecoder(
            parse_int=_bounded_int,
            parse_constant=files.no_json_constant,
            object_pairs_hook=files.unique_keys,
        )
        try:
            d = decoder.decode(text)
        except RecursionError:  # the C scanner's own guard, far below the stack's end
            raise CheckpointError(
                f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels."
            ) from None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{where}: corrupt manifest, not valid JSON ({e}).") from None
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from None
        return cls.from_json(d, where=where)

    @classmethod
    def _from_model(cls, m: model.ManifestModel, where: str) -> Manifest:
        """The manifest of a decoded model, after the checks a schema cannot express."""
        with bulk.cyclic_gc_paused():
            entries: list = m.entries
            source = {} if m.source is UNSET else m.source
            if _deeper(source, 2) is not None or any(
                e.provenance is not None
                and e.provenance is not UNSET
                and _deeper(e.provenance, 4) is not None
                for e in entries
                if type(e) is model.TensorModel
            ):
                raise CheckpointError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels.")
            for i, e in enumerate(entries):  # in place: each model freed as its entry is built
                at = f"{where}: entries[{i}]"
                entries[i] = (
                    _tensor_entry(e, at) if type(e) is model.TensorModel else _value_entry(e, at)
                )
            tree = (
                None if m.tree is None or m.tree is UNSET else _tree_dicts(m.tree, entries, where)
            )
            try:  # Manifest's own checks (a key or directory twice) name the file too
                return cls(
                    entries=entries,
                    save_id=m.save_id,
                    kvstore_driver=m.kvstore.driver,
                    created_by="" if m.created_by is UNSET else m.created_by,
                    created_at=0.0 if m.created_at is UNSET else float(m.created_at),
                    source=source,
                    tree=tree,
                    version=m.version,
                    format=m.format,
                )
            except CheckpointError as e:
                if str(e).startswith(where):
                    raise
                raise CheckpointError(f"{where}: {e}") from None


def _decoded(text: str | bytes) -> model.ManifestModel | None:
    """``text`` decoded into the model by msgspec, or None where it refuses it (or holds a
    long run of digits): the slow path then finds the error and names the field."""
    if _long_digit_run(text):
        return None
    with bulk.cyclic_gc_paused(), contextlib.suppress(*_REFUSALS):
        decoded = model.DECODER.decode(text)
        return decoded if no_duplicate_keys(text, decoded) else None
    return None


def no_duplicate_keys(text: str | bytes, decoded: model.ManifestModel) -> bool:
    """Whether every JSON object of ``text`` names each key once, as far as two counts in C
    tell (False: the slow path decides, refusing a key named twice, ``"value":7,"value":8``).

    msgspec keeps the last of two equal keys silently, another reader the first. Re-encoded,
    the decoded model holds each member the text had once (a member the text left out is
    UNSET and left out, ``model.DEFAULTS``), and the same strings: so the text has as many
    ":" as the re-encoding exactly when no key was named twice, unless a string spells a ":"
    as an escape (``\u003a``: one ":" more in the re-encoding), which takes the slow path too.
    """
    colon, escape = (b":", b"\\u003") if isinstance(text, bytes) else (":", "\\u003")
    if escape in text:  # type: ignore[operator]
        return False
    encode, entries = model.ENCODER.encode, decoded.entries
    found = encode(msgspec.structs.replace(decoded, entries=[])).count(b":")
    for start in range(0, len(entries), _ENCODED_AT_ONCE):  # never a second copy of the text
        found += encode(entries[start : start + _ENCODED_AT_ONCE]).count(b":")
    return text.count(colon) == found  # type: ignore[arg-type]


_ENCODED_AT_ONCE = 4096  # entries re-encoded together (about 2 MB of JSON at once)


TREE_NODE_TYPES = model.TREE_NODE_TYPES
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
    decoded = _decoded(data)
    if decoded is None:
        return Manifest.loads(data, where=path)  # the error, naming the field
    del data  # the bytes freed before the entries are built (50 MB for 100 000 tensors)
    return Manifest._from_model(decoded, path)


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


def _check_header(d: Any, where: str) -> None:
    """The format and version, checked before any other field: a newer version may have
    fields this reader does not know."""
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
    missing = next((f for f in _MANIFEST_REQUIRED if f not in d), None)
    if missing is not None:  # before an unknown field: what is missing, then what is extra
        raise CheckpointError(f"{where}: missing field {missing!r}.")


_MANIFEST_REQUIRED = [
    f.encode_name for f in msgspec.structs.fields(model.ManifestModel) if f.required
]


def _converted(d: Any, kind: type, where: str, top: bool = False) -> Any:
    """``d`` (decoded JSON) as the model ``kind``; a refusal names ``where`` and the field."""
    try:
        return msgspec.convert(d, kind)
    except msgspec.ValidationError as e:
        raise _field_error(str(e), d, where, top) from None


# msgspec names the culprit as a path: `$.entries[2].shape[0]`, `key` in `$.x.shard_digests`
_PATH_PART = re.compile(r"\.([A-Za-z_]+)|\[([0-9]+|\.\.\.)\]")
# fields reported whole (as the format describes them), not by the element at fault
_WHOLE = frozenset(
    ("key", "key_types", "shape", "chunk_shape", "inner_chunk_shape", "logical_axes")
    + ("axis_names", "shard_digests", "provenance", "source")
)
_DIMS = "a list of integers ≥ 0"
_POSITIVE_DIMS = "a list of integers ≥ 1"
# what a field must be, as messages say it (a field not here: msgspec's own words)
_EXPECTED = {
    "version": "an integer ≥ 1",
    "kvstore": "a JSON object",
    "entries": "a list",
    "source": "a JSON object",
    "created_at": "a number",
    "entry": '"tensor" or "value"',
    "key": "a non-empty list of strings",
    "dir": "'arrays/<escaped key>' (no '/', no '..')",
    "shape": _DIMS,
    "chunk_shape": _POSITIVE_DIMS,
    "inner_chunk_shape": _POSITIVE_DIMS,
    "dtype": f"one of {list(dtypes_lib.SUPPORTED)}",
    "role": f"one of {list(ROLES)}",
    "compression": f"one of {list(COMPRESSIONS)}",
    "checksum": f"one of {list(CHECKSUMS)}",
    "logical_axes": "a list of strings or nulls",
    "saved_sharding": "a JSON object",
    "mesh": "a JSON object",
    "axis_names": "a list of strings",
    "partition_spec": "a list of: null, an axis name or a list of axis names",
    "provenance": "a JSON object",
    "shard_digests": "shard key -> 8 hex digits",
    "frozen": "a JSON bool",
    "key_impl": f"one of {list(model.KEY_IMPLS)}",
    "metadata": "a JSON scalar or a list of them",
    "children": "a list of [name, key type, node]",
}


def _field_error(message: str, d: Any, where: str, top: bool) -> CheckpointError:
    """msgspec's refusal of ``d`` as the project's error, naming ``where``, the entry (its
    index and key path) and the field as the format names them, and what was found."""
    message, _, at = message.partition(" - at `")
    parts = [n or (None if i == "..." else int(i)) for n, i in _PATH_PART.findall(at)]
    node, name, sep = d, where, "."
    if top:
        sep = ": "
        if len(parts) > 2 and parts[0] == "entries" and isinstance(parts[1], int):
            node, name, sep = _at(d, parts[:2]), f"{where}: entries[{parts[1]}]", "."
            parts = parts[2:]
    kind = "entry"
    if sep == "." and parts and parts[0] not in ("key", "entry"):
        key = node.get("key") if isinstance(node, dict) else None
        if isinstance(key, list) and key and all(isinstance(k, str) for k in key):
            name = _named(name, tuple(key))
    elif sep == ": ":
        kind = "tree" if parts[:1] == ["tree"] else "manifest"
    kept: list = []
    for part in parts:  # a list of scalars is named whole, a map by its own name
        if part is None or (isinstance(part, int) and kept and kept[-1] in _WHOLE):
            break
        kept.append(part)
    field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in kept)[1:]
    if field:
        name += (sep if not field.startswith("[") else "") + field
    if message.startswith(("Object missing required field", "Object contains unknown field")):
        missing = message.split("`")[1]
        if "missing" in message:
            return CheckpointError(f"{name}: missing field {missing!r}.")
        return CheckpointError(f"{name}: unknown field(s) [{_short(missing, 40)}].")
    found = _at(node, kept)
    if kept[-1:] == ["metadata"] and isinstance(found, dict):  # name the value at fault
        bad = next((k for k, v in found.items() if not _metadata_value(v)), None)
        if bad is not None:
            name, found = f"{name}.{bad}", found[bad]
    return CheckpointError(
        f"{name}: expected {_expected(message, kept, node, found, kind)}, found {_short(found)}."
    )


def _metadata_value(v: Any) -> bool:
    """A JSON scalar or a list of them (what an nnx.Variable's recorded metadata may hold)."""
    scalar = (str, int, float, bool, type(None))
    return isinstance(v, scalar) or (isinstance(v, list) and all(isinstance(x, scalar) for x in v))


def _expected(message: str, kept: list, node: Any, found: Any, kind: str) -> str:
    """What the field at ``kept`` (names and indices) must be, as the format says it."""
    last = next((p for p in reversed(kept) if isinstance(p, str)), "")
    element = bool(kept) and isinstance(kept[-1], int)
    if last == "entries" and element:
        return 'a JSON object, "entry": "tensor" or "value"'
    if last == "partition_spec" and element:
        return "null, an axis name or a list of axis names"
    if element and kind == "tree":  # children[i], or its name [0] or key type [1]
        if isinstance(kept[-2], int) and kept[-1] in (0, 1):
            return "a string" if kept[-1] == 0 else f"one of {list(KEY_TYPES)}"
        return "[name, key type, node]"
    if last == "type":
        allowed = model.TREE_NODE_TYPES if kind == "tree" else tuple(_VALUE_TYPES)
        return f"one of {list(allowed)}"
    if last == "key_types":
        key = node.get("key") if isinstance(node, dict) else None
        n = len(key) if isinstance(key, list) else "as many as key"
        return f"a list of {n} of {list(KEY_TYPES)}"
    if last in ("shape", "chunk_shape", "inner_chunk_shape") and "length <=" in message:
        return "at most 64 dimensions"
    if last == "key" and isinstance(found, list) and found:
        return "a list of strings"
    if last in _EXPECTED:
        return _EXPECTED[last]
    if message.startswith("Expected `str`"):
        return "a string"
    return message[0].lower() + message[1:]


def _at(node: Any, path: Sequence) -> Any:
    """What ``path`` (names and indices) leads to in decoded JSON, None where it does not."""
    for p in path:
        try:
            node = node[p]
        except (KeyError, IndexError, TypeError):
            return None
    return node


def _tree_dicts(root: Any, entries: list[Entry], where: str) -> dict:
    """The saved tree as the dicts of its JSON, each node's children freed as they are built
    (walked without recursion), checked: at most ``MAX_JSON_DEPTH`` JSON levels deep (3 a
    pytree level, below the manifest's own 2), and its leaves exactly the entries' keys."""
    remaining = {e.key for e in entries}
    out: dict = {}
    stack: list[tuple[Any, dict, tuple[str, ...], int]] = [(root, out, (), 2)]
    while stack:
        node, d, prefix, level = stack.pop()
        leaf = type(node) is model.LeafNode
        # a container's children list is one level deeper, each [name, type, node] two
        if level + (0 if leaf else 2 if node.children else 1) > MAX_JSON_DEPTH:
            raise CheckpointError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels.")
        d["type"] = _NODE_TAGS[type(node)]
        if leaf:
            if prefix not in remaining:  # not an entry's key, or a second leaf of one
                _tree_differs(where, [prefix])
            remaining.discard(prefix)
            continue
        if node.class_ is not msgspec.UNSET:
            d["class"] = node.class_
        if node.metadata is not msgspec.UNSET:  # an nnx.Variable's (JSON scalars, lists)
            private = sorted(k for k in node.metadata if k.startswith("_"))[:3]
            if private:  # a restore sets metadata on the Variable: never its internals
                raise CheckpointError(
                    f"{where}: tree node {keypath_lib.key_to_str(prefix) or 'the root'!r}: "
                    f"metadata names {private}: private or special attributes of a Variable, "
                    f"never recorded metadata (a restore would set them on it)."
                )
            d["metadata"] = node.metadata
        children: list = []
        for name, kind, child in node.children:
            children.append([name, kind, {}])
            stack.append((child, children[-1][2], (*prefix, name), level + 3))
        node.children.clear()  # its nodes now held by the stack only
        d["children"] = children
    if remaining:
        _tree_differs(where, sorted(remaining)[:3])
    return out


def _tree_differs(where: str, odd: list[tuple[str, ...]]) -> NoReturn:
    raise CheckpointError(
        f"{where}: tree: its leaves and the entries differ (e.g. "
        f"{[keypath_lib.key_to_str(k) for k in odd]}); expected exactly one leaf per entry."
    )


_NODE_TAGS = {kind: kind.__struct_config__.tag for kind in model.TreeNode.__args__}


def _named(where: str, key: tuple[str, ...]) -> str:
    """How errors name an entry: ``where`` and its key path."""
    return f"{where} ({keypath_lib.key_to_str(key)!r})"


def _tensor_entry(e: model.TensorModel, where: str) -> TensorEntry:
    """The entry of a decoded tensor model, after the checks across its fields; what entries
    share (key names, key types, shapes, saved shardings) is one object for all."""
    key = tuple(map(sys.intern, e.key))
    types = _key_types(e.key_types, key, where)
    shapes = e.shape, e.chunk_shape, e.inner_chunk_shape
    shapes = _SHAPES.get(shapes) or _remember(_SHAPES, shapes, _shapes(*shapes, _named(where, key)))
    logical = None if e.logical_axes is UNSET else e.logical_axes
    if logical is not None and len(logical) != len(e.shape):
        _fail(f"{_named(where, key)}.logical_axes", f"{len(e.shape)} names", list(logical))
    saved = None if e.saved_sharding is UNSET else e.saved_sharding
    key_impl = None if e.key_impl is UNSET else e.key_impl
    entry = object.__new__(TensorEntry)  # every field set here: __init__'s 17 frozen setattrs
    entry.__dict__.update(  # would double the cost of a parse; the fields are checked
        key=key,
        key_types=types,
        dir=e.dir,
        shape=shapes[0],
        dtype=_CANONICAL[e.dtype],
        chunk_shape=shapes[1],
        inner_chunk_shape=shapes[2],
        compression=_CANONICAL.get(e.compression),  # UNSET: None, as absent
        checksum=_CANONICAL.get(e.checksum),
        role=_CANONICAL[e.role],
        sub_role=None if e.sub_role is UNSET else e.sub_role,
        logical_axes=logical,
        saved_sharding=None if saved is None else _saved_sharding(saved),
        provenance=None if e.provenance is UNSET else e.provenance,
        shard_digests=None if e.shard_digests is UNSET else e.shard_digests,
        frozen=e.frozen is True,
        tied_to=None if e.tied_to is UNSET else e.tied_to,
        key_impl=key_impl,
    )
    if key_impl is not None:
        _key_impl(key_impl, e.dtype, shapes[0], _named(where, key))
    return entry


_OMITTED_AT_DEFAULT = frozenset(("frozen", "tied_to", "key_impl"))
#: JAX's PRNG key implementations a ``key_impl`` may name, with the shape of one key's data
#: (the stored tensor's last dimensions): a manifest names nothing else.
KEY_IMPLS = model.KEY_IMPLS


def _key_impl(v: str, dtype: str, shape: tuple[int, ...], where: str) -> None:
    """A ``key_impl`` checked against the tensor it describes: uint32 key data whose last
    dimensions are one key's (the name itself is the model's enum)."""
    key_shape = KEY_IMPLS[v]
    if dtype != "uint32" or tuple(shape[len(shape) - len(key_shape) :]) != key_shape:
        _fail(
            f"{where}.key_impl",
            f"uint32 key data of shape (..., {', '.join(map(str, key_shape))}) for {v!r}",
            f"{dtype} of shape {list(shape)}",
        )


def _value_entry(e: model.ValueModel, where: str) -> ValueEntry:
    """The entry of a decoded value model, its value checked against its ``type``."""
    key = tuple(e.key)
    expected, valid = _VALUE_TYPES[e.type]
    v = e.value
    if not valid(v):
        _fail(f"{_named(where, key)}.value", expected, v)
    if e.type == "float":
        try:
            v = float.fromhex(v)
        except (ValueError, OverflowError):
            _fail(f"{_named(where, key)}.value", expected, e.value)
    return ValueEntry(
        key=key,
        key_types=_key_types(e.key_types, key, where),
        value=v,
        role="other" if e.role is UNSET else e.role,
        sub_role=None if e.sub_role is UNSET else e.sub_role,
    )


def _key_types(types: Any, key: tuple[str, ...], where: str) -> tuple[str, ...]:
    """An entry's key types (absent: all "key"), as long as its key; one shared tuple each."""
    if types is msgspec.UNSET:
        types = ("key",) * len(key)
    elif len(types) != len(key):
        n = len(key)
        _fail(f"{_named(where, key)}.key_types", f"a list of {n} of {list(KEY_TYPES)}", list(types))
    return _KEY_TYPES.get(types) or _remember(_KEY_TYPES, types, types)


def _shapes(shape: tuple, chunk_shape: tuple, inner: tuple, w: str) -> tuple[tuple, tuple, tuple]:
    """An entry's shape, chunk_shape and inner_chunk_shape, checked together."""
    if not (len(shape) == len(chunk_shape) == len(inner)):
        _fail(
            f"{w}.chunk_shape",
            f"{len(shape)} dimensions like shape {list(shape)}",
            list(chunk_shape),
        )
    if any(c > max(n, 1) for n, c in zip(shape, chunk_shape)):
        _fail(  # a chunk larger than its array would make a reader allocate for nothing
            f"{w}.chunk_shape",
            f"extents at most shape {list(shape)} (1 for a zero-size dimension)",
            list(chunk_shape),
        )
    if any(c % i for c, i in zip(chunk_shape, inner)):
        _fail(
            f"{w}.inner_chunk_shape",
            f"extents dividing chunk_shape {list(chunk_shape)}",
            list(inner),
        )
    return shape, chunk_shape, inner


def _saved_sharding(s: model.SavedShardingModel) -> SavedSharding:
    """A decoded saved sharding as its dataclass, the one of equal entries shared."""
    known = _SHARDINGS.get(s)
    if known is None:
        known = SavedSharding(s.mesh.axis_names, s.mesh.shape, s.partition_spec)
        _remember(_SHARDINGS, s, known)
    return known


def _remember(memo: dict, key: Any, value: Any) -> Any:
    """``memo[key] = value``, the memo emptied first when full (a hostile manifest of all
    different shapes keeps it bounded); returns ``value``."""
    if len(memo) >= _MEMO_SIZE:
        memo.clear()
    memo[key] = value
    return value


# Values many entries share, built once: (shape, chunk_shape, inner) triples, key types and
# saved shardings (decoded by type: equal means the same, no True == 1).
_MEMO_SIZE = 4096
_SHAPES: dict[tuple, tuple] = {}
_KEY_TYPES: dict[tuple, tuple] = {}
_SHARDINGS: dict[model.SavedShardingModel, SavedSharding] = {}
# one str object per name for every entry (the parsed JSON has one per occurrence)
_CANONICAL: dict[Any, str] = {
    name: name for name in (*dtypes_lib.SUPPORTED, *ROLES, *COMPRESSIONS[1:], *CHECKSUMS[1:])
}


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits (at most {MAX_INT_DIGITS} allowed)")
    return int(text)


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


def _check_nesting(d: dict, where: str) -> None:
    """Refuses a manifest to be written that nests deeper than ``MAX_JSON_DEPTH`` in its
    free-form parts (the source record, each entry's provenance), as a reader would."""
    stack: list[tuple[Any, int]] = [(d.get("source"), 2)]
    stack += [(e.get("provenance"), 4) for e in d["entries"]]
    if any(_deeper(node, depth) is not None for node, depth in stack):
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
