"""Export a UCP checkpoint as a torch distributed checkpoint
(:func:`~jax_ucp._src.torchfiles.dcp.write_dcp`): the tensors under ``select``, or (``optimizer``)
a torch model's weights and its Adam state under the names ``get_state_dict`` gives them with
``flatten_optimizer_state_dict=True`` (FSDP2's and torchtitan's layout)::

    <model>.<name>                                   the weights (fp32 masters where saved)
    <optimizer>.state.<name>.exp_avg / exp_avg_sq    float32, Adam's moments
    <optimizer>.state.<name>.step                    a 0-d float32 tensor, the optimizer step
    <optimizer>.param_groups.<name>.<hyper-parameter>  the group of <name>'s values"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jax_ucp._src import format as fmt
from jax_ucp._src import store
from jax_ucp._src.errors import RequestError
from jax_ucp._src.exporters import by_spec, source
from jax_ucp._src.exporters.options import Exported, TorchDcpExport
from jax_ucp._src.format.manifest import torch_optimizer_record
from jax_ucp._src.restoring import locate
from jax_ucp._src.restoring.model import Request, check_cast
from jax_ucp._src.restoring.sources import ucp_source
from jax_ucp._src.torchfiles.dcp import DATA_FILE, METADATA_FILE, DcpItem, write_dcp
from jax_ucp._src.torchfiles.dtypes import torch_dtype


def export(root: str, dst: str, options: TorchDcpExport) -> Exported:
    """The tensors and values under ``select`` (or a model and its optimizer) as a single-file
    DCP checkpoint.

    Args:
        root: the UCP checkpoint directory (a manager step already resolved).
        dst: the directory to create.
        options: this format's options (``engine.export`` checked them)."""
    if options.optimizer is not None:
        return _with_optimizer(root, dst, options)
    chosen = source.select(root, options, torch_dtype, with_values=True)
    items = [DcpItem(t.name, p, t.shape, t.dtype) for t, p in zip(chosen.tensors, chosen.paths)]
    items += [DcpItem(name, path, value=v) for name, path, v in chosen.values]

    def write(tmp: str) -> list[str]:
        write_dcp(tmp, items, chosen.arrays, chosen.save_id, source.pieces)
        return [METADATA_FILE, DATA_FILE]

    return chosen.exported(dst, source.write_atomically(dst, write, options.force))


def _with_optimizer(root: str, dst: str, options: TorchDcpExport) -> Exported:
    """The weights, Adam's moments and step, and the param groups, by manifest role."""
    manifest = store.read_manifest(root)
    spec = by_spec.load(options.spec, manifest, None)  # the names the torch model has
    available = ucp_source.available_tensors(manifest, spec)
    by_key = {k: a.sources[0] for k, a in available.items()}
    found, count = source.required_adam_keys(root, by_key, "a torch DCP export of the optimizer")
    params, moments = found.params, found.moments
    names = {p: ".".join(rel) for p, rel in params.items()}
    (step,) = ucp_source.read(root, manifest, [Request(count)], available=available)
    groups = _groups(options, manifest.source, list(names.values()), root)
    reads = source.Source(root, manifest, available, options.casting, options.progress)
    opt, model = options.optimizer or "", options.model
    items: list[DcpItem] = []
    arrays: list[Any] = []

    def add(path: tuple[str, ...], key: tuple, dtype: Any) -> None:
        fqn = ".".join(path)
        check_cast(fqn, available[key].dtype, dtype, options.casting)
        torch_dtype(fqn, dtype)
        items.append(DcpItem(fqn, path, tuple(available[key].shape), np.dtype(dtype)))
        arrays.append(reads.tensor(key, dtype, fqn))

    for p, name in names.items():
        add((model, name) if model else (name,), p, options.dtype or available[p].dtype)
    step_value = np.asarray(float(step), np.float32)  # torch's Adam keeps it so
    for p, name in names.items():
        for state, moment in (("exp_avg", "mu"), ("exp_avg_sq", "nu")):
            add((opt, f"state.{name}.{state}"), moments[(p, moment)], np.dtype(np.float32))
        items.append(
            DcpItem(f"{opt}.state.{name}.step", (opt, f"state.{name}.step"), (), step_value.dtype)
        )
        arrays.append(step_value)
    for name in names.values():
        for key, value in groups[name].items():
            path = (opt, f"param_groups.{name}.{key}")
            items.append(DcpItem(".".join(path), path, value=value))
    reads.total = len(arrays) - len(names)

    def write(tmp: str) -> list[str]:
        write_dcp(tmp, items, arrays, str(manifest.save_id), source.pieces)
        return [METADATA_FILE, DATA_FILE]

    files = source.write_atomically(dst, write, options.force)
    tensors = [it for it in items if it.shape is not None]
    written = {*params, *moments.values(), count}
    return Exported(
        path=dst,
        files=files,
        tensors=len(tensors),
        bytes=sum(int(np.prod(t.shape or ())) * np.dtype(t.dtype).itemsize for t in tensors),
        skipped=[fmt.key_to_str(k) for k in by_key if k not in written]
        + [fmt.key_to_str(v.key) for v in manifest.values],
    )


def _groups(options: TorchDcpExport, recorded: Any, names: list[str], root: str) -> dict:
    """{parameter name: its group's hyper-parameters}: ``options.param_groups`` (a list: the
    groups; a mapping: set on every recorded group), the ``run_record``'s or this checkpoint's
    recorded ones; every parameter in exactly one group, no other name."""
    given = options.param_groups
    groups: Any = given if isinstance(given, list) else None
    if groups is None:
        if options.run_record is not None:
            read = locate.read_consistently(
                options.run_record, lambda c: store.read_manifest(c.root)
            )
            recorded = read.source
        groups = torch_optimizer_record(recorded or {}).get("param_groups")
        if not groups and isinstance(given, Mapping):
            groups = [{**given, "params": names}]
        if not isinstance(groups, list) or not groups:
            raise RequestError(
                f"{root}: a torch DCP export of the optimizer needs its param groups: the "
                f"checkpoint records none (a continued run: give run_record= the checkpoint "
                f"imported from torch), or give param_groups= the optimizer's hyper-parameters"
            )
        groups = [{**g, **given} if isinstance(given, Mapping) else g for g in groups]
    out: dict[str, dict] = {}
    for i, group in enumerate(groups):
        members = group.get("params") if isinstance(group, Mapping) else None
        if not isinstance(members, list):
            raise RequestError(f"param_groups[{i}]: no list of parameter names under 'params'")
        hyper = source.plain({k: v for k, v in group.items() if k != "params"})
        for name in members:
            if name in out or name not in names:
                why = "is in two groups" if name in out else "is no parameter of the export"
                raise RequestError(f"param_groups[{i}]: {name!r} {why} (e.g. {names[:3]})")
            out[name] = hyper
    missing = [n for n in names if n not in out]
    if missing:
        raise RequestError(f"param_groups: parameters {missing[:5]} are in no group")
    return out
