"""The manifest (``ucp.json``): typed metadata for every leaf of a checkpoint.

Versioned JSON.  A reader refuses a newer major ``version`` than it knows instead of guessing,
and every field a reader needs is explicit (global shape, dtype, chunking, codecs, kvstore), so a
checkpoint is self-describing without JAX, without the mesh it was saved from, and without us.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn

import msgspec
from msgspec import UNSET, Meta

from jax_ucp._src import bulk
from jax_ucp._src.errors import CheckpointError, RequestError
from jax_ucp._src.format import display, files
from jax_ucp._src.format import dtypes as dtypes_lib
from jax_ucp._src.format import keypath as keypath_lib
from jax_ucp._src.format import manifest_model as model
from jax_ucp._src.format.manifest_model import KvStore
from jax_ucp._src.format.sizes import format_size
from jax_ucp._src.version import __version__

FORMAT_NAME = model.FORMAT_NAME
FORMAT_VERSION = model.FORMAT_VERSION
MANIFEST_FILE = "ucp.json"
ARRAYS_DIR = "arrays"

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


# Bounds on what a manifest may be: a hostile ucp.json must fail fast, not exhaust the host.
MAX_MANIFEST_BYTES = 512 << 20
MAX_JSON_DEPTH = 512  # a recorded tree structure nests 3 JSON levels per pytree level
#: containers nested in a saved tree: what ``ucp.json`` can record within ``MAX_JSON_DEPTH``
#: (checked at save, so what ``save`` writes ``restore`` reads)
MAX_TREE_DEPTH = MAX_JSON_DEPTH // 3
TOO_DEEP = f"JSON nested deeper than {MAX_JSON_DEPTH} levels."
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
    created_by: str | model.Absent = model.ABSENT
    created_at: float | model.Absent = model.ABSENT
    source: Annotated[dict[str, Any], Meta(description="Free-form provenance.")] | model.Absent = (
        model.ABSENT
    )
    # The saved pytree's containers (dict/list/tuple/NamedTuple nodes, child names) as the dicts
    # of its JSON, so a restore without a target rebuilds e.g. optax states; None for imports.
    tree: model.SavedTree = model.ABSENT
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
        absent = [f for f, _ in _HEAD_DEFAULTS if getattr(self, f) is UNSET]
        for field, default in _HEAD_DEFAULTS:
            if field in absent:
                setattr(self, field, {} if field == "source" else default)
        model.COUNTS.absent = getattr(model.COUNTS, "absent", 0) + len(absent)
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
                if e.provenance and _deeper(e.provenance, 4) is not None:
                    raise CheckpointError(f"{e.name!r}: provenance: {TOO_DEEP}")
        if _deeper(self.source, 2) is not None:
            raise CheckpointError(f"source: {TOO_DEEP}")

    @property
    def kvstore_driver(self) -> str:
        return self.kvstore.driver

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
        if self.source.get("path"):  # an import
            framework = self.source.get("framework") or self.source.get("format") or "torch"
            lines.append(f"imported from {framework}: {self.source['path']}")
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
        head |= {"kvstore": {"driver": self.kvstore.driver}, "source": self.source}
        head |= {} if self.tree is None else {"tree": self.tree}
        fields = [f" {json.dumps(k)}: {_compact(v, k, where)}" for k, v in head.items()]
        if any(_non_finite(e.provenance) for e in self.tensors if e.provenance):
            _compact(float("nan"), "entries", where)
        lines = model.ENCODER.encode_lines(
            [e if type(e) is TensorEntry else e.to_json() for e in self.entries]
        )
        entries = lines[:-1].decode().replace("\n", ",\n  ")
        return "{\n" + ",\n".join([*fields, f' "entries": [\n  {entries}\n ]']) + "\n}\n"

    @classmethod
    def from_json(cls, d: Any, *, where: str = MANIFEST_FILE) -> Manifest:
        """Parsed from its JSON form, strictly; errors name ``where`` and the field."""
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            found = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise CheckpointError(
                f'{where}: not a jax_ucp manifest (expected "format": "{FORMAT_NAME}", '
                f"found {model.short(found)})."
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
                decoded = msgspec.convert(d, cls)
        except msgspec.ValidationError as e:
            raise _refused(str(e), d, where) from None
        return _with_tree(decoded, where)

    @classmethod
    def loads(cls, text: str | bytes, *, where: str = MANIFEST_FILE) -> Manifest:
        """Parsed from ``ucp.json``'s text (size, depth, integers bounded); errors name ``where``.

        msgspec decodes the text straight into the typed model (in C, each entry a compact
        Struct); a text it refuses is decoded again by ``json`` (with its duplicate-key rule and
        error messages) and checked field by field for the error naming the field."""
        decoded = _decoded(text)
        if decoded is not None:
            return _with_tree(decoded, where)
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
        return cls.from_json(d, where=where)


_HEAD_DEFAULTS = tuple(model.DEFAULTS["Manifest"].items())
_REQUIRED = [f.encode_name for f in msgspec.structs.fields(Manifest) if f.required]
DECODER = msgspec.json.Decoder(Manifest)


def _decoded(text: str | bytes) -> Manifest | None:
    """``text`` decoded by msgspec, or None where it refuses it (or holds a long run of
    digits): the slow path then finds the error and names the field."""
    if _long_digit_run(text):
        return None
    with bulk.cyclic_gc_paused(), contextlib.suppress(*_REFUSALS):
        model.COUNTS.absent = 0
        decoded = DECODER.decode(text)
        return decoded if no_duplicate_keys(text, decoded, model.COUNTS.absent) else None
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
    encode, entries = model.ENCODER.encode, decoded.entries
    head = {f: getattr(decoded, f) for f in decoded.__struct_fields__ if f != "entries"}
    found = encode(head).count(b":") + 1  # and "entries":
    for start in range(0, len(entries), _ENCODED_AT_ONCE):  # never a second copy of the text
        found += encode(entries[start : start + _ENCODED_AT_ONCE]).count(b":")
    return text.count(colon) == found - absent  # type: ignore[arg-type]


_ENCODED_AT_ONCE = 4096  # entries re-encoded together (about 2 MB of JSON at once)


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
    del data  # the bytes freed before the tree's dicts are built (50 MB for 100 000 tensors)
    return _with_tree(decoded, path)


def _with_tree(m: Manifest, where: str) -> Manifest:
    """``m`` with its decoded tree as the dicts of its JSON, checked; errors name ``where``."""
    if m.tree is not None and type(m.tree) is not dict:
        try:
            with bulk.cyclic_gc_paused():
                m.tree = _tree_dicts(m.tree, {e.key for e in m.entries})
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
    found = model.short(_at(d, path))
    if message.startswith("Object missing required field"):
        return CheckpointError(f"{name}: missing field {message.split('`')[1]!r}.")
    if message.startswith("Object contains unknown field"):
        return CheckpointError(f"{name}: unknown field {model.short(message[31:-1], 40)}.")
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
    "tree": {"type": model.TREE_NODE_TYPES, "children": model.KEY_TYPES},
    0: {"entry": ("tensor", "value"), "type": tuple(model.VALUE_SCHEMAS)}
    | {"role": ("param", "opt_state", "other"), "dtype": dtypes_lib.SUPPORTED}
    | {"key_types": model.KEY_TYPES, "key_impl": tuple(KEY_IMPLS)}
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


def _tree_dicts(root: Any, remaining: set[tuple[str, ...]]) -> dict:
    """The saved tree as the dicts of its JSON, each node's children freed as they are built
    (walked without recursion), checked: at most ``MAX_JSON_DEPTH`` JSON levels deep (3 a
    pytree level, below the manifest's own 2), and its leaves exactly the entries' keys
    (``remaining``, emptied)."""
    out: dict = {}
    stack: list[tuple[Any, dict, tuple[str, ...], int]] = [(root, out, (), 2)]
    while stack:
        node, d, prefix, level = stack.pop()
        leaf = type(node) is model.LeafNode
        # a container's children list is one level deeper, each [name, type, node] two
        if level + (0 if leaf else 2 if node.children else 1) > MAX_JSON_DEPTH:
            raise CheckpointError(TOO_DEEP)
        d["type"] = _NODE_TAGS[type(node)]
        if leaf:
            if prefix not in remaining:  # not an entry's key, or a second leaf of one
                _tree_differs([prefix])
            remaining.discard(prefix)
            continue
        if node.class_ is not msgspec.UNSET:
            d["class"] = node.class_
        if node.metadata is not msgspec.UNSET:  # an nnx.Variable's (JSON scalars, lists)
            private = sorted(k for k in node.metadata if k.startswith("_"))[:3]
            if private:  # a restore sets metadata on the Variable: never its internals
                raise CheckpointError(
                    f"tree node {keypath_lib.key_to_str(prefix) or 'the root'!r}: "
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
        _tree_differs(sorted(remaining)[:3])
    return out


def _tree_differs(odd: list[tuple[str, ...]]) -> NoReturn:
    raise CheckpointError(
        f"tree: its leaves and the entries differ (e.g. "
        f"{[keypath_lib.key_to_str(k) for k in odd]}); expected exactly one leaf per entry."
    )


_NODE_TAGS = {kind: kind.__struct_config__.tag for kind in model.TreeNode.__args__}


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > model.MAX_INT_DIGITS:
        raise ValueError(
            f"an integer of {len(text)} digits (at most {model.MAX_INT_DIGITS} allowed)"
        )
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
    run, step = b"0" * (model.MAX_INT_DIGITS + 1), 1 << 20
    for start in range(0, len(text), step):  # the slices overlap by a run's length
        part = text[start : start + step + model.MAX_INT_DIGITS]
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
