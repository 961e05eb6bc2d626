"""Import ``torch.save`` checkpoints as UCP, read through the safe unpickler (no torch).

Covered: a plain ``torch.save(model.state_dict())`` file (``.pt``/``.pth``/``.bin``); Hugging
Face ``pytorch_model.bin`` and sharded ``pytorch_model-0000K-of-0000N.bin`` with
``pytorch_model.bin.index.json``; Accelerate's full-state ``save_state`` folder
(``pytorch_model.bin`` or ``pytorch_model_fsdp.bin``, ``optimizer.bin``) and HF Trainer's
``optimizer.pt`` beside the weights; Lightning ``.ckpt`` files (``state_dict`` +
``optimizer_states``); dictionaries holding a model under ``model`` / ``state_dict`` /
``model_state_dict`` and an optimizer under ``optimizer`` / ``optim`` / ``optimizer_state_dict``.

Tensors are read-only memory maps of the files, streamed one at a time. An optimizer keyed by
name (``get_optimizer_state_dict``, FSDP's full state) is used as it is; one keyed by index is
named by the first source of its order that applies (:func:`_name_keys`), checked against every
shape: a count or shape that disagrees is an error, never a guess.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_ucp._src.errors import OptimizerOrderWarning, RequestError, SourceError
from jax_ucp._src.format import files, safetensors
from jax_ucp._src.format.safetensors import first_tensors, weight_map_of
from jax_ucp._src.importers import trainer_files
from jax_ucp._src.importers.plan import Detection, ImportPlan, refuse_spec, tensor_names
from jax_ucp._src.importers.safetensors_weights import RangedTensor, file_tensors, weight_files
from jax_ucp._src.importers.torch import hf_trainer
from jax_ucp._src.importers.torch.options import TorchOptions
from jax_ucp._src.importers.torch_state import (
    TensorRef,
    TorchState,
    clean_name,
    plan_state,
    scalar_ref,
    state_shape,
    strip_wrappers,
)
from jax_ucp._src.store.storage import LocalDirectory, Storage
from jax_ucp._src.torchfiles import allow_list, torch_zip

__all__ = [
    "MODEL_FILES",
    "OPTIMIZER_FILES",
    "SUFFIXES",
    "detect",
    "detect_optimizer",
    "plan_torch_files",
]

SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
INDEX_FILE = "pytorch_model.bin.index.json"
MODEL_FILES = ("pytorch_model.bin", "pytorch_model_fsdp.bin", "model.pt", "model.bin")
OPTIMIZER_FILES = ("optimizer.bin", "optimizer.pt")
_MODEL_KEYS = ("state_dict", "model", "model_state_dict", "module")
_OPTIMIZER_KEYS = ("optimizer_states", "optimizer", "optim", "optimizer_state_dict")


def _is_zip(folder: Storage, name: str) -> bool:
    """Whether file ``name`` of ``folder`` begins a zip archive, its first bytes read through
    ``folder`` (a remote object's by one ranged read). One ``folder`` refuses to read (a link out
    of it) is taken: the plan follows a Hugging Face cache snapshot's link into its blobs, or
    names why not (``_inside``). Asked once of a storage (detected, then planned)."""
    known = _ZIPS.setdefault(folder, {})
    if name not in known:
        try:
            known[name] = folder.reader(name).read(0, 4) == b"PK\x03\x04"
        except files.UnsafeFileError:
            known[name] = True
        except (OSError, ValueError):  # gone, a failed range
            known[name] = False
    return known[name]


_ZIPS: weakref.WeakKeyDictionary[Storage, dict[str, bool]] = weakref.WeakKeyDictionary()


#: one rank's file of a framework whose importer assembles the ranks (never read as a model)
_RANK_FILE = re.compile(r"^(model_optim_rng|distrib_optim)\.pt$|mp_rank_|zero_pp_rank_|_rank_[0-9]")


_Files = dict[str, tuple[Storage, str]]  # a file's path in messages -> (storage, name) read


def _one_file(storage: Storage) -> tuple[Storage, str] | None:
    """(its folder's storage, its name) when ``storage`` names one file, not a folder: a local
    file (a link: its file's folder), or an object of a torch.save suffix with none below it (a
    single remote ``pytorch_model.bin``); asked once of a storage (detected, then planned)."""
    if storage not in _ONE:
        _ONE[storage] = _file_of(storage)
    return _ONE[storage]


_ONE: weakref.WeakKeyDictionary[Storage, tuple[Storage, str] | None] = weakref.WeakKeyDictionary()


def _file_of(storage: Storage) -> tuple[Storage, str] | None:
    try:
        if storage.names():
            return None
    except NotADirectoryError:  # a local file
        parent, name = os.path.split(os.path.realpath(storage.root))
        return type(storage)(parent), name
    except OSError:  # nothing there
        return None
    parent, _, name = storage.root.rstrip("/").rpartition("/")
    return (type(storage)(parent), name) if name.endswith(SUFFIXES) else None


def _top(storage: Storage) -> set[str]:
    """The names of the folder ``storage``'s own files (a remote prefix's: none below it)."""
    return {n for n in storage.names() if "/" not in n}


def _single_file(folder: Storage, names: set[str]) -> str | None:
    """The one torch.save file of a folder holding no other (``run.pt``, Lightning's ``.ckpt``),
    nor safetensors weights or a DCP's ``.metadata`` it would sit beside as a side file; one
    rank's file of Megatron, DeepSpeed or verl is no whole model (their importers read them)."""
    if ".metadata" in names or any(n.endswith(".safetensors") for n in names):
        return None
    found = sorted(n for n in names if n.endswith(SUFFIXES) and not _RANK_FILE.search(n))
    return found[0] if len(found) == 1 and _is_zip(folder, found[0]) else None


def _files_of(
    storage: Storage, one: tuple | None, names: set[str], index: dict | None = None
) -> tuple[_Files, tuple | None]:
    """(model files, (path, where) of the optimizer file or None) of a file (``one``) or a
    folder holding ``names``."""
    src = storage.root
    if one is not None:
        return {src: one}, None
    opt = next((n for n in OPTIMIZER_FILES if n in names), None)
    optimizer = None if opt is None else (storage.join(opt), _inside(storage, opt, src))
    if INDEX_FILE in names:
        return _index_files(storage, index or _weight_map(storage)), optimizer
    found = [n for n in MODEL_FILES if n in names]
    if len(found) > 1:
        raise SourceError(f"{src}: several model files ({', '.join(found)}); pass one")
    if found:
        return {storage.join(found[0]): _inside(storage, found[0], src)}, optimizer
    weights = {} if optimizer is None else weight_files(storage)
    if weights:  # a Trainer checkpoint-N/ or Accelerate save_state folder: safetensors weights
        return weights, optimizer
    single = _single_file(storage, names)
    if single is not None:
        return {storage.join(single): _inside(storage, single, src)}, None
    raise SourceError(
        f"{src}: no {INDEX_FILE}, {', '.join(MODEL_FILES)} or single torch.save file "
        f"({'/'.join(SUFFIXES)})"
    )


def _weight_map(storage: Storage) -> dict[str, str]:
    """The index's ``weight_map``, the index itself never a link to another model's."""
    folder, name = _inside(storage, INDEX_FILE, storage.root)
    raw = folder.read(name, safetensors.MAX_INDEX_BYTES) or b""  # none: no JSON index
    return weight_map_of(raw, storage.join(INDEX_FILE), error=SourceError)


def _index_files(storage: Storage, weight_map: dict[str, str]) -> _Files:
    first = first_tensors(weight_map)
    what = f"{storage.join(INDEX_FILE)}: weight_map entry"
    return {storage.join(n): _inside(storage, n, f"{what} {t[:100]!r}") for n, t in first.items()}


def _inside(folder: Storage, name: str, what: str) -> tuple[Storage, str]:
    """(storage, name) file ``name`` of ``folder`` is read at, once it resolves inside the
    folder (a Hugging Face cache snapshot: inside its cache repo, its links into ``blobs/``
    followed), never a link to a file elsewhere; a remote prefix's object as it is named."""
    if not isinstance(folder, LocalDirectory):
        return folder, name
    try:
        real = files.inside_checkpoint(folder.root, name, what)
    except files.UnsafeFileError as e:
        raise SourceError(str(e)) from None
    return LocalDirectory(os.path.dirname(real)), os.path.basename(real)


def _split(obj: Any, path: str) -> tuple[str | None, dict, str | None, Any]:
    """(model key or None for a bare state dict, model state dict, optimizer path prefix,
    optimizer state dict or None)."""
    if not isinstance(obj, dict):
        raise SourceError(f"{path}: holds a {type(obj).__name__}, expected a dict")
    model_key = next((k for k in _MODEL_KEYS if isinstance(obj.get(k), dict)), None)
    if model_key is None:
        tensors = {k: v for k, v in obj.items() if isinstance(v, np.ndarray)}
        if not tensors:
            raise SourceError(
                f"{path}: no tensors and none of the keys {', '.join(_MODEL_KEYS)} holding a "
                f"state dict (top-level keys: {sorted(map(str, obj))[:8]})"
            )
        return None, tensors, None, None
    optimizer_key = next((k for k in _OPTIMIZER_KEYS if k in obj), None)
    optimizer = obj.get(optimizer_key) if optimizer_key else None
    prefix = f"{optimizer_key}."
    if optimizer_key == "optimizer_states" and not isinstance(optimizer, list):
        raise SourceError(f"{path}: optimizer_states is not a list")  # Lightning: one per optimizer
    if isinstance(optimizer, list) and len(optimizer) == 1:
        optimizer, prefix = optimizer[0], f"{prefix}0."
    elif isinstance(optimizer, list):
        optimizer = _merged(optimizer, path, prefix) if optimizer else None
    return model_key, obj[model_key], prefix if optimizer is not None else None, optimizer


def _merged(optimizers: list, path: str, prefix: str) -> dict:
    """Several optimizers of one run (torch's Muon beside AdamW for the other parameters) as
    one state_dict: their groups in order, the indices of each after those of the ones before;
    ``_sources`` keeps each state's name in the file."""
    state: dict = {}
    groups: list = []
    sources: dict = {}
    for j, one in enumerate(optimizers):
        if not (isinstance(one, dict) and isinstance(one.get("state"), dict)):
            raise SourceError(f"{path}: {prefix}{j} is not a torch optimizer state_dict")
        ids = [p for g in one.get("param_groups") or [] for p in g.get("params", [])]
        by_name = all(isinstance(k, str) for k in [*one["state"], *ids])
        offset = 0 if by_name else sum(len(g.get("params", [])) for g in groups)
        moved = {k: k if by_name else k + offset for k in [*one["state"], *ids]}
        state.update({moved[k]: v for k, v in one["state"].items()})
        sources.update({moved[k]: f"{j}.state.{k}." for k in one["state"]})
        groups += [
            {**g, "params": [moved[p] for p in g.get("params", [])]}
            for g in one.get("param_groups") or []
        ]
    return {"state": state, "param_groups": groups, "_sources": sources}


def detect(storage: Storage) -> Detection:
    """Whether ``src`` is a torch.save file or a folder of them, from names (and a zip's
    signature). A folder is a weak claim: DeepSpeed and Megatron folders hold them too."""
    one = _one_file(storage)
    if one is not None:
        if storage.root.endswith(SUFFIXES) and _is_zip(*one):
            return Detection(True, "a torch.save file")
        return Detection(False, "not a torch.save file (`.bin`/`.pt`/`.pth`/`.ckpt` zip)")
    try:
        names = _top(storage)
    except OSError:  # nothing there
        names = set()
    if names & {INDEX_FILE, *MODEL_FILES} or _single_file(storage, names) is not None:
        return Detection(True, "torch.save files", weak=True)
    return Detection(
        False,
        f"no torch.save files (`pytorch_model.bin`, `{INDEX_FILE}`, `pytorch_model_fsdp.bin`, "
        f"a `.bin`/`.pt`/`.pth`/`.ckpt` file)",
    )


def detect_optimizer(storage: Storage) -> Detection:
    """Whether ``src`` holds a torch optimizer file beside its weights (a Hugging Face Trainer
    ``checkpoint-N/``, Accelerate's ``save_state``): read here with the safetensors weights
    that format's importer claims."""
    try:
        names = storage.names()
    except OSError:  # a file, or nothing
        names = []
    if any(n in names for n in OPTIMIZER_FILES):
        return Detection(True, "a torch optimizer beside the weights (optimizer.pt / .bin)")
    return Detection(False, "no torch optimizer (`optimizer.pt`, `optimizer.bin`)")


def plan_torch_files(storage: Storage, options: TorchOptions) -> ImportPlan:
    """The import of a torch.save checkpoint (file or folder), or of a folder of safetensors
    weights beside a torch optimizer (Trainer ``checkpoint-N/``, Accelerate ``save_state``).

    Args:
        storage: a torch.save file, or a folder of them (sharded ``.bin``, or safetensors weights
            beside ``optimizer.pt``).
        options: ``weights_only``: the model weights alone, the optimizer state in
            ``source.skipped``; ``parameter_order``: the names of the optimizer's parameters
            in the order torch numbered them (group after group; for
            ``AdamW(model.parameters())``, ``[n for n, _ in model.named_parameters()]``), for
            an optimizer keyed by bare indices whose order the files do not keep;
            ``model_config``: a Hugging Face ``config.json`` whose model gives that order.
    """
    src = storage.root
    spec, weights_only = options.spec, options.weights_only
    parameter_order = options.parameter_order
    model_config = None if options.model_config is None else os.fspath(options.model_config)
    refuse_spec(spec, "torch file imports keep torch's parameter names", SourceError)
    one = _one_file(storage)
    try:
        names = set() if one is not None else _top(storage)
    except FileNotFoundError:
        raise SourceError(f"{src}: no such file or folder") from None
    index = _weight_map(storage) if INDEX_FILE in names else None  # read once
    model_files, optimizer_file = _files_of(storage, one, names, index)
    if optimizer_file is None:
        trainer_files.check_optimizer_beside_scheduler(storage, weights_only)
    model, found, other, optimizer, optimizer_at = _read_model_files(src, model_files)
    base_folder = None if options.base_model is None else os.fspath(options.base_model)
    if base_folder is not None:
        _add_base(storage, base_folder, model, found)
        config = os.path.join(base_folder, trainer_files.CONFIG_FILE)
        if model_config is None and parameter_order is None and os.path.isfile(config):
            model_config = config  # the adapter's order over the base model's modules
    if index is not None:
        _check_index(storage.join(INDEX_FILE), index, model)
    if optimizer_file is not None:
        optimizer = torch_zip.load_torch_file(optimizer_file[1])
        base = os.path.basename(optimizer_file[0])
        optimizer_at = (optimizer_file[0], f"{base}:")
        found += [f"{base}:{n}" for n in tensor_names(optimizer)]
    clean, removed = strip_wrappers(list(model), src)
    params = {new: _ref(*model[old]) for new, old in clean.items()}
    states: dict[str, dict[str, TensorRef]] = {}
    groups: list[dict] = []
    info: dict[str, Any] = {}
    optimizer_sources: list[str] = []
    skipped: dict[str, str] = {}
    if optimizer is not None:
        assert optimizer_at is not None  # found with the optimizer
        path, prefix = optimizer_at
        optimizer_sources = [n for n in found if n.startswith(prefix)]
        info["optimizer_file"] = os.path.basename(path)
        if not weights_only:
            on_safetensors = next(iter(model_files)).endswith(".safetensors")
            order = _Order(
                storage, parameter_order, on_safetensors, model_config, path, model, clean, info
            )
            states, groups, info["optimizer_keys"] = _optimizer(optimizer, prefix, skipped, order)
    folder = one is None
    _skip_unused(storage, folder, model_files, found, optimizer_sources, params, states, skipped)
    if folder and names & {"optimizer.pt", trainer_files.STATE_FILE}:  # the Trainer saved it
        info["trainer"] = trainer_files.trainer_record(storage)  # the schedule, clipping, step
    elif info.get("optimizer_file") == "optimizer.bin" and not weights_only:
        # Accelerate's save_state: its scheduler's base_lrs / _last_lr state the groups' rates
        info.update(trainer_files.scheduler_record(storage, "scheduler.bin", "lr_scheduler"))
    if folder and trainer_files.is_adapter_checkpoint(storage):
        info["lora"] = trainer_files.adapter_record(storage)  # exported back as peft reads it
    if base_folder is not None:
        info["base_model"] = os.path.abspath(base_folder)  # its weights imported, frozen
    if removed:
        info["wrappers_removed"] = removed
    if other:
        info["other_entries"] = other  # pickled values that are not tensors (epoch, versions...)
    state = TorchState(params, states, groups, skipped, src, found, optimizer_sources)
    source = {
        "framework": "torch_files",
        "path": storage.absolute(),
        "files": [os.path.basename(p) for p in model_files],
        **info,
    }
    return plan_state(state, source, options)


def _add_base(storage: Storage, base: str, model: dict, found: list[str]) -> None:
    """The base model's weights (``base``: a folder of Hugging Face weights) added to the
    adapter's under their own names: parameters without optimizer state, held frozen. Only
    beside a peft adapter checkpoint; a name the adapter also has is refused."""
    src = storage.root
    if _one_file(storage) is not None or not trainer_files.is_adapter_checkpoint(storage):
        raise RequestError(f"{src}: base_model= is for a peft adapter checkpoint's folder")
    if not os.path.isdir(base):
        raise SourceError(f"base_model={base}: not a folder of the base model's weights")
    folder = LocalDirectory(base)
    weights = weight_files(folder) or _files_of(folder, None, _top(folder))[0]
    tensors, base_found, *_ = _read_model_files(base, weights)
    clash = sorted(set(tensors) & set(model))
    if clash:
        raise SourceError(f"base_model={base}: {clash[0]!r} is also a tensor of {src}")
    hf_trainer.check_base_model(storage, base, tensors, model)
    model.update(tensors)
    found += base_found


def _read_model_files(src: str, model_files: _Files):
    """The model files' tensors, ``{name: (tensor, file, source name)}``, with every tensor
    found, the non-tensor entries, and an optimizer state saved inside them with (its file,
    its source-name prefix). A name in two files is refused."""
    model: dict[str, tuple[np.ndarray | RangedTensor, str, str]] = {}  # -> (tensor, file, name)
    found: list[str] = []
    other: list[str] = []
    optimizer = optimizer_at = None
    for path, at in model_files.items():
        base = os.path.basename(path)
        if path.endswith(".safetensors"):
            sd, prefix = file_tensors(*at), f"{base}:"  # views of a map, or read by ranges
            found += [f"{base}:{n}" for n in sd]
        else:
            obj = torch_zip.load_torch_file(at)
            key, sd, opt_prefix, opt = _split(obj, path)
            found += [f"{base}:{n}" for n in tensor_names(obj)]
            other += [f"{base}:{k}" for k, v in obj.items() if not _has_tensors(v)]
            if opt is not None:
                optimizer, optimizer_at = opt, (path, f"{base}:{opt_prefix}")
            prefix = f"{base}:{key + '.' if key else ''}"
        for name, value in sd.items():
            if not isinstance(name, str):
                raise SourceError(f"{path}: state dict key {name!r} is not a string")
            if not isinstance(value, np.ndarray | RangedTensor):
                continue  # a nested object's tensors are accounted as skipped below
            if name in model:
                raise SourceError(f"{src}: tensor {name!r} in {model[name][1]} and {path}")
            model[name] = (value, path, f"{prefix}{name}")
    return model, found, other, optimizer, optimizer_at


def _skip_unused(
    storage: Storage,
    folder: bool,
    model_files: _Files,
    found: list[str],
    optimizer_sources: list[str],
    params: dict[str, TensorRef],
    states: dict[str, dict[str, TensorRef]],
    skipped: dict[str, str],
) -> None:
    """Why each tensor found that is neither imported nor an optimizer state is left out; the
    Trainer's torch RNG states beside safetensors weights (``rng_state*.pth``) are source files
    of their own, each counted in ``found`` too."""
    if folder and next(iter(model_files)).endswith(".safetensors"):
        rng = trainer_files.rng_states(storage)
        rng.update(trainer_files.adapter_beside_model(storage))  # LoRA files beside a full model
        found.extend(rng)
        skipped.update(rng)
    for name in optimizer_sources:
        if ":param_groups." in name or ".param_groups." in name:
            skipped.setdefault(name, "optimizer hyper-parameter, recorded in source.optimizer")
    used = {r.name for r in params.values()} | {
        r.name for per in states.values() for r in per.values()
    }
    for name in found:
        if name not in used and name not in optimizer_sources:
            skipped.setdefault(name, "not a model weight or optimizer state")


def _has_tensors(value: Any) -> bool:
    return next(iter(tensor_names(value)), None) is not None


def _ref(value: np.ndarray | RangedTensor, path: str, name: str) -> TensorRef:
    where = {"format": "torch_files", "file": os.path.basename(path)}
    if isinstance(value, RangedTensor):  # its rows read by ranges as they are written
        rows, count = (value.rows, value.shape[0]) if value.shape else (None, 1)
        read = lambda: value.rows(0, count).reshape(value.shape)
        identity = (value.file.shown, value.offset, value.shape, value.dtype.str)
        return TensorRef(name, value.shape, value.dtype, read, where, identity, rows)
    return TensorRef(
        name,
        tuple(value.shape),
        value.dtype,
        lambda: value,
        where,
        # where its bytes are: tied tensors are views of one storage
        identity=(
            value.__array_interface__["data"][0],
            value.shape,
            value.strides,
            value.dtype.str,
        ),
    )


def _check_index(index: str, weight_map: dict[str, str], model: dict) -> None:
    wrong = sorted(n for n, f in weight_map.items() if n not in model)
    unlisted = sorted(set(model) - set(weight_map))
    moved = sorted(
        n for n, f in weight_map.items() if n in model and os.path.basename(model[n][1]) != f
    )
    if wrong or unlisted or moved:
        raise SourceError(
            f"{index}: weight_map and the files disagree: missing from the files {wrong[:5]}, "
            f"not in the index {unlisted[:5]}, in another file than listed {moved[:5]}"
        )


@dataclasses.dataclass(frozen=True)
class _Order:
    """Where the order of an index-keyed optimizer's parameters may come from, and what it is
    checked against: the model state dict's tensors."""

    src: Storage  # the checkpoint folder (or file)
    given: Sequence[str] | None  # parameter_order=
    safetensors: bool  # the weights are safetensors: their order is sorted, not the model's
    model_config: str | os.PathLike | None  # model_config=: a config.json to rebuild it from
    path: str  # the optimizer's file
    model: dict  # model state dict name -> (tensor, file, source name)
    clean: dict[str, str]  # clean parameter name -> model state dict name
    info: dict  # the source record: notes, parameter_order


def _optimizer(
    optimizer: Any, prefix: str, skipped: dict, order: _Order
) -> tuple[dict[str, dict[str, TensorRef]], list[dict], str]:
    """Per-parameter state keyed by clean parameter name, the groups, and how keys were read;
    an assumption the mapping rests on is added to ``info["notes"]`` (and warned)."""
    path = order.path
    state = optimizer.get("state") if isinstance(optimizer, dict) else None
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    if not isinstance(state, dict) or not isinstance(groups, list):
        raise SourceError(
            f"{path}: the optimizer state is not a torch optimizer state_dict ('state' and "
            f"'param_groups'); convert with weights_only=True to import the weights alone"
        )
    keys, to_name = _name_keys(order, state, groups)
    merged = optimizer.get("_sources")
    at = {k: f"{prefix}{v}" for k, v in merged.items()} if merged else prefix
    states = _state_refs(state, to_name, path, at, skipped)
    out_groups = [
        {
            **{k: v for k, v in g.items() if k not in ("params", "param_names")},
            "params": [to_name.get(p, str(p)) for p in g.get("params", [])],
        }
        for g in groups
        if isinstance(g, dict)
    ]
    how = {
        "names": "parameter names",
        "param_names": "parameter indices, named by the groups' param_names",
        "indices": "parameter indices, in state-dict order",
        "parameter_order": "parameter indices, named by parameter_order",
        "trainer": "parameter indices, in the Trainer's groups rebuilt (source.parameter_order)",
        "model_config": "parameter indices, in the groups rebuilt from model_config "
        "(source.parameter_order)",
    }[keys]
    return states, out_groups, how


def _name_keys(order: _Order, state: dict, groups: list) -> tuple[str, dict]:
    """(how the state is keyed, {key: clean parameter name}): the names themselves, else the
    first source of an order that applies (param_names, parameter_order=, model_config=, the
    Trainer's groups, the state-dict order), each checked against the weights."""
    path, info = order.path, order.info
    ids = [p for g in groups if isinstance(g, dict) for p in g.get("params", [])]
    keys = "names" if all(isinstance(k, str) for k in [*state, *ids]) else "indices"
    if keys == "names":
        to_name = {k: clean_name(k)[0] for k in {*state, *ids}}
    elif _named_groups(groups):  # torch >= 2.5 with named parameters: param_names beside params
        keys = "param_names"
        _check_unique_names(groups, path)
        to_name = {
            i: clean_name(n)[0] for g in groups for i, n in zip(g["params"], g["param_names"])
        }
    elif order.given is not None:
        keys, to_name = "parameter_order", _given_order(order.given, ids, path)
    elif order.model_config is not None:
        keys = "model_config"
        to_name, rule = _trainer_order(order, groups, state, order.model_config)
        info["parameter_order"] = f"{order.model_config}: {rule}"
        _say_order_assumed(order, to_name, state, _config_rule(str(order.model_config), rule))
    elif (
        trainer_files.is_trainer_checkpoint(order.src) and os.path.basename(path) == "optimizer.pt"
    ):
        keys = "trainer"
        to_name, info["parameter_order"] = _trainer_order(order, groups, state)
        said = _TRAINER_RULE
        adapter = trainer_files.ADAPTER_CONFIG_FILE
        if trainer_files.is_adapter_checkpoint(order.src) and trainer_files.side_json(
            order.src, adapter, absent_ok=True
        ):
            said = _config_rule("the base model's config.json", info["parameter_order"])
        _say_order_assumed(order, to_name, state, said)
    else:  # one group, torch.save weights: by the state-dict order, else refused
        keys = "indices"
        to_name = _by_index(order, ids, groups, state)
        _say_order_assumed(order, to_name, state, _INDEX_RULE)
    if keys not in ("names", "indices"):
        _check_named(order, to_name, state)
    return keys, to_name


def _state_refs(
    state: dict, to_name: dict, path: str, prefix: str | dict, skipped: dict
) -> dict[str, dict[str, TensorRef]]:
    """{parameter: {state name: reference}}; a non-tensor entry holding tensors is skipped
    with the reason, so every tensor stays accounted for. ``prefix``: of the state's names in
    the file, or each key's (several optimizers merged)."""
    states: dict[str, dict[str, TensorRef]] = {}
    for key, per in state.items():
        if not isinstance(per, dict):
            raise SourceError(f"{path}: state of parameter {key!r} is not a dict")
        mine = states.setdefault(to_name[key], {})
        at = prefix[key] if isinstance(prefix, dict) else f"{prefix}state.{key}."
        for k, v in per.items():
            name = f"{at}{k}"
            if isinstance(v, np.ndarray):
                mine[str(k)] = _ref(v, path, name)
            elif k == "step":
                mine["step"] = scalar_ref(name, v, {"file": os.path.basename(path)})
            elif _has_tensors(v):
                for n in tensor_names(v, name):
                    skipped[n] = f"optimizer state {k!r} is not a tensor but holds tensors"
    return states


def _given_order(given: Sequence[str], ids: list, path: str) -> dict:
    """Index ``ids[i]`` (group after group) -> ``given[i]``, wrapper prefixes removed."""
    if isinstance(given, str) or not all(isinstance(n, str) for n in given):
        raise SourceError("parameter_order: expected a list of parameter names")
    names = [clean_name(n)[0] for n in given]
    if len(names) != len(ids) or len(set(names)) != len(names):
        raise SourceError(
            f"{path}: parameter_order names {len(names)} parameters ({len(set(names))} distinct), "
            f"the optimizer numbers {len(ids)}"
        )
    return dict(zip(ids, names))


def _trainer_order(
    order: _Order, groups: list, state: dict, model_config: str | os.PathLike | None = None
) -> tuple[dict, str]:
    """Index -> name by the Trainer's groups rebuilt (:mod:`hf_trainer`) from the folder's
    ``config.json`` or ``model_config``: the one candidate whose group sizes and every state's
    shape fit, else refused naming why."""
    sizes, path = _group_sizes(groups), order.path
    fits: list[tuple[dict, str]] = []
    misfits: list[str] = []
    config = None if model_config is None else os.fspath(model_config)
    for c in hf_trainer.trainer_candidates(order.src, len(order.model), config):
        want = [len(g) for g in c.groups]
        if want != sizes:
            misfits.append(f"{c.rule}: groups of {want}")
            continue
        to_name = {i: n for g, names in zip(groups, c.groups) for i, n in zip(g["params"], names)}
        bad = [
            f"index {key} ({n}): {k} {list(v.shape)} vs {want and list(want)}"
            for key, per in state.items()
            for n in [to_name.get(key)]
            for want in [None if n is None else c.shapes[n]]
            for k, v in _misfits(per, want)
        ]
        if bad:
            misfits.append(f"{c.rule}: {bad[0]}")
            continue
        fits.append((to_name, c.rule))
    if len(fits) == 1:
        return fits[0]
    if fits:
        raise SourceError(
            f"{path}: the Trainer's parameter order is ambiguous: {len(fits)} groupings fit the "
            f"group sizes {sizes} and every shape ({'; '.join(r for _, r in fits)}); pass "
            f"parameter_order=, or convert with weights_only=True"
        )
    config = model_config if model_config is not None else trainer_files.CONFIG_FILE
    raise SourceError(
        f"{path}: the optimizer's groups (sizes {sizes}) are not "
        f"{'one group of model.named_parameters() nor ' if model_config is not None else ''}"
        f"the Trainer's grouping of {config}'s model ({'; '.join(misfits)}): a custom "
        f"optimizer or another model; pass parameter_order=, or convert with weights_only=True"
    )


def _group_sizes(groups: list) -> list[int | None]:
    return [len(g.get("params", [])) if isinstance(g, dict) else None for g in groups]


def _named_groups(groups: list) -> bool:
    """Every group lists ``param_names`` (strings) one for one with its ``params``."""
    return bool(groups) and all(
        isinstance(g, dict)
        and isinstance(g.get("param_names"), list)
        and isinstance(g.get("params"), list)
        and len(g["param_names"]) == len(g["params"])
        and all(isinstance(n, str) for n in g["param_names"])
        for g in groups
    )


def _check_unique_names(groups: list, path: str) -> None:
    """No parameter named twice across the groups' ``param_names`` (wrapper prefixes removed):
    two indices would map to one parameter and one of their states would be lost."""
    first: dict[str, tuple[int, str]] = {}  # clean name -> (group, name as written)
    for group, g in enumerate(groups):
        for index, name in zip(g["params"], g["param_names"]):
            clean = clean_name(name)[0]
            if clean in first:
                other, written = first[clean]
                raise SourceError(
                    f"{path}: param_names names parameter {clean[:200]!r} twice: as "
                    f"{written[:200]!r} in group {other} and as {name[:200]!r} (params entry "
                    f"{allow_list.short_repr(index, 40)}) in group {group}; a parameter is "
                    f"optimized once, so which of the two states is its own cannot be told"
                )
            first[clean] = (group, name)


def _check_named(order: _Order, to_name: dict, state: dict, named_by: str = "") -> None:
    """Each named index is a model tensor of the state's shape (``named_by``: how the indices
    were named and the way out, for the errors)."""
    path, clean, model = order.path, order.clean, order.model
    for key, per in state.items():
        name = to_name.get(key)
        if name is None or name not in clean:
            raise SourceError(
                f"{path}: optimizer state for index {key!r} ({name!r}), which is not a tensor "
                f"of the model state dict{' (in no param group)' if name is None else ''}"
            )
        shape = tuple(model[clean[name]][0].shape)
        for k, v in _misfits(per, shape):
            raise SourceError(
                f"{path}: optimizer state {k!r} of {name!r} (index {key}) has shape "
                f"{list(v.shape)}, the parameter {list(shape)}{named_by}"
            )


#: how an index-keyed optimizer's states were named when nothing in the files names them
_INDEX_RULE = (
    "mapped by order (index i -> the i-th distinct floating tensor of the model state dict, "
    "torch's numbering of model.parameters())"
)
_TRAINER_RULE = (
    "mapped by the Hugging Face Trainer's default grouping rebuilt from config.json (decayed "
    "then non-decayed parameters, each in model.named_parameters() order; a Trainer subclass "
    "with its own create_optimizer() numbers them otherwise)"
)


def _config_rule(config: str, rule: str) -> str:
    return (
        f"mapped by the grouping rebuilt from {config} ({rule}; an optimizer built in another "
        "order numbers them otherwise)"
    )


def _say_order_assumed(order: _Order, to_name: dict, state: dict, rule: str) -> None:
    """An index -> name mapping inferred by ``rule`` (the state-dict order, the Trainer's
    grouping) is what the optimizer did only if it was built that way, and nothing in the file
    can confirm it: when two parameters with state share a shape, states built in another order
    would land on the wrong one unseen. Say so once (a warning) and in the manifest
    (``source.notes``), whichever rule named them."""
    path, clean, model, info = order.path, order.clean, order.model, order.info
    by_shape: dict[tuple, list[str]] = {}
    for key in state:
        name = to_name.get(key)
        if name is None:
            continue
        tensor = model.get(clean.get(name, name))
        if tensor is not None:
            by_shape.setdefault(tuple(tensor[0].shape), []).append(name)
    shared = {shape: names for shape, names in by_shape.items() if len(names) > 1}
    if not shared:
        return
    count = sum(len(names) for names in shared.values())
    shape, names = max(shared.items(), key=lambda item: len(item[1]))
    example = ", ".join(repr(n[:100]) for n in names[:3]) + (", ..." if len(names) > 3 else "")
    note = (
        f"{os.path.basename(path)}: optimizer state keyed by index was {rule}; {count} "
        f"parameters share a shape with another ({example} are "
        f"all {list(shape)}), so states of an optimizer built in another order would not be "
        f"told apart. To confirm the mapping, save the optimizer with param_names (torch >= 2.5: "
        f"build it from model.named_parameters()) or keyed by name (get_optimizer_state_dict)"
    )
    info.setdefault("notes", []).append(note)
    warnings.warn(f"{path}: {note.split(': ', 1)[1]}", OptimizerOrderWarning, stacklevel=2)


def _by_index(order: _Order, ids: list, groups: list, state: dict) -> dict:
    """Index ``i`` -> the ``i``-th distinct floating tensor of the model state dict (torch
    numbers ``model.parameters()`` so; tied copies share storage and count once). Refused, naming
    the way out, when that order cannot hold: safetensors weights (sorted names) or several
    groups."""
    path, clean, model = order.path, order.clean, order.model
    sizes = _group_sizes(groups)
    names = (
        "[n for n, _ in model.named_parameters()]"
        if len(groups) <= 1
        else f"the names group after group ({_group_order(groups)}), each group's in the "
        "order it lists its indices: for groups split from model.named_parameters(), "
        "[n for group in name_groups for n in group], not [n for n, _ in "
        "model.named_parameters()], which interleaves the groups"
    )
    way_out = (
        f"pass parameter_order={names} (--parameter-order FILE on the command line), or, for "
        f"a transformers model, model_config= its config.json (--model-config CONFIG.json) to "
        f"rebuild the order, or convert with weights_only=True to import the weights alone"
    )
    if order.safetensors:
        raise SourceError(
            f"{path}: the optimizer numbers {len(ids)} parameters by index (groups of "
            f"{sizes}) without their names, and safetensors keeps no parameter order (its "
            f"names are sorted), so which state is whose cannot be told; {way_out}"
        )
    if len(groups) > 1:
        raise SourceError(
            f"{path}: the optimizer numbers {len(ids)} parameters by index over {len(groups)} "
            f"groups without their names ({_describe_groups(groups)}); {_numbering(ids)}, so "
            f"index i is not the i-th tensor of the model state dict and which state is whose "
            f"cannot be told; {way_out}"
        )
    distinct: dict[tuple, str] = {}  # by storage: tied copies once
    for new, old in clean.items():
        value = model[old][0]
        if np.issubdtype(value.dtype, np.floating) or value.dtype.kind == "V":
            ident = (value.__array_interface__["data"][0], value.shape, value.strides)
            distinct.setdefault(ident, new)
    hint = "; convert with weights_only=True to import the weights alone"
    if len(ids) != len(distinct) or sorted(ids, key=str) != sorted(set(ids), key=str):
        raise SourceError(
            f"{path}: the optimizer numbers {len(ids)} parameters, the model state dict has "
            f"{len(distinct)} distinct floating tensors: cannot tell which state is whose "
            f"(buffers or frozen parameters in the state dict?){hint}"
        )
    to_name = dict(zip(ids, distinct.values()))
    _check_named(order, to_name, state, f" (index i named as the i-th in state-dict order){hint}")
    return to_name


def _group_order(groups: list) -> str:
    """ "group 0's 2, then group 1's 4" for the advice."""
    return ", then ".join(f"group {i}'s {n}" for i, n in enumerate(_group_sizes(groups)))


def _describe_groups(groups: list) -> str:
    """What each index-keyed group holds: its size, its first indices and the hyper-parameters
    that set it apart from the other groups (``weight_decay`` 0.1 / 0.0)."""
    plain = [g for g in groups if isinstance(g, dict)]
    keys = sorted({str(k) for g in plain for k in g} - {"params", "param_names"})
    differ = [k for k in keys if len({allow_list.short_repr(g.get(k), 40) for g in plain}) > 1]
    out = []
    for i, g in enumerate(groups):
        if not isinstance(g, dict):
            out.append(f"group {i}: a {type(g).__name__}")
            continue
        params = g.get("params", [])
        shown = ", ".join(allow_list.short_repr(p, 20) for p in params[:4])
        more = ", ..." if len(params) > 4 else ""
        hps = "".join(f", {k} {allow_list.short_repr(g.get(k), 40)}" for k in differ[:3])
        out.append(f"group {i}: {len(params)} parameters (indices {shown}{more}){hps}")
    return "; ".join(out)


def _numbering(ids: list) -> str:
    """How the indices run: torch's own numbering (0, 1, ... group after group), or re-keyed."""
    if ids == list(range(len(ids))):
        return (
            "torch's own numbering, group after group (Hugging Face's Trainer puts "
            "weight-decayed parameters first, norms and biases after)"
        )
    return (
        "the indices do not run group after group as torch's own numbering does: re-keyed "
        "after saving (e.g. by FSDP's rekey_optim_state_dict, which numbers model.parameters(), "
        "as Lightning's ModelParallelStrategy does for a consolidated .ckpt)"
    )


def _misfits(per: Any, shape: tuple | None) -> list[tuple[Any, np.ndarray]]:
    """The state tensors of one parameter's state ``per`` whose shape is not ``shape`` (every
    one when ``shape`` is None: no parameter to hold them); scalars (``step``) fit any."""
    return [
        (k, v)
        for k, v in (per.items() if isinstance(per, dict) else ())
        if isinstance(v, np.ndarray)
        and v.ndim
        and (shape is None or tuple(v.shape) != state_shape(str(k), shape))
    ]
