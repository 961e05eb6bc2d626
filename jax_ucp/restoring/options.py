"""A restore's options as one checked object: ``jax_ucp.restore``'s keywords and ``UCPRestore``.

Checked once where they enter (the public function, or Orbax's args when constructed, as
Orbax's ``StandardRestoreArgs`` are) and passed down the read path whole, so the UCP reader and
the safetensors reader see the same validated values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

from jax_ucp.errors import RequestError
from jax_ucp.format.sizes import SizeError, parse_optional_size
from jax_ucp.restoring.adam_state import follow_adam_state

CASTINGS = ("no", "equiv", "safe", "same_kind", "unsafe")

# Host bytes a restore may hold in read buffers at once (see ``restore(max_read_bytes=)``).
DEFAULT_MAX_READ_BYTES = 256 << 20


class ArgsError(RequestError):
    """A ``UCPSave`` / ``UCPRestore`` field (or a ``restore`` keyword) of the wrong kind, named
    with what it accepts."""


@dataclasses.dataclass(frozen=True)
class RestoreOptions:
    """What a restore is asked: ``jax_ucp.restore``'s keywords (its docstring says what each
    does in full), checked when constructed.

    Attributes:
      target: pytree of jax.Array / jax.ShapeDtypeStruct / numpy arrays (or flax-boxed abstract
        state) whose structure, shardings and dtypes the result takes.
      shardings: pytree of ``jax.sharding.Sharding`` (overrides the target's).
      mesh: a ``jax.sharding.Mesh``; alone, saved PartitionSpecs are reused where they fit.
      rules: flax-style logical-axis rules ``[(logical_name, mesh_axes), ...]``, with ``mesh``.
      spec: a UCP-language spec whose restore-time transforms are applied as lazy views.
      dtype: cast every tensor to this dtype (None: the saved or the target's dtype).
      casting: numpy's casting rule for dtype conversions (one of ``CASTINGS``).
      select: a regex matched in full against "/"-joined names, or a predicate on the name:
        only those leaves are restored (without a target).
      max_read_bytes: host memory for read buffers in flight: bytes or e.g. "256MiB" (None:
        256 MiB).
      strict: with ``mesh=``, refuse misspelt logical names in rules and misspelt mesh axes.
      replicated_read: "each" or "once" (None: "each"): how a multi-process restore reads a
        tensor every process needs whole.
      where: how errors name a field: a class (``"UCPRestore"`` gives ``UCPRestore.casting``)
        or a function (``"restore"`` gives ``restore(casting=)``). Not a field.
    """

    target: Any = None
    shardings: Any = None
    mesh: jax.sharding.Mesh | None = None
    rules: Sequence[tuple[str, Any]] | None = None
    spec: Any = None
    dtype: Any = None
    casting: str = "same_kind"
    select: Any = None
    max_read_bytes: int | str | None = None
    strict: bool = True
    replicated_read: str | None = None
    where: dataclasses.InitVar[str] = "restore"

    def __post_init__(self, where: str):
        def field(name: str) -> str:
            return f"{where}.{name}" if where[:1].isupper() else f"{where}({name}=)"

        if isinstance(self.rules, Iterable) and not isinstance(self.rules, (str, bytes)):
            object.__setattr__(self, "rules", tuple(self.rules))  # a generator is read once
        _check_kinds(self, field)
        if self.select is not None and self.has_target:
            raise ArgsError(
                "select= restores part of a checkpoint without a target; a target "
                "already says which leaves to read."
            )
        if self.rules is not None and self.mesh is None and not self.has_target:
            raise ArgsError("Logical-axis `rules` need a `mesh` to map onto.")
        if self.spec is not None and self.has_target:  # the optimizer roots follow the target
            target = self.target if self.target is not None else self.shardings
            object.__setattr__(self, "spec", follow_adam_state(self.spec, target))

    @property
    def has_target(self) -> bool:
        """A target or shardings say which leaves to read and how to place them."""
        return self.target is not None or self.shardings is not None

    @property
    def read_budget(self) -> int:
        """``max_read_bytes``, or the default."""
        return DEFAULT_MAX_READ_BYTES if self.max_read_bytes is None else int(self.max_read_bytes)


def _check_kinds(options: RestoreOptions, field) -> None:
    """Each field of the kind it accepts (``field(name)`` names it in the error)."""
    if options.mesh is not None and not isinstance(
        options.mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)
    ):
        raise ArgsError(
            f"{field('mesh')}: expected a jax.sharding.Mesh, got {type(options.mesh).__name__}."
        )
    if options.rules is not None:
        bad = _bad_rule(options.rules)
        if bad is not None:
            raise ArgsError(
                f"{field('rules')}: expected (logical_name, mesh_axes) pairs, e.g. "
                f"[('embed', 'data'), ('mlp', 'model')], got {bad!r}."
            )
    if options.dtype is not None:
        try:
            np.dtype(options.dtype)
        except TypeError:
            raise ArgsError(
                f"{field('dtype')}: expected a dtype (np.float32, jnp.bfloat16, 'float16'), got "
                f"{options.dtype!r}."
            ) from None
    if options.casting not in CASTINGS:
        raise ArgsError(
            f"{field('casting')}: expected one of {', '.join(map(repr, CASTINGS))}, got "
            f"{options.casting!r}."
        )
    if options.select is not None and not (
        isinstance(options.select, str) or callable(options.select)
    ):
        raise ArgsError(
            f"{field('select')}: expected a regex string or a predicate on the name, got "
            f"{type(options.select).__name__}."
        )
    try:  # an int or a size such as "256MiB", as every byte-size option
        read_bytes = parse_optional_size(options.max_read_bytes, field("max_read_bytes"))
    except SizeError as e:
        raise ArgsError(f"{e}.") from None
    object.__setattr__(options, "max_read_bytes", read_bytes)
    if not isinstance(options.strict, bool):
        raise ArgsError(f"{field('strict')}: expected True or False, got {options.strict!r}.")
    if options.replicated_read not in (None, "each", "once"):
        raise ArgsError(
            f"{field('replicated_read')}: expected 'each' or 'once', got "
            f"{options.replicated_read!r}."
        )


def _bad_rule(rules):
    """The first entry of ``rules`` that is no (name, mesh axes) pair, or ``rules`` itself."""
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
        return rules
    for rule in rules:
        if not isinstance(rule, (tuple, list)) or len(rule) != 2 or not isinstance(rule[0], str):
            return rule
    return None
