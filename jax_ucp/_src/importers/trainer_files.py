"""The files a Hugging Face Trainer writes beside any checkpoint layout (its own
``optimizer.pt``, DeepSpeed's ``global_stepN/``, FSDP's ``pytorch_model_fsdp_0/``):
``trainer_state.json``, ``training_args.bin``, ``scheduler.pt``, ``config.json``. Shared by the
importers that read a Trainer's ``checkpoint-N/`` (torch files, DeepSpeed, DCP), which never
import each other.

``training_args.bin`` (a pickled ``TrainingArguments``) is read through the restricted
unpickler with inert stand-ins, for the schedule and clipping the run used; ``scheduler.pt`` and
``trainer_state.json`` are plain data. Every file is reached through
:func:`jax_ucp._src.format.files.inside`: a link leading out of the checkpoint folder is refused.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import warnings
from typing import Any

from jax_ucp._src.errors import SourceError
from jax_ucp._src.format import files
from jax_ucp._src.importers import runs
from jax_ucp._src.importers.plan import jsonable
from jax_ucp._src.store.storage import LocalDirectory, Storage
from jax_ucp._src.torchfiles import allow_list, torch_zip

__all__ = [
    "ADAPTER_WEIGHTS",
    "ARG_FIELDS",
    "MODEL_FIELDS",
    "MODEL_WEIGHTS",
    "adapter_beside_model",
    "adapter_record",
    "check_optimizer_beside_scheduler",
    "is_adapter_checkpoint",
    "is_trainer_checkpoint",
    "model_config",
    "read_json",
    "rng_states",
    "scheduler_record",
    "side_file",
    "side_json",
    "trainer_folder_above",
    "trainer_record",
    "trainer_saved",
]

MAX_JSON_BYTES = 16 << 20
CONFIG_FILE = "config.json"
ADAPTER_CONFIG_FILE = "adapter_config.json"  # peft's adapter (LoRA) beside adapter weights
STATE_FILE = "trainer_state.json"
ARGS_FILE = "training_args.bin"
SCHEDULER_FILE = "scheduler.pt"
#: a LoRA / peft adapter's weights: peft's ``save_pretrained`` (safetensors or ``.bin``) and
#: torchtune's own copy in its names (``.pt``)
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
#: a full model's weights as transformers' ``save_pretrained`` names them
MODEL_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)

#: TrainingArguments fields that say how the optimizer stepped (recorded in the manifest)
ARG_FIELDS = (
    "learning_rate",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "max_grad_norm",
    "lr_scheduler_type",
    "lr_scheduler_kwargs",
    "warmup_steps",
    "warmup_ratio",
    "max_steps",
    "num_train_epochs",
    "optim",
    "gradient_accumulation_steps",
    "per_device_train_batch_size",
)
#: config.json fields recorded (source.trainer.model_config): the model's shape, for specs
MODEL_FIELDS = (
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",  # transformers 5: rope_theta and the scaling, in one object
    "tie_word_embeddings",
)
#: what a pickled TrainingArguments refers to, read as inert stand-ins
ARG_CLASSES = (
    "transformers.training_args.OptimizerNames",
    "transformers.trainer_utils.SchedulerType",
    "transformers.trainer_utils.IntervalStrategy",
    "transformers.trainer_utils.SaveStrategy",
    "transformers.trainer_utils.HubStrategy",
    "transformers.trainer_utils.FSDPOption",
    "transformers.trainer_pt_utils.AcceleratorConfig",
    "transformers.debug_utils.DebugOption",
    "accelerate.state.PartialState",
    # under DeepSpeed: the Trainer's config of it (data: the config as a dict)
    "accelerate.utils.dataclasses.DeepSpeedPlugin",
    "transformers.integrations.deepspeed.HfDeepSpeedConfig",
    "transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig",
    "accelerate.utils.dataclasses.DistributedType",
    "torch.device",
)


def is_trainer_checkpoint(storage: Storage) -> bool:
    """A folder the Trainer saved: ``optimizer.pt`` or ``trainer_state.json`` beside the weights."""
    return any(_has(storage, n) for n in ("optimizer.pt", STATE_FILE))


def _has(storage: Storage, name: str) -> bool:
    """Whether ``name`` is an entry of the folder ``storage``: a local one's (a link, even
    dangling, too), a remote prefix's by its one listing."""
    if isinstance(storage, LocalDirectory):
        return os.path.lexists(os.path.join(storage.root, name))
    with contextlib.suppress(OSError):
        return name in _entries(storage)
    return False


def side_json(storage: Storage, name: str, absent_ok: bool = False) -> tuple[Any, str] | None:
    """(JSON side file ``name`` of the folder ``storage``, its path or URL for errors): a local
    one through :func:`side_file` (a link out refused), a remote one read by name, both bounded
    in size; None when ``absent_ok`` and it is no file there."""
    if isinstance(storage, LocalDirectory):
        path = side_file(storage.root, name)
        if absent_ok and not os.path.isfile(path):
            return None
        return read_json(path), path
    if absent_ok and not _has(storage, name):
        return None
    return _json(storage, name, {name}), storage.join(name)


#: a learning-rate scheduler's state: the Trainer's ``scheduler.pt``, Accelerate's
#: ``scheduler.bin`` / ``scheduler_<i>.bin`` (``save_state``); each steps an optimizer
_SCHEDULER = re.compile(r"scheduler(_[0-9]+)?\.(pt|bin)")
#: an optimizer's state beside it: a file (``optimizer.pt``, ``optimizer_<i>.bin``) or an FSDP
#: sharded folder (``optimizer_0/``)
_OPTIMIZER = re.compile(r"optimizer(_[0-9]+)?(\.(pt|bin))?")


def check_optimizer_beside_scheduler(storage: Storage, weights_only: bool) -> None:
    """A folder holding a scheduler's state but no optimizer's lost it (the Trainer and
    Accelerate's ``save_state`` write both, or neither): refused unless only the weights are
    asked for, so a resume never starts its optimizer from nothing unsaid. Without a
    scheduler, a run's other state (the Trainer's ``rng_state*.pth``, written only with its
    optimizer; Accelerate's ``random_states_*.pkl``, written by every ``save_state``) or a
    name like an optimizer's (``optimizer.bin.bak``) is said: a warning, the weights alone."""
    try:
        names, folder = [] if weights_only else _entries(storage), storage.root
    except OSError:  # a file, or nothing
        return
    if any(_OPTIMIZER.fullmatch(n) for n in names):
        return
    schedulers = sorted(n for n in names if _SCHEDULER.fullmatch(n))
    if schedulers:
        raise SourceError(
            f"{folder}: {schedulers[0]} is here (a training run's state, as the Trainer and "
            f"Accelerate's save_state write it) but no optimizer state (optimizer.pt, "
            f"optimizer.bin, optimizer_<i>.bin or an optimizer_0/ folder): the optimizer's "
            f"file is missing or renamed; pass weights_only=True to take the weights alone"
        )
    signs = [n for n in names if "optimizer" in n.lower() or n.startswith(_RUN_STATE)]
    if signs:
        warnings.warn(
            f"{folder}: {', '.join(sorted(signs)[:4])} here, no optimizer state (optimizer.pt, "
            f"optimizer.bin): a training run's save whose optimizer file is lost or renamed (or "
            f"a run without one); the weights are imported alone",
            stacklevel=2,
        )


_RUN_STATE = ("rng_state", "random_states_")  # the Trainer's / Accelerate's RNG states


def _holds_model(storage: Storage) -> bool:
    return any(_has(storage, n) for n in MODEL_WEIGHTS)


def is_adapter_checkpoint(storage: Storage) -> bool:
    """A peft adapter checkpoint (the Trainer's save of a ``PeftModel``): ``adapter_config.json``
    and no full model's weights beside it, so its weights and optimizer are the adapter's."""
    return _has(storage, ADAPTER_CONFIG_FILE) and not _holds_model(storage)


def adapter_record(storage: Storage) -> dict[str, Any]:
    """The folder ``storage``'s ``adapter_config.json`` as written ({} without one), recorded as
    the manifest's ``source.lora`` so that an export writes the adapter's config back unchanged."""
    if not _has(storage, ADAPTER_CONFIG_FILE):
        return {}
    got = side_json(storage, ADAPTER_CONFIG_FILE)
    return got[0] if got is not None and isinstance(got[0], dict) else {}


def adapter_beside_model(storage: Storage) -> dict[str, str]:
    """{file: why skipped} of the LoRA / peft adapter files in a folder that also holds a full
    model's weights (:data:`MODEL_WEIGHTS`): the full model is imported, the adapter (its own
    parameters, not the model's) is listed, never read. {} for an adapter checkpoint, whose
    adapter is what is imported."""
    if not _holds_model(storage):
        return {}
    return {
        name: "a LoRA / peft adapter beside the full model's weights (the full model imported)"
        for name in (*ADAPTER_WEIGHTS, ADAPTER_CONFIG_FILE)
        if _has(storage, name)
    }


def read_json(path: str) -> Any:
    """A Trainer's JSON file (bounded in size), or refused naming the file."""
    return files.strict_json(files.read_regular(path, MAX_JSON_BYTES), path)


def rng_states(storage: Storage) -> dict[str, str]:
    """{file: why skipped} of the Trainer's torch RNG states (``rng_state*.pth``) in the folder
    ``storage``: source files of their own, which the caller counts as found and lists as
    skipped."""
    return {
        name: "the torch run's RNG state, not imported"
        for name in sorted(_entries(storage))
        if name.startswith("rng_state") and name.endswith(".pth")
    }


def trainer_saved(storage: Storage) -> dict[str, str] | None:
    """:func:`rng_states` of the folder ``storage`` when the Trainer saved it (``optimizer.pt``
    or ``trainer_state.json`` among its entries: :func:`is_trainer_checkpoint`), else None."""
    return rng_states(storage) if is_trainer_checkpoint(storage) else None


def side_file(folder: str, name: str) -> str:
    """The path of the Trainer's side file ``name`` in ``folder`` (``trainer_state.json``,
    ``training_args.bin``, ``scheduler.pt``, ``config.json``, ...), through
    :func:`jax_ucp._src.format.files.inside`: a link leading out of the checkpoint is refused, never
    read into the new manifest."""
    return files.inside(folder, name, f"{folder}: the Trainer's {name}")


def _arg(value: Any) -> Any:
    """A TrainingArguments field as JSON: str enums (stand-ins) by their value."""
    if isinstance(value, allow_list.StandIn):
        args = getattr(value, "args", ())
        return jsonable(args[0]) if len(args) == 1 else None
    return jsonable(value)


class _TrainingArguments(allow_list.StandIn):
    """``TrainingArguments`` as data; its ``cached_property`` values (``__cached__*``, pickled
    by transformers 4.x) are dropped, not refused: they are not arguments."""

    qualname = "transformers.training_args.TrainingArguments"

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            state = {
                k: v
                for k, v in state.items()
                if not (isinstance(k, str) and k.startswith("__cached__"))
            }
        super().__setstate__(state)


def model_config(storage: Storage) -> dict | None:
    """The :data:`MODEL_FIELDS` of the ``config.json`` of the folder ``storage`` (what a spec by
    name needs to restore the model: its head settings), None without one."""
    config = _json(storage, CONFIG_FILE, _entries(storage))
    if not isinstance(config, dict):
        return None
    return {k: jsonable(config[k]) for k in MODEL_FIELDS if k in config}


def _entries(storage: Storage) -> set[str]:
    """The entries of ``storage`` (a remote prefix's by its one listing)."""
    return {name.split("/", 1)[0] for name in storage.names()}


def _refuse_link_out(storage: Storage, name: str) -> None:
    """A local side file linking out of the checkpoint refused, never recorded as unread."""
    if isinstance(storage, LocalDirectory):
        side_file(storage.root, name)


def _json(storage: Storage, name: str, entries: set[str]) -> Any:
    """JSON file ``name`` of ``storage`` (bounded in size), None when not among ``entries``."""
    raw = storage.read(name, MAX_JSON_BYTES) if name in entries else None
    return None if raw is None else files.strict_json(raw, storage.join(name))


def trainer_record(storage: Storage) -> dict:
    """What the Trainer recorded of its optimizer's schedule: ``training_args`` (the fields of
    :data:`ARG_FIELDS`), ``scheduler`` (``last_epoch``, ``base_lrs``, ``last_lr``) and
    ``global_step`` / ``max_steps``, ``logged_lr`` (:func:`logged_rates`); absent files are
    absent keys; the folder ``storage`` (a remote one read in place)."""
    entries = _entries(storage)
    out: dict[str, Any] = {}
    config = model_config(storage)
    if config is not None:
        out["model_config"] = config
    state = _json(storage, STATE_FILE, entries)
    if isinstance(state, dict):
        out.update({k: jsonable(state[k]) for k in ("global_step", "max_steps") if k in state})
        logged = logged_rates(state.get("log_history"))
        if logged:
            out["logged_lr"] = logged
        runs.say_renamed(
            storage.root,
            rf"checkpoint-({files.DIGITS})",
            out.get("global_step"),
            "folder's name says step {named}, " + STATE_FILE + "'s global_step says {step} "
            "(renamed or copied?); the Trainer's resume counts from global_step {step}",
        )
    if ARGS_FILE in entries:
        _refuse_link_out(storage, ARGS_FILE)
        try:
            classes = {n: allow_list.standin_class(n) for n in ARG_CLASSES}
            classes[_TrainingArguments.qualname] = _TrainingArguments
            args = torch_zip.load_torch_file((storage, ARGS_FILE), classes)
        except allow_list.TorchFileError as e:
            out["training_args_unread"] = str(e)[:300]
        else:
            fields = vars(args) if isinstance(args, allow_list.StandIn) else {}
            out["training_args"] = {k: _arg(fields[k]) for k in ARG_FIELDS if k in fields}
    out.update(scheduler_record(storage, SCHEDULER_FILE, "scheduler"))
    return out


def scheduler_record(storage: Storage, name: str, key: str) -> dict[str, Any]:
    """``{key: {last_epoch, base_lrs, last_lr}}`` of the torch scheduler's state ``name`` in
    the folder ``storage`` (the Trainer's ``scheduler.pt``, Accelerate's ``scheduler.bin``),
    ``{key + "_unread": why}`` when it cannot be read; ``{}`` without the file."""
    if name not in _entries(storage):
        return {}
    _refuse_link_out(storage, name)
    try:
        sched = torch_zip.load_torch_file((storage, name))
    except allow_list.TorchFileError as e:
        return {f"{key}_unread": str(e)[:300]}
    if not isinstance(sched, dict):
        return {}
    keys = {"last_epoch": "last_epoch", "base_lrs": "base_lrs", "_last_lr": "last_lr"}
    return {key: {v: jsonable(sched[k]) for k, v in keys.items() if k in sched}}


#: the last learning rates of ``log_history`` recorded (each a record of the schedule)
MAX_LOGGED = 32


def logged_rates(history: Any) -> list[list]:
    """``[step, learning_rate]`` of the last :data:`MAX_LOGGED` entries of ``log_history`` that
    log one: what the schedule gave, checked against the recorded schedule by the continuation."""
    if not isinstance(history, list):
        return []
    rates = [
        [entry["step"], entry["learning_rate"]]
        for entry in history
        if isinstance(entry, dict)
        and type(entry.get("step")) is int
        and type(entry.get("learning_rate")) in (int, float)
        and math.isfinite(entry["learning_rate"])
    ]
    return rates[-MAX_LOGGED:]


def trainer_folder_above(
    tag_dir: Storage, opened: Storage, marker: str = STATE_FILE
) -> Storage | None:
    """The Trainer's ``checkpoint-N/`` holding ``tag_dir`` (DeepSpeed's ``global_stepN/``, FSDP's
    ``pytorch_model_fsdp_0/``): its parent when the Trainer saved there (``trainer_state.json``;
    another ``marker``: a DeepSpeed ``save_dir``'s ``latest``), else None. Only that one folder
    is looked at, never further up: ``opened`` (the folder read, a remote one listed once) when
    ``tag_dir`` is its entry, else a local folder's parent folder."""
    if tag_dir is not opened and tag_dir.root == opened.join(os.path.basename(tag_dir.root)):
        parent: Storage = opened
    elif isinstance(tag_dir, LocalDirectory):  # opened at the tag folder or below it
        parent = LocalDirectory(os.path.dirname(os.path.abspath(tag_dir.root)))
    else:  # a remote prefix above the one given is never read
        return None
    with contextlib.suppress(OSError):
        return parent if marker in _entries(parent) else None


def trainer_run(root: Storage) -> runs.TrainerRun | None:
    """A Trainer's ``output_dir``: its ``checkpoint-N`` folders. The Trainer writes
    ``trainer_state.json`` last in a checkpoint (after the weights, optimizer, scheduler and RNG
    states), so a folder without it is a save that did not complete."""

    def complete(step: Storage) -> str | None:
        if STATE_FILE in _entries(step):
            return None
        return (
            f"{step.root}: no {STATE_FILE} (the Trainer writes it last): its save did not complete"
        )

    found = runs.step_folders(root, rf"checkpoint-({files.DIGITS})")
    return runs.trainer_run(root, "a Hugging Face Trainer output directory", found, complete)
