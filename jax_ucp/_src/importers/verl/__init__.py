"""Import verl FSDP checkpoints (verl 0.9's ``FSDPCheckpointManager``, FSDP1 and FSDP2).

Each rank's ``model_world_size_W_rank_R.pt`` is ``model.state_dict()`` saved with
``torch.save``: DTensors (FSDP2, ``Shard(0)``) or ShardedTensors (FSDP1 under
``SHARDED_STATE_DICT``), read through the allow-listed unpickler with the sharded-tensor
stand-ins and reassembled from every rank's local piece, one tensor at a time
(:mod:`jax_ucp._src.torchfiles.sharded`). ``optim_world_size_W_rank_R.pt`` is
``optimizer.state_dict()``: under FSDP2 its ``exp_avg`` / ``exp_avg_sq`` are DTensors keyed by
parameter index, in the order of the model's parameters (a tied key, sharing its bytes with
an earlier one, counted once, as ``named_parameters()`` does; checked against every shape); under
FSDP1 (``use_orig_params=False``, verl's default) it holds flat-parameter state that names no
parameter, and is refused unless only the weights are wanted. The step is the optimizer's
(every rank and parameter agreeing), beside the run's ``global_step`` (folder and tracker) and
the scheduler's record from ``extra_state_world_size_W_rank_0.pt``.

Output tree (docs/FORMAT.md 2.6): ``params/<name>``, ``opt_state/mu|nu/<name>``,
``opt_state/count``; names are the model's (``model.layers.0.self_attn.q_proj.weight``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from jax_ucp._src import writer
from jax_ucp._src.errors import SourceError
from jax_ucp._src.format import files
from jax_ucp._src.importers.plan import (
    TENSORS,
    Detection,
    ImportOptions,
    ImportPlan,
    agreed_step,
    host_item,
    jsonable,
    refuse_spec,
    skip,
)
from jax_ucp._src.importers.verl import layout
from jax_ucp._src.torchfiles import sharded, unpickler

__all__ = ["VerlOptions", "detect", "plan"]

ADAM_STATE = {"exp_avg": ("opt_state", "mu"), "exp_avg_sq": ("opt_state", "nu")}
MAX_CONFIG_BYTES = 1 << 20

# numpy's pickled RNG state (``np.random.get_state()`` in the extra state) as inert stand-ins
_EXTRA_CLASSES = unpickler.NUMPY_CLASSES


@dataclasses.dataclass(frozen=True)
class VerlOptions(ImportOptions):
    """``ImportOptions``: a verl checkpoint takes no options of its own."""


def detect(src: os.PathLike | str) -> Detection:
    """Whether ``src`` is a verl run root, ``global_step_N/`` or its ``actor/`` folder, from
    file names alone."""
    path = os.fspath(src)
    if layout.is_model_dir(path):
        return Detection(True, "verl FSDP rank files (model_world_size_W_rank_R.pt)")
    if layout.is_model_dir(os.path.join(path, layout.MODEL_DIRS[0])):
        return Detection(True, "a verl global_step_N/ folder (actor/ rank files)")
    if steps := layout.step_dirs(path):
        return Detection(True, f"a verl run ({', '.join(steps[-3:])})")
    return Detection(
        False,
        "no verl `model_world_size_W_rank_R.pt`, `global_step_N/actor/` or run root with them",
    )


def plan(src: os.PathLike | str, options: ImportOptions) -> ImportPlan:
    """The import of the verl checkpoint at ``src`` (a run root, ``global_step_N/`` or its
    ``actor/``). Every check that needs no tensor bytes runs before this returns."""
    refuse_spec(options.spec, "a verl import keeps the model's parameter names", SourceError)
    where = layout.locate(os.fspath(src))
    model_dir = where.model_dir
    ranks = layout.rank_files(model_dir)
    world = ranks.world_size
    if "model" not in ranks.by_kind:
        raise SourceError(f"{model_dir}: no model_world_size_{world}_rank_R.pt")
    recorded = {
        "fsdp_version": _fsdp_config(model_dir, world),
        "global_step": where.step,
        "tracker_step": where.tracker_step,
    }
    source: dict[str, Any] = {"framework": "verl", "path": model_dir, "world_size": world}
    source.update((k, v) for k, v in recorded.items() if v is not None)
    found: list[str] = []  # every source tensor (or file read as a unit)

    models = [_load(model_dir, name) for name in ranks.by_kind["model"]]
    params = _parameters(model_dir, ranks.by_kind["model"], models, world, found)
    tied = _tied_keys(params)
    config = _hf_config(model_dir)
    if config is not None:
        source["trainer"] = {"model_config": config}

    moments, count = _optimizer_state(model_dir, ranks, options, params, tied, source, found)
    _extra(model_dir, ranks.by_kind.get("extra_state", []), source, found)
    _scheduler_against_optimizer(model_dir, source, None if count is None else count[0])
    _units_beside(where, source, found)
    names = options.share.pick(params)

    def items() -> Iterator[writer.HostItem]:
        for name in names:
            shape, dtype, pieces = params[name]
            item = _item(("params", name), shape, dtype, pieces)
            if name in tied:
                item = dataclasses.replace(item, tied_to=f"params/{tied[name]}")
            elif moments and name not in moments:
                item = dataclasses.replace(item, frozen=True)
            yield item
            for state, tree in ADAM_STATE.items():
                if name in moments:
                    yield _item((*tree, name), shape, dtype, moments[name][state])
        if count is not None and options.share.primary:
            step, step_names = count
            yield host_item(
                ("opt_state", "count"),
                np.asarray(step, np.int32),
                {TENSORS: step_names, "pattern": "optimizer state 'step'"},
            )

    return ImportPlan(items(), source, len(names), found)


def _optimizer_state(model_dir, ranks, options, params: Params, tied, source, found):
    """The moments by parameter and the (step, its tensors), the optimizer recorded in
    ``source`` and its tensors in ``found``; its state skipped with ``weights_only``."""
    optim_files = ranks.by_kind.get("optim", [])
    if not optim_files:
        if not options.weights_only:
            source.setdefault("notes", []).append("no optimizer state saved (no optim_* files)")
        return {}, None
    optims = [_load(model_dir, name) for name in optim_files]
    names = _optimizer_tensor_names(optim_files, optims)
    found += names
    if options.weights_only:
        skip(source, names, "optimizer state: weights_only=True")
        return {}, None
    trained = {n: v for n, v in params.items() if n not in tied}
    moments, count, groups = _optimizer(model_dir, optim_files, optims, trained, ranks.world_size)
    source["optimizer"] = {
        "param_groups": groups,
        "state": ["exp_avg", "exp_avg_sq", "step"],
        "no_state": sorted(n for n in trained if n not in moments),
    }
    if tied:
        source["optimizer"]["tied"] = dict(sorted(tied.items()))
    return moments, count


Params = dict[str, tuple[tuple[int, ...], np.dtype, "Pieces"]]


def _load(folder: str, name: str) -> Any:
    path = files.inside(folder, name, f"{folder}: verl's rank file")
    try:
        return unpickler.load_torch_file(path, unpickler.SHARDED_TENSOR_CLASSES)
    except (unpickler.TorchFileError, files.UnsafeFileError) as e:
        raise SourceError(str(e)) from None


def _pieces(value: Any, world: int, file: str, key: str) -> list[sharded.Piece]:
    """The blocks of ``value`` (DTensor / ShardedTensor / plain tensor) this rank holds."""
    if isinstance(value, np.ndarray):
        return [sharded.Piece((0,) * value.ndim, value, replicated=True)]
    if not isinstance(value, unpickler.WrapperTensor):
        raise SourceError(f"{file}: {key!r} holds a {type(value).__name__}, expected a tensor")
    try:
        return sharded.local_pieces(value, world)
    except sharded.ShardLayoutError as e:
        raise SourceError(f"{file}: {key!r}: {e}") from None


Pieces = list[tuple[str, "sharded.Piece | None"]]  # (file, its block; None: rank 0's copy)


def _gather(
    what: str, values: list[Any], files_: list[str], world: int, folder: str
) -> tuple[tuple[int, ...], np.dtype, Pieces]:
    """One tensor's pieces from every rank, checked to agree on shape and dtype and to tile it;
    a replicated tensor is read from rank 0's file (the others' copies named as its source)."""
    first = values[0]
    shape = tuple(first.shape)
    dtype = np.dtype(first.dtype)
    out: Pieces = []
    kind = getattr(first, "qualname", "tensor")
    for file, value in zip(files_, values):
        if getattr(value, "qualname", "tensor") != kind:  # files of two runs (FSDP1 and FSDP2)
            raise SourceError(
                f"{os.path.join(folder, file)}: {what!r} is a "
                f"{getattr(value, 'qualname', 'tensor').rsplit('.', 1)[-1]}, rank 0's "
                f"({files_[0]}) a {kind.rsplit('.', 1)[-1]}: the rank files are of different saves"
            )
        if tuple(value.shape) != shape or np.dtype(value.dtype) != dtype:
            raise SourceError(
                f"{os.path.join(folder, file)}: {what!r} is {tuple(value.shape)} {value.dtype}, "
                f"rank 0's ({files_[0]}) {shape} {dtype}"
            )
        out += [(file, p) for p in _pieces(value, world, os.path.join(folder, file), what)]
    blocks = [p for _, p in out if p is not None]
    if all(p.replicated for p in blocks):  # the same tensor on every rank: rank 0's is read
        return shape, dtype, [(f, p if i == 0 else None) for i, (f, p) in enumerate(out)]
    if any(p.replicated for p in blocks):
        raise SourceError(f"{folder}: {what!r} is sharded on some ranks and whole on others")
    problem = sharded.covers(shape, blocks)
    if problem:
        raise SourceError(
            f"{folder}: the {world} ranks' pieces of {what!r} ({shape}) do not tile it: {problem}"
        )
    return shape, dtype, out


def _parameters(
    folder: str, names: list[str], models: list[Any], world: int, found: list[str]
) -> Params:
    """The model's tensors, by name in the state dict's order, every rank's keys equal."""
    for name, state in zip(names, models):
        if not isinstance(state, dict):
            raise SourceError(
                f"{os.path.join(folder, name)}: holds a {type(state).__name__}, expected "
                f"model.state_dict()"
            )
        if list(state) != list(models[0]):
            extra = sorted(set(map(str, state)) ^ set(map(str, models[0])))
            raise SourceError(
                f"{os.path.join(folder, name)}: its keys differ from {names[0]}'s"
                + (f" ({', '.join(extra[:6])})" if extra else " (order)")
            )
    params: Params = {}
    for key in models[0]:
        key_s = str(key)
        params[key_s] = _gather(key_s, [m[key] for m in models], names, world, folder)
        found += [f"{file}/{key_s}" for file in names]
    return params


def _tied_keys(params: Params) -> dict[str, str]:
    """Key -> the earlier key whose bytes it shares on every rank (a tied ``lm_head.weight``
    saved beside ``model.embed_tokens.weight``: one storage in each rank's file, one parameter
    and one optimizer state, as ``named_parameters()`` yields it once)."""
    first: dict[tuple, str] = {}
    tied: dict[str, str] = {}
    for name, (shape, dtype, pieces) in params.items():
        where = tuple(
            (f, p.offsets, p.array.__array_interface__["data"][0], p.array.strides)
            for f, p in pieces
            if p is not None and p.array.size
        )
        if not where:
            continue
        owner = first.setdefault((shape, str(dtype), where), name)
        if owner != name:
            tied[name] = owner
    return tied


def _item(key: tuple[str, ...], shape, dtype, pieces: Pieces) -> writer.HostItem:
    """One tensor, assembled from its pieces when the writer has room for it (in row slabs
    when it is larger than the budget)."""
    blocks = [p for _, p in pieces if p is not None]
    value = writer.Deferred(
        shape,
        dtype,
        lambda: sharded.assemble(shape, dtype, blocks),
        rows=(lambda a, b: sharded.assemble(shape, dtype, blocks, a, b)) if shape else None,
    )
    return host_item(
        key, value, {TENSORS: [f"{f}/{key[-1]}" if key[0] == "params" else f for f, _ in pieces]}
    )


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


def _optimizer(folder, files_, optims, params: Params, world: int):
    """FSDP2's AdamW state by parameter name: each index is the model's parameter of that
    position (the sharded tensors of the state dict, in order), checked by shape."""
    groups = [o.get("param_groups") for o in optims]
    if not isinstance(groups[0], list) or not all(isinstance(g, dict) for g in groups[0]):
        raise SourceError(f"{os.path.join(folder, files_[0])}: no param_groups list")
    for file, g in zip(files_, groups):
        if jsonable(g) != jsonable(groups[0]):
            raise SourceError(
                f"{os.path.join(folder, file)}: param_groups differ from {files_[0]}'s"
            )
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
        isinstance(v, unpickler.WrapperTensor) for e in first.values() for v in e.values()
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
    moments: dict[str, dict[str, Pieces]] = {}
    steps: dict[float, str] = {}
    step_names: list[str] = []
    for index, name in by_index.items():
        found = _moments(folder, files_, optims, index, name, params, world, steps, step_names)
        if found is not None:
            moments[name] = found
    count = None
    if steps:
        step = agreed_step(steps, folder, recorded_by="ranks and parameters", error=SourceError)
        count = (step, step_names)
    kept = [{k: v for k, v in g.items() if k != "param_names"} for g in groups[0]]
    named = [jsonable({**g, "params": [by_index[i] for i in g.get("params", [])]}) for g in kept]
    return moments, count, named


def _moments(folder, files_, optims, index, name, params: Params, world, steps, step_names):
    """Parameter ``index``'s (``name``'s) exp_avg / exp_avg_sq pieces from every rank, its
    steps added to ``steps`` / ``step_names``; None when no rank holds state for it."""
    entries = [o["state"].get(index) for o in optims]
    if any(e is None for e in entries):
        if all(e is None for e in entries):
            return None  # a parameter the optimizer never stepped
        raise SourceError(f"{folder}: some ranks hold optimizer state {index} ({name}), not all")
    keys = set(entries[0])
    if keys - set(ADAM_STATE) - {"step"} or not set(ADAM_STATE) <= keys:
        raise SourceError(
            f"{os.path.join(folder, files_[0])}: state[{index}] ({name}) holds "
            f"{', '.join(sorted(map(str, keys)))}: only torch Adam / AdamW state (exp_avg, "
            f"exp_avg_sq, step) is imported"
        )
    shape = params[name][0]
    out: dict[str, Pieces] = {}
    for state in ADAM_STATE:
        what = f"state.{index}.{state}"
        got = _gather(what, [e[state] for e in entries], files_, world, folder)
        if got[0] != shape:
            raise SourceError(
                f"{os.path.join(folder, files_[0])}: {what} is {got[0]}, parameter {index} "
                f"({name}) is {shape}: the optimizer's order is not the model's"
            )
        out[state] = [(f"{f}/{what}", p) for f, p in got[2]]
    for file, e in zip(files_, entries):
        if (value := e.get("step")) is not None:
            steps.setdefault(float(np.asarray(value).reshape(())), f"in {file} state[{index}]")
            step_names.append(f"{file}/state.{index}.step")
    return out


def _extra(folder: str, names: list[str], source: dict, found: list[str]) -> None:
    """The scheduler's record from rank 0's extra state; every extra-state file (the RNG
    states) is a unit left out."""
    if not names:
        return
    found += names
    why = "verl's extra state (RNG states, lr scheduler), not imported; the scheduler's record"
    skip(source, names, why + " is in source.lr_scheduler")
    records: list[tuple[str, dict | None]] = []  # every rank's: one run steps them alike
    for name in names:
        path = files.inside(folder, name, f"{folder}: verl's extra state")
        try:
            extra = unpickler.load_torch_file(path, _EXTRA_CLASSES)
        except (unpickler.TorchFileError, files.UnsafeFileError) as e:
            source["lr_scheduler_unread"] = f"{name} was not read ({str(e)[:300]})"
            return
        sched = extra.get("lr_scheduler") if isinstance(extra, dict) else None
        records.append((name, _scheduler_record(sched) if isinstance(sched, dict) else None))
    first_name, first = records[0]
    for name, record in records[1:]:
        if record != first:
            keys: list[str] = sorted({*(record or {}), *(first or {})})
            differ = [k for k in keys if (record or {}).get(k) != (first or {}).get(k)]
            raise SourceError(
                f"{folder}: the ranks' lr schedulers disagree on {', '.join(differ)}: "
                f"{first_name} has {_shown(first, differ)}, {name} has {_shown(record, differ)} "
                f"(files of two saves mixed?)"
            )
    if first is not None:
        source["lr_scheduler"] = first


def _shown(record: dict | None, keys: list[str]) -> str:
    if record is None:
        return "no lr scheduler"
    return ", ".join(f"{k}={record.get(k)!r}" for k in keys)


def _scheduler_record(sched: dict) -> dict[str, Any]:
    return {
        k: jsonable(v)
        for k, v in sched.items()
        if k in ("last_epoch", "_step_count", "base_lrs", "_last_lr")
    }


def _scheduler_against_optimizer(folder: str, source: dict, step: int | None) -> None:
    """verl steps its lr scheduler with the optimizer: a ``last_epoch`` other than the
    optimizer's step (an update skipped for a non-finite gradient norm, or files of two saves)
    is said, naming both, in a warning and ``source.notes``; the import keeps the optimizer's."""
    last = (source.get("lr_scheduler") or {}).get("last_epoch")
    if step is None or type(last) is not int or last == step:
        return
    note = (
        f"the lr scheduler (extra_state_world_size_{source['world_size']}_rank_0.pt) has "
        f"last_epoch {last}, the optimizer (optim_world_size_{source['world_size']}_rank_*.pt) "
        f"step {step}: the import keeps the optimizer's step"
    )
    source.setdefault("notes", []).append(note)
    warnings.warn(f"{folder}: {note}", UserWarning, stacklevel=4)


def _units_beside(where: layout.Located, source: dict, found: list[str]) -> None:
    """Files verl saves beside the model that are not imported, each a unit in
    ``source.skipped``: the data loader's ``data.pt``, the other model folder (``critic/``),
    weights under ``huggingface/`` (a full copy of the same model)."""
    model_dir = where.model_dir
    hf = os.path.join(model_dir, "huggingface")
    if os.path.isdir(hf):
        for name in sorted(os.listdir(hf)):
            if name.endswith((".safetensors", ".bin")):
                unit = f"huggingface/{name}"
                found.append(unit)
                skip(
                    source,
                    [unit],
                    "the model's weights gathered by verl (hf_model), the same as the rank files",
                )
    if where.step_dir is None:
        return
    if os.path.isfile(os.path.join(where.step_dir, "data.pt")):
        found.append("../data.pt")
        skip(source, ["../data.pt"], "verl's data loader state, not imported")
    for other in layout.MODEL_DIRS:
        path = os.path.join(where.step_dir, other)
        if path != model_dir and layout.is_model_dir(path):
            unit = f"../{other}/"
            found.append(unit)
            skip(source, [unit], f"verl's {other} model: convert {path} on its own")


def _fsdp_config(folder: str, world: int) -> int | None:
    """``FSDP_version`` from ``fsdp_config.json``, its ``world_size`` checked against the rank
    files' (None without the file)."""
    path = os.path.join(folder, "fsdp_config.json")
    if not os.path.isfile(path):
        return None
    try:
        data = json.loads(files.read_regular(files.in_own_folder(path), MAX_CONFIG_BYTES))
    except (ValueError, RecursionError, files.UnsafeFileError) as e:
        raise SourceError(f"{path}: not readable JSON ({str(e)[:200]})") from None
    if not isinstance(data, dict):
        raise SourceError(f"{path}: expected a JSON object")
    if data.get("world_size") not in (None, world):
        raise SourceError(
            f"{path}: world_size {data.get('world_size')!r}, the rank files are of {world}"
        )
    version = data.get("FSDP_version")
    return version if isinstance(version, int) and not isinstance(version, bool) else None


def _hf_config(folder: str) -> dict | None:
    path = os.path.join(folder, "huggingface", "config.json")
    if not os.path.isfile(path):
        return None
    try:
        data = json.loads(files.read_regular(files.in_own_folder(path), MAX_CONFIG_BYTES))
    except (ValueError, RecursionError, files.UnsafeFileError):
        return None
    return data if isinstance(data, dict) else None
