"""ZeRO-0 in bf16 / fp16: the fp32 masters and Adam state of DeepSpeed's ``FP16_UnfusedOptimizer``.

Without ZeRO a low-precision run steps through ``FP16_UnfusedOptimizer`` (DeepSpeed 0.19 with a
torch optimizer; runtime/fp16/unfused_optimizer.py), whose ``state_dict()`` sits in
``mp_rank_00_model_states.pt`` under ``optimizer``: ``fp32_groups[g][j]``, the fp32 master of the
j-th trained parameter of the client's param group g, and ``optimizer_state_dict``, the torch
optimizer's own, keyed by index (``param_groups[g].params[j]``). Nothing in the file names a
master: each is matched to the ``module`` weight it was last copied to (the master rounded to
the run's dtype is that weight, bit for bit), taking every group's parameters in module order, as
``model.parameters()`` and the Trainer's weight-decay groups list them. Module weights no master
matches are tied to a trained weight (the same tensor under a second name: left out, as
DeepSpeed's ``shared_params`` are) or frozen (never handed to the optimizer).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from jax_ucp._src import writer
from jax_ucp._src.errors import OptimizerOrderWarning, SourceError
from jax_ucp._src.format import mapped_file
from jax_ucp._src.importers.deepspeed.files import (
    OPTIMIZER_FILE,
    dtype_of_run,
    file_name,
    listed,
    load_model_states,
    require,
    source_record,
    sourced_item,
)
from jax_ucp._src.importers.plan import ImportOptions, ImportPlan, agreed_step, skip, tensor_names
from jax_ucp._src.store.storage import Storage

#: Elements compared per tensor while matching masters to module weights (all are compared as
#: each master is read for writing).
_SAMPLE = 64


@dataclass
class Masters:
    """The unfused optimizer's state matched to parameter names."""

    # name -> (group, position in the group, torch optimizer state index)
    where: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    frozen: list[str] = field(default_factory=list)  # module weights no master matches
    # module names of a trained weight's own tensor (tied weights: one parameter, one master)
    tied: dict[str, str] = field(default_factory=dict)
    ambiguous: list[list[str]] = field(default_factory=list)  # same shape and weights


def module_parameters(model_states: Mapping) -> dict[str, np.ndarray]:
    """The ``module`` weights without its buffers (``buffer_names``), in module order."""
    module = model_states.get("module")
    buffers = set(model_states.get("buffer_names") or [])
    if not isinstance(module, Mapping):
        return {}
    return {str(n): v for n, v in module.items() if isinstance(v, np.ndarray) and n not in buffers}


def _same_tensor(a: np.ndarray, b: np.ndarray) -> bool:
    """``a`` and ``b`` are views of the same bytes (one tensor saved under two names, as
    ``state_dict()`` lists a tied weight)."""
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and a.strides == b.strides
        and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    )


def _sample(array: np.ndarray) -> np.ndarray:
    """A fixed set of elements of ``array`` (both ends and evenly between), flat."""
    index = np.unique(np.linspace(0, array.size - 1, min(array.size, _SAMPLE)).astype(np.int64))
    return mapped_file.take(array.reshape(-1), index, "matching fp32 masters")


def _rounds_to(master: np.ndarray, weight: np.ndarray, *, whole: bool) -> bool:
    """``master`` cast to ``weight``'s dtype is ``weight`` bit for bit (``whole``: every
    element, else a sample)."""
    if master.shape != weight.shape:
        return False
    if whole:
        found = mapped_file.read_out(master).astype(weight.dtype)
        return found.tobytes() == mapped_file.read_out(weight).tobytes()
    if not master.size:
        return True
    found = _sample(master).astype(weight.dtype)
    return found.tobytes() == _sample(weight).tobytes()


def match_masters(
    optimizer: Mapping, weights: Mapping[str, np.ndarray], model_file: str
) -> Masters:
    """Which module weight each fp32 master is the master of; a master that matches none (in its
    group's module order) is refused naming it.

    Args:
        optimizer: the model states' ``optimizer`` (``FP16_UnfusedOptimizer.state_dict()``).
        weights: the module's parameters, in module order.
        model_file: the model states file, for errors.
    """
    groups = require(optimizer, "fp32_groups", model_file)
    inner = require(optimizer, "optimizer_state_dict", model_file)
    param_groups = require(inner, "param_groups", f"{model_file} optimizer.optimizer_state_dict")
    if not isinstance(groups, (list, tuple)) or not isinstance(param_groups, (list, tuple)):
        raise SourceError(f"{model_file}: optimizer.fp32_groups / param_groups are not lists")
    if len(groups) != len(param_groups):
        raise SourceError(
            f"{model_file}: {len(groups)} groups of fp32 masters but the torch optimizer has "
            f"{len(param_groups)} param groups"
        )
    names = list(weights)
    out = Masters()
    taken: set[str] = set()
    for g, (masters, param_group) in enumerate(zip(groups, param_groups)):
        indices = param_group.get("params") if isinstance(param_group, Mapping) else None
        if not isinstance(masters, (list, tuple)) or not isinstance(indices, (list, tuple)):
            raise SourceError(f"{model_file}: optimizer group {g} is not a list of tensors")
        if len(masters) != len(indices):
            raise SourceError(
                f"{model_file}: optimizer.fp32_groups.{g} holds {len(masters)} masters, the torch "
                f"optimizer's param group {g} {len(indices)} parameters"
            )
        at = 0  # a group lists its parameters in module order
        for j, (master, index) in enumerate(zip(masters, indices)):
            if not isinstance(master, np.ndarray) or master.dtype != np.float32:
                raise SourceError(f"{model_file}: optimizer.fp32_groups.{g}.{j} is not fp32")
            if not isinstance(index, int) or isinstance(index, bool):
                raise SourceError(f"{model_file}: bad parameter index {index!r} in group {g}")
            while at < len(names) and (
                names[at] in taken or not _rounds_to(master, weights[names[at]], whole=False)
            ):
                at += 1
            if at == len(names):
                raise SourceError(
                    f"{model_file}: optimizer.fp32_groups.{g}.{j} (shape {master.shape}) is the "
                    "fp32 master of no module weight (rounded to the run's dtype it equals none "
                    "of those after the previous master's, in module order)"
                )
            out.where[names[at]] = (g, j, index)
            taken.add(names[at])
            at += 1
    if len({index for _, _, index in out.where.values()}) != len(out.where):
        raise SourceError(f"{model_file}: a parameter index repeats in the torch optimizer")
    _sort_unmatched(out, names, weights)
    return out


def _sort_unmatched(out: Masters, names: list[str], weights: Mapping[str, np.ndarray]) -> None:
    """Fills ``out.tied`` / ``out.frozen`` (the weights no master matched) and
    ``out.ambiguous`` (matched weights only module order tells apart)."""
    for name in names:  # a weight the optimizer never had: tied to a trained one, or frozen
        if name in out.where:
            continue
        tied = next((n for n in out.where if _same_tensor(weights[n], weights[name])), None)
        if tied is not None:
            out.tied[name] = tied
        else:
            out.frozen.append(name)
    same: dict[tuple, list[str]] = {}
    for name in out.where:
        weight = weights[name]
        same.setdefault((weight.shape, _sample(weight).tobytes()), []).append(name)
    out.ambiguous = [group for group in same.values() if len(group) > 1]


def adam_entry(
    entry, where: str, name: str, shape: tuple, steps: dict, step_tensors: list, advice: str = ""
) -> tuple[list[np.ndarray], list[str]]:
    """``[exp_avg, exp_avg_sq]`` of one torch optimizer state entry of parameter ``name``, each
    of its ``shape``, and their source tensors; the entry's ``step`` noted in ``steps`` (value ->
    where) and, when a tensor, in ``step_tensors``.

    Args:
        entry: the state entry (``optimizer.state_dict()["state"][index]``).
        where: its source tensor prefix (``<file>:<dotted path>``).
        name: the parameter at its index.
        shape: that parameter's shape.
        steps: the steps seen, filled.
        step_tensors: the step tensors seen, filled.
        advice: what a moment of another shape means, after the message.
    """
    pair = []
    for key in ("exp_avg", "exp_avg_sq"):
        value = require(entry, key, where)
        if not isinstance(value, np.ndarray) or value.shape != shape:
            raise SourceError(
                f"{where}.{key}: shape {getattr(value, 'shape', None)} but parameter "
                f"{name!r} (at this index) has shape {shape}{advice}"
            )
        pair.append(value)
    if "step" in entry:
        steps.setdefault(float(mapped_file.read_out(np.asarray(entry["step"]))), f"in {where}")
        if isinstance(entry["step"], np.ndarray):
            step_tensors.append(f"{where}.step")
    return pair, [f"{where}.exp_avg", f"{where}.exp_avg_sq"]


@dataclass
class _Read:
    """One trained parameter's sources."""

    master: np.ndarray
    master_tensor: str
    moments: list[np.ndarray] | None
    moment_tensors: list[str]


def zero0_model_file(tag_dir: Storage) -> str | None:
    """The model states file of a ZeRO-0 (optimizer not partitioned) checkpoint: no ZeRO
    optimizer files, and the optimizer state inside ``mp_rank_00_model_states.pt``."""
    names = listed(tag_dir) or []
    if any(OPTIMIZER_FILE.match(f) for f in names):
        return None
    name = "mp_rank_00_model_states.pt"
    return tag_dir.join(name) if name in names else None


def plan_zero0(tag_dir: Storage, model_file: str, options: ImportOptions) -> ImportPlan:
    """ZeRO-0: the optimizer state is inside the model states file. A bf16 / fp16 run's
    (``FP16_UnfusedOptimizer``) is imported from its fp32 masters (``params``), module weights
    (``model_params``), Adam moments and step; an fp32 run's plain torch
    ``optimizer.state_dict()`` is not, and its weights are the module's
    (:func:`_plan_module_weights`).

    Args:
        tag_dir: the tag folder.
        model_file: its model states file.
        options: ``weights_only``: masters and model weights alone (the module's weights of a
            run without fp32 masters, which need it set); ``share``: this process's part.
    """
    model_states = load_model_states(tag_dir, file_name(model_file))
    file = file_name(model_file)
    weights = module_parameters(model_states)
    model_dtype = dtype_of_run(model_states.get("ds_config") or {}, weights)
    optimizer = model_states.get("optimizer")
    if not (isinstance(optimizer, Mapping) and "fp32_groups" in optimizer):
        what = (
            "no optimizer state" if optimizer is None else "no fp32_groups in its optimizer state"
        )
        why = f"{file} holds {what}"
        return _plan_module_weights(tag_dir, model_file, model_states, model_dtype, why, options)
    if not weights:
        raise SourceError(f"{model_file}: no 'module' weights to import")
    masters = match_masters(optimizer, weights, model_file)
    inner = optimizer["optimizer_state_dict"]
    state = require(inner, "state", f"{model_file} optimizer.optimizer_state_dict")
    prefix = f"{file}:optimizer.optimizer_state_dict.state"
    read: dict[str, _Read] = {}
    steps: dict[float, str] = {}
    step_tensors: list[str] = []
    for name, (g, j, index) in masters.where.items():
        master = optimizer["fp32_groups"][g][j]
        moments, tensors = None, []
        if not options.weights_only:
            entry = require(state, index, f"{model_file} optimizer state")
            where = f"{prefix}.{index}"
            moments, tensors = adam_entry(entry, where, name, master.shape, steps, step_tensors)
        read[name] = _Read(master, f"{file}:optimizer.fp32_groups.{g}.{j}", moments, tensors)
    count = None
    if not options.weights_only:
        count = agreed_step(steps, model_file, recorded_by="parameters", error=SourceError)

    source = source_record(
        tag_dir,
        model_states,
        0,
        ds_optimizer="FP16_UnfusedOptimizer",
        model_dtype=str(model_dtype),
        frozen_params=masters.frozen,
        shared_params=masters.tied,
    )
    notes = source.setdefault("notes", [])
    global_steps = model_states.get("global_steps")
    if count is not None and type(global_steps) is int and count == global_steps + 1:
        notes.append(
            f"opt_state.count is {count}, the torch optimizer's step; global_steps is "
            f"{global_steps}: FP16_UnfusedOptimizer takes one zero-gradient step when it is "
            "built (initialize_optimizer_states), which moves no weight"
        )
    if masters.ambiguous:
        example = masters.ambiguous[0]
        note = (
            f"{file}: fp32 masters were matched to module weights by value; "
            f"{sum(len(g) for g in masters.ambiguous)} parameters share shape and weights "
            f"with another (e.g. {example[:3]}), so their masters and moments are matched by "
            "module order alone"
        )
        notes.append(note)
        warnings.warn(
            f"{model_file}: {note.split(': ', 1)[1]}", OptimizerOrderWarning, stacklevel=2
        )
    if not notes:
        source.pop("notes")

    found = [f"{file}:{n}" for n in tensor_names(model_states)]
    imported = {r.master_tensor for r in read.values()}
    imported |= {t for r in read.values() for t in r.moment_tensors} | set(step_tensors)
    imported |= {f"{file}:module.{n}" for n in weights if n not in masters.tied}
    for name, tied in masters.tied.items():
        skip(source, [f"{file}:module.{name}"], f"tied to {tied!r} (the same tensor in module)")
    optimizer_tensors = [n for n in found if n.startswith(f"{file}:optimizer.")]
    if options.weights_only:
        skip(
            source,
            [n for n in optimizer_tensors if n not in imported],
            "weights_only: ZeRO-0 optimizer state (Adam moments and step)",
        )
    skip(source, sorted(set(found) - imported), "not a module weight")
    names = options.share.pick(n for n in weights if n not in masters.tied)
    items = _items(
        names, weights, read, model_dtype, file, (count, step_tensors), options.share.primary
    )
    return ImportPlan(items, source, len(names), source_tensors=found)


def _plan_module_weights(
    tag_dir: Storage, model_file: str, model_states: Mapping, run_dtype, why: str, options
) -> ImportPlan:
    """ZeRO-0 without ``FP16_UnfusedOptimizer`` state (``why``): the module's weights, the
    optimizer state listed in ``source.skipped``; ``options.weights_only`` must be set (a
    low-precision run without fp32 masters gets the module's too, said in ``source.notes``
    and warned)."""
    if not options.weights_only:
        has_optimizer = model_states.get("optimizer") is not None
        raise SourceError(
            f"{model_file}: a ZeRO stage 0 checkpoint (no '*zero_pp_rank_*_optim_states.pt' "
            f"files{'; its optimizer state is inside this file' if has_optimizer else ''}). "
            "Importing ZeRO-0 optimizer state is not supported (supported: ZeRO stages 1, 2 "
            "and 3 of DeepSpeed 0.19). To import the model weights: convert(..., "
            "importing=ImportOptions(weights_only=True)) / jax-ucp convert --weights-only"
        )
    module = model_states.get("module")
    if not isinstance(module, Mapping) or not module:
        raise SourceError(f"{model_file}: no 'module' weights to import")
    names = options.share.pick(n for n, v in module.items() if isinstance(v, np.ndarray))
    file = file_name(model_file)
    items = (
        sourced_item(("params", n), module[n], "module", [f"{file}:module.{n}"]) for n in names
    )

    source = source_record(tag_dir, model_states, 0)
    if run_dtype != np.dtype(np.float32):  # the module's weights in bf16 / fp16: said
        note = f"params are the module weights in the run's {run_dtype}, not fp32 masters: {why}"
        source["notes"] = [note]
        warnings.warn(f"{model_file}: {note}", UserWarning, stacklevel=3)
    found = [f"{file}:{n}" for n in tensor_names(model_states)]
    imported = {f"{file}:module.{n}" for n, v in module.items() if isinstance(v, np.ndarray)}
    optimizer = [n for n in found if n.startswith(f"{file}:optimizer.")]
    skip(source, optimizer, "weights_only: ZeRO-0 optimizer state (torch optimizer.state_dict())")
    skip(source, sorted(set(found) - imported - set(optimizer)), "not a module weight")
    return ImportPlan(items, source, len(names), source_tensors=found)


def _items(names, weights, read, model_dtype, file, step, primary):
    """Each parameter's master (checked whole against its module weight as it is read), moments
    and model-precision weight; frozen ones in the run's precision; then the step."""
    for name in names:
        weight = weights[name]
        module_tensor = f"{file}:module.{name}"
        if name not in read:  # frozen: never stepped, no master
            item = sourced_item(("params", name), weight, "frozen", [module_tensor])
            item.frozen = True
            yield item
            continue
        got = read[name]

        def checked(got=got, weight=weight, name=name) -> np.ndarray:
            if not _rounds_to(got.master, weight, whole=True):
                raise SourceError(
                    f"{got.master_tensor}: the fp32 master of {name!r} does not round to its "
                    f"module weight (module.{name}) everywhere: the file's "
                    "optimizer state and module are from different saves"
                )
            return got.master

        master = writer.Deferred(got.master.shape, np.dtype(np.float32), checked)
        yield sourced_item(("params", name), master, "fp32-master", [got.master_tensor])
        if got.moments is not None:
            for tree, value, tensor in zip(("mu", "nu"), got.moments, got.moment_tensors):
                yield sourced_item(("opt_state", tree, name), value, "zero0-optimizer", [tensor])
        if weight.dtype != model_dtype:
            raise SourceError(f"{module_tensor}: dtype {weight.dtype}, run dtype is {model_dtype}")
        yield sourced_item(("model_params", name), weight, "module", [module_tensor])
    count, tensors = step
    if count is not None and primary:
        value = np.asarray(count, np.int32)
        yield sourced_item(("opt_state", "count"), value, "step", tensors)
