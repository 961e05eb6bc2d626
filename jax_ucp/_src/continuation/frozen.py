"""Parameters a torch run did not train, held in its continuation: those the checkpoint holds
no Adam moments for (a LoRA / DoRA base, ``requires_grad=False`` weights: torch's optimizer keeps
state only for a parameter it stepped, and steps one only once it has a gradient). Their leaves
get zero updates whatever gradient is fed, so a ``jax.grad`` over the whole model continues the
run as torch does, the base frozen; the trained leaves' chain (clipping included: torch's norm
is over the gradients it has) sees only the trained leaves."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

TRAINED, FROZEN = "trained", "frozen"


def _held(tree: Any, path: tuple) -> Any:
    """The leaf of ``tree`` at ``path`` (a params path), or None where ``tree`` has none."""
    node = tree
    for key in path:
        try:  # a dict's key, a sequence's index, or a dataclass / namedtuple field
            node = (
                getattr(node, key.name)
                if hasattr(key, "name")
                else node[key.key if hasattr(key, "key") else key.idx]
            )
        except (AttributeError, KeyError, IndexError, TypeError):
            return None
    return node


def split(params: Any, mu: Any, nu: Any) -> tuple[Any, Any, Any, Any, list[str]]:
    """(labels or None, the trained params, their mu, their nu, the frozen leaves' paths):
    ``labels`` marks each leaf of ``params`` trained or frozen (no first moment held for it);
    the trained trees hold ``optax.MaskedNode()`` at the frozen leaves, as ``optax.partition``
    hands them to the trained chain. None and the trees unchanged when every leaf is trained."""
    import jax
    import optax

    leaves = jax.tree_util.tree_leaves_with_path(params)
    frozen = [path for path, _ in leaves if _held(mu, path) is None]
    if not frozen:
        return None, params, mu, nu, []
    said = {jax.tree_util.keystr(p) for p in frozen}

    def label(path, _):
        return FROZEN if jax.tree_util.keystr(path) in said else TRAINED

    labels = jax.tree_util.tree_map_with_path(label, params)

    def only(pick):
        return jax.tree_util.tree_map_with_path(
            lambda path, leaf: optax.MaskedNode() if label(path, leaf) == FROZEN else pick(path),
            params,
        )

    trained = only(lambda path: _held(params, path))
    return labels, trained, only(lambda p: _held(mu, p)), only(lambda p: _held(nu, p)), sorted(said)


def holding(tx: Any, state: Any, params: Any, labels: Any) -> tuple[Any, Any]:
    """(``tx`` over the trained leaves and zero updates for the frozen ones, its state around
    ``state``, the trained chain's restored state)."""
    import jax
    import optax

    full = optax.partition({TRAINED: tx, FROZEN: optax.set_to_zero()}, labels)
    shapes = jax.eval_shape(full.init, params)  # pyright: ignore[reportArgumentType]
    inner: dict[Hashable, Any] = {
        TRAINED: optax.MaskedState(inner_state=state),
        FROZEN: shapes.inner_states[FROZEN],
    }
    return full, optax.PartitionState(inner)
