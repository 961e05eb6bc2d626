"""verl's optimizer state across its rank files, as a torch optimizer's
(:class:`~jax_ucp._src.importers.torch_state.TorchState`): FSDP2's AdamW ``exp_avg`` /
``exp_avg_sq`` (DTensors keyed by parameter index, in the order of the model's parameters,
checked by shape; a tied key counted once) and each parameter's step, every rank agreeing;
FSDP1's flat-parameter state refused (it names no parameter) unless only the weights are
wanted."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from jax_ucp._src.errors import SourceError
from jax_ucp._src.facts import ABSENT, Facts
from jax_ucp._src.importers.plan import ADAM_TREES, agreed_step, jsonable
from jax_ucp._src.importers.torch_state import TensorRef
from jax_ucp._src.importers.verl import rank_tensors
from jax_ucp._src.torchfiles import allow_list

__all__ = ["optimizer_state"]


def optimizer_state(model_dir, ranks, options, params: rank_tensors.Params, tied, source, found):
    """The optimizer's state by parameter (``TorchState.states``: exp_avg, exp_avg_sq, step),
    its param_groups naming the parameters, and its source tensors (added to ``found``; the
    state is not read with ``weights_only``).

    Args:
        model_dir: the folder of the rank files (a ``Storage``).
        ranks: the rank files by kind (``layout.rank_files``).
        options: the import options (``weights_only``).
        params: the model's tensors (``rank_tensors.parameters``).
        tied: tied key -> the key whose bytes it shares (no state of its own).
        source: the manifest's source record, added to.
        found: every source tensor's name, added to.
    """
    optim_files = ranks.by_kind.get("optim", [])
    if not optim_files:
        if not options.weights_only:
            source.setdefault("notes", []).append("no optimizer state saved (no optim_* files)")
        return {}, [], []
    optims = [rank_tensors.load(model_dir, name) for name in optim_files]
    names = _optimizer_tensor_names(optim_files, optims)
    found += names
    if options.weights_only:
        return {}, [], names
    trained = {n: v for n, v in params.items() if n not in tied}
    states, groups = _optimizer(model_dir.root, optim_files, optims, trained, ranks.world_size)
    return states, groups, names


def _optimizer_tensor_names(files_: list[str], optims: list[Any]) -> list[str]:
    names = []
    for file, state in zip(files_, optims):
        per = state.get("state") if isinstance(state, dict) else None
        if not isinstance(per, dict):
            raise SourceError(f"{file}: expected optimizer.state_dict() ('state', 'param_groups')")
        for index, entries in per.items():
            if not isinstance(entries, dict):
                raise SourceError(f"{file}: state[{index!r}] is not a dict")
            names += [f"{file}/state.{index}.{k}" for k in entries]
    return names


def _groups_agree(folder: str, files_: list[str], groups: list[Any]) -> None:
    """Every rank's param groups are one optimizer's (each rank steps its shard alike): a field
    one rank holds otherwise (a file edited, or another save's) is refused, each rank's file
    named with its value (``facts.py``)."""
    facts = Facts(folder)
    for file, held in zip(files_, groups):
        ok = isinstance(held, list) and all(isinstance(g, dict) for g in held)
        count = len(held) if ok else f"<{type(held).__name__}>"
        facts.state("the number of param groups", f"{file} param_groups", count)
    facts.agree("the number of param groups")
    for g in range(len(groups[0])):
        for key in sorted({str(k) for held in groups for k in held[g]}):
            for file, held in zip(files_, groups):
                value = jsonable(held[g].get(key, ABSENT))
                facts.state(f"param_groups[{g}].{key}", f"{file} param_groups[{g}].{key}", value)
    facts.agree_all()


def _optimizer(folder, files_, optims, params: rank_tensors.Params, world: int):
    """FSDP2's AdamW state by parameter name: each index is the model's parameter of that
    position (the sharded tensors of the state dict, in order), checked by shape."""
    groups = [o.get("param_groups") for o in optims]
    if not isinstance(groups[0], list) or not all(isinstance(g, dict) for g in groups[0]):
        raise SourceError(f"{os.path.join(folder, files_[0])}: no param_groups list")
    _groups_agree(folder, files_, groups)
    indices = [i for g in groups[0] for i in g.get("params", [])]
    sharded_names = [
        n for n, (_, _, pieces) in params.items() if all(p and not p.replicated for _, p in pieces)
    ]
    first = optims[0]["state"]
    flat = [
        i
        for i, entries in first.items()
        if any(isinstance(v, np.ndarray) and v.ndim == 1 and v.size > 1 for v in entries.values())
    ]
    if flat and not any(
        isinstance(v, allow_list.WrapperTensor) for e in first.values() for v in e.values()
    ):
        raise SourceError(
            f"{os.path.join(folder, files_[0])}: FSDP1 flat-parameter optimizer state "
            f"({len(indices)} flat parameters, use_orig_params=False): the file does not record "
            f"which parameters each flat buffer holds, so the moments cannot be named. Import "
            f"the weights alone with weights_only=True (--weights-only)"
        )
    if indices != list(range(len(indices))) or len(indices) != len(sharded_names):
        raise SourceError(
            f"{os.path.join(folder, files_[0])}: param_groups number {len(indices)} parameters "
            f"({indices[:6]}...), the model state dict holds {len(sharded_names)} sharded ones; "
            f"cannot tell which parameter each index is"
        )
    recorded = [n for g in groups[0] for n in g.get("param_names", [])]
    if recorded:  # torch >= 2.5, an optimizer built from named_parameters(): its own names
        unknown = [n for n in recorded if n not in params]
        if len(recorded) != len(indices) or unknown:
            raise SourceError(
                f"{os.path.join(folder, files_[0])}: param_groups name {len(recorded)} "
                f"parameters for {len(indices)} indices"
                + (f"; not in the model: {', '.join(map(str, unknown[:4]))}" if unknown else "")
            )
        by_index = dict(zip(indices, recorded))
    else:  # torch numbers the parameters as model.parameters() yields them: checked by shape
        by_index = dict(zip(indices, sharded_names))
    states: dict[str, dict[str, TensorRef]] = {}
    for index, name in by_index.items():
        found = _moments(folder, files_, optims, index, name, params, world)
        if found is not None:
            states[name] = found
    kept = [{k: v for k, v in g.items() if k != "param_names"} for g in groups[0]]
    return states, [{**g, "params": [by_index[i] for i in g.get("params", [])]} for g in kept]


def _moments(folder, files_, optims, index, name, params: rank_tensors.Params, world):
    """Parameter ``index``'s (``name``'s) exp_avg / exp_avg_sq from every rank's pieces, and
    its step (every rank's, agreeing); None when no rank holds state for it."""
    entries = [o["state"].get(index) for o in optims]
    if any(e is None for e in entries):
        if all(e is None for e in entries):
            return None  # a parameter the optimizer never stepped
        raise SourceError(f"{folder}: some ranks hold optimizer state {index} ({name}), not all")
    keys = set(entries[0])
    if keys - set(ADAM_TREES) - {"step"} or not set(ADAM_TREES) <= keys:
        raise SourceError(
            f"{os.path.join(folder, files_[0])}: state[{index}] ({name}) holds "
            f"{', '.join(sorted(map(str, keys)))}: only torch Adam / AdamW state (exp_avg, "
            f"exp_avg_sq, step) is imported"
        )
    shape = params[name][0]
    out: dict[str, TensorRef] = {}
    for state in ADAM_TREES:
        what = f"state.{index}.{state}"
        got = rank_tensors.gather(what, [e[state] for e in entries], files_, world, folder)
        if got[0] != shape:
            raise SourceError(
                f"{os.path.join(folder, files_[0])}: {what} is {got[0]}, parameter {index} "
                f"({name}) is {shape}: the optimizer's order is not the model's"
            )
        out[state] = rank_tensors.tensor_ref(what, *got)
    steps: dict[float, str] = {}
    names = []
    for file, e in zip(files_, entries):
        if (value := e.get("step")) is not None:
            steps.setdefault(float(np.asarray(value).reshape(())), f"in {file} state[{index}]")
            names.append(f"{file}/state.{index}.step")
    if steps:
        step = np.asarray(agreed_step(steps, folder, recorded_by="ranks", error=SourceError))
        out["step"] = TensorRef(
            names[0], (), step.dtype, lambda: step, {}, other_names=tuple(names[1:])
        )
    return out
