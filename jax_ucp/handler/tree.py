"""Pytrees ⇄ key paths: flattening what is saved, rebuilding nested dicts/lists on restore."""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from typing import Any

import jax

from jax_ucp.format import keypath as keypath_lib


def _is_leaf(x) -> bool:
    if x is None:
        return True
    try:  # flax metadata boxes (nn.Partitioned, nn.LogicalPartitioned) carry axis names
        from flax.core import meta

        return isinstance(x, meta.AxisMetadata)
    except ImportError:  # pragma: no cover - flax is a core dependency
        return False


def flatten(tree) -> tuple[list[tuple[tuple[str, ...], tuple[str, ...], Any]], Any]:
    """[(key, key_types, leaf)] in flatten order, and the treedef. None is a leaf (a saved value)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    out = []
    for path, leaf in leaves:
        comps = [keypath_lib.component_of(p) for p in path]
        out.append((tuple(c[1] for c in comps), tuple(c[0] for c in comps), leaf))
    return out, treedef


def unbox(leaf) -> tuple[Any, tuple | None]:
    """(value, logical axis names) for flax metadata boxes; (leaf, None) otherwise."""
    try:
        from flax.core import meta
    except ImportError:  # pragma: no cover
        return leaf, None
    if isinstance(leaf, meta.AxisMetadata):
        names = getattr(leaf, "names", None)
        return leaf.unbox(), (tuple(names) if names is not None else None)
    return leaf, None


def nest(items: Iterable[tuple[Sequence[str], Sequence[str], Any]]) -> Any:
    """Nested dicts from (key, key_types, value); a level whose keys are all sequence indices
    0..n-1 becomes a list (tuples and lists were saved that way)."""
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
        return conv

    return convert(root, ())


def _is_axes(x) -> bool:
    return x is None or (isinstance(x, tuple) and all(isinstance(n, (str, type(None))) for n in x))


def flatten_axes(logical_axes) -> dict[tuple[str, ...], tuple | None]:
    """A pytree of logical axis-name tuples (or PartitionSpecs of names) → {key: names}."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(logical_axes, is_leaf=_is_axes)
    return {
        tuple(keypath_lib.component_of(p)[1] for p in path): (
            None if names is None else tuple(names)
        )
        for path, names in leaves
    }


# --- container types: recorded at save, rebuilt on restore without a target ----------------------
# A restore without a target must give back a state ``tx.update`` accepts: optax states are
# NamedTuples (ScaleByAdamState, EmptyState() with no leaves at all), chains are tuples. The save
# records every container node; the restore rebuilds it, importing classes only from these
# packages (a manifest is untrusted: it never makes us import anything else).
ALLOWED_MODULE_ROOTS = ("optax", "flax", "jax", "builtins", "collections")


def describe_structure(tree) -> dict:
    """The container structure of ``tree`` as JSON: node types, classes, child names."""

    def node(x) -> dict:
        if _is_leaf(x):
            return {"type": "leaf"}
        children = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda c: c is not x)[0]
        if len(children) == 1 and children[0][0] == ():  # not a container
            return {"type": "leaf"}
        kids = []
        for path, child in children:
            key_type, name = keypath_lib.component_of(path[0])
            kids.append([name, key_type, node(child)])
        if type(x) is dict:
            kind = "dict"
        elif type(x) is list:
            kind = "list"
        elif type(x) is tuple:
            kind = "tuple"
        elif isinstance(x, tuple) and hasattr(type(x), "_fields"):
            kind = "namedtuple"
        else:
            kind = "object"
        out: dict = {"type": kind, "children": kids}
        if kind in ("namedtuple", "object"):
            out["class"] = f"{type(x).__module__}:{type(x).__qualname__}"
        return out

    return node(tree)


_MISSING = object()


def rebuild_structure(description: dict, value_at: Any, prefix: tuple = ()) -> Any:
    """The tree ``describe_structure`` described, with each leaf from ``value_at(key)`` (which
    returns ``_MISSING`` for leaves not restored, e.g. not selected): containers that lose
    children become dicts, empty subtrees of a selection disappear."""
    if description["type"] == "leaf":
        return value_at(prefix)
    kids = []
    for name, _, child in description["children"]:
        value = rebuild_structure(child, value_at, prefix + (name,))
        if value is not _MISSING:
            kids.append((name, value))
    complete = len(kids) == len(description["children"])
    if not kids and description["children"]:
        return _MISSING  # nothing of this subtree was restored
    kind = description["type"]
    if kind == "list" and complete:
        return [v for _, v in kids]
    if kind == "tuple" and complete:
        return tuple(v for _, v in kids)
    if kind == "namedtuple" and complete:
        cls = _allowed_class(description.get("class", ""))
        if cls is not None and tuple(getattr(cls, "_fields", ())) == tuple(n for n, _ in kids):
            return cls(*(v for _, v in kids))
        return dict(kids)  # a class outside the allow-list: its fields, by name
    if kind == "object" and complete:
        cls = _allowed_class(description.get("class", ""))
        if cls is not None:
            try:
                return cls(dict(kids))  # e.g. flax FrozenDict
            except Exception:  # noqa: BLE001 - an unknown constructor: plain dict below
                pass
    return dict(kids)


def _allowed_class(name: str):
    module, _, qualname = name.partition(":")
    if not qualname or module.split(".")[0] not in ALLOWED_MODULE_ROOTS:
        return None
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return obj if isinstance(obj, type) else None


def missing() -> Any:
    """The marker ``value_at`` returns for a leaf that is not restored."""
    return _MISSING
