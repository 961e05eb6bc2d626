"""Which sharding each restored tensor gets: a ``Sharding`` per leaf, else logical-axis ``rules`` on
a ``mesh``, else each saved PartitionSpec kept per dimension where it fits."""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_ucp._src.errors import RequestError
from jax_ucp._src.format import SavedSharding
from jax_ucp._src.format.sizes import format_size

LogicalRules = Sequence[tuple[str, Any]]


class ReplicationWarning(UserWarning):
    """A restore replicates on every device tensors the checkpoint saved sharded."""


def axes_of(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _axis_size(mesh: Mesh | jax.sharding.AbstractMesh, axes: Sequence[str]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def check_divisible(name: str, shape: Sequence[int], sharding: jax.sharding.Sharding) -> None:
    """Clear error (tensor, dimension, axis) instead of JAX's generic one.

    Args:
        name: the tensor's name, for the message
        shape: its global shape
        sharding: the sharding asked for it"""
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
        if len(spec) > len(shape):
            raise RequestError(
                f"Tensor {name!r} has {len(shape)} dimensions (shape {tuple(shape)}) but its "
                f"PartitionSpec {sharding.spec} has {len(sharding.spec)} entries."
            )
        for dim, entry in enumerate(spec):  # its axes are the mesh's (JAX checked them)
            axes = axes_of(entry)
            size = _axis_size(sharding.mesh, axes)
            if axes and shape[dim] % size:
                raise RequestError(
                    f"Tensor {name!r}: dimension {dim} (size {shape[dim]}) is not divisible by mesh "
                    f"axis {'×'.join(axes)!r} (size {size}) of PartitionSpec {sharding.spec}. Choose a "
                    f"PartitionSpec that replicates that dimension, or a mesh whose axis divides it."
                )
    else:
        try:
            sharding.shard_shape(tuple(shape))
        except Exception as e:  # re-raised with the tensor's name
            raise RequestError(f"Tensor {name!r} (shape {tuple(shape)}): {e}") from e


def _claim(entry, size: int, mesh: Mesh, used: set[str]) -> Any:
    """``entry`` (lists as tuples) if its mesh axes exist, are not ``used`` by an earlier
    dimension and divide ``size`` (then they are marked used), else None (replicated)."""
    axes = axes_of(entry)
    if not axes or any(a not in mesh.shape for a in axes) or used.intersection(axes):
        return None
    if size % _axis_size(mesh, axes):
        return None
    used.update(axes)
    return tuple(entry) if isinstance(entry, list) else entry


def partition_spec_from_saved(
    shape: Sequence[int], saved: SavedSharding | None, mesh: Mesh
) -> PartitionSpec:
    """The saved PartitionSpec, kept per dimension where it still fits the new mesh.

    Args:
        shape: the tensor's global shape
        saved: its saved sharding from the manifest (None: replicated)
        mesh: the mesh restored onto"""
    if saved is None:
        return PartitionSpec()
    out: list = []
    used: set[str] = set()
    for dim, size in enumerate(shape):
        entry = saved.partition_spec[dim] if dim < len(saved.partition_spec) else None
        out.append(_claim(entry, size, mesh, used))
    return PartitionSpec(*out)


def partition_spec_from_logical(
    shape: Sequence[int], logical_axes: Sequence[str | None], rules: LogicalRules, mesh: Mesh
) -> PartitionSpec:
    """flax-style logical → mesh axes: the first rule for a name whose mesh axes are free and divide.

    Args:
        shape: the tensor's global shape
        logical_axes: its logical axis name per dimension (None: unnamed)
        rules: ``(logical name, mesh axes)`` pairs, first match wins
        mesh: the mesh restored onto"""
    out: list = []
    used: set[str] = set()
    for dim, name in enumerate(logical_axes):
        chosen = None
        if name is not None:
            for rule_name, mesh_axes in rules:
                if rule_name != name:
                    continue
                chosen = _claim(mesh_axes, shape[dim], mesh, used)
                if chosen is not None or not axes_of(mesh_axes):
                    break  # claimed, or explicitly replicated
        out.append(chosen)
    return PartitionSpec(*out)


def check_rules(rules: LogicalRules, mesh: Mesh | jax.sharding.AbstractMesh) -> None:
    """Every mesh axis a rule names exists in ``mesh`` (a typo would silently replicate)."""
    for rule in rules:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise RequestError(
                f"Logical-axis rule {rule!r}: expected (logical name, mesh axis or axes or None)."
            )
        missing = [a for a in axes_of(rule[1]) if a not in mesh.shape]
        if missing:
            raise RequestError(
                f"Logical-axis rule {tuple(rule)!r} names mesh axis {missing[0]!r}, which the "
                f"mesh (axes {tuple(mesh.axis_names)}) does not have."
            )


def _closest(name: str, known: Iterable[str]) -> str:
    near = difflib.get_close_matches(name, sorted(set(known)), n=3, cutoff=0.5)
    return ", ".join(repr(n) for n in near) if near else "none close"


def _near_miss(name: str, known: Iterable[str]) -> bool:
    """``name`` reads like a misspelling of a known one (``modle``/``model``)."""
    return bool(difflib.get_close_matches(name, sorted(set(known)), n=1, cutoff=0.75))


def _listed(names: Iterable[str], limit: int = 12) -> str:
    names = sorted(set(names))
    text = ", ".join(repr(n) for n in names[:limit])
    return (text + f", … ({len(names)} in all)" if len(names) > limit else text) or "none"


def unmatched_rules(rules: LogicalRules | None, logical_names: Iterable[str]) -> list[str]:
    """The logical names of ``rules`` that no tensor carries: those rules shard nothing."""
    known = set(logical_names)
    return [name for name, _ in rules or () if name not in known]


def unmatched_rules_message(
    where: str, unmatched: Sequence[str], logical_names, unnamed=(), advice: str = ""
) -> str:
    """Why ``rules`` shard nothing, or not these tensors, and what to do about it.

    Args:
        where: the checkpoint, for the message.
        unmatched: the logical names of rules that matched no tensor.
        logical_names: the logical axis names the tensors carry.
        unnamed: the tensors of two or more dimensions that carry none, left whole.
        advice: how to name their axes, for the source at hand."""
    said = []
    if unmatched:
        said.append(
            f"rules for {_listed(unmatched)} match no logical axis name of the tensors (they "
            f"carry: {_listed(logical_names)}); what those rules should shard is replicated on "
            f"every device"
        )
    if unnamed:
        said.append(
            f"{len(unnamed)} tensor(s) of 2 or more dimensions carry no logical axis names, so "
            f"no rule shards them and they are replicated on every device: {_listed(unnamed, 5)}"
        )
    return f"{where}: {'; '.join(said)}: {advice or 'fix the names or leave those rules out'}."


def check_names(
    mesh: Mesh,
    rules: LogicalRules | None,
    *,
    logical_names: Iterable[str],
    saved_axes: Iterable[str],
    where: str,
    strict: bool = True,
) -> None:
    """Refuses, before anything is read, misspelt names that would make a restore replicate
    silently: a rule's logical name or a mesh axis close to a used one (``strict=False`` allows
    them).

    Args:
        mesh: the mesh restored onto
        rules: the logical-axis rules given, if any
        logical_names: every logical name the checkpoint's tensors carry
        saved_axes: every mesh axis a saved PartitionSpec uses
        where: the checkpoint, for messages
        strict: refuse near-miss names (False: allow them)"""
    if rules is not None:
        check_rules(rules, mesh)
    if not strict:
        return
    logical_names = set(logical_names)
    saved_axes = set(saved_axes)
    advice = "or pass strict=False to allow it"
    if rules is not None:
        for name, _ in rules:
            if name not in logical_names and _near_miss(name, logical_names):
                raise RequestError(
                    f"Logical-axis rule {name!r}: no tensor of the checkpoint {where} carries "
                    f"that logical axis name (closest: {_closest(name, logical_names)}; the "
                    f"checkpoint's names: {_listed(logical_names)}). Fix the name, {advice} "
                    f"(e.g. rules shared with activation axes)."
                )
    rule_axes = {a for _, axes in rules or () for a in axes_of(axes)}
    known = rule_axes | saved_axes
    for axis in mesh.axis_names:
        if mesh.shape[axis] > 1 and axis not in known and _near_miss(axis, known):
            if rules is not None:
                what = (
                    f"no rule maps a logical name to it nor does any PartitionSpec the "
                    f"checkpoint {where} was saved with use it (rules use {_listed(rule_axes)}; "
                    f"saved axes {_listed(saved_axes)})"
                )
            elif saved_axes:
                what = (
                    f"the checkpoint {where} was saved on a mesh without it (saved axes "
                    f"{_listed(saved_axes)}; closest: {_closest(axis, saved_axes)}); pass "
                    f"rules= for the logical names {_listed(logical_names)}"
                )
            else:
                what = (
                    f"the checkpoint {where} records no PartitionSpec (saved from host arrays, "
                    f"or imported); pass "
                    + (
                        f"rules= for its logical names {_listed(logical_names)}, "
                        if logical_names
                        else ""
                    )
                    + "a target or shardings="
                )
            raise RequestError(
                f"Mesh axis {axis!r} (size {mesh.shape[axis]}): {what}. Every tensor would be "
                f"replicated along it. Fix the axis name, {advice}."
            )


def replicated_unasked(
    shape: Sequence[int],
    spec: PartitionSpec,
    *,
    mesh: Mesh,
    saved: SavedSharding | None,
    logical_axes: Sequence[str | None] | None,
    rules: LogicalRules | None,
) -> bool:
    """The tensor was saved sharded, ``spec`` replicates it, and no rule asked for that.

    Args:
        shape: the tensor's global shape
        spec: the PartitionSpec it gets
        mesh: the mesh restored onto
        saved: its saved sharding
        logical_axes: its logical axis names
        rules: the logical-axis rules given"""
    if math.prod(mesh.shape.values()) < 2 or math.prod(shape) < 2:
        return False
    if any(axes_of(entry) for entry in spec):
        return False
    if saved is None:
        return False
    sizes = dict(zip(saved.mesh.axis_names, saved.mesh.shape))
    if not any(sizes.get(a, 1) > 1 for entry in saved.partition_spec for a in axes_of(entry)):
        return False  # saved replicated
    if rules is not None and logical_axes is not None:
        asked = True
        for name in logical_axes:
            if name is None:
                continue
            first = next((axes for rule_name, axes in rules if rule_name == name), ...)
            asked = asked and first is not ... and not axes_of(first)
        return not asked
    return True


def replication_warning(where: str, tensors: Sequence[tuple[str, int]]) -> str:
    """The message of a ``ReplicationWarning`` for ``[(name, bytes)]``."""
    total = sum(n for _, n in tensors)
    names = ", ".join(repr(name) for name, _ in tensors[:5])
    more = f", … ({len(tensors)} in all)" if len(tensors) > 5 else ""
    return (
        f"{where}: {len(tensors)} tensor(s) saved sharded will be replicated on every device "
        f"({format_size(total)} per device): {names}{more}. Their saved mesh axes are not in the "
        f"mesh or do not divide them, or no rule covers their logical names: pass rules= or a "
        f"target to shard them (jax_ucp.plan shows the placement)."
    )


def sharding_for(
    shape: Sequence[int],
    *,
    mesh: Mesh,
    saved: SavedSharding | None,
    logical_axes: Sequence[str | None] | None,
    rules: LogicalRules | None,
) -> NamedSharding:
    """The sharding a restore onto ``mesh`` gives a tensor: by the rules, else its saved spec.

    Args:
        shape: the tensor's global shape
        mesh: the mesh restored onto
        saved: its saved sharding from the manifest
        logical_axes: its logical axis names
        rules: the logical-axis rules given (they win over the saved PartitionSpec)"""
    if rules is not None and logical_axes is not None:
        return NamedSharding(mesh, partition_spec_from_logical(shape, logical_axes, rules, mesh))
    return NamedSharding(mesh, partition_spec_from_saved(shape, saved, mesh))


def describe(sharding: jax.sharding.Sharding | None) -> SavedSharding | None:
    """What the manifest records of a save-time sharding (informational)."""
    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        spec = tuple(tuple(p) if isinstance(p, list) else p for p in sharding.spec)
        sizes = [int(mesh.shape[a]) for a in mesh.axis_names]
        return SavedSharding.of(mesh.axis_names, sizes, spec)
    return None
