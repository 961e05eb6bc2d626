"""A restore's requests, the JAX part of restoring: one per leaf of a target tree (its
shardings, an ``AbstractMesh``'s made concrete), or one per tensor ``select`` picks, placed on
``mesh=`` through the saved PartitionSpecs and logical axes (``rules=``).
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import jax
import numpy as np

from jax_ucp._src import format as fmt
from jax_ucp._src import sharding as sharding_lib
from jax_ucp._src import tree as tree_lib
from jax_ucp._src.errors import CheckpointError
from jax_ucp._src.options import user_stacklevel
from jax_ucp._src.restoring.engine import OpenedSource
from jax_ucp._src.restoring.model import Request, short_repr
from jax_ucp._src.restoring.options import RestoreOptions
from jax_ucp._src.sharding.mesh_layout import axes_of


@dataclasses.dataclass(frozen=True)
class Wanted:
    """A restore's requests, what they are read from, and how their results become its tree."""

    requests: list[Request]
    available: Mapping
    assemble: Callable[[list], Any]


def requests_for(opened: OpenedSource, options: RestoreOptions) -> Wanted:
    """The requests of a restore from ``opened`` (see ``restore_from``) and how to build the
    result from theirs: the target's structure (flax boxes kept), the saved containers, or the
    tensors nested by key."""
    every, values = opened.available, opened.values
    if options.has_target:  # one request per leaf, the results in the target's structure
        if options.rules is not None and options.mesh is not None:
            sharding_lib.check_rules(options.rules, options.mesh)
        impls = {k: key_impl_of(av) for k, av in every.items() if key_impl_of(av)}
        reqs, rebuild = requests_from_target(options.target, options.shardings, options.mesh, impls)
        for r in reqs if options.dtype is not None else ():
            if tuple(map(str, r.key)) not in impls:  # key data is never cast
                r.dtype = np.dtype(options.dtype)
        return Wanted(reqs, every, rebuild)
    where = opened.source.path
    if options.mesh is not None:
        check_mesh_names(
            where, every.values(), options.mesh, options.rules, options.strict, options.spec
        )
    available, chosen_values = selected(where, every, values, options.select)
    reqs, key_types = placed_requests(where, available.values(), options)
    for v in chosen_values:
        reqs.append(Request(key=v.key))
        key_types.append(v.key_types)
    partial, tree = options.select is not None, opened.tree
    impls = {av.key: key_impl_of(av) for av in available.values() if key_impl_of(av)}

    def nested(results):
        if impls:  # typed PRNG keys saved as their key data: keys again
            results = [_as_keys(r.key, x, impls.get(r.key)) for r, x in zip(reqs, results)]
        if tree is not None:  # the saved containers, NamedTuples and nnx.Variables included
            by_key = {r.key: x for r, x in zip(reqs, results)}
            axes = {av.key: av.logical_axes for av in available.values()}
            rebuilt = tree_lib.rebuild_structure(
                tree,
                lambda key: by_key.get(key, tree_lib.missing()),
                partial=partial,
                axes_at=axes.get,
            )
            return {} if rebuilt is tree_lib.missing() else rebuilt
        return tree_lib.nest(
            ((r.key, k, x) for r, k, x in zip(reqs, key_types, results)), partial=partial
        )

    return Wanted(reqs, available, nested)


def key_impl_of(available) -> str | None:
    """The PRNG key implementation of a stored typed-key tensor (its entry's ``key_impl``)."""
    if not getattr(available, "stored", False) or len(available.sources) != 1:
        return None
    return getattr(available.sources[0], "key_impl", None)


def _is_key_dtype(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)  # pyright: ignore[reportPrivateImportUsage]


def _as_keys(key, data, impl: str | None, want=None):
    """``data`` (key data read back) wrapped into typed PRNG keys of implementation ``impl``;
    ``want``: the target's key dtype, which they must have."""
    if impl is None and want is None:
        return data
    try:
        keys = jax.random.wrap_key_data(data, impl=impl)
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"Leaf {fmt.key_to_str(key)!r}: its key data (shape {tuple(data.shape)}, "
            f"{data.dtype}) cannot be PRNG keys of implementation {impl!r}: {e}"
        ) from None
    if want is not None and keys.dtype != want:
        raise CheckpointError(
            f"Leaf {fmt.key_to_str(key)!r}: the checkpoint holds PRNG keys of implementation "
            f"{impl!r} ({keys.dtype}); the target wants keys of {_impl_of(want)!r} ({want})."
        )
    return keys


def _impl_of(key_dtype) -> str | None:
    """The name (``fmt.KEY_IMPLS``) of the PRNG implementation of a key dtype, if known."""
    for name, key_shape in fmt.KEY_IMPLS.items():
        data = jax.ShapeDtypeStruct(key_shape, np.uint32)
        if jax.eval_shape(lambda d, n=name: jax.random.wrap_key_data(d, impl=n), data).dtype == (
            key_dtype
        ):
            return name
    return None


def _concrete(key, sharding, mesh):
    """A target's ``NamedSharding`` on an ``AbstractMesh`` (what ``nnx.eval_shape`` under
    ``jax.set_mesh`` gives) on the concrete mesh: ``mesh=`` or the one set by
    ``jax.set_mesh``, when its axis names and sizes are the abstract mesh's."""
    if not (
        isinstance(sharding, jax.sharding.NamedSharding)
        and isinstance(sharding.mesh, jax.sharding.AbstractMesh)
    ):
        return sharding
    wanted = dict(sharding.mesh.shape)
    candidates = [mesh] if mesh is not None else []
    current = getattr(jax.sharding, "get_mesh", lambda: None)()
    if current is not None and not getattr(current, "empty", True):
        candidates.append(current)
    for candidate in candidates:
        if isinstance(candidate, jax.sharding.Mesh) and dict(candidate.shape) == wanted:
            return jax.sharding.NamedSharding(candidate, sharding.spec)
    found = f"; mesh= has axes {dict(mesh.shape)}" if mesh is not None else ""
    raise CheckpointError(
        f"Leaf {fmt.key_to_str(key)!r}: the target's sharding is on an AbstractMesh {wanted} "
        f"(nnx.eval_shape under jax.set_mesh gives these), which has no devices{found}. Pass "
        f"the concrete mesh as mesh=, or restore inside `with jax.set_mesh(mesh):`."
    )


def requests_from_target(
    target, shardings=None, mesh=None, impls: Mapping | None = None
) -> tuple[list[Request], Callable]:
    """One request per target leaf, and how the results become the target's structure (flax
    boxes keep their metadata); shardings (same structure) override the target's own. A typed
    PRNG key leaf asks for its key data and gets keys back.

    Args:
        target: the pytree to restore into (None: ``shardings`` are the target).
        shardings: shardings in the target's structure (override its own).
        mesh: the concrete mesh for shardings on an ``AbstractMesh``.
        impls: {key: the checkpoint's ``key_impl``} of its typed-key tensors.
    """
    boxed = target is not None  # a pytree of shardings as the target: no boxes to keep
    if target is None:
        target, shardings = shardings, None
    leaves, rebuild = tree_lib.target_leaves(target, boxed)
    overrides = tree_lib.target_leaves(shardings)[0] if shardings is not None else ()
    shard_by_key = {key: _concrete(key, s, mesh) for key, s in overrides}
    reqs = []
    keys_at: dict[int, Any] = {}  # position → the key dtype of a typed PRNG key leaf
    for key, leaf in leaves:
        if isinstance(leaf, jax.sharding.Sharding):  # a pytree of shardings used as the target
            reqs.append(Request(key=key, sharding=_concrete(key, leaf, mesh)))
            continue
        sharding = shard_by_key.get(key, _concrete(key, getattr(leaf, "sharding", None), mesh))
        if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) and _is_key_dtype(leaf.dtype):
            # its key data is what was saved: uint32, one key's data last (the sharding's
            # spec leaves those dimensions whole)
            data = jax.eval_shape(jax.random.key_data, leaf)
            keys_at[len(reqs)] = leaf.dtype
            reqs.append(Request(key, data.dtype, tuple(data.shape), sharding, wants_array=True))
            continue
        if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)):
            dtype, shape = np.dtype(leaf.dtype), tuple(leaf.shape)
            reqs.append(Request(key, dtype, shape, sharding, wants_array=True))
        elif isinstance(leaf, (bool, int, float)):
            reqs.append(Request(key=key, python_type=type(leaf), sharding=sharding))
        else:  # None, str, or anything else: take what was saved
            reqs.append(Request(key=key, sharding=shard_by_key.get(key)))
    if not keys_at:
        return reqs, rebuild

    def rebuild_keys(values: list) -> Any:
        values = list(values)
        for i, want in keys_at.items():
            key = reqs[i].key
            recorded = (impls or {}).get(key)  # None: saved as bare key data (uint32)
            values[i] = _as_keys(key, values[i], recorded or _impl_of(want), want)
        return rebuild(values)

    return reqs, rebuild_keys


def selected(where: str, every: Mapping, values: Sequence[fmt.ValueEntry], select):
    """The tensors and values ``select`` (a regex matched in full against "a/b/c" names, or a
    predicate on the name) matches (all without it); matching none is an error.

    Args:
        where: the checkpoint, for the error.
        every: the tensors it holds, by key path.
        values: its saved Python values.
        select: a regex over "/"-joined names, a predicate on the name, or None (all).
    """
    if select is None:
        return dict(every), list(values)
    if isinstance(select, str):
        selected = re.compile(select).fullmatch
    elif callable(select):
        selected = cast(Callable[[str], Any], select)
    else:
        raise TypeError(
            f"select must be a regex string or a predicate, got {type(select).__name__}."
        )
    available = {k: av for k, av in every.items() if selected(fmt.key_to_str(k))}
    chosen_values = [v for v in values if selected(v.name)]
    if not available and not chosen_values:
        tops = sorted({k[0] for k in every if k} | {v.key[0] for v in values if v.key})
        shown = ", ".join(map(repr, tops[:20])) + (
            f", … ({len(tops)} in all)" if len(tops) > 20 else ""
        )
        example = next(map(fmt.key_to_str, every), values[0].name if values else "params/w")
        raise CheckpointError(
            f"select={short_repr(select)} matches no tensor or value of the checkpoint {where}; its "
            f"top-level names: {shown or 'none'} (a regex is matched in full "
            f"against '/'-joined names such as {example!r})."
        )
    return available, chosen_values


def placed_requests(where: str, available, options: RestoreOptions):
    """One request per tensor of ``available``, placed as ``restore(mesh=, rules=)`` places it
    (host numpy without a mesh; a 64-bit tensor without jax_enable_x64 stays on host, exact).
    A tensor saved sharded that comes back replicated without a rule asking for it is named in
    one ``ReplicationWarning``.

    Args:
      where: the checkpoint, for the warning.
      available: ``Available``-like tensors (key, key_types, shape, dtype, saved_sharding,
        logical_axes).
      options: the restore's options (mesh, rules, dtype).

    Returns:
      (requests, key types), one each per tensor.
    """
    dtype, mesh, rules = options.dtype, options.mesh, options.rules
    reqs, key_types, replicated = [], [], []
    for av in available:
        want = np.dtype(av.dtype if key_impl_of(av) else dtype or av.dtype)  # key data: as is
        sharding = None
        if mesh is not None and np.dtype(jax.dtypes.canonicalize_dtype(want)) == want:
            placement: dict[str, Any] = dict(
                mesh=mesh, saved=av.saved_sharding, logical_axes=av.logical_axes, rules=rules
            )
            sharding = sharding_lib.sharding_for(av.shape, **placement)
            if sharding_lib.replicated_unasked(av.shape, sharding.spec, **placement):
                replicated.append((av.name, math.prod(av.shape) * want.itemsize))
        reqs.append(Request(key=av.key, sharding=sharding, dtype=None if dtype is None else want))
        key_types.append(av.key_types)
    if replicated:
        warnings.warn(
            sharding_lib.replication_warning(where, replicated),
            sharding_lib.ReplicationWarning,
            stacklevel=user_stacklevel(),
        )
    return reqs, key_types


def _whole(av, mesh) -> bool:
    """``av`` (more than one element) is whole on every device of ``mesh`` as saved."""
    spec = sharding_lib.sharding_for(
        av.shape, mesh=mesh, saved=av.saved_sharding, logical_axes=None, rules=None
    ).spec
    return math.prod(av.shape) > 1 and not any(spec)


def _naming_advice(keys: Sequence[tuple[str, ...]], spec) -> str:
    """How to name the axes of tensors left unnamed, for the source at hand (``keys``: all
    its tensors): the spec given lacks ``axes`` for them, or a shipped spec covers its names."""
    if spec is not None:
        what = spec if isinstance(spec, str) else getattr(spec, "name", None) or "given"
        return (
            f"the spec {what!r} gives them no axes: add axes = [...] (a logical name per "
            f"dimension, docs/LANGUAGE.md) to the restore rules that make them"
        )
    from jax_ucp._src.language.plan import specs_naming  # only when warning

    found = specs_naming(keys)
    use = "a spec whose restore rules give them axes = [...] (docs/LANGUAGE.md)"
    if found:
        use = f"spec={found[0]!r}, whose restore rules cover these names and name their axes"
    return f"restore with {use}; or give a target carrying shardings"


def check_mesh_names(root: str, available, mesh, rules, strict: bool, spec=None) -> None:
    """``sharding.check_names`` for the tensors a restore (or plan) with ``mesh=`` would
    place: the logical names they carry and the mesh axes they were saved with. Rules that
    match no name, or tensors of two or more dimensions that carry none and stay whole on
    every device, are said in one ``ReplicationWarning`` with advice for ``spec``.

    Args:
        root: the checkpoint, for errors.
        available: the tensors to place.
        mesh: the mesh restored onto.
        rules: the logical-axis rules (or None).
        strict: also refuse unused rules and mesh axes.
        spec: the restore-time spec given (None: none), for the advice.
    """
    names, axes, unnamed, whole = set(), set(), [], False
    available = list(available)
    for av in available:
        names.update(n for n in av.logical_axes or () if n is not None)
        saved = av.saved_sharding
        if saved is not None:
            axes.update(saved.mesh.axis_names)
            axes.update(a for entry in saved.partition_spec for a in axes_of(entry))
        if rules is not None and _whole(av, mesh):
            whole = True
            if len(av.shape) > 1 and not any(av.logical_axes or ()):
                unnamed.append(av)
    sharding_lib.check_names(
        mesh, rules, logical_names=names, saved_axes=axes, where=root, strict=strict
    )
    unmatched = sharding_lib.unmatched_rules(rules, names)
    if (unmatched and (names or whole)) or unnamed:
        advice = _naming_advice([av.key for av in available], spec) if unnamed else ""
        warnings.warn(
            sharding_lib.unmatched_rules_message(
                root, unmatched, names, [av.name for av in unnamed], advice
            ),
            sharding_lib.ReplicationWarning,
            stacklevel=user_stacklevel(),
        )
