"""The manifest (``ucp.json``): typed metadata for every leaf of a checkpoint.

Versioned JSON.  A reader refuses a newer major ``version`` than it knows instead of guessing,
and every field a reader needs is explicit (global shape, dtype, chunking, codecs, kvstore), so a
checkpoint is self-describing without JAX, without the mesh it was saved from, and without us.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import os
import re
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
KEY_TYPES = model.KEY_TYPES
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
MAX_INT_DIGITS = model.MAX_INT_DIGITS
KEY_IMPLS = model.KEY_IMPLS


SavedSharding = model.SavedSharding
TensorEntry = model.TensorEntry
ValueEntry = model.ValueEntry
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
        return "jax_ucp checkpoint", self.summary_lines(), rows, model.ENTRY_COLUMNS

    def __repr__(self) -> str:
        return (
            f"Manifest({len(self.tensors)} tensors, {len(self.values)} values, "
            f"{format_size(self.nbytes)}, format v{self.version})"
        )

    def to_json(self) -> dict:
        """The JSON form of ``ucp.json``."""
        return json.loads(self.dumps())

    def dumps(self) -> str:
        """``ucp.json``'s text, refused when nested deeper than a reader accepts or holding a
        NaN. One field a line, the tree on one line and one entry a line (msgspec's encoding),
        each compact: readable and greppable (a tensor per line) at 57 % of the indented size,
        which a 100 000-tensor checkpoint parses in proportion."""
        where = f"{MANIFEST_FILE} to be written"
        head = {"format": self.format, "version": self.version, "save_id": self.save_id}
        head |= {"created_by": self.created_by, "created_at": self.created_at}
        head |= {"kvstore": {"driver": self.kvstore_driver}, "source": self.source}
        head |= {} if self.tree is None else {"tree": self.tree}
        provenances = [e.provenance for e in self.tensors if e.provenance]
        if any(
            _deeper(n, d) is not None for n, d in [(self.source, 2), *((p, 4) for p in provenances)]
        ):
            raise CheckpointError(
                f"{where} (the saved tree nests too deep): JSON nested deeper than {MAX_JSON_DEPTH} levels."
            )
        fields = [f" {json.dumps(k)}: {_compact(v, k, where)}" for k, v in head.items()]
        if any(map(_non_finite, provenances)):
            _compact(float("nan"), "entries", where)
        lines = model.ENCODER.encode_lines(
            [e if type(e) is TensorEntry else e.to_json() for e in self.entries]
        )
        entries = lines[:-1].decode().replace("\n", ",\n  ")
        return "{\n" + ",\n".join([*fields, f' "entries": [\n  {entries}\n ]']) + "\n}\n"

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
                type(e) is TensorEntry and e.provenance and _deeper(e.provenance, 4) is not None
                for e in entries
            ):
                raise CheckpointError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels.")
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
        decoded, absent = model.decode(text)
        return decoded if no_duplicate_keys(text, decoded, absent) else None
    return None


def no_duplicate_keys(text: str | bytes, decoded: model.ManifestModel, absent: int) -> bool:
    """Whether every JSON object of ``text`` names each key once, as far as two counts in C
    tell (False: the slow path decides, refusing a key named twice, ``"value":7,"value":8``).

    msgspec keeps the last of two equal keys silently, another reader the first. Re-encoded,
    the decoded model holds each member the text had once, and the ``absent`` ones its entries
    left out (``model.decode``; ``frozen``, ``tied_to`` and ``key_impl`` left out at their
    defaults, as written), and the same strings: so the text has as many ":" as the
    re-encoding less ``absent`` exactly when no key was named twice, unless a string spells a
    ":" as an escape (``\u003a``: one ":" more in the re-encoding): the slow path then too.
    """
    colon, escape = (b":", b"\\u003") if isinstance(text, bytes) else (":", "\\u003")
    if escape in text:  # type: ignore[operator]
        return False
    encode, entries = model.ENCODER.encode, decoded.entries
    found = encode(msgspec.structs.replace(decoded, entries=[])).count(b":")
    for start in range(0, len(entries), _ENCODED_AT_ONCE):  # never a second copy of the text
        found += encode(entries[start : start + _ENCODED_AT_ONCE]).count(b":")
    return text.count(colon) == found - absent  # type: ignore[arg-type]


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


def _check_header(d: Any, where: str) -> None:
    """The format and version, checked before any other field: a newer version may have
    fields this reader does not know."""
    if not isinstance(d, Mapping) or d.get("format") != FORMAT_NAME:
        found = d.get("format") if isinstance(d, Mapping) else type(d).__name__
        raise CheckpointError(
            f'{where}: not a jax_ucp manifest (expected "format": "{FORMAT_NAME}", '
            f"found {model.short(found)})."
        )
    version = d.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        found = model.short(version)
        raise CheckpointError(f"{where}: version: expected an integer ≥ 1, found {found}.")
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
_OWN_RULE = re.compile(r"([a-z_]+): (?=expected )")
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
    own = _OWN_RULE.match(message)  # a rule across an entry's fields: the field it names
    parts += [own[1]] if own else []
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
    if own:
        return CheckpointError(f"{name}: {message[own.end() :]}")
    if message.startswith(("Object missing required field", "Object contains unknown field")):
        missing = message.split("`")[1]
        if "missing" in message:
            return CheckpointError(f"{name}: missing field {missing!r}.")
        return CheckpointError(f"{name}: unknown field(s) [{model.short(missing, 40)}].")
    found = _at(node, kept)
    if kept[-1:] == ["metadata"] and isinstance(found, dict):  # name the value at fault
        bad = next((k for k, v in found.items() if not _metadata_value(v)), None)
        if bad is not None:
            name, found = f"{name}.{bad}", found[bad]
    return CheckpointError(
        f"{name}: expected {_expected(message, kept, node, found, kind)}, found {model.short(found)}."
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
        allowed = model.TREE_NODE_TYPES if kind == "tree" else tuple(model.VALUE_SCHEMAS)
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


def _compact(v: Any, field: str, where: str) -> str:
    try:
        return json.dumps(v, separators=(",", ":"), allow_nan=False)
    except ValueError:  # NaN or an infinity that a record took from a source's file
        raise CheckpointError(
            f"{where}: {field!r} holds NaN or an infinity, which JSON cannot hold"
        ) from None


def _non_finite(node: Any) -> bool:
    """Whether a record (nested dicts and lists) holds a NaN or an infinity."""
    stack = [node]
    while stack:
        node = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            return True
        if isinstance(node, (dict, list)):
            stack.extend(node.values() if isinstance(node, dict) else node)
    return False


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
