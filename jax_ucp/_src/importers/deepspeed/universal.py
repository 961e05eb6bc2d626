"""Import DeepSpeed *universal* checkpoints: what ``ds_to_universal`` writes (UCP v0.2 to v0.4)
and what ``jax-ucp export --to deepspeed-universal`` writes.

Layout (DeepSpeed 0.19, ``deepspeed/checkpoint/ds_to_universal.py``)::

    ROOT/latest_universal                          -> "<tag>_universal"
    ROOT/<tag>_universal/mp_rank_XX_model_states.pt          (ZeRO 1/2: copied from the run)
    ROOT/<tag>_universal/zero_pp_rank_D_mp_rank_XX_model_states.pt   (ZeRO-3: copied)
    ROOT/<tag>_universal/zero/optimizer_state.pt   param groups (ZeRO-3: also DP rank 0's flat
                                                   partition and the per-sub-group step)
    ROOT/<tag>_universal/zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt
    ROOT/<tag>_universal/zero/<param>/step.pt      (ZeRO 1/2 and jax_ucp's export only)

Each state file of a ZeRO 1/2 run (or of any tensor-parallel run) holds
``{"param": whole tensor, "cat_dim": ..., ...}``, tensor-parallel pieces already merged (fused
QKV sub-parameters by v0.4's ``sub_param_shard_widths``, vocabulary padding stripped), so nothing
is left to merge here. A ZeRO-3 run without tensor parallelism gives a bare flat tensor: its shape
is only in the model states' ``param_shapes``, its step only in ``zero/optimizer_state.pt``. A
parameter that never had optimizer state (frozen, or never given a gradient) gets ``fp32.pt``
alone, cast from the module weight.

The output is the DeepSpeed importer's contract (the package's docstring): ``model_params``
the module weights as stored, else the masters cast, as the direct import does; frozen
parameters in the run's precision from ``frozen_param_fragments``.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jax_ucp._src.errors import SourceError
from jax_ucp._src.format import files, mapped_file
from jax_ucp._src.importers.deepspeed.files import (
    dtype_of_run,
    file_name,
    follow_tracker,
    frozen_shapes_of,
    listed,
    load_deepspeed_file,
    load_model_states,
    param_shapes_of,
    source_record,
    sourced_item,
    unsafe_files_refused,
    version_string,
)
from jax_ucp._src.importers.deepspeed.zero import STATE_TREES, DeepSpeedCheckpoint, frozen_items
from jax_ucp._src.importers.plan import (
    VALUES,
    ImportOptions,
    ImportPlan,
    agreed_step,
    count_item,
    refuse_spec,
    skip,
    tensor_names,
)
from jax_ucp._src.store.storage import Storage

#: The tracker file ``ds_to_universal`` writes next to the universal tag folder.
LATEST_UNIVERSAL = "latest_universal"
ZERO_DIR = "zero"
OPTIMIZER_STATE = "optimizer_state.pt"
_MODEL_FILE = re.compile(r"^(?:zero_pp_rank_([0-9]+)_)?mp_rank_([0-9]+)_model_states\.pt\Z")


def is_universal_tag_dir(folder: Storage, names: list[str] | None = None) -> bool:
    """A universal tag folder (its entries ``names``, listed when None): ``zero/`` beside
    DeepSpeed model states files."""
    names = listed(folder) if names is None else names
    if not names or ZERO_DIR not in names or not any(_MODEL_FILE.match(f) for f in names):
        return False
    with unsafe_files_refused():
        return bool(listed(folder.folder(ZERO_DIR)))


def universal_tag_dir(src: Storage, tag: str | None) -> Storage | None:
    """The universal tag folder ``src`` means, or None when it is not a universal checkpoint.

    ``src`` itself, ``src/<tag>``, or what ``latest_universal`` names when ``src`` has no
    ``latest`` (a run folder holding both is read through ``latest``, the training checkpoint;
    pass ``tag=`` to pick the universal one)."""
    names = listed(src)
    if names is None:
        return None
    if tag is not None:
        with unsafe_files_refused():
            candidate = src.folder(tag)
        return candidate if is_universal_tag_dir(candidate) else None
    if is_universal_tag_dir(src, names):
        return src
    if LATEST_UNIVERSAL not in names or "latest" in names:
        return None
    tag_dir = follow_tracker(src, LATEST_UNIVERSAL)
    if not is_universal_tag_dir(tag_dir):
        raise SourceError(
            f"{src.join(LATEST_UNIVERSAL)} names {tag_dir.root}, which holds no universal checkpoint (expected a 'zero/' "
            "folder beside '*mp_rank_*_model_states.pt' files)"
        )
    return tag_dir


@dataclass
class UniversalParam:
    """One parameter's folder under ``zero/``: its states' arrays (memory-mapped) and names."""

    name: str
    shape: tuple[int, ...]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # state -> flat or shaped
    sources: dict[str, str] = field(default_factory=dict)  # state -> source tensor name
    step: Any = None  # step.pt's value, if any
    step_source: str | None = None

    def value(self, state: str) -> np.ndarray:
        """The state in the parameter's shape (a view of the memory map)."""
        return np.asarray(self.arrays[state]).reshape(self.shape)


@dataclass
class UniversalCheckpoint:
    """A DeepSpeed universal folder: its model-states file, stage and per-parameter folders."""

    tag_dir: Storage
    stage: int | None
    model_file: str
    model_states: Mapping
    model_files: dict[str, Mapping]  # every model states file, by path
    model_dtype: np.dtype
    params: dict[str, UniversalParam]  # trained parameters, in param_shapes order
    frozen: dict[str, tuple[int, ...]]
    frozen_fp32: dict[str, str]  # frozen name -> its zero/<name>/fp32.pt tensor, if any
    untracked: dict[str, str]  # zero/<name>/fp32.pt tensor of a name DeepSpeed did not describe
    optimizer_state: Mapping
    world_size: int
    mp_world_size: int
    info: Mapping


def _load_state(folder: Storage, name: str, rel: str) -> tuple[np.ndarray, str]:
    """A ``zero/<param>/<state>.pt``: the array and its source-tensor name."""
    value, path = load_deepspeed_file(folder, name), folder.join(name)
    if isinstance(value, np.ndarray):
        return value, f"{rel}:"
    if isinstance(value, Mapping) and isinstance(value.get("param"), np.ndarray):
        return value["param"], f"{rel}:param"
    raise SourceError(
        f"{path}: expected a tensor or a dict with a 'param' tensor (ds_to_universal's "
        f"layout), found {type(value).__name__}"
    )


def _model_files(tag_dir: Storage) -> tuple[dict[int, dict[int | None, str]], int]:
    """``{mp rank: {dp rank or None: path}}`` of the model states files, and the ZeRO-3 DP size."""
    by_mp: dict[int, dict[int | None, str]] = {}
    numbered = files.numbered_names(  # mp_rank_00 and mp_rank_0: refused, not one taken
        [
            ((int(m.group(2)), -1 if m.group(1) is None else int(m.group(1))), name)
            for name in (listed(tag_dir) or [])
            if (m := _MODEL_FILE.match(name))
        ],
        tag_dir.root,
        "(model-parallel rank, DP rank)",
    )
    for (mp, dp), name in numbered.items():
        by_mp.setdefault(mp, {})[None if dp < 0 else dp] = tag_dir.join(name)
    zero3 = {mp: sorted(d for d in ranks if d is not None) for mp, ranks in by_mp.items()}
    world = max((len(v) for v in zero3.values()), default=0)
    for mp, dps in zero3.items():
        if dps and dps != list(range(world)):
            raise SourceError(
                f"{tag_dir.root}: ZeRO-3 model states of model-parallel rank {mp} for DP ranks {dps}; "
                f"expected 0..{world - 1}"
            )
    return by_mp, world


def open_universal_checkpoint(tag_dir: Storage) -> UniversalCheckpoint:
    """Finds and checks every file of a universal tag folder; tensors stay memory-mapped."""
    by_mp, world = _model_files(tag_dir)
    if sorted(by_mp) != list(range(len(by_mp))):
        raise SourceError(
            f"{tag_dir.root}: model states of model-parallel ranks {sorted(by_mp)}; expected "
            f"0..{len(by_mp) - 1}"
        )
    model_files = {
        p: load_model_states(tag_dir, file_name(p))
        for ranks in by_mp.values()
        for p in ranks.values()
    }
    first = by_mp[0].get(None) or by_mp[0][min(d for d in by_mp[0] if d is not None)]
    model_states = model_files[first]
    mp_world_size = len(by_mp)
    recorded = model_states.get("mp_world_size")
    if recorded not in (None, mp_world_size):
        raise SourceError(
            f"{first}: mp_world_size is {recorded} but {tag_dir.root} holds model states of "
            f"{mp_world_size} model-parallel rank(s)"
        )
    with unsafe_files_refused():  # zero/ linked to another run's folder is never read
        zero = tag_dir.folder(ZERO_DIR)
    optimizer_path = zero.join(OPTIMIZER_STATE)  # absent: an empty dict
    here = OPTIMIZER_STATE in (listed(zero) or ())
    optimizer_state = load_deepspeed_file(zero, OPTIMIZER_STATE) if here else {}
    if not isinstance(optimizer_state, Mapping):
        raise SourceError(f"{optimizer_path}: expected a dict")
    stage = optimizer_state.get("zero_stage")
    stage = int(stage) if stage is not None else (3 if world else None)
    info = model_states.get("universal_checkpoint_info") or {}
    if not isinstance(info, Mapping):
        raise SourceError(f"{first}: universal_checkpoint_info is not a dict")
    shapes: dict[str, Any] = {}  # every trained parameter's shape, the first file naming it wins
    for path, states in model_files.items():
        for group in param_shapes_of(states, path):
            for name, shape in group.items():
                shapes.setdefault(name, shape)
    frozen = frozen_shapes_of(model_states, first, shapes)
    params, frozen_fp32, untracked = _param_folders(zero, first, shapes, frozen, mp_world_size)
    module = model_states.get("module") or {}
    return UniversalCheckpoint(
        tag_dir=tag_dir,
        stage=stage,
        model_file=first,
        model_states=model_states,
        model_files=model_files,
        model_dtype=dtype_of_run(model_states.get("ds_config") or {}, module),
        params=params,
        frozen=frozen,
        frozen_fp32=frozen_fp32,
        untracked=untracked,
        optimizer_state=optimizer_state,
        world_size=world or int(model_states.get("dp_world_size") or 1),
        mp_world_size=mp_world_size,
        info=info,
    )


def _param_folders(
    zero: Storage, first: str, shapes: dict[str, Any], frozen: Mapping, mp_world_size: int
) -> tuple[dict[str, UniversalParam], dict[str, str], dict[str, str]]:
    """The folders under ``zero/``: trained parameters (in ``param_shapes`` order, none
    missing), and the fp32 copies of frozen and of undescribed names."""
    params: dict[str, UniversalParam] = {}
    frozen_fp32: dict[str, str] = {}
    untracked: dict[str, str] = {}
    for name in (n for n in listed(zero) or () if n != OPTIMIZER_STATE):
        with unsafe_files_refused():  # a link: one parameter could read another's folder
            folder = zero.folder(name, link=False)
        present = _folder_states(folder, name)
        if name in frozen or name not in shapes:
            if present != {"fp32"}:
                what = "frozen" if name in frozen else "not in param_shapes of " + first
                raise SourceError(
                    f"{folder.root}: parameter {name!r} is {what} but has optimizer state "
                    f"{sorted(present - {'fp32'})}"
                )
            _, source = _load_state(folder, "fp32.pt", f"zero/{name}/fp32.pt")
            (frozen_fp32 if name in frozen else untracked)[name] = source
            continue
        missing = sorted({"exp_avg", "exp_avg_sq"} - present)
        if missing:
            raise SourceError(
                f"{folder.root}: parameter {name!r} has no {' / '.join(f'{m}.pt' for m in missing)} "
                "(ds_to_universal writes fp32.pt alone for a parameter that never had optimizer "
                "state). To import the weights alone: convert(..., importing=ImportOptions(weights_only=True)) / "
                "jax-ucp convert --weights-only"
            )
        params[name] = _open_param(folder, name, shapes[name], mp_world_size)
    missing = [n for n in shapes if n not in params]
    if missing:
        raise SourceError(
            f"{zero.root}: no folder for parameter(s) {missing[:8]} of param_shapes in {first} "
            f"({len(missing)} missing)"
        )
    return {n: params[n] for n in shapes}, frozen_fp32, untracked  # param_shapes' order


def _folder_states(folder: Storage, name: str) -> set[str]:
    """The states a parameter folder holds: a folder of known ``<state>.pt`` files, fp32.pt
    among them."""
    names = listed(folder)
    if not names:
        raise SourceError(
            f"{folder.root}: expected a parameter folder (or {OPTIMIZER_STATE}) under zero/"
        )
    present = {f[:-3] for f in names if f.endswith(".pt")}
    unknown = sorted(set(names) - {f"{s}.pt" for s in present})
    unknown += sorted(s for s in present if s not in ("fp32", "exp_avg", "exp_avg_sq", "step"))
    if unknown:
        raise SourceError(
            f"{folder.root}: unexpected entries {unknown}; a universal parameter folder holds "
            "fp32.pt, exp_avg.pt, exp_avg_sq.pt and step.pt"
        )
    if "fp32" not in present:
        raise SourceError(f"{folder.join('fp32.pt')}: missing (parameter {name!r})")
    return present


def _open_param(folder: Storage, name: str, local_shape, mp_world_size: int) -> UniversalParam:
    """A trained parameter's state files: same shape for every state, fp32; a flat (ZeRO-3)
    state takes the ``param_shapes`` shape, which only a single model-parallel rank records."""
    rel = f"zero/{name}"
    param = UniversalParam(name, ())
    for state, _ in STATE_TREES:
        array, source = _load_state(folder, f"{state}.pt", f"{rel}/{state}.pt")
        if array.dtype != np.float32:
            raise SourceError(
                f"{folder.join(state)}.pt: parameter {name!r} is {array.dtype}, expected float32"
            )
        if array.ndim == 1 and array.size == math.prod(local_shape) and mp_world_size == 1:
            full = tuple(local_shape)  # flat: ZeRO-3's layout, shape from param_shapes
        elif array.ndim == 1 and mp_world_size > 1 and tuple(local_shape) != array.shape:
            raise SourceError(
                f"{folder.join(state)}.pt: parameter {name!r} is a flat tensor of {array.size} "
                f"elements from a run of {mp_world_size} model-parallel ranks, whose "
                f"param_shapes record only each rank's piece ({tuple(local_shape)})"
            )
        else:
            full = tuple(array.shape)
        if mp_world_size == 1 and math.prod(full) != math.prod(local_shape):
            raise SourceError(
                f"{folder.join(state)}.pt: parameter {name!r} holds {array.size} elements "
                f"{array.shape}; param_shapes says {tuple(local_shape)}"
            )
        if param.arrays and full != param.shape:
            raise SourceError(
                f"{folder.join(state)}.pt: parameter {name!r} has shape {full}, fp32.pt has "
                f"{param.shape}"
            )
        param.shape = full
        param.arrays[state] = array
        param.sources[state] = source
    step_path = folder.join("step.pt")
    if "step.pt" in (listed(folder) or ()):
        step = load_deepspeed_file(folder, "step.pt")
        if isinstance(step, np.ndarray) and step.size == 1:
            param.step, param.step_source = float(step.reshape(())), f"{rel}/step.pt:"
        elif isinstance(step, (int, float)) and not isinstance(step, bool):
            param.step = float(step)
        else:
            raise SourceError(f"{step_path}: expected a scalar step, found {step!r}"[:300])
    return param


# --------------------------------------------------------------------------- the import


def _step(checkpoint: UniversalCheckpoint) -> tuple[int, list[str], list[str]]:
    """The optimizer step every parameter (or ZeRO-3 sub-group) recorded, with the tensors and
    other values it comes from."""
    found: dict[float, str] = {}
    tensors, values = [], []
    for param in checkpoint.params.values():
        if param.step is None:
            continue
        found.setdefault(param.step, f"in zero/{param.name}/step.pt")
        (tensors if param.step_source else values).append(
            param.step_source or f"zero/{param.name}/step.pt"
        )
    state = ((checkpoint.optimizer_state.get("optimizer_state_dict") or {}).get("state")) or {}
    if not found and isinstance(state, Mapping):
        for key, group in state.items():
            step = group.get("step") if isinstance(group, Mapping) else None
            tensor = isinstance(step, np.ndarray) and step.size == 1
            if tensor or (isinstance(step, (int, float)) and not isinstance(step, bool)):
                found.setdefault(
                    float(np.asarray(step).reshape(())), f"in zero/{OPTIMIZER_STATE} group {key}"
                )
                name = f"zero/{OPTIMIZER_STATE}:optimizer_state_dict.state.{key}.step"
                (tensors if tensor else values).append(name)
    where = checkpoint.tag_dir.join(ZERO_DIR)
    if not found:
        raise SourceError(
            f"{where}: no step.pt in any parameter folder and no step in {OPTIMIZER_STATE}; "
            "cannot recover the optimizer step. To import the weights alone: convert(..., "
            "importing=ImportOptions(weights_only=True)) / jax-ucp convert --weights-only"
        )
    return agreed_step(found, where, recorded_by="parameters", error=SourceError), tensors, values


def _model_weight(checkpoint: UniversalCheckpoint, name: str, fp32: np.ndarray, fp32_source: str):
    """The model-precision copy: the module weight as stored when it is whole, else the fp32
    master cast (a ZeRO-3 placeholder, or a tensor-parallel rank's piece)."""
    stored = _stored_weight(checkpoint, name, fp32.shape)
    if stored is not None:
        tensor = f"{file_name(checkpoint.model_file)}:module.{name}"
        return sourced_item(("model_params", name), stored, "module", [tensor])
    cast = mapped_file.read_out(fp32, f"{name!r} fp32").astype(checkpoint.model_dtype)
    pattern = f"cast(fp32 -> {checkpoint.model_dtype})"
    return sourced_item(("model_params", name), cast, pattern, [fp32_source])


def _stored_weight(checkpoint: UniversalCheckpoint, name: str, shape) -> np.ndarray | None:
    """The module weight of ``name`` when it is whole (``shape``) and in the run's precision."""
    stored = (checkpoint.model_states.get("module") or {}).get(name)
    if isinstance(stored, np.ndarray) and stored.size and stored.shape == shape:
        return stored if stored.dtype == checkpoint.model_dtype else None
    return None


def _frozen_reader(checkpoint: UniversalCheckpoint) -> DeepSpeedCheckpoint:
    """The frozen parameters' view of the model states files, as the ZeRO reader reads them."""
    zero3 = sorted(
        p
        for p in checkpoint.model_files
        if (m := _MODEL_FILE.match(file_name(p))) is not None and m.group(1)
    )
    return DeepSpeedCheckpoint(
        tag_dir=checkpoint.tag_dir,
        stage=3 if zero3 else (checkpoint.stage or 2),
        world_size=checkpoint.world_size,
        model_dtype=checkpoint.model_dtype,
        param_shapes=[],
        model_file=checkpoint.model_file,
        optim_files=[],
        model_states=checkpoint.model_states,
        optim_states=[],
        frozen=dict(checkpoint.frozen),
        frozen_files=zero3 or [checkpoint.model_file],
    )


def _frozen_fp32(
    checkpoint: UniversalCheckpoint, name: str, weight: np.ndarray, frozen_files: list[str]
) -> list[str]:
    """The ``zero/<name>/fp32.pt`` the universal converter wrote for a frozen parameter, if it
    did: it must hold the weights of ``frozen_param_fragments``."""
    if name not in checkpoint.frozen_fp32:
        return []
    copy = _load_state(checkpoint.tag_dir.folder(ZERO_DIR).folder(name), "fp32.pt", "")[0]
    copy, weight = mapped_file.read_out(copy), mapped_file.read_out(weight)
    if copy.shape != weight.shape or not np.array_equal(copy, weight.astype(np.float32)):
        raise SourceError(
            f"{checkpoint.tag_dir.root}/zero/{name}/fp32.pt: frozen parameter {name!r} "
            f"differs from its weights in frozen_param_fragments of {frozen_files}"
        )
    return [checkpoint.frozen_fp32[name]]


def iter_universal_items(checkpoint: UniversalCheckpoint, options: ImportOptions) -> Iterator:
    """Per parameter (this process's share): fp32 master, Adam moments, model-precision copy;
    frozen weights; step. ``options.weights_only``: fp32 masters alone, no moments or step."""
    weights_only, share = options.weights_only, options.share
    for name in share.pick(checkpoint.params):
        param = checkpoint.params[name]
        for state, tree in STATE_TREES[:1] if weights_only else STATE_TREES:
            tensors = [param.sources[state]]
            yield sourced_item((*tree, name), param.value(state), "deepspeed-universal", tensors)
        if checkpoint.model_dtype != np.dtype(np.float32):
            yield _model_weight(checkpoint, name, param.value("fp32"), param.sources["fp32"])
    if checkpoint.frozen:
        yield from frozen_items(
            _frozen_reader(checkpoint),
            share.pick(checkpoint.frozen),
            functools.partial(_frozen_fp32, checkpoint),
        )
    if weights_only or not share.primary:
        return
    step, tensors, values = _step(checkpoint)
    provenance = {"files": [ZERO_DIR], "pattern": "step", "tensors": tensors}
    if values:
        provenance[VALUES] = values
    yield count_item(step, provenance)


def universal_tensors(
    checkpoint: UniversalCheckpoint, source: dict, *, weights_only: bool
) -> list[str]:
    """Every tensor of the folder (``<file relative to the tag folder>:<path>``); those not
    imported listed in ``source["skipped"]`` with the reason.

    Args:
        checkpoint: the opened universal folder.
        source: the manifest's source record, whose ``skipped`` is filled.
        weights_only: whether the moments are skipped.
    """
    found: list[str] = []
    for param in checkpoint.params.values():
        found += [param.sources[s] for s, _ in STATE_TREES]
        if param.step_source:
            found.append(param.step_source)
    found += list(checkpoint.frozen_fp32.values()) + list(checkpoint.untracked.values())
    skip(
        source,
        list(checkpoint.untracked.values()),
        "fp32 copy ds_to_universal made of a module entry in neither param_shapes nor "
        "frozen_param_shapes (a buffer or a parameter DeepSpeed does not describe): not imported",
    )
    found += _optimizer_tensors(checkpoint, source, weights_only=weights_only)
    found += _model_states_tensors(checkpoint, source)
    return found


def _optimizer_tensors(
    checkpoint: UniversalCheckpoint, source: dict, *, weights_only: bool
) -> list[str]:
    """The tensors of ``zero/optimizer_state.pt``, all skipped but the step when it is the one
    read; under ``weights_only`` also the Adam moments and every step skipped."""
    step_names = [
        f"zero/{OPTIMIZER_STATE}:optimizer_state_dict.state.{k}.step"
        for k in ((checkpoint.optimizer_state.get("optimizer_state_dict") or {}).get("state") or {})
    ]
    optimizer_found = [
        f"zero/{OPTIMIZER_STATE}:{n}" for n in tensor_names(checkpoint.optimizer_state)
    ]
    uses_optimizer_step = not any(p.step is not None for p in checkpoint.params.values())
    skip(
        source,
        [n for n in optimizer_found if not (n in step_names and uses_optimizer_step)],
        "DP rank 0's flat partition, copied into optimizer_state.pt by ds_to_universal; the "
        "whole parameters are read from zero/<param>/",
    )
    if weights_only:
        moments = [
            p.sources[s] for p in checkpoint.params.values() for s in ("exp_avg", "exp_avg_sq")
        ]
        skip(source, moments, "weights_only: Adam moment")
        steps = [p.step_source for p in checkpoint.params.values() if p.step_source]
        skip(source, steps + step_names, "weights_only: optimizer step")
    return optimizer_found


def _model_states_tensors(checkpoint: UniversalCheckpoint, source: dict) -> list[str]:
    """The tensors of every model states file; all but the imported module weights and frozen
    fragments skipped with the reason."""
    model_file = file_name(checkpoint.model_file)
    cast = checkpoint.model_dtype != np.dtype(np.float32)  # a model copy is imported
    imported = {
        f"{model_file}:module.{name}"
        for name, param in checkpoint.params.items()
        if cast and _stored_weight(checkpoint, name, param.shape) is not None
    }
    frozen_names = {f"frozen_param_fragments.{n}" for n in checkpoint.frozen}
    found = []
    for path, states in checkpoint.model_files.items():
        file = file_name(path)
        for name in tensor_names(states):
            full = f"{file}:{name}"
            found.append(full)
            if full in imported or name in frozen_names:
                continue
            key = name[len("module.") :] if name.startswith("module.") else None
            skip(source, [full], _why_not_imported(checkpoint, key))
    return found


def _why_not_imported(checkpoint: UniversalCheckpoint, key: str | None) -> str:
    """Why a model states tensor (``module.<key>``, or no module entry at all) is skipped."""
    if key in checkpoint.params and checkpoint.stage == 3:
        return "ZeRO-3 placeholder of the model weight; params/ is read from zero/"
    if key in checkpoint.params and checkpoint.model_dtype == np.dtype(np.float32):
        return "the model weight in fp32: the fp32 master of zero/<param>/fp32.pt"
    if key in checkpoint.params:
        return "a model-parallel rank's piece of the weight; model_params/ is the master cast"
    if key in checkpoint.frozen:
        return "frozen parameter: imported from frozen_param_fragments"
    if key is not None:
        return (
            "in module but in neither param_shapes nor frozen_param_shapes (a buffer "
            "or a parameter DeepSpeed does not describe): not imported"
        )
    return "not a model weight"


def source_info(checkpoint: UniversalCheckpoint) -> dict:
    """What the manifest records about a universal checkpoint."""
    version = checkpoint.info.get("universal_checkpoint_version")
    return source_record(
        checkpoint.tag_dir,
        checkpoint.model_states,
        checkpoint.stage,
        layout="universal",
        dp_world_size=checkpoint.world_size,
        mp_world_size=checkpoint.mp_world_size,
        model_dtype=str(checkpoint.model_dtype),
        ds_version=version_string(checkpoint.model_states)
        or version_string(checkpoint.optimizer_state),
        universal_checkpoint_version=float(version)
        if isinstance(version, (int, float)) and not isinstance(version, bool)
        else None,
        frozen_params=sorted(checkpoint.frozen),
    )


def plan_universal(tag_dir: Storage, options: ImportOptions) -> ImportPlan:
    """The import of the ``<tag>_universal`` folder ``tag_dir`` (every file found and checked
    before this returns)."""
    weights_only, share = options.weights_only, options.share
    refuse_spec(
        options.spec,
        "convert: a DeepSpeed universal checkpoint holds whole tensors (DeepSpeed merged"
        " its tensor-parallel pieces), keyed by DeepSpeed's names, so an import spec has nothing "
        "to do",
    )
    checkpoint = open_universal_checkpoint(tag_dir)
    source = source_info(checkpoint)
    found = universal_tensors(checkpoint, source, weights_only=weights_only)
    if not weights_only:
        _step(checkpoint)  # a missing or disagreeing step fails before anything is written
    total = len(share.pick(checkpoint.params)) + len(share.pick(checkpoint.frozen))
    return ImportPlan(iter_universal_items(checkpoint, options), source, total, found)
