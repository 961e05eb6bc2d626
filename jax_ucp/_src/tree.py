"""Pytrees ⇄ key paths: flattening what is saved, rebuilding nested dicts/lists on restore."""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from jax_ucp._src.errors import RequestError
from jax_ucp._src.format import keypath as keypath_lib


def _is_leaf(x) -> bool:
    if x is None:
        return True
    return _is_box(x)


def _is_box(x) -> bool:
    """A flax metadata box (nn.Partitioned, nn.LogicallyPartitioned: they name axes). Asked of
    flax only once flax.core.meta is imported (no box exists before): importing flax to ask
    would cost a first save or restore ~0.2 s."""
    meta = sys.modules.get("flax.core.meta")
    return meta is not None and isinstance(x, meta.AxisMetadata)


def flatten(tree) -> tuple[list[tuple[tuple[str, ...], tuple[str, ...], Any]], Any]:
    """[(key, key_types, leaf)] in flatten order, and the treedef. None is a leaf (a saved value).

    Key components must be UTF-8 text (they become ucp.json strings and directory names) and a
    dict's keys must be sortable (JAX sorts them): otherwise a ``RequestError`` names the key path.
    """
    import jax  # here, not at import: inspect reads a tree's classes without JAX

    try:
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    except ValueError as e:
        where = _unsortable_dict(tree)
        if where is None:
            raise
        path, types = where
        raise RequestError(
            f"Dict at key path {_path_text(path)} mixes key types {types} (e.g. 1 and '1'); JAX "
            f"sorts a dict's keys and a checkpoint names leaves by them: use keys of one type."
        ) from e
    out = []
    for path, leaf in leaves:
        comps = [keypath_lib.component_of(p) for p in path]
        key = tuple(c[1] for c in comps)
        for component in key:
            if not component.isascii():
                try:
                    component.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise RequestError(
                        f"Key path {_path_text(key)}: component {component!r} is not valid "
                        f"Unicode text ({e.reason} at position {e.start}); a checkpoint stores "
                        f"keys as UTF-8. Rename that key."
                    ) from None
        out.append((key, tuple(c[0] for c in comps), leaf))
    return out, treedef


def _key_of(path) -> tuple[str, ...]:
    """The key (component names) of a JAX key path."""
    return tuple(keypath_lib.component_of(p)[1] for p in path)


def _path_text(path: Sequence[str]) -> str:
    text = "/".join(path) if path else "(the root)"
    return repr(text if len(text) <= 200 else text[:200] + "…")  # repr escapes surrogates


def _unsortable_dict(tree) -> tuple[tuple[str, ...], list[str]] | None:
    """(key path, key type names) of the first dict whose keys cannot be sorted, else None."""
    stack: list[tuple[tuple[str, ...], Any]] = [((), tree)]
    while stack:
        prefix, node = stack.pop()
        if _is_leaf(node):
            continue
        if isinstance(node, dict):
            try:
                sorted(node)
            except TypeError:
                return prefix, sorted({type(k).__name__ for k in node})
            stack.extend((prefix + (str(k),), v) for k, v in node.items())
            continue
        try:
            children = _children(node)
        except ValueError:  # a dict-like node (FrozenDict) whose own keys do not sort
            return prefix, ["mixed"]
        stack.extend((prefix + _key_of(path), child) for path, child in children or ())
    return None


def _children(node) -> list | None:
    """(key path entry, child) of each child of ``node``; None when it is no container."""
    import jax  # here, not at import: inspect reads a tree's classes without JAX

    children = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda c: c is not node)[0]
    return None if len(children) == 1 and children[0][0] == () else children


def unbox(leaf) -> tuple[Any, tuple | None]:
    """(value, logical axis names) for flax metadata boxes; (leaf, None) otherwise."""
    if _is_box(leaf):
        names = getattr(leaf, "names", None)
        return leaf.unbox(), (tuple(names) if names is not None else None)
    return leaf, None


def rebox(target_leaf, value) -> Any:
    """``value`` in the flax metadata box ``target_leaf`` is (``nn.LogicallyPartitioned``,
    ``nn.Partitioned``, ...), so a restore gives back the target's treedef; else ``value``."""
    if _is_box(target_leaf):
        return target_leaf.replace_boxed(value)
    return value


def target_leaves(target, boxed: bool = True) -> tuple[list[tuple[tuple[str, ...], Any]], Callable]:
    """A restore target flattened once: its leaves by key, out of their flax metadata boxes,
    and ``rebuild(values)``, the target's structure with one value per leaf (in the leaf's box
    when ``boxed``), so a restore gives back the target's treedef."""
    import jax  # here, not at import: inspect reads a tree's classes without JAX

    leaves, treedef = flatten(target)
    boxes = [leaf for _, _, leaf in leaves] if boxed else None

    def rebuild(values: list) -> Any:
        if boxes is not None:
            values = [rebox(box, x) for box, x in zip(boxes, values)]
        return jax.tree_util.tree_unflatten(treedef, values)

    return [(key, unbox(leaf)[0]) for key, _, leaf in leaves], rebuild


def _is_variable(x) -> bool:
    # As _is_box: a Variable exists only once flax.nnx is imported; importing it to ask cost a
    # first save ~0.5 s (1.74 s vs 0.44 s for 1 GB on 8 CPU devices).
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Variable)


# nnx.Variable metadata holding its axis names, by flax release (0.12: out_sharding).
_VARIABLE_AXES_METADATA = ("out_sharding", "sharding_names", "sharding")


def variable_axes(tree) -> dict[tuple[str, ...], tuple]:
    """{key of the array inside an ``nnx.Variable``: its axis names} for every Variable of
    ``tree`` whose metadata names them (``nnx.with_partitioning``), so a save records them as
    it records linen boxes' names. Keys are those ``flatten`` gives (``…/kernel/value``)."""
    import jax  # here, not at import: inspect reads a tree's classes without JAX

    out: dict[tuple[str, ...], tuple] = {}
    nodes = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: _is_variable(x) or _is_leaf(x)
    )[0]
    for path, node in nodes:
        if not _is_variable(node):
            continue
        metadata = node.get_metadata() if hasattr(node, "get_metadata") else {}
        names = next(
            (metadata[m] for m in _VARIABLE_AXES_METADATA if metadata.get(m) is not None), None
        )
        if names is None or not all(isinstance(n, (str, type(None))) for n in names):
            continue
        for inner, _ in jax.tree_util.tree_flatten_with_path(node)[0]:
            out[_key_of(path) + _key_of(inner)] = tuple(names)
    return out


def nest(items: Iterable[tuple[Sequence[str], Sequence[str], Any]], *, partial=False) -> Any:
    """Nested dicts from (key, key_types, value); a level whose keys are all sequence indices
    0..n-1 becomes a list (tuples and lists were saved that way). ``partial`` (a selection):
    a level of indices is a list only when no index is missing, else a dict of int keys."""
    root: dict = {}
    types_at: dict[tuple, set] = {}
    for key, key_types, value in items:
        node = root
        for depth, comp in enumerate(key[:-1]):
            types_at.setdefault(tuple(key[:depth]), set()).add(
                key_types[depth] if depth < len(key_types) else "key"
            )
            node = node.setdefault(comp, {})
        types_at.setdefault(tuple(key[:-1]), set()).add(key_types[-1] if key_types else "key")
        node[key[-1]] = value

    def convert(node, prefix):
        if not isinstance(node, dict):
            return node
        conv = {k: convert(v, prefix + (k,)) for k, v in node.items()}
        if types_at.get(prefix) == {"index"} and sorted(conv, key=int) == [
            str(i) for i in range(len(conv))
        ]:
            return [conv[str(i)] for i in range(len(conv))]
        if partial and types_at.get(prefix) == {"index"}:
            return {int(k): v for k, v in sorted(conv.items(), key=lambda kv: int(kv[0]))}
        return conv

    return convert(root, ())


def _is_axes(x) -> bool:
    return x is None or (isinstance(x, tuple) and all(isinstance(n, (str, type(None))) for n in x))


def flatten_axes(logical_axes) -> dict[tuple[str, ...], tuple | None]:
    """A pytree of logical axis-name tuples (or PartitionSpecs of names) → {key: names}."""
    import jax  # here, not at import: inspect reads a tree's classes without JAX

    leaves, _ = jax.tree_util.tree_flatten_with_path(logical_axes, is_leaf=_is_axes)
    return {_key_of(path): None if names is None else tuple(names) for path, names in leaves}


# --- container types: recorded at save, rebuilt on restore without a target ----------------------
# A restore without a target must give back a state ``tx.update`` accepts: optax states are
# NamedTuples (ScaleByAdamState, EmptyState() with no leaves at all), chains are tuples. The save
# records every container node as "<module>:<qualname>"; the restore rebuilds a node only when
# that exact name is in ``allowed_classes()``. A manifest is untrusted: its class names are looked
# up in that table, never imported or resolved by attribute (a walk such as
# "jax.version:subprocess.Popen" once reached any class). Anything else is a dict of its fields.

# Public optax modules whose NamedTuples (optimizer states) are rebuilt.
_OPTAX_MODULES = (
    "optax",
    "optax.contrib",
    "optax.schedules",
    "optax.transforms",
    "optax.tree_utils",
)
# Other container classes rebuilt from the dict of their children: (module, attribute).
_DICT_CLASSES = (("flax.core", "FrozenDict"), ("flax.nnx", "State"))


def class_name(cls: type) -> str:
    """How ``describe_structure`` names a class in the manifest."""
    return f"{cls.__module__}:{cls.__qualname__}"


@functools.cache
def allowed_classes() -> dict[str, type]:
    """Manifest class name → class, for every container class a restore rebuilds: optax's
    public NamedTuples (enumerated from its public modules) and flax's dict-like containers.

    The table is built from our own list of modules, never from a manifest."""
    table: dict[str, type] = {}
    for module_name in _OPTAX_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # pragma: no cover - an optax without that module
            continue
        for attr in dir(module):
            obj = getattr(module, attr, None)
            if (
                isinstance(obj, type)
                and issubclass(obj, tuple)
                and isinstance(getattr(obj, "_fields", None), tuple)
                and obj.__module__.split(".")[0] == "optax"
            ):
                table[class_name(obj)] = obj
    for module_name, attr in _DICT_CLASSES:
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError):  # pragma: no cover - an older flax
            continue
        table[class_name(obj)] = obj
    return table


@functools.cache
def _by_package_and_qualname() -> dict[tuple[str, str], type | None]:
    """(top package, qualname) → class, for names unique in the table (None when ambiguous):
    optax moves classes between private modules across releases."""
    out: dict[tuple[str, str], type | None] = {}
    for cls in allowed_classes().values():
        key = (cls.__module__.split(".")[0], cls.__qualname__)
        out[key] = None if key in out and out[key] is not cls else cls
    return out


def allowed_class(name: object) -> type | None:
    """The class a manifest's ``"<module>:<qualname>"`` names, if the allow-list holds it: the
    exact name, or the same qualname in the same top package (a class optax has moved)."""
    if not isinstance(name, str):
        return None
    cls = allowed_classes().get(name)
    if cls is not None:
        return cls
    module, _, qualname = name.partition(":")
    return _by_package_and_qualname().get((module.split(".")[0], qualname))


_PLAIN_KINDS = {dict: "dict", list: "list", tuple: "tuple"}


def describe_structure(tree) -> dict:
    """The container structure of ``tree`` as JSON: node types, classes, child names."""

    def node(x) -> dict:
        children = None if _is_leaf(x) else _children(x)
        if children is None:
            return {"type": "leaf"}
        kids = []
        for path, child in children:
            key_type, name = keypath_lib.component_of(path[0])
            kids.append([name, key_type, node(child)])
        kind = _PLAIN_KINDS.get(type(x))
        if kind is not None:
            return {"type": kind, "children": kids}
        kind = "namedtuple" if isinstance(x, tuple) and hasattr(type(x), "_fields") else "object"
        return {"type": kind, "children": kids, "class": class_name(type(x))}

    return node(tree)


_MISSING = object()


def rebuild_structure(
    description: dict, value_at: Any, prefix: tuple = (), *, partial: bool = False
) -> Any:
    """The tree ``describe_structure`` described, with each leaf from ``value_at(key)`` (which
    returns ``_MISSING`` for leaves not restored, e.g. not selected): containers that lose
    children become dicts (of int keys for a sequence's positions), empty subtrees of a
    selection disappear. ``partial`` (a selection): only containers of restored leaves come
    back; a leafless node (optax's ``EmptyState()``) comes back only beside siblings restored
    whole, so ``select=r"opt_state/.*"`` still gives the optimizer's tuple.

    Args:
        description: what ``describe_structure`` recorded.
        value_at: the value of a leaf, by key (``_MISSING`` when not restored).
        prefix: the key of ``description``'s node.
        partial: a selection: only containers of restored leaves.
    """
    return _rebuild(description, value_at, prefix, partial)[0]


class _Leafless:
    """A child without leaves (``EmptyState()``, ``{}``) whose place a selection decides."""

    def __init__(self, description: dict):
        self.description = description


def _has_leaves(description: dict) -> bool:
    if description["type"] == "leaf":
        return True
    return any(_has_leaves(child) for _, _, child in description["children"])


def _rebuild(description: dict, value_at: Any, prefix: tuple, partial: bool) -> tuple[Any, bool]:
    """(the rebuilt node or ``_MISSING``, whether every leaf under it was restored)."""
    if description["type"] == "leaf":
        value = value_at(prefix)
        return value, value is not _MISSING
    slots: list = []  # (key, value) per child in order; leafless ones decided below
    whole = True
    for name, key_type, child in description["children"]:
        key = int(name) if key_type == "index" else name
        if partial and not _has_leaves(child):
            slots.append((key, _Leafless(child)))
            continue
        value, child_whole = _rebuild(child, value_at, prefix + (name,), partial)
        whole = whole and child_whole
        slots.append((key, value))
    restored = [(k, v) for k, v in slots if not isinstance(v, _Leafless) and v is not _MISSING]
    if partial:
        if not restored:
            return _MISSING, False
        if whole:  # every leaf below was restored: its leafless parts belong to it too
            restored = [
                (k, _rebuild(v.description, value_at, prefix, False)[0])
                if isinstance(v, _Leafless)
                else (k, v)
                for k, v in slots
            ]
    elif not restored and description["children"]:
        return _MISSING, False  # nothing of this subtree was restored
    if len(restored) < len(description["children"]):
        return dict(restored), False  # part of a container (a selection): positions stay ints
    kind, values = description["type"], [v for _, v in restored]
    fields = {str(k): v for k, v in restored}
    if kind in ("list", "tuple"):
        return (list if kind == "list" else tuple)(values), whole
    cls = _rebuildable(description)  # None: a dict, or a class outside the allow-list
    if cls is None:
        return fields, whole  # its fields, by name
    return (cls(*values) if kind == "namedtuple" else cls(fields)), whole  # FrozenDict, State


def _rebuildable(description: dict) -> type | None:
    """The allow-listed class of a "namedtuple"/"object" node, if it is rebuilt as that class:
    a NamedTuple whose fields are exactly the children's names, a dict-like object."""
    cls = allowed_class(description.get("class"))
    if cls is None:
        return None
    names = tuple(name for name, _, _ in description["children"])
    is_namedtuple = issubclass(cls, tuple)
    if (description["type"] == "namedtuple") != is_namedtuple:
        return None
    if is_namedtuple and tuple(getattr(cls, "_fields", ())) != names:
        return None
    return cls


def class_notices(description: dict | None) -> list[tuple[str, str]]:
    """[(node path, notice)] for each "namedtuple"/"object" node a restore without a target
    gives back as a plain dict (its class is not in the allow-list, or its fields differ)."""
    out: list[tuple[str, str]] = []
    stack: list[tuple[tuple[str, ...], dict]] = (
        [((), description)] if description is not None else []
    )
    while stack:
        prefix, node = stack.pop()
        if node["type"] == "leaf":
            continue
        if node["type"] in ("namedtuple", "object") and _rebuildable(node) is None:
            name = node.get("class")
            cls = allowed_class(name)
            why = (
                "is not in the allow-list of container classes"
                if cls is None
                else "is allow-listed but its fields are not "
                + _short_text(tuple(name for name, _, _ in node["children"]))
            )
            where = "/".join(prefix) or "the root"
            out.append(
                (
                    where,
                    f"Tree node {where!r}: class {_short_text(name)} {why}; a restore without a "
                    f"target gives it back as a dict of its fields.",
                )
            )
        for name, _, child in reversed(node["children"]):
            stack.append((prefix + (name,), child))
    return out


def _short_text(text, limit: int = 120) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[:limit] + "…"


def missing() -> Any:
    """The marker ``value_at`` returns for a leaf that is not restored."""
    return _MISSING
