"""A restore's options as one checked object: ``jax_ucp.restore``'s and ``plan``'s keywords,
and ``UCPRestore`` (a subclass).

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

from jax_ucp._src.errors import RequestError
from jax_ucp._src.format.dtypes import CASTINGS
from jax_ucp._src.format.sizes import DEFAULT_MEMORY_BUDGET, parse_optional_size
from jax_ucp._src.options import field_namer
from jax_ucp._src.restoring.adam_state import follow_adam_state


@dataclasses.dataclass
class RestoreOptions:
    """What a restore is asked, checked when constructed: the one definition of the keywords of
    ``jax_ucp.restore`` and ``jax_ucp.plan`` and the fields of ``UCPRestore``.

    Without target/shardings/mesh a restore gives nested dicts/lists of ``np.ndarray`` and the
    saved scalars. Each process reads only the slices its devices need.

    Attributes:
      target: pytree of jax.Array / jax.ShapeDtypeStruct (with shardings) / numpy arrays; the
        result has its structure (its treedef: flax ``nn.LogicallyPartitioned`` /
        ``nn.Partitioned`` boxes and ``nnx.Variable``s kept), shardings and dtypes (shapes must
        match). A saved Python bool/int/float restored into an array leaf becomes an array
        (a ``jax.Array`` on the leaf's sharding) when ``casting`` allows the conversion from
        its type and the value survives it.
      shardings: pytree of ``jax.sharding.Sharding`` (overrides the target's).
      mesh: alone, each tensor keeps its saved PartitionSpec dimension by dimension where the
        axis names exist in ``mesh`` and divide, and is replicated along the other dimensions.
      rules: flax-style logical-axis rules ``[(logical_name, mesh_axes), ...]`` with ``mesh``,
        applied to the logical axis names recorded at save time. A misspelt name (a rule for a
        name no tensor carries but close to one that does, or a mesh axis (size > 1) that no
        rule and no saved PartitionSpec uses but close to one that does) is an error naming
        the closest known names (see ``strict``). A tensor saved sharded that would come back
        replicated on every device (no rule for its names, its saved axes not in ``mesh``)
        gives a ``ReplicationWarning`` with the bytes per device.
      spec: a UCP-language spec (a ``jax_ucp.language.Spec``, a shipped spec's name or a spec
        file) whose restore-time transforms (stack/unstack, split/merge, transpose, rename)
        are applied as lazy views.
      dtype: cast every tensor to this dtype.
      casting: which dtype conversions (to the target's or ``dtype``) are allowed, in numpy's
        terms (``format.dtypes.CASTINGS``): "same_kind" (default: float32 → bfloat16 yes,
        float → int no), "safe", "no", "equiv", or "unsafe" (anything, also a saved Python
        value into an array target). Values are checked too: a narrowing float cast (float32
        → float16 / bfloat16 / float8, int32 → float16) in which a finite value exceeds the
        target's largest (1e10 → float16 inf, 500 → float8_e4m3fn NaN) or an inf meets a
        dtype without inf (float8_e4m3fn) is an error under "same_kind" naming the tensor and
        how many values; under "unsafe" it is converted with a RuntimeWarning saying the
        same. Casts that cannot overflow are not checked (no extra pass); a checked cast is
        counted block by block as it is converted.
      select: restore only part of the checkpoint, without a target: a regex matched in full
        against "/"-joined key names (``r"params/.*"``: weights without optimizer state) or a
        predicate on the name. Only the matched leaves and the containers holding them come
        back (a sequence missing positions as a dict of int keys); nothing else is read. A
        selection matching nothing is an error listing the top-level names.
      memory_budget: bytes of tensor data in flight: an int or a size such as "1GiB" (None:
        ``DEFAULT_MEMORY_BUDGET``, 256 MiB). Peak host memory of a restore is about the
        restored arrays plus this (a tensor larger than it is read alone); larger values
        overlap more reads.
      strict: with ``mesh=``, refuse misspelt logical names in rules and misspelt mesh axes
        (default). ``strict=False`` allows them. Names unlike every known one always pass
        (rules shared with activation names, a purely data-parallel axis).
      replicated_read: in a multi-process job, how a tensor every process needs whole
        (``P()``, host numpy) is read: "each" (None: default) every process reads all of it;
        "once" each reads a share and the shares are all-gathered over JAX's collectives
        (gloo on CPU), so the storage is read once in all (see ``restoring/replicated.py``).
      step: with a CheckpointManager root as the path: the step to restore, or "latest" for
        the newest step that is committed (never one still being written) and readable (its
        manifest, its shard files, their digests as the restore reads them); the step
        ``jax_ucp.latest_step`` gives (one rule: ``restoring.resume``).
      fallback: with ``step="latest"``, move on to the next older committed step when one
        cannot be read, with a ``jax_ucp.ResumeWarning`` naming it and why (default False:
        the error, naming the step, and the older steps there are); each candidate is then
        read whole before it is restored (as ``verify``), so every process takes one step.
      importing: with a source ``convert`` reads (torch DCP, torch.save files, DeepSpeed,
        Megatron, ...), restored straight from it: its import options, as ``convert``'s
        ``importing=`` (``jax_ucp.conversion.ImportOptions(weights_only=True)``,
        ``TorchOptions(parameter_order=..., model_config=...)``, ``DeepSpeedOptions(tag=...)``;
        None: the format's defaults). The tree is the one convert + restore gives; nothing is
        written. ``spec`` above stays the restore-time spec (an import's spec goes here).
      format: the source's format, as ``convert``'s ``format=`` (None: detected).
    """

    target: Any = None
    _: dataclasses.KW_ONLY
    shardings: Any = None
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None
    rules: Sequence[tuple[str, Any]] | None = None
    spec: Any = None
    dtype: Any = None
    casting: str = "same_kind"
    select: Any = None
    memory_budget: int | str | None = None
    strict: bool = True
    replicated_read: str | None = None
    step: int | str | None = None
    fallback: bool = False
    importing: Any = None
    format: str | None = None

    def __post_init__(self):
        field = field_namer(self)
        if isinstance(self.rules, Iterable) and not isinstance(self.rules, (str, bytes)):
            self.rules = tuple(self.rules)  # a generator is read once
        _check_kinds(self, field)
        if self.select is not None and self.has_target:
            raise RequestError(
                "select= restores part of a checkpoint without a target; a target "
                "already says which leaves to read."
            )
        if self.rules is not None and self.mesh is None and not self.has_target:
            raise RequestError("Logical-axis `rules` need a `mesh` to map onto.")
        if self.spec is not None and self.has_target:  # the optimizer roots follow the target
            target = self.target if self.target is not None else self.shardings
            self.spec = follow_adam_state(self.spec, target)

    @property
    def has_target(self) -> bool:
        """A target or shardings say which leaves to read and how to place them."""
        return self.target is not None or self.shardings is not None

    @property
    def read_budget(self) -> int:
        """``memory_budget`` in bytes (the default when None)."""
        return DEFAULT_MEMORY_BUDGET if self.memory_budget is None else int(self.memory_budget)


def _step(v) -> bool:
    """None, "latest" or a step number (an int >= 0, not a bool)."""
    return v in (None, "latest") or (isinstance(v, int) and not isinstance(v, bool) and v >= 0)


#: field -> (whether a value is of the kind it takes, what it takes, the value shown by its
#: type's name rather than its repr)
_KINDS = {
    "mesh": (
        lambda v: v is None or isinstance(v, (jax.sharding.Mesh, jax.sharding.AbstractMesh)),
        "a jax.sharding.Mesh",
        True,
    ),
    "casting": (lambda v: v in CASTINGS, f"one of {', '.join(map(repr, CASTINGS))}", False),
    "select": (
        lambda v: v is None or isinstance(v, str) or callable(v),
        "a regex string or a predicate on the name",
        True,
    ),
    "strict": (lambda v: isinstance(v, bool), "True or False", False),
    "step": (_step, "a step number or 'latest'", False),
    "fallback": (lambda v: isinstance(v, bool), "True or False", False),
    "format": (lambda v: v is None or isinstance(v, str), "a format name such as 'torch'", False),
    "replicated_read": (lambda v: v in (None, "each", "once"), "'each' or 'once'", False),
}


def _check_kinds(options: RestoreOptions, field) -> None:
    """Each field of the kind it accepts (``field(name)`` names it in the error)."""
    if options.rules is not None:
        bad = _bad_rule(options.rules)
        if bad is not None:
            raise RequestError(
                f"{field('rules')}: expected (logical_name, mesh_axes) pairs, e.g. "
                f"[('embed', 'data'), ('mlp', 'model')], got {bad!r}."
            )
    if options.dtype is not None:
        try:
            np.dtype(options.dtype)
        except TypeError:
            raise RequestError(
                f"{field('dtype')}: expected a dtype (np.float32, jnp.bfloat16, 'float16'), got "
                f"{options.dtype!r}."
            ) from None
    for name, (ok, expected, by_type) in _KINDS.items():
        value = getattr(options, name)
        if not ok(value):
            shown = type(value).__name__ if by_type else repr(value)
            raise RequestError(f"{field(name)}: expected {expected}, got {shown}.")
    try:  # an int or a size such as "256MiB", as every byte-size option
        options.memory_budget = parse_optional_size(options.memory_budget, field("memory_budget"))
    except RequestError as e:
        raise RequestError(f"{e}.") from None
    if options.fallback and options.step != "latest":
        raise RequestError(
            f"{field('fallback')}: goes with step='latest' (older steps on failure)."
        )


def _bad_rule(rules):
    """The first entry of ``rules`` that is no (name, mesh axes) pair, or ``rules`` itself."""
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
        return rules
    for rule in rules:
        if not isinstance(rule, (tuple, list)) or len(rule) != 2 or not isinstance(rule[0], str):
            return rule
    return None
