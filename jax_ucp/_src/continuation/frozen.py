"""Parameters a torch run did not train, held in its continuation: those the checkpoint holds
no optimizer state for (Adam's moments, SGD's or Muon's momentum, Adafactor's second moments) of
a LoRA / DoRA base, ``requires_grad=False`` weights: torch's optimizer keeps state only for a
parameter it stepped, and steps one only once it has a gradient. Their leaves
get zero updates whatever gradient is fed, so a ``jax.grad`` over the whole model continues the
run as torch does, the base frozen; the trained leaves' chain (clipping included: torch's norm
is over the gradients it has) sees only the trained leaves."""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Held:
    """The leaves of a run's params it did not train: each leaf labelled trained or frozen."""

    labels: Any
    paths: tuple[str, ...]

    @property
    def note(self) -> str:
        """What the continuation says of them."""
        shown = ", ".join(self.paths[:4]) + (", ..." if len(self.paths) > 4 else "")
        return (
            f"{len(self.paths)} leaves without optimizer state held (zero updates: the run did "
            f"not train them, e.g. a LoRA base): {shown}"
        )

    def only(self, tree: Any) -> Any:
        """``tree`` (params, or a state tree keyed alike) laid out as the params with
        ``optax.MaskedNode()`` at the frozen leaves, as ``optax.partition`` hands them to the
        trained chain."""
        import jax
        import optax

        return jax.tree_util.tree_map_with_path(
            lambda path, label: optax.MaskedNode() if label == FROZEN else _held(tree, path),
            self.labels,
        )

    def partition(self, tx: Any) -> Any:
        """``tx`` over the trained leaves, zero updates for the frozen ones."""
        import optax

        return optax.partition({TRAINED: tx, FROZEN: optax.set_to_zero()}, self.labels)

    def holding(self, tx: Any, state: Any, params: Any) -> tuple[Any, Any]:
        """(:meth:`partition` of ``tx``, its state around ``state``, the trained chain's
        restored state)."""
        import jax
        import optax

        full = self.partition(tx)
        shapes = jax.eval_shape(full.init, params)  # pyright: ignore[reportArgumentType]
        inner: dict[Hashable, Any] = {
            TRAINED: optax.MaskedState(inner_state=state),
            FROZEN: shapes.inner_states[FROZEN],
        }
        return full, optax.PartitionState(inner)


def find(params: Any, *states: Any) -> Held | None:
    """The leaves of ``params`` that none of ``states`` (the run's per-parameter state trees:
    Adam's mu, SGD's momentum, Adafactor's second moments...) holds, or None where each is held,
    or none is (a run that keeps no state, SGD without momentum: nothing tells)."""
    import jax

    leaves = jax.tree_util.tree_leaves_with_path(params)
    frozen = [p for p, _ in leaves if all(_held(s, p) is None for s in states)]
    if not frozen or len(frozen) == len(leaves):
        return None
    said = {jax.tree_util.keystr(p) for p in frozen}
    labels = jax.tree_util.tree_map_with_path(
        lambda path, _: FROZEN if jax.tree_util.keystr(path) in said else TRAINED, params
    )
    return Held(labels, tuple(sorted(said)))
