"""The saved pytree's record in ``ucp.json`` (``tree``, docs/FORMAT.md section 5): its nodes as
typed Structs, read into the dicts of its JSON and checked against the entries; and how deep
JSON may nest, which bounds the tree a save may record."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from jax_ucp._src.errors import CheckpointError, RequestError
from jax_ucp._src.format import keypath as keypath_lib

MAX_JSON_DEPTH = 512  # a recorded tree structure nests 3 JSON levels per pytree level
#: containers nested in a saved tree: what ``ucp.json`` can record within ``MAX_JSON_DEPTH``
#: (checked at save, so what ``save`` writes ``restore`` reads)
MAX_TREE_DEPTH = MAX_JSON_DEPTH // 3
TOO_DEEP = f"JSON nested deeper than {MAX_JSON_DEPTH} levels."

KEY_TYPES = ("key", "index", "attr")
if TYPE_CHECKING:  # a checker sees what code builds and reads: names as str
    KeyType = str
else:
    KeyType = Literal[KEY_TYPES]
Child = tuple[str, KeyType, "TreeNode"]
Scalar = str | int | float | bool | None


class _Node(Struct, forbid_unknown_fields=True, gc=False, tag_field="type"):
    """Strict (an unknown field is an error) and untracked by the cyclic GC (JSON holds no
    cycles)."""


class LeafNode(_Node, tag="leaf"):
    """A leaf of the saved tree: one entry."""


class _Container(_Node):
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


class DictNode(_Container, tag="dict"):
    """A dict; children as [name, key type, node]."""


class ListNode(_Container, tag="list"):
    """A list; children as [name, key type, node]."""


class TupleNode(_Container, tag="tuple"):
    """A tuple; children as [name, key type, node]."""


class NamedTupleNode(_Container, tag="namedtuple"):
    """A NamedTuple of class 'module:qualname' (rebuilt only from an allow-list of modules)."""

    class_: str = msgspec.field(name="class")


class ObjectNode(_Container, tag="object"):
    """Another pytree class 'module:qualname' (rebuilt only from an allow-list of modules)."""

    class_: str = msgspec.field(name="class")


TreeNode = LeafNode | DictNode | ListNode | TupleNode | NamedTupleNode | ObjectNode
NODE_TAGS = {kind: kind.__struct_config__.tag for kind in TreeNode.__args__}
if TYPE_CHECKING:  # a decoded manifest holds its tree as the dicts of its JSON
    SavedTree = dict | None
else:
    SavedTree = TreeNode | UnsetType | None


def tree_dicts(root: Any, remaining: set[tuple[str, ...]]) -> dict:
    """The saved tree as the dicts of its JSON, each node's children freed as they are built
    (walked without recursion), checked: at most ``MAX_JSON_DEPTH`` JSON levels deep (3 a
    pytree level, below the manifest's own 2), and its leaves exactly the entries' keys
    (``remaining``, emptied)."""
    out: dict = {}
    stack: list[tuple[Any, dict, tuple[str, ...], int]] = [(root, out, (), 2)]
    while stack:
        node, d, prefix, level = stack.pop()
        leaf = type(node) is LeafNode
        # a container's children list is one level deeper, each [name, type, node] two
        if level + (0 if leaf else 2 if node.children else 1) > MAX_JSON_DEPTH:
            raise CheckpointError(TOO_DEEP)
        d["type"] = NODE_TAGS[type(node)]
        if leaf:
            if prefix not in remaining:  # not an entry's key, or a second leaf of one
                remaining = {prefix}
                break
            remaining.discard(prefix)
            continue
        if node.class_ is not UNSET:
            d["class"] = node.class_
        if node.metadata is not UNSET:  # an nnx.Variable's (JSON scalars, lists)
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
        raise CheckpointError(
            f"tree: its leaves and the entries differ (e.g. "
            f"{[keypath_lib.key_to_str(k) for k in sorted(remaining)[:3]]}); expected exactly "
            f"one leaf per entry."
        )
    return out


def check_tree_depth(tree: Any) -> None:
    """Refuses a tree whose dicts, lists and tuples nest deeper than :data:`MAX_TREE_DEPTH`,
    walking it without recursion, before anything recursive (flattening, the manifest) runs:
    ``ucp.json`` could not record it, and a reader would refuse it."""
    path = deeper(tree, 1, MAX_TREE_DEPTH, (Mapping, list, tuple))
    if path is not None:
        raise RequestError(
            f"the tree nests containers deeper than {MAX_TREE_DEPTH} levels (at "
            f"{path[:120]!r}...): ucp.json records at most {MAX_JSON_DEPTH} JSON "
            f"levels, so such a checkpoint could not be restored; flatten part of the tree"
        )


def deeper(node: Any, depth: int, limit: int = MAX_JSON_DEPTH, kinds: tuple = (dict, list)):
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
