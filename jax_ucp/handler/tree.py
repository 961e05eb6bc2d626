"""Pytrees ⇄ key paths: flattening what is saved, rebuilding nested dicts/lists on restore."""

from __future__ import annotations

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
