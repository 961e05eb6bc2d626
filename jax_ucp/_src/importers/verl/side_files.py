"""The files verl saves beside the model's rank files: ``fsdp_config.json`` (its FSDP version,
its world size checked), ``huggingface/config.json``, the extra state (the scheduler's record;
RNG states), and what is not imported, each a unit in ``source.skipped`` (``data.pt``, the
other model folder, ``huggingface/`` weights)."""

from __future__ import annotations

import warnings
from typing import Any

from jax_ucp._src.errors import RequestError, SourceError
from jax_ucp._src.format import files
from jax_ucp._src.importers.plan import jsonable, skip
from jax_ucp._src.importers.verl import layout
from jax_ucp._src.store.storage import Storage
from jax_ucp._src.torchfiles import allow_list, torch_zip

__all__ = [
    "extra_state",
    "fsdp_config",
    "hf_config",
    "scheduler_against_optimizer",
    "units_beside",
]

MAX_CONFIG_BYTES = 1 << 20

# numpy's pickled RNG state (``np.random.get_state()`` in the extra state) as inert stand-ins
_EXTRA_CLASSES = allow_list.NUMPY_CLASSES


def extra_state(folder: Storage, names: list[str], source: dict, found: list[str]) -> None:
    """The scheduler's record from the ranks' extra state (every rank's, which must agree);
    every extra-state file (the RNG states) is a unit left out.

    Args:
        folder: the folder of the rank files.
        names: the extra-state files' names, by rank.
        source: the manifest's source record, added to.
        found: every source tensor's (or unit's) name, added to.
    """
    if not names:
        return
    found += names
    why = "verl's extra state (RNG states, lr scheduler), not imported; the scheduler's record"
    skip(source, names, why + " is in source.lr_scheduler")
    records: list[tuple[str, dict | None]] = []  # every rank's: one run steps them alike
    for name in names:
        try:
            extra = torch_zip.load_torch_file((folder, name), _EXTRA_CLASSES)
        except (allow_list.TorchFileError, files.UnsafeFileError) as e:
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
                f"{folder.root}: the ranks' lr schedulers disagree on {', '.join(differ)}: "
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


def scheduler_against_optimizer(folder: str, source: dict, step: int | None) -> None:
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


def units_beside(where: layout.Located, source: dict, found: list[str]) -> None:
    """Files verl saves beside the model that are not imported, each a unit in
    ``source.skipped``: the data loader's ``data.pt``, the other model folder (``critic/``),
    weights under ``huggingface/`` (a full copy of the same model).

    Args:
        where: where the checkpoint's folders are (``layout.locate``).
        source: the manifest's source record, added to.
        found: every source tensor's (or unit's) name, added to.
    """
    model_dir = where.model_dir
    if "huggingface" in layout.entries(model_dir):
        for name in layout.entries(model_dir.folder("huggingface")):
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
    beside = layout.entries(where.step_dir)
    if "data.pt" in beside:
        found.append("../data.pt")
        skip(source, ["../data.pt"], "verl's data loader state, not imported")
    for other in layout.MODEL_DIRS:
        path = where.step_dir.join(other)
        if (
            other in beside
            and path != model_dir.root
            and layout.is_model_dir(where.step_dir.folder(other))
        ):
            found.append(f"../{other}/")
            skip(source, [f"../{other}/"], f"verl's {other} model: convert {path} on its own")


def _json(folder: Storage, name: str) -> Any:
    """JSON file ``name`` of ``folder`` (bounded), None without it; refused naming it."""
    path = folder.join(*name.split("/"))
    try:
        raw = folder.read(name, MAX_CONFIG_BYTES)
        return None if raw is None else files.strict_loads(raw)
    except (files.UnsafeFileError, RequestError) as e:  # a link out, a larger one
        raise SourceError(str(e)) from None
    except (ValueError, RecursionError) as e:
        raise SourceError(f"{path}: not readable JSON ({str(e)[:200]})") from None


def fsdp_config(folder: Storage, world: int) -> int | None:
    """``FSDP_version`` from ``fsdp_config.json``, its ``world_size`` checked against the rank
    files' (None without the file)."""
    path = folder.join("fsdp_config.json")
    data = (
        _json(folder, "fsdp_config.json") if "fsdp_config.json" in layout.entries(folder) else None
    )
    if data is None:
        return None
    if not isinstance(data, dict):
        raise SourceError(f"{path}: expected a JSON object")
    if data.get("world_size") not in (None, world):
        raise SourceError(
            f"{path}: world_size {data.get('world_size')!r}, the rank files are of {world}"
        )
    version = data.get("FSDP_version")
    return version if isinstance(version, int) and not isinstance(version, bool) else None


def hf_config(folder: Storage) -> dict | None:
    """``huggingface/config.json`` of the model folder (None without it), refused when it is
    not a JSON object (NaN and infinities included: the manifest records it) or when it or
    ``huggingface/`` leads out of the model folder (a link): another model's config would set
    the import's settings."""
    if "huggingface" not in layout.entries(folder):
        return None
    data = _json(folder, "huggingface/config.json")
    if data is not None and not isinstance(data, dict):
        path = folder.join("huggingface", "config.json")
        raise SourceError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data
