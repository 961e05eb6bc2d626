"""Import plain torch Distributed Checkpoints (``torch.distributed.checkpoint.save``) as UCP.

Whatever wrote them: FSDP2 ``fully_shard`` or FSDP1 ``SHARDED_STATE_DICT`` with
``get_state_dict`` / ``FSDP.optim_state_dict``, torchtitan's checkpointer, Accelerate's
``save_state`` (``pytorch_model_fsdp_0/`` + ``optimizer_0/``), Lightning's sharded ``.ckpt/``
folders, HF Trainer FSDP checkpoints. Read without torch through :mod:`torchfiles.dcp` (nothing in
``.metadata`` or a chunk is executed); each tensor is assembled from its own chunks only, one
tensor at a time.

DCP flattens the saved state dict into dotted names. The layouts differ only in where the
model and the optimizer sit:

* an optimizer root ``R`` is where ``R.param_groups.*`` lives (``optim.``, ``optimizer.``,
  ``optimizer_0.``, or nothing); its state is ``R.state.<param>.<state>`` and its groups are
  ``R.param_groups.<i>.<hyper-parameter>`` (``get_state_dict``) or
  ``R.param_groups.<param>.<hyper-parameter>`` (``flatten_optimizer_state_dict=True``, torchtitan);
* the model container ``P`` (``model.`` for ``get_state_dict`` / Accelerate / Lightning,
  nothing for torchtitan's top-level model keys) is found from the optimizer's parameter names
  (``P + name`` must be a tensor for every one) or, without optimizer state, is a single
  top-level ``model.`` / ``state_dict.`` all tensors share, unless ``.metadata``'s
  ``planner_data`` records them as keys of the dict saved (a tied model's weights, all
  ``model.*``, exported by jax_ucp);
* everything else (``train_state``, ``lr_scheduler``, ``dataloader``, pickled objects) is listed
  in ``source.skipped``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from jax_ucp._src.errors import SourceError
from jax_ucp._src.format import files
from jax_ucp._src.importers import trainer_files
from jax_ucp._src.importers.plan import Detection, ImportPlan, jsonable, refuse_spec
from jax_ucp._src.importers.torch import olmo_core
from jax_ucp._src.importers.torch.options import TorchOptions, refuse_model_config
from jax_ucp._src.importers.torch_state import (
    TensorRef,
    TorchState,
    clean_name,
    numbered_names,
    plan_state,
    scalar_ref,
    strip_wrappers,
)
from jax_ucp._src.store.storage import Storage
from jax_ucp._src.torchfiles import dcp as torch_dcp
from jax_ucp._src.torchfiles import dcp_safetensors

__all__ = [
    "MODEL_CONTAINERS",
    "NON_MODEL_ROOTS",
    "dcp_dirs",
    "detect",
    "is_torch_dcp",
    "plan_torch_dcp",
]

#: Top-level keys a model state dict is saved under (``dcp.save({"model": ...})``).
MODEL_CONTAINERS = ("model", "state_dict", "model_state_dict")
#: Top-level keys of torchtitan & co. beside top-level model keys that hold no parameters.
NON_MODEL_ROOTS = ("train_state", "lr_scheduler", "lr_schedulers", "dataloader", "rng", "ft")
#: Accelerate's / HF Trainer's sharded FSDP folders inside a save_state / checkpoint folder.
_ACCELERATE_DIR = re.compile(r"^(pytorch_model_fsdp|optimizer)_[0-9]+\Z")
#: transformers' ``save_optimizer_distributed`` folder beside ``save_pretrained``'s rank-local files
HF_OPTIMIZER_DIR = "optimizer"
#: megatron-core's files beside its torch_dist .metadata (that is the Megatron importer's)
MEGATRON_FILES = ("common.pt", "metadata.json", "integrity.json")


def dcp_dirs(storage: Storage) -> list[str]:
    """The DCP folders of ``storage``, as names in it ("": itself): itself when it holds
    ``.metadata``, an OLMo-core step folder's ``model_and_optim/``, else Accelerate's
    ``pytorch_model_fsdp_N/`` and ``optimizer_N/`` inside it; [] when none. Rank-local
    safetensors come with the DCP ``optimizer/`` transformers' ``save_optimizer_distributed``
    writes beside them, if any. From its listing (and a folder's ``.metadata`` asked)."""
    try:
        names = set(storage.names())
    except OSError:  # a file, or nothing
        return []
    return _dirs(storage, names)


def _dirs(storage: Storage, names: set[str]) -> list[str]:
    """:func:`dcp_dirs` of ``storage``, whose listing is ``names``."""
    subs = sorted({n.split("/", 1)[0] for n in names})
    if dcp_safetensors.is_rank_local(storage):
        # save_optimizer_distributed takes any name; transformers' docs say optimizer/ (taken
        # even broken, so that it is refused)
        held = [d for d in subs if d == HF_OPTIMIZER_DIR or _holds(storage, names, d, ".metadata")]
        return ["", *held]
    if torch_dcp.METADATA_FILE in names:
        return [""]
    if olmo_core.is_step_folder(storage):
        return [olmo_core.MODEL_DIR]
    return [d for d in subs if _ACCELERATE_DIR.match(d) and _holds(storage, names, d, ".metadata")]


def _holds(storage: Storage, names: set[str], folder: str, name: str, out: bool = True) -> bool:
    """Whether ``folder`` ("": ``storage`` itself) holds file ``name``: by the listing ``names``
    (a remote prefix's lists nested names), else asked of a folder it lists (a directory's
    lists its entries); ``out`` for a folder linked out of the checkpoint (its plan refuses it)."""
    path = f"{folder}/{name}" if folder else name
    if path in names or not folder or folder not in names:
        return path in names
    try:
        return storage.exists(path)
    except files.UnsafeFileError:
        return out


def is_torch_dcp(storage: Storage) -> bool:
    """A plain torch DCP checkpoint (not megatron-core's, which has common.pt/metadata.json)."""
    try:
        names = set(storage.names())
    except OSError:  # a file, or nothing
        return False
    dirs = _dirs(storage, names)
    megatron = (_holds(storage, names, d, f, out=False) for d in dirs for f in MEGATRON_FILES)
    return bool(dirs) and not any(megatron)


def detect(storage: Storage) -> Detection:
    """Whether ``src`` is a torch DCP checkpoint (``.metadata``, or Accelerate's / OLMo-core's
    folders holding one, or the rank-local safetensors of torch's Hugging Face writer), not
    megatron-core's, from names alone (and a safetensors header's ``__metadata__``)."""
    if is_torch_dcp(storage):
        if dcp_safetensors.is_rank_local(storage):  # then read as its own DCP folder ("")
            return Detection(True, "torch DCP rank-local safetensors (DCP_SHARDING_INFO)")
        return Detection(True, "torch DCP (.metadata)")
    return Detection(
        False,
        "no torch DCP (`.metadata` + `__R_S.distcp`, Accelerate's `pytorch_model_fsdp_0/` + "
        "`optimizer_0/`)",
    )


def plan_torch_dcp(storage: Storage, options: TorchOptions) -> ImportPlan:
    """The import of a torch DCP checkpoint folder (or Accelerate's folder holding several).

    Every check that needs no tensor bytes (files present and long enough, chunks tiling each
    tensor, optimizer state matching its parameters, one step) runs before this returns.

    Args:
        storage: the DCP folder (or Accelerate's folder holding several).
        options: ``weights_only``: the model weights alone, the optimizer state in
            ``source.skipped``; ``parameter_order``: the model's parameter names in the order
            torch numbered them, for an optimizer saved keyed by index
            (``optimizer.state_dict()`` as is: torchtune's asynchronous ``dist_epoch_N/``),
            None for one keyed by name.
    """
    src = storage.root
    refuse_model_config(src, options)
    spec, weights_only = options.spec, options.weights_only
    parameter_order = options.parameter_order
    refuse_spec(spec, "torch DCP imports keep torch's parameter names", SourceError)
    names = dcp_dirs(storage)
    parent = storage.parent()
    if (
        parent is not None
        and dcp_safetensors.is_rank_local(parent)
        and storage.absolute().rstrip("/").rsplit("/", 1)[-1] in dcp_dirs(parent)[1:]
    ):
        raise SourceError(
            f"{src}: a DCP folder beside a model's rank-local safetensors (transformers' "
            f"save_optimizer_distributed): import {parent.root} (the model and this folder)"
        )
    if not names:
        raise SourceError(
            f"{src}: no .metadata (and no pytorch_model_fsdp_N/ or optimizer_N/ folder holding "
            f"one): not a torch DCP checkpoint"
        )
    try:  # Accelerate's folders inside src, never links to another run's
        dirs = [storage.folder(d) if d else storage for d in names]
        checkpoints = [_open(d) for d in dirs]
        for ck in checkpoints:
            ck.check_files()
            for name in ck.tensors:
                ck.check_tensor(name)
        state, info = _state(checkpoints, str(src), weights_only, parameter_order)
        _check_shared(state, str(src))
        units: dict[str, str] = {}  # side files found and skipped whole
        if olmo_core.is_step_folder(storage):  # the trainer's step, its files skipped as units
            info["trainer"], units = olmo_core.train_record(storage)
            if "global_step_unread" in info["trainer"]:
                info["notes"] = [
                    f"OLMo-core's trainer step not recovered: "
                    f"{info['trainer']['global_step_unread']}"
                ]
        elif names[0] and (rng := trainer_files.trainer_saved(storage)) is not None:
            # a Trainer's FSDP checkpoint-N/: its schedule, clipping and step beside the folders
            info["trainer"] = trainer_files.trainer_record(storage)
            units = rng  # the Trainer's torch RNG states
        state.found.extend(units)
        state.skipped.update(units)
        notes = [n for ck in checkpoints for n in ck.notes]
        if notes:
            info["notes"] = [*info.get("notes", []), *notes]
        plan = plan_state(
            state,
            {
                "framework": "torch_dcp",
                "path": storage.absolute(),
                "folders": [d or "." for d in names],
                "dcp_version": checkpoints[0].version,
                **({"layout": "hf_safetensors"} if checkpoints[0].layout != "dcp" else {}),
                **info,
            },
            options,
        )
    except files.UnsafeFileError as e:  # the reader's own errors are already this group's
        raise SourceError(str(e)) from None
    return plan


def _open(folder: Storage) -> torch_dcp.DcpCheckpoint:
    """A DCP folder: its ``.metadata``, else torch's Hugging Face writer's rank-local
    ``.safetensors`` shards."""
    if dcp_safetensors.is_rank_local(folder):
        return dcp_safetensors.open_rank_local(folder)
    return torch_dcp.open_dcp(folder)


def _ref(ck: torch_dcp.DcpCheckpoint, name: str) -> TensorRef:
    t = ck.tensors[name]
    return TensorRef(
        name,
        t.shape,
        t.dtype,
        lambda: ck.read(name),
        {"format": "torch_dcp", "source_name": name, "files": t.files, "chunks": len(t.chunks)},
        rows=lambda start, stop: ck.read_rows(name, start, stop),
        regions=lambda dests: ck.region_jobs(name, dests),
        # one storage entry, one tensor: a tied weight's (DcpItem.same_as), see _check_shared
        identity=(str(ck.path), t.chunks, t.shape, t.dtype.str),
    )


def _check_shared(state: TorchState, where: str) -> None:
    """Tensors of one storage entry (``check_disjoint`` lets whole ones through) are a tied
    weight: parameters, at most one of them with optimizer state; any other pair is refused
    (a tensor would import another's values)."""
    groups: dict[Any, list[tuple[str, int]]] = {}  # 0: a weight without state, 1: with, 2: state
    for name, ref in state.params.items():
        groups.setdefault(ref.identity, []).append((ref.name, int(name in state.states)))
    for per in state.states.values():
        for ref in per.values():
            groups.setdefault(ref.identity, []).append((ref.name, 2))
    for key, group in groups.items():
        if key is not None and sum(kind for _, kind in group) > 1 and len(group) > 1:
            raise SourceError(
                f"{where}: {[n for n, _ in group]} are one storage entry; only a tied weight "
                f"(parameters, all but one without optimizer state) may share one"
            )


def _state(
    checkpoints: list[torch_dcp.DcpCheckpoint],
    where: str,
    weights_only: bool = False,
    order: Sequence[str] | None = None,
) -> tuple[TorchState, dict[str, Any]]:
    tensors, objects = _tables(checkpoints, where)
    everything = list(tensors) + list(objects)
    _refuse_flat_params(tensors, where)
    root = _optimizer_root(everything, where)
    skipped: dict[str, str] = {}
    states: dict[str, dict[str, Any]] = {}
    groups: list[dict] = []
    if root is not None:
        states = _optimizer_states(root, tensors, objects, skipped)
        groups = _param_groups(root, objects, tensors, where)
    in_optimizer = {n for n in everything if root is not None and n.startswith(root)}
    model_names = [n for n in tensors if n not in in_optimizer]
    by_index = bool(states) and all(files.name_number(k) is not None for k in states)
    if by_index:
        states, groups = _numbered(states, groups, order, weights_only, where)
    elif order is not None:
        raise SourceError(
            f"{where}: the optimizer state is keyed by parameter name; parameter_order applies "
            f"to one keyed by index"
        )
    container = _container(model_names, states, tensors, where)
    params: dict[str, TensorRef] = {}  # the model tensors, named inside the container
    for name in model_names:
        first = name.split(".", 1)[0]
        if container and not name.startswith(container):
            skipped[name] = f"tensor outside the model container {container.rstrip('.')!r}"
        elif not container and first in NON_MODEL_ROOTS:
            skipped[name] = f"{first}: training state, not a model parameter"
        else:
            params[name[len(container) :]] = _ref(tensors[name][0], name)
    for name in everything:  # why the rest (no parameter, no optimizer state) is not imported
        if root is not None and name.startswith(f"{root}param_groups."):
            skipped[name] = "optimizer hyper-parameter, recorded in source.optimizer.param_groups"
        elif name in objects and name not in in_optimizer:
            skipped.setdefault(name, "a pickled object, not a tensor")
        elif root is not None and name.startswith(root) and not name.startswith(root + "state."):
            skipped.setdefault(name, "optimizer entry outside state and param_groups")
    clean, removed = strip_wrappers(list(params), where)
    params = {new: params[old] for new, old in clean.items()}
    states_clean, _ = strip_wrappers(list(states), where)
    states = {new: states[old] for new, old in states_clean.items()}
    for group in groups:
        if isinstance(group.get("params"), list):
            group["params"] = [clean_name(p)[0] for p in group["params"]]
    info: dict[str, Any] = {
        "model_container": container.rstrip(".") or None,
        "optimizer_root": None if root is None else root.rstrip(".") or "<top level>",
    }
    if removed:
        info["wrappers_removed"] = removed
    if by_index:
        info["optimizer_keyed_by"] = "index"
    state = TorchState(params, states, groups, skipped, where, everything, sorted(in_optimizer))
    return state, info


def _numbered(
    states: dict[str, dict[str, Any]],
    groups: list[dict],
    order: Sequence[str] | None,
    weights_only: bool,
    where: str,
) -> tuple[dict[str, dict[str, Any]], list[dict]]:
    """An optimizer keyed by index (``optimizer.state_dict()`` saved as is) keyed by name:
    ``order`` along the groups' ``params`` (torch numbers them so); with weights_only and no
    order, none (the optimizer is skipped whole); else refused saying what would name them."""
    ids = [str(i) for g in groups for i in (g.get("params") or ())]
    if order is None:
        if weights_only:
            return {}, []
        keys = sorted(states, key=int)
        raise SourceError(
            f"{where}: the optimizer state is keyed by index ({len(keys)} parameters, indices "
            f"{', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}: optimizer.state_dict() "
            f"saved as is, as torchtune's asynchronous dist_epoch_N/ saves it), without "
            f"parameter names. Give them: parameter_order=[n for n, _ in "
            f"model.named_parameters()] of the model that was trained (the order it gave them "
            f"to the optimizer; --parameter-order FILE on the CLI), or convert with "
            f"weights_only=True to import the weights"
        )
    to_name = numbered_names(ids, sorted(states, key=int), order, where)
    named = [{**g, "params": [to_name[str(i)] for i in g.get("params") or ()]} for g in groups]
    return {to_name[k]: v for k, v in states.items()}, named


def _tables(checkpoints: list[torch_dcp.DcpCheckpoint], where: str) -> tuple[dict, dict]:
    """({name: (checkpoint, name)} of the tensors, the same of the objects) of every DCP
    folder; a name saved in two folders is refused."""
    tensors: dict[str, tuple[torch_dcp.DcpCheckpoint, str]] = {}
    objects: dict[str, tuple[torch_dcp.DcpCheckpoint, str]] = {}
    for ck in checkpoints:
        for table, names in ((tensors, ck.tensors), (objects, ck.objects)):
            for name in names:
                if name in tensors or name in objects:
                    raise SourceError(f"{where}: {name!r} is saved in two DCP folders")
                table[name] = (ck, name)
    return tensors, objects


def _refuse_flat_params(tensors: dict[str, Any], where: str) -> None:
    """FSDP1's LOCAL_STATE_DICT flat parameters hold many parameters in one rank-local buffer."""
    for name in tensors:
        if name.endswith("_flat_param") or "._flat_param" in name:
            raise SourceError(
                f"{where}: tensor {name!r} is an FSDP1 flat parameter (LOCAL_STATE_DICT); save "
                f"with SHARDED_STATE_DICT (or get_state_dict) to import it"
            )


def _optimizer_root(everything: list[str], where: str) -> str | None:
    """The prefix of the one optimizer's ``param_groups`` (None without one); several refused."""
    roots = sorted({m.group(1) for n in everything if (m := _GROUPS.match(n))})
    if len(roots) > 1:
        raise SourceError(
            f"{where}: {len(roots)} optimizers ({', '.join(r.rstrip('.') or '<top>' for r in roots)}); "
            f"importing several optimizers into one opt_state is not supported"
        )
    return roots[0] if roots else None


_GROUPS = re.compile(r"^((?:[^.]+\.)*?)param_groups\.")


def _optimizer_states(
    root: str,
    tensors: dict[str, Any],
    objects: dict[str, Any],
    skipped: dict[str, str],
) -> dict[str, dict[str, Any]]:
    """``{parameter: {state: TensorRef or number}}`` from ``<root>state.<param>.<state>``."""
    prefix = root + "state."
    states: dict[str, dict[str, Any]] = {}
    for table in (tensors, objects):
        for name, (ck, _) in table.items():
            if not (name.startswith(prefix) and "." in name[len(prefix) :]):
                continue
            param, key = name[len(prefix) :].rsplit(".", 1)
            if table is tensors:
                states.setdefault(param, {})[key] = _ref(ck, name)
            elif key == "step":  # a Python number in some optimizers
                where = {
                    "format": "torch_dcp",
                    "source_name": name,
                    "files": [ck.objects[name].file],
                }
                states.setdefault(param, {})[key] = scalar_ref(name, ck.read_object(name), where)
            else:
                skipped[name] = f"optimizer state {key!r} of {param!r} is a pickled object"
    return states


def _param_groups(
    root: str, objects: dict[str, Any], tensors: dict[str, Any], where: str
) -> list[dict]:
    """The hyper-parameters of each group: ``<root>param_groups.<i>.<hp>`` (one entry per group,
    ``params`` listing its parameters) or, flattened, ``<root>param_groups.<param>.<hp>``
    (collapsed into groups of parameters sharing every value)."""
    prefix = root + "param_groups."
    values: dict[str, dict[str, Any]] = {}
    for table in (objects, tensors):
        for name, (ck, _) in table.items():
            if name.startswith(prefix) and "." in name[len(prefix) :]:
                owner, key = name[len(prefix) :].rsplit(".", 1)
                value = ck.read_object(name) if table is objects else ck.read(name)
                values.setdefault(owner, {})[key] = value
    if all(files.name_number(k) is not None and "params" in v for k, v in values.items()):
        return [values[k] for k in sorted(values, key=int)]
    grouped: list[dict] = []
    for param, hps in values.items():
        for group in grouped:
            if jsonable({k: v for k, v in group.items() if k != "params"}) == jsonable(hps):
                group["params"].append(param)
                break
        else:
            grouped.append({**hps, "params": [param]})
    return grouped


def _container(
    model_names: list[str], states: dict[str, dict], tensors: dict[str, Any], where: str
) -> str:
    """The prefix before each parameter name in the saved dict ("" or e.g. ``model.``)."""
    if states:
        probe = min(states, key=len)
        for name in model_names:
            if name == probe or name.endswith("." + probe):
                container = name[: len(name) - len(probe)]
                missing = [p for p in states if container + p not in tensors]
                if not missing:
                    return container
        raise SourceError(
            f"{where}: the optimizer holds state for {len(states)} parameters, but no model "
            f"tensor is named like {probe!r} under one prefix (model tensors: "
            f"{sorted(model_names)[:3]})"
        )
    if any(tensors[n][0].tops.get(n) == n for n in model_names):  # a key of the dict saved
        return ""  # (planner_data: {"model.embed.weight": t} has no model container)
    firsts = {n.split(".", 1)[0] for n in model_names if "." in n}
    if len(firsts) == 1 and firsts <= set(MODEL_CONTAINERS) and all("." in n for n in model_names):
        return firsts.pop() + "."
    return ""
