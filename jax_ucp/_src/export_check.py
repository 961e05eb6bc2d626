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
import os
from typing import Any

import numpy as np

from jax_ucp._src import logits, store, writer
from jax_ucp._src.errors import RequestError
from jax_ucp._src.exporters import by_spec
from jax_ucp._src.format import keypath
from jax_ucp._src.importers import registry
from jax_ucp._src.restoring import locate
from jax_ucp._src.restoring.inspecting import inspect
from jax_ucp._src.restoring.model import Request
from jax_ucp._src.restoring.sources import ucp_source


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


def compare_export(exported: str, ckpt: str, spec: Any = None, progress=None) -> ExportComparison:
    """Each tensor of the export at ``exported`` against the checkpoint ``ckpt`` it was written
    from (see the module); ``spec``: the spec the export was written by (None: the names as
    saved)."""
    return locate.read_consistently(
        ckpt, lambda found: _compare(exported, found.root, ckpt, spec, progress)
    )


def _compare(exported: str, root: str, ckpt: str, spec: Any, progress) -> ExportComparison:
    """``compare_export`` of the checkpoint found at ``root``."""
    manifest = store.read_manifest(root)
    importer = registry.importer_for(exported)
    config = os.path.join(exported, "config.json")  # a safetensors export's: the heads
    config = config if spec and os.path.isfile(config) else None
    # a torch DCP export holds the names transformers' model has (its experts fused)
    spec = by_spec.load(spec, manifest, config, state_dict=importer.model_names)
    available = ucp_source.available_tensors(manifest, spec)
    ours: dict[tuple, tuple] = {}
    for key, found in available.items():
        canonical = _canonical(tuple(key), found.sources[0])
        if canonical is not None:
            ours.setdefault(canonical, tuple(key))
    plan = registry.plan_import(exported, format=importer)
    result = ExportComparison(format=importer.format)
    seen = set()
    items = list(plan.items)
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
            value = item.value
            got = np.asarray(value.build(name) if isinstance(value, writer.Deferred) else value)
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
        raise RequestError(f"{exported}: its import holds no tensor to compare")
    return result


def export_logits(exported: str, ckpt: str, spec: Any, tolerance: float | None) -> Any:
    """``verify(EXPORTED, against=CKPT, logits=True)``: the logits of the export's model weights,
    read by its format's import, against the checkpoint's (``logits.compare_export_logits``); the
    model's settings are the export's ``config.json``, else the one the checkpoint recorded,
    else refused: an export that carries none (a torch DCP) says nothing of its model."""
    importer = registry.importer_for(exported)
    items = [
        it
        for it in registry.plan_import(exported, format=importer).items
        if len(it.key) == 2 and it.key[0] in ("params", "model_params") and not it.tied_to
    ]
    tree = "model_params" if any(it.key[0] == "model_params" for it in items) else "params"
    where = os.path.join(exported, "config.json")
    if os.path.isfile(where):
        config = logits.read_config(exported)
    else:
        config, where = by_spec.recorded_config(inspect(ckpt).source), f"{ckpt}'s recorded config"
        if config is None:
            raise RequestError(
                f"--logits needs the model's settings (a config.json): {exported} (a "
                f"{importer.format} export) holds none and {ckpt} records none (a "
                f"SafetensorsExport with config= writes one); compare the tensors alone"
            )

    def weights() -> dict[str, Any]:
        def read(value: Any, name: str) -> Any:
            return value.build(name) if isinstance(value, writer.Deferred) else value

        return {it.key[1]: read(it.value, it.key[1]) for it in items if it.key[0] == tree}

    return logits.compare_export_logits(
        ckpt,
        config,
        where,
        weights,
        tree,
        spec=spec,
        tolerance=tolerance,
        source=f"the export {exported} read by its {importer.format} import",
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
