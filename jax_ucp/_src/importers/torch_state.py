"""Torch state-dict conventions mapped onto the importer contract (docs/FORMAT.md 2.6).

The importers of torch optimizers (torch's DCP, torch.save files, torchtune,
torch_checkpointing; verl's FSDP rank files) reduce a checkpoint to model tensors and
per-parameter optimizer state keyed by parameter name (:class:`TorchState`); this module turns
that into the output tree, with nothing dropped silently:

* ``params/<name>``: the model tensors as stored (a bf16 model without fp32 masters stays bf16
  and the manifest says so);
* ``opt_state/mu|nu/<name>`` from Adam's ``exp_avg`` / ``exp_avg_sq``, ``opt_state/count`` from
  ``step`` (every parameter must agree), ``opt_state/trace/<name>`` from SGD's
  ``momentum_buffer``, any other per-parameter state under ``opt_state/<its name>/<name>``;
* ``param_groups`` hyper-parameters in ``source.optimizer``; the rest in ``source.skipped``.

Wrapper components in parameter names (DDP's leading ``module.``, torch.compile's
``_orig_mod.``, FSDP1's ``_fsdp_wrapped_module.``, activation checkpointing's
``_checkpoint_wrapped_module.``) are removed, as torch's own ``get_state_dict`` removes them.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from jax_ucp._src import writer
from jax_ucp._src.errors import SourceError
from jax_ucp._src.format import mapped_file
from jax_ucp._src.format.dtypes import is_floating
from jax_ucp._src.importers.plan import (
    ADAM_TREES,
    ImportOptions,
    ImportPlan,
    agreed_step,
    count_item,
    host_item,
    jsonable,
)

__all__ = [
    "STATE_TREES",
    "TensorRef",
    "TorchState",
    "clean_name",
    "numbered_names",
    "plan_state",
    "scalar_ref",
    "state_shape",
    "strip_wrappers",
]


#: torch optimizer state name -> where it goes in the output tree (the rest keep their names)
STATE_TREES: dict[str, tuple[str, ...]] = {**ADAM_TREES, "momentum_buffer": ("opt_state", "trace")}

#: components torch's wrappers insert into parameter names (anywhere), and DDP's (leading)
_WRAPPERS_ANYWHERE = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
_WRAPPERS_LEADING = ("module",)


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """A tensor not read yet: its shape and dtype (from metadata or a lazy view) and how to
    read it; ``where`` names its file(s) in errors and provenance, ``names`` the source tensors
    it is built from."""

    name: str  # the source tensor's name, as the import accounting knows it
    shape: tuple[int, ...]
    dtype: np.dtype
    read: Callable[[], np.ndarray]
    where: dict
    # Same value => same tensor (tied weights share one storage, offset, shape and strides);
    # None when unknown.
    identity: Any = None
    #: rows ``start:stop`` of dim 0 alone (a DCP tensor's chunks overlapping them), so that a
    #: tensor larger than the memory budget is written in row slabs; None: read whole
    rows: Callable[[int, int], np.ndarray] | None = None
    #: a direct restore's boxes read straight into their buffers (``writer.Deferred.regions``)
    regions: Callable[[list], list] | None = None
    #: the source tensors it is assembled from besides ``name`` (the other ranks' pieces)
    other_names: tuple[str, ...] = ()

    @property
    def names(self) -> list[str]:
        return [self.name, *self.other_names]


def numbered_names(ids: list, keys: list, order: Sequence[str], where: str) -> dict:
    """{index: name} of an optimizer keyed by index: ``order`` along the groups' ``params``
    (``ids``, torch numbers them so), one name per index and every state key (``keys``) listed,
    or refused: a wrong order would put moments on the wrong parameters.

    Args:
        ids: the indices of the groups' ``params``, group after group.
        keys: the indices the optimizer holds state for.
        order: parameter_order, the names in the order torch numbered them.
        where: the file, for the errors.
    """
    order = list(order)
    if len(order) != len(ids) or len(set(ids)) != len(ids):
        raise SourceError(
            f"{where}: parameter_order names {len(order)} parameters, the optimizer's groups "
            f"number {len(ids)}{' (some twice)' if len(set(ids)) != len(ids) else ''}"
        )
    to_name = dict(zip(ids, order))
    unlisted = [k for k in keys if k not in to_name]
    if unlisted:
        shown = ", ".join(str(k) for k in unlisted[:3]) + (", ..." if len(unlisted) > 3 else "")
        raise SourceError(
            f"{where}: optimizer state for indices {shown}, which no param group lists"
        )
    return to_name


def scalar_ref(name: str, value: Any, where: dict) -> TensorRef:
    """A pickled Python number (a step some optimizers keep as ``int``) as a 0-d tensor.

    Args:
        name: the source name of the value.
        value: the pickled number.
        where: the file it was read from.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SourceError(f"{name}: a {type(value).__name__}, expected a number")
    array = np.asarray(value, np.float64)
    return TensorRef(name, (), array.dtype, lambda: array, where)


@dataclasses.dataclass
class TorchState:
    """A checkpoint reduced to the contract's parts, names already free of containers.

    ``params``: parameter (or buffer) name -> tensor; ``states``: parameter name -> {torch
    optimizer state name -> tensor (a Python-number step as a 0-d one)}; ``param_groups``:
    hyper-parameters per group (``params``: the names in it); ``skipped``: source name ->
    reason it is not imported; ``found``: every source entry (tensors and pickled objects);
    ``optimizer_sources``: the source entries of the optimizer (skipped with weights_only).
    """

    params: dict[str, TensorRef]
    states: dict[str, dict[str, TensorRef]]
    param_groups: list[dict]
    skipped: dict[str, str]
    where: str  # the checkpoint, for errors
    found: list[str]
    optimizer_sources: list[str]


def clean_name(name: str) -> tuple[str, list[str]]:
    """``name`` without wrapper components, and the components removed."""
    parts = name.split(".")
    kept: list[str] = []
    removed: list[str] = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if not last and (part in _WRAPPERS_ANYWHERE or (not kept and part in _WRAPPERS_LEADING)):
            removed.append(part + ".")
        else:
            kept.append(part)
    return ".".join(kept), removed


def strip_wrappers(names: list[str], where: str) -> tuple[dict[str, str], dict[str, int]]:
    """``{clean name: source name}`` and how many of each wrapper component were removed.

    Refuses names that collide once clean (two parameters would become one)."""
    clean: dict[str, str] = {}
    removed: Counter[str] = Counter()
    for name in names:
        new, gone = clean_name(name)
        removed.update(gone)
        if new in clean:
            raise SourceError(
                f"{where}: {clean[new]!r} and {name!r} are the same parameter {new!r} once "
                f"wrapper prefixes ({', '.join(_WRAPPERS_LEADING + _WRAPPERS_ANYWHERE)}) are "
                f"removed"
            )
        clean[new] = name
    return clean, dict(removed)


def _step_of(ref: TensorRef, name: str, where: str) -> float:
    if ref.shape not in ((), (1,)):
        raise SourceError(
            f"{where}: optimizer step of {name!r} has shape {list(ref.shape)}, expected a scalar"
        )
    value = ref.read()
    if isinstance(value, np.ndarray) and value.size == 1:
        value = value.reshape(()).item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SourceError(
            f"{where}: optimizer step of {name!r} is {type(value).__name__}, expected a number"
        )
    return float(value)


def state_shape(key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape torch optimizers keep state ``key`` in for a parameter of ``shape``:
    transformers' Adafactor factors its second moment of a matrix into ``exp_avg_sq_row`` and
    ``exp_avg_sq_col`` and keeps the parameter's ``RMS`` (a scalar), torch's Adafactor into
    ``row_var`` / ``col_var`` (kept dims), NAdam keeps a scalar ``mu_product``; every other state
    is the parameter's shape."""
    if len(shape) >= 2:
        factored = {
            "exp_avg_sq_row": shape[:-1],
            "exp_avg_sq_col": (*shape[:-2], shape[-1]),
            "row_var": (*shape[:-1], 1),
            "col_var": (*shape[:-2], 1, shape[-1]),
        }
        if key in factored:
            return factored[key]
    return () if key in ("RMS", "mu_product") else shape


def _check_states(state: TorchState) -> None:
    """Every optimizer state names a model tensor and holds its shape (or is a scalar), in a
    floating dtype: every torch optimizer keeps its per-parameter state so (``zeros_like`` of
    a floating parameter), and integer bytes there are a file rewritten, never moments."""
    for name, states in state.states.items():
        param = state.params.get(name)
        if param is None:
            near = sorted(state.params)[:3]
            raise SourceError(
                f"{state.where}: optimizer state for parameter {name!r}, which is not among the "
                f"model's {len(state.params)} tensors (e.g. {near})"
            )
        for key, value in states.items():
            if key != "step" and not is_floating(value.dtype):
                raise SourceError(
                    f"{state.where}: optimizer state {key!r} of {name!r} is "
                    f"{np.dtype(value.dtype).name}; a torch optimizer's state is floating point "
                    f"({value.where.get('files') or value.where})"
                )
            if key != "step" and value.shape != state_shape(key, param.shape):
                raise SourceError(
                    f"{state.where}: optimizer state {key!r} of {name!r} has shape "
                    f"{list(value.shape)}, the parameter {list(param.shape)} "
                    f"({value.where.get('files') or value.where})"
                )


def plan_state(state: TorchState, source: dict, options: ImportOptions) -> ImportPlan:
    """The import of ``state``: checked (every optimizer state names a parameter of the same
    shape, one step for all) before anything is read beyond scalars.

    Args:
        state: the torch state read from the files.
        source: the manifest's source record.
        options: ``weights_only``: the model weights alone, the optimizer state in
            ``source.skipped``; ``share``: this process's part of a distributed import.
    """
    weights_only, share = options.weights_only, options.share
    skipped = dict(state.skipped)
    states, groups = ({}, []) if weights_only else (state.states, state.param_groups)
    if weights_only:
        why = "weights_only: optimizer state not imported"
        skipped.update(dict.fromkeys(state.optimizer_sources, why))
    _check_states(dataclasses.replace(state, states=states))
    steps: dict[float, str] = {}
    step_names: list[str] = []
    for name, per in states.items():
        if "step" in per:
            steps.setdefault(_step_of(per["step"], name, state.where), f"({name})")
            step_names += per["step"].names
    count = (
        agreed_step(steps, state.where, recorded_by="parameters", error=SourceError)
        if steps
        else None
    )
    kept_states = sorted({k for per in states.values() for k in per if k != "step"})
    dtypes = sorted({str(t.dtype) for t in state.params.values()})
    source = dict(source)
    source["model_dtype"] = ", ".join(dtypes)
    tied = tied_parameters(state.params, states)
    if state.optimizer_sources and not weights_only:
        frozen = sorted(n for n in state.params if n not in states and n not in tied)
        source["optimizer"] = {
            "param_groups": [jsonable(g) for g in groups],
            "state": kept_states + (["step"] if count is not None else []),
            "no_state": frozen,
        }
        if tied:
            source["optimizer"]["tied"] = dict(sorted(tied.items()))
        floating = [d for d in dtypes if d != "float32"]
        if floating:
            source.setdefault("notes", []).append(
                f"the checkpoint holds no fp32 master weights: params are the model's "
                f"{', '.join(floating)} weights as trained"
            )
    if skipped:
        source["skipped"] = skipped
    mine = share.pick(state.params)
    step = (count, step_names) if share.primary and count is not None else None
    return ImportPlan(
        _items(state, states, tied, mine, step), source, len(mine), source_tensors=state.found
    )


def tied_parameters(params: dict[str, TensorRef], states: dict) -> dict[str, str]:
    """Parameter without optimizer state -> the parameter with state it is the same tensor as
    (a tied ``lm_head.weight`` saved beside ``embed_tokens.weight``: one storage, so torch's
    optimizer holds one state, under the other name); without ``states``, -> the first of the
    parameters it is the same tensor as."""
    trained = {}
    for name, ref in params.items():
        if (name in states or not states) and ref.identity is not None:
            trained.setdefault(ref.identity, name)
    return {
        name: trained[ref.identity]
        for name, ref in params.items()
        if name not in states and trained.get(ref.identity, name) != name
    }


def _items(
    state: TorchState,
    states: dict[str, dict[str, TensorRef]],
    tied: dict[str, str],
    names: list[str],
    step: tuple[int, list[str]] | None,
) -> Iterator[writer.HostItem]:
    for name in names:
        param = state.params[name]
        per = states.get(name, {})
        value = _deferred(param, name, state.where)
        item = host_item(("params", name), value, {**param.where, "tensors": param.names})
        if name in tied:
            item = dataclasses.replace(item, tied_to=f"params/{tied[name]}")
        elif states and not per:
            item = dataclasses.replace(item, frozen=True)
        yield item
        for key in sorted(k for k in per if k != "step"):
            ref = per[key]
            tree = STATE_TREES.get(key, ("opt_state", key))
            value = _deferred(ref, f"{name} ({key})", state.where)
            provenance = {**ref.where, "state": key, "tensors": ref.names}
            if tree[1] in ("mu", "nu"):
                yield host_item((*tree, name), value, provenance)
            else:
                yield writer.HostItem(
                    (*tree, name), value, role="opt_state", sub_role=tree[1], provenance=provenance
                )
    if step is not None:
        count, sources = step
        found = set(state.found)  # a step pickled as a Python number is a value, no tensor
        tensors = [n for n in sources if n in found]
        values = [n for n in sources if n not in found]
        yield count_item(
            count,
            {
                "pattern": "state.*.step",
                "tensors": tensors,
                **({"values": values} if values else {}),
            },
        )


def _deferred(ref: TensorRef, name: str, where: str) -> writer.Deferred:
    """``ref`` read (and checked) only once the writer has room for it in the memory budget:
    a DCP tensor is assembled from its chunks in anonymous memory."""

    def read() -> np.ndarray:
        value = ref.read()
        _check_read(value, ref.dtype, ref.shape, name, where)
        # a view of a memory-mapped file is read out with pread: the writer never touches the
        # mapping, so a file truncated meanwhile is an error naming it, not SIGBUS
        return mapped_file.read_out(value, f"tensor {name!r}")

    def rows(start: int, stop: int) -> np.ndarray:
        assert ref.rows is not None  # passed on only then
        value = ref.rows(start, stop)
        shape = (stop - start, *ref.shape[1:])
        _check_read(value, ref.dtype, shape, f"{name} rows {start}:{stop}", where)
        return mapped_file.read_out(value, f"tensor {name!r} rows {start}:{stop}")

    by_rows = rows if ref.rows is not None and ref.shape else None
    regions = ref.regions if ref.shape else None
    shape, dtype = tuple(ref.shape), np.dtype(ref.dtype)
    return writer.Deferred(shape, dtype, read, rows=by_rows, regions=regions)


def _check_read(value: Any, dtype: np.dtype, shape: tuple, name: str, where: str) -> None:
    if not isinstance(value, np.ndarray) or value.dtype != dtype or value.shape != shape:
        found = (
            f"{value.dtype} {list(value.shape)}"
            if isinstance(value, np.ndarray)
            else type(value).__name__
        )
        raise SourceError(
            f"{where}: tensor {name!r} reads as {found}, expected {dtype} {list(shape)}"
        )
