"""Which sharding each restored tensor gets on the target mesh.

Three ways to say it, most explicit first: a ``jax.sharding.Sharding`` per leaf (given directly or
carried by a target array / ``ShapeDtypeStruct``); logical-axis ``rules`` on a ``mesh`` (flax
style: the logical names recorded at save time are mapped to mesh axes); or ``mesh`` alone, which
reuses each tensor's saved PartitionSpec dimension by dimension where the axis names exist in the
new mesh and divide the dimension, and replicates that dimension otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_ucp.format import SavedSharding

LogicalRules = Sequence[tuple[str, Any]]


class ShardingMismatchError(ValueError):
    """A tensor dimension does not divide the mesh axes it is asked to be split over."""


def _axes_of(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(entry)
    return (entry,)


def _axis_size(mesh: Mesh, axes: Sequence[str]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def check_divisible(name: str, shape: Sequence[int], sharding: jax.sharding.Sharding) -> None:
    """Clear error (tensor, dimension, axis) instead of JAX's generic one."""
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
        if len(spec) > len(shape):
            raise ShardingMismatchError(
                f"Tensor {name!r} has {len(shape)} dimensions (shape {tuple(shape)}) but its "
                f"PartitionSpec {sharding.spec} has {len(sharding.spec)} entries."
            )
        for dim, entry in enumerate(spec):
            axes = _axes_of(entry)
            for a in axes:
                if a not in sharding.mesh.shape:
                    raise ShardingMismatchError(
                        f"Tensor {name!r}: PartitionSpec {sharding.spec} names mesh axis {a!r}, which the "
                        f"target mesh (axes {tuple(sharding.mesh.axis_names)}) does not have."
                    )
            size = _axis_size(sharding.mesh, axes)
            if axes and shape[dim] % size:
                raise ShardingMismatchError(
                    f"Tensor {name!r}: dimension {dim} (size {shape[dim]}) is not divisible by mesh "
                    f"axis {'×'.join(axes)!r} (size {size}) of PartitionSpec {sharding.spec}. Choose a "
                    f"PartitionSpec that replicates that dimension, or a mesh whose axis divides it."
                )
    else:
        try:
            sharding.shard_shape(tuple(shape))
        except Exception as e:  # noqa: BLE001 - re-raised with the tensor's name
            raise ShardingMismatchError(f"Tensor {name!r} (shape {tuple(shape)}): {e}") from e


def partition_spec_from_saved(
    shape: Sequence[int], saved: SavedSharding | None, mesh: Mesh
) -> PartitionSpec:
    """The saved PartitionSpec, kept per dimension where it still fits the new mesh."""
    if saved is None:
        return PartitionSpec()
    out: list = []
    used: set[str] = set()
    for dim, size in enumerate(shape):
        entry = saved.partition_spec[dim] if dim < len(saved.partition_spec) else None
        axes = _axes_of(entry)
        if (
            axes
            and all(a in mesh.shape for a in axes)
            and not used.intersection(axes)
            and size % _axis_size(mesh, axes) == 0
        ):
            out.append(entry if not isinstance(entry, list) else tuple(entry))
            used.update(axes)
        else:
            out.append(None)
    return PartitionSpec(*out)


def partition_spec_from_logical(
    shape: Sequence[int], logical_axes: Sequence[str | None], rules: LogicalRules, mesh: Mesh
) -> PartitionSpec:
    """flax-style logical → mesh axes: the first rule for a name whose mesh axes are free and divide."""
    out: list = []
    used: set[str] = set()
    for dim, name in enumerate(logical_axes):
        chosen = None
        if name is not None:
            for rule_name, mesh_axes in rules:
                if rule_name != name:
                    continue
                axes = _axes_of(mesh_axes)
                if not axes:
                    break  # explicitly replicated
                if (
                    all(a in mesh.shape for a in axes)
                    and not used.intersection(axes)
                    and shape[dim] % _axis_size(mesh, axes) == 0
                ):
                    chosen = mesh_axes if not isinstance(mesh_axes, list) else tuple(mesh_axes)
                    used.update(axes)
                    break
        out.append(chosen)
    return PartitionSpec(*out)


def check_rules(rules: LogicalRules, mesh: Mesh) -> None:
    """Every mesh axis a rule names exists in ``mesh`` (a typo would silently replicate)."""
    for rule in rules:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ShardingMismatchError(
                f"Logical-axis rule {rule!r}: expected (logical name, mesh axis or axes or None)."
            )
        missing = [a for a in _axes_of(rule[1]) if a not in mesh.shape]
        if missing:
            raise ShardingMismatchError(
                f"Logical-axis rule {tuple(rule)!r} names mesh axis {missing[0]!r}, which the "
                f"mesh (axes {tuple(mesh.axis_names)}) does not have."
            )


def sharding_for(
    shape: Sequence[int],
    *,
    mesh: Mesh,
    saved: SavedSharding | None,
    logical_axes: Sequence[str | None] | None,
    rules: LogicalRules | None,
) -> NamedSharding:
    if rules is not None and logical_axes is not None:
        return NamedSharding(mesh, partition_spec_from_logical(shape, logical_axes, rules, mesh))
    return NamedSharding(mesh, partition_spec_from_saved(shape, saved, mesh))


def describe(sharding: jax.sharding.Sharding | None) -> SavedSharding | None:
    """What the manifest records of a save-time sharding (informational)."""
    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        spec = tuple(tuple(p) if isinstance(p, list) else p for p in sharding.spec)
        return SavedSharding(
            mesh_axis_names=tuple(mesh.axis_names),
            mesh_shape=tuple(int(mesh.shape[a]) for a in mesh.axis_names),
            partition_spec=spec,
        )
    return None
