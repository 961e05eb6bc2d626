"""Where a restore target keeps its Adam state, so a spec's optimizer roots follow it.

Shipped specs place an imported checkpoint's ``opt_state/{mu,nu,count}`` at
``opt_state/0/...``: the first state of ``optax.adam``/``optax.adamw``'s chain. A target built
with another chain (``optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(...))``, an
``inject_hyperparams`` or ``masked`` wrapper) keeps its ``ScaleByAdamState`` elsewhere; found by
its keys (``count`` beside ``mu`` and ``nu``) at any depth, the roots are moved there.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

from jax_ucp._src import tree as tree_lib
from jax_ucp._src.errors import RequestError

MOMENTS = ("mu", "nu", "count")


def adam_states(target: Any, top: str = "opt_state") -> list[tuple[str, ...]]:
    """Key prefixes under ``top`` holding an Adam state (``count``, ``mu`` and ``nu`` together)."""
    keys = [key for key, _, _ in tree_lib.flatten(target)[0]]
    counts = {k[:-1] for k in keys if len(k) >= 2 and k[0] == top and k[-1] == "count"}
    return [
        p
        for p in sorted(counts)
        if {"mu", "nu"} <= {k[len(p)] for k in keys if len(k) > len(p) and k[: len(p)] == p}
    ]


def follow_adam_state(spec: Any, target: Any) -> Any:
    """``spec`` with its roots into ``opt_state/<i>/{mu,nu,count}`` moved to the target's Adam
    state, when the target keeps it elsewhere; ``spec`` itself when nothing needs moving."""
    if spec is None or target is None:
        return spec
    from jax_ucp._src import language

    if not isinstance(spec, language.Spec):
        spec = language.load_spec(spec)
    movable = [(i, r) for i, r in enumerate(spec.roots) if _adam_target(r) is not None]
    if not movable:
        return spec
    found = adam_states(target, movable[0][1].target.split("/")[0])
    wanted = {_adam_target(r) for _, r in movable}
    if not found or wanted <= set(found):
        return spec  # no Adam state to follow, or already where the spec puts it
    if len(found) > 1:
        shown = ", ".join("/".join(p) for p in found)
        raise RequestError(
            f"spec {spec.name!r} restores an Adam state (its roots put opt_state/mu, nu, count at "
            f"{'/'.join(sorted(cast(set[tuple[str, ...]], wanted))[0])}), but the target holds {len(found)} Adam states: "
            f"{shown}. Say which in the spec's [[roots]] targets (e.g. "
            f'target = "{shown.split(", ")[0]}/mu").'
        )
    where = "/".join(found[0])
    roots = list(spec.roots)
    for i, r in movable:
        leaf = r.target.split("/")[-1]
        roots[i] = dataclasses.replace(r, target=f"{where}/{leaf}")
    return dataclasses.replace(spec, roots=tuple(roots))


def _adam_target(root) -> tuple[str, ...] | None:
    """The Adam-state prefix a root's fixed target names (``opt_state/0`` of
    ``opt_state/0/mu``), or None for any other root."""
    t = root.target
    if t is None or "{" in t:
        return None
    parts = tuple(p for p in t.split("/") if p)
    if len(parts) < 2 or parts[-1] not in MOMENTS or "*" in root.source:
        return None
    return parts[:-1]
