"""An OLMo-core trainer checkpoint ``stepN/``: ``model_and_optim/`` (torch DCP, the model and
optimizer) beside ``train/`` (the trainer's state, ``train/rank<R>.pt`` per rank, a
``torch.save`` of ``Trainer.state_dict()``: ``global_step``, the data loader's position, the RNG
states, the callbacks' states) and ``.metadata.json`` (OLMo-core's version). A step folder
holding ``model_and_optim/`` alone (its ``train/`` not kept) is read the same way, its step
recorded as not recovered.

The weights and the optimizer are the torch DCP importer's, read from ``model_and_optim/``;
the trainer's ``global_step`` is read from ``train/rank0.pt`` (the file OLMo-core itself falls
back to) through the allow-listed unpickler, numpy's pickled RNG state as inert stand-ins.
Nothing else of the trainer state is imported: each ``train/`` file is listed in
``source.skipped`` as a unit, and a step that cannot be read is recorded as not recovered
(``source.trainer.global_step_unread``, with why), never guessed.
"""

from __future__ import annotations

import re
from typing import Any

from jax_ucp._src.format import files
from jax_ucp._src.importers.plan import Detection
from jax_ucp._src.store.storage import Storage
from jax_ucp._src.torchfiles import allow_list, torch_zip

__all__ = ["MODEL_DIR", "TRAIN_DIR", "detect", "is_step_folder", "train_record"]

MODEL_DIR = "model_and_optim"
TRAIN_DIR = "train"
VERSION_FILE = ".metadata.json"
MAX_JSON_BYTES = 1 << 20
_RANK_FILE = re.compile(r"rank([0-9]+)\.pt")

#: Classes an OLMo-core trainer state may reference beyond torch's, as inert stand-ins
#: (numpy's arrays and scalars: np.random.get_state() in the RNG states).
TRAIN_CLASSES: dict[str, Any] = dict(allow_list.NUMPY_CLASSES)


def is_step_folder(storage: Storage) -> bool:
    """An OLMo-core ``Checkpointer`` folder: no ``.metadata`` of its own and a torch DCP
    ``model_and_optim/.metadata`` (OLMo-core's name), with ``train/`` beside it or not (a step
    folder copied without its trainer state is still OLMo-core's layout)."""
    try:
        names = storage.names()  # a remote prefix's: model_and_optim/.metadata among them
        inside = MODEL_DIR in names and storage.folder(MODEL_DIR).exists(".metadata")
    except files.UnsafeFileError:  # linked out of the checkpoint: its plan refuses it
        return True
    except OSError:  # a file, or nothing
        return False
    return ".metadata" not in names and (inside or f"{MODEL_DIR}/.metadata" in names)


def detect(storage: Storage) -> Detection:
    """Whether ``src`` is an OLMo-core step folder, from names (its ``model_and_optim/`` is
    torch DCP, planned by the DCP importer, which reads ``train/`` too)."""
    if is_step_folder(storage):
        return Detection(True, "an OLMo-core step folder (model_and_optim/ torch DCP, train/)")
    return Detection(False, "no OLMo-core `model_and_optim/` + `train/`")


def rank_files(storage: Storage) -> list[str] | None:
    """``train/rank<R>.pt`` of ``storage``, by rank (names relative to it); None: no ``train/``."""
    try:
        listed = (train := storage.folder(TRAIN_DIR)).names()
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not listed and not any(n.partition("/")[0] == TRAIN_DIR for n in storage.names()):
        return None  # a remote prefix: no object under train/
    found = [(int(m.group(1)), n) for n in listed if (m := _RANK_FILE.fullmatch(n))]
    return [f"{TRAIN_DIR}/{n}" for n in files.numbered_names(found, train.root, "rank").values()]


def train_record(storage: Storage) -> tuple[dict[str, Any], dict[str, str]]:
    """What the trainer recorded, and its files as skipped units (``name -> why``).

    The record: ``framework`` "olmo_core", ``train_files``, ``global_step`` (and ``max_steps``,
    ``world_size`` when recorded) from ``train/rank0.pt``, or ``global_step_unread`` saying why
    there is no step; ``olmo_core_version`` from ``.metadata.json`` when it names one.
    """
    names = rank_files(storage)
    record: dict[str, Any] = {"framework": "olmo_core", "train_files": names or []}
    first = f"{TRAIN_DIR}/rank0.pt"
    if names is None:  # model_and_optim/ kept alone
        found = "is not a folder" if storage.exists(TRAIN_DIR) else "is missing"
        record["global_step_unread"] = (
            f"{TRAIN_DIR}/ {found} (OLMo-core's trainer state was not kept beside {MODEL_DIR}/)"
        )
    elif first not in names:
        record["global_step_unread"] = (
            f"no {first} (found {', '.join(names) or 'no rank file'} in {TRAIN_DIR}/)"
        )
    elif storage.exists(first):  # (listed) a link out of the checkpoint refused, not recorded
        try:
            state = torch_zip.load_torch_file((storage, first), TRAIN_CLASSES)
        except (allow_list.TorchFileError, files.UnsafeFileError) as e:
            record["global_step_unread"] = f"{first} was not read ({str(e)[:300]})"
        else:
            _steps(state, first, record)
    if (version := _version(storage)) is not None:
        record["olmo_core_version"] = version
    why = (
        "OLMo-core's trainer state (data loader position, RNG states, callbacks), not imported; "
        "its global_step is recorded in source.trainer"
    )
    return record, dict.fromkeys(names or [], why)


def _steps(state: Any, name: str, record: dict[str, Any]) -> None:
    """``global_step`` (a non-negative int) and the counts beside it into ``record``."""
    if not isinstance(state, dict):
        record["global_step_unread"] = (
            f"{name} holds a {type(state).__name__}, expected the trainer's state dict"
        )
        return
    step = state.get("global_step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        found = "no 'global_step'" if "global_step" not in state else f"global_step {step!r}"
        keys = ", ".join(sorted(str(k) for k in state)[:12])
        record["global_step_unread"] = (
            f"{name} holds {found}, expected a non-negative integer (keys: {keys or 'none'})"
        )
    else:
        record["global_step"] = step
    for key in ("max_steps", "world_size", "global_train_tokens_seen"):
        if isinstance(value := state.get(key), int) and not isinstance(value, bool):
            record[key] = value


def _version(storage: Storage) -> str | None:
    """OLMo-core's version from ``.metadata.json``, None if absent or unreadable (a record)."""
    if not storage.exists(VERSION_FILE):  # a link out of the checkpoint refused (``inside``)
        return None
    try:
        data = files.strict_loads(storage.read(VERSION_FILE, MAX_JSON_BYTES) or b"")
    except (ValueError, RecursionError, files.UnsafeFileError):
        return None
    version = data.get("version") if isinstance(data, dict) else None
    return version if isinstance(version, str) else None
