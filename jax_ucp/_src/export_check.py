"""``verify(EXPORTED, against=CKPT)``: is an export the checkpoint it was written from? The
exported folder (safetensors, DeepSpeed universal, megatron-core torch_dist, torch DCP) is read
by the import of its format, planned as ``convert`` would (its readers' checks run: zip CRC-32s,
DCP chunk coverage), and every tensor it holds (weights, fp32 masters, Adam's moments, the step)
is compared with the checkpoint's tensor of the same role and name, read through the spec the
export ran backwards (``spec=``), bit for bit; the step by value. An exported tensor the
checkpoint has no counterpart of is a problem; the checkpoint's parameters and moments the
export left out are listed. Rows an export added (megatron's vocab padding) must be zeros; a
tied weight it wrote (its files say so: a DCP entry shared) is its parameter's."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jax_ucp._src import logits, store, writer
from jax_ucp._src.errors import RequestError
from jax_ucp._src.exporters import by_spec
from jax_ucp._src.format import keypath
from jax_ucp._src.importers import registry
from jax_ucp._src.importers.trainer_files import MODEL_FIELDS
from jax_ucp._src.restoring import locate
from jax_ucp._src.restoring.inspecting import inspect
from jax_ucp._src.restoring.model import Request
from jax_ucp._src.restoring.sources import ucp_source
from jax_ucp._src.store.storage import Storage


@dataclasses.dataclass
class ExportComparison:
    """What ``compare_export`` found, by the export's tensor names (as its import keys them)."""

    format: str = ""
    equal: list[str] = dataclasses.field(default_factory=list)
    different: dict[str, str] = dataclasses.field(default_factory=dict)
    #: the checkpoint's parameters and moments the export holds no copy of
    not_exported: list[str] = dataclasses.field(default_factory=list)


def _canonical(key: tuple[str, ...], entry: Any) -> tuple[str, ...] | None:
    """``key`` as an import of an export keys it: ``params/<name>``, ``model_params/<name>``,
    ``opt_state/{mu,nu}/<name>``, ``opt_state/count``; None for other leaves."""
    if entry.role == "param" and not entry.tied_to:
        return ("model_params" if entry.sub_role == "model" else "params", *key[1:])
    if entry.role == "opt_state" and entry.sub_role in ("mu", "nu"):
        return ("opt_state", entry.sub_role, *key[key.index(entry.sub_role) + 1 :])
    if entry.role == "opt_state" and entry.sub_role == "count":
        return ("opt_state", "count")
    return None


@dataclasses.dataclass
class _Export:
    """An export as its format's import reads it, planned once for the tensors and the
    logits."""

    path: str
    format: str
    model_names: bool  # the import reads a torch model's names (its experts fused)
    items: list
    config: dict | None  # its config.json, read through its Storage (None: it holds none)
    where: str


def _read_export(storage: Storage) -> _Export:
    """The export at ``storage`` planned by its format's import, and its ``config.json``."""
    importer = registry.importer_for(storage)
    where = storage.join("config.json")
    raw = storage.read("config.json", logits.MAX_CONFIG_BYTES)
    config = None if raw is None else logits.config_object(raw, where)
    items = list(registry.plan_import(storage, format=importer).items)
    return _Export(storage.root, importer.format, importer.model_names, items, config, where)


def verify_export(
    exported: Storage, ckpt: str, spec: Any, progress, with_logits: bool, tolerance: float | None
) -> tuple[ExportComparison, Any]:
    """Each tensor of the export at ``exported`` against the checkpoint ``ckpt`` it was written
    from (see the module; ``spec``: the spec the export was written by, None: the names as
    saved) and, ``with_logits``, its model's logits against the checkpoint's
    (:func:`_export_logits`; else None)."""
    export = _read_export(exported)
    found = locate.read_consistently(ckpt, lambda c: _compare(export, c.root, ckpt, spec, progress))
    return found, _export_logits(export, ckpt, spec, tolerance) if with_logits else None


def _compare(export: _Export, root: str, ckpt: str, spec: Any, progress) -> ExportComparison:
    """The comparison of the checkpoint found at ``root``."""
    manifest = store.read_manifest(root)
    # a safetensors export's config.json: the heads; a torch DCP export holds the names
    # transformers' model has (its experts fused)
    config = export.config if spec else None
    spec = by_spec.load(spec, manifest, config, state_dict=export.model_names)
    available = ucp_source.available_tensors(manifest, spec)
    ours: dict[tuple, tuple] = {}
    for key, found in available.items():
        canonical = _canonical(tuple(key), found.sources[0])
        if canonical is not None:
            ours.setdefault(canonical, tuple(key))
    result = ExportComparison(format=export.format)
    seen = set()
    items = export.items
    for done, item in enumerate(items, 1):
        name = keypath.key_to_str(item.key)
        key = ours.get(tuple(item.key)) or (
            tuple(item.key) if tuple(item.key) in available else None
        )
        if key is None and item.tied_to:  # a tied weight the export wrote: its parameter's
            key = ours.get(("params", item.tied_to.removeprefix("params/")))
        if key is None:
            result.different[name] = f"exported, but {ckpt} holds no tensor of this name and role"
        else:
            seen.add(key)
            got = _value(item.value, name)
            (want,) = ucp_source.read(root, manifest, [Request(key)], available=available)
            why = _differs(got, np.asarray(want), tuple(item.key) == ("opt_state", "count"))
            if why:
                result.different[name] = f"{why} (the checkpoint's {keypath.key_to_str(key)})"
            else:
                result.equal.append(name)
        if progress is not None:
            progress(name, done, len(items))
    result.not_exported = [
        keypath.key_to_str(k)
        for c, k in ours.items()
        if k not in seen and c[0] in ("params", "opt_state") and c[-1] != "count"
    ]
    if not items:
        raise RequestError(f"{export.path}: its import holds no tensor to compare")
    return result


def _value(value: Any, name: str) -> np.ndarray:
    """An item's value, built if the import deferred it."""
    return np.asarray(value.build(name) if isinstance(value, writer.Deferred) else value)


def _export_logits(export: _Export, ckpt: str, spec: Any, tolerance: float | None) -> Any:
    """The logits of the export's model weights, read by its format's import, against the
    checkpoint's (``logits.compare_export_logits``); the model's settings are the export's
    ``config.json``, else the one the checkpoint recorded, else refused: an export that carries
    none (a torch DCP) says nothing of its model. The checkpoint's logits take the fields it
    recorded itself, so an export whose config.json says otherwise (another ``rms_norm_eps``)
    differs."""
    items = [
        it
        for it in export.items
        if len(it.key) == 2 and it.key[0] in ("params", "model_params") and not it.tied_to
    ]
    tree = "model_params" if any(it.key[0] == "model_params" for it in items) else "params"
    config, where = export.config, export.where
    recorded = by_spec.recorded_config(inspect(ckpt).source)
    if config is not None:
        config = logits.checked_config(config, where)
        if recorded and set(recorded) <= set(MODEL_FIELDS):  # a Trainer's record of some fields
            recorded = {**config, **recorded}
    else:
        config, where = recorded, f"{ckpt}'s recorded config"
        if config is None:
            raise RequestError(
                f"--logits needs the model's settings (a config.json): {export.path} (a "
                f"{export.format} export) holds none and {ckpt} records none (a "
                f"SafetensorsExport with config= writes one); compare the tensors alone"
            )

    def weights() -> dict[str, Any]:
        return {it.key[1]: _value(it.value, it.key[1]) for it in items if it.key[0] == tree}

    return logits.compare_export_logits(
        ckpt,
        config,
        where,
        weights,
        tree,
        spec=spec,
        tolerance=tolerance,
        source=f"the export {export.path} read by its {export.format} import",
        recorded=recorded,
    )


def _differs(got: np.ndarray, want: np.ndarray, count: bool) -> str:
    """Why the exported ``got`` is not the checkpoint's ``want`` ("" when it is)."""
    if count:
        return "" if got.size == 1 and float(got) == float(want) else f"step {got}, not {want}"
    if got.dtype != want.dtype:
        try:
            cast = want.astype(got.dtype)
        except (TypeError, ValueError):
            return f"{got.dtype}, the checkpoint's {want.dtype}"
        if not np.array_equal(cast.astype(want.dtype), want, equal_nan=True):
            return f"{got.dtype}, the checkpoint's {want.dtype} (not exactly representable)"
        want = cast
    if got.ndim and got.shape[1:] == want.shape[1:] and got.shape[0] > want.shape[0]:
        extra = got[want.shape[0] :]
        if np.any(extra.view(np.uint8) if extra.dtype.itemsize else extra):
            return f"rows {want.shape[0]}: onward are not zero padding"
        got = got[: want.shape[0]]
    if got.shape != want.shape:
        return f"shape {list(got.shape)}, the checkpoint's {list(want.shape)}"
    bits = np.dtype(f"u{got.dtype.itemsize}") if got.dtype.itemsize in (1, 2, 4, 8) else None
    a, b = (got.view(bits), want.view(bits)) if bits is not None else (got, want)
    diff = int(np.count_nonzero(a != b))
    return f"{diff} of {got.size} elements differ" if diff else ""
