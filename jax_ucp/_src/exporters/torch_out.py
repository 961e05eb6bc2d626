"""Export a UCP checkpoint as a torch distributed checkpoint
(:func:`~jax_ucp._src.torchfiles.dcp.write_dcp`): the tensors under ``select``, or (``optimizer``)
a torch model's weights and its Adam state under the names ``get_state_dict`` gives them with
``flatten_optimizer_state_dict=True`` (FSDP2's and torchtitan's layout; False: torch's nested
``state.<name>.<state>`` and ``param_groups.<i>.<hyper-parameter>``, ``params`` the names)::

    <model>.<name>                                   the weights (fp32 masters where saved)
    <optimizer>.state.<name>.exp_avg / exp_avg_sq    float32, Adam's moments
    <optimizer>.state.<name>.step                    a 0-d float32 tensor, the optimizer step
    <optimizer>.param_groups.<name>.<hyper-parameter>  the group of <name>'s values"""

from __future__ import annotations

import re
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

#: a transformers model's per-expert weight (``...experts.3.w1.weight``), as its files name it
_PER_EXPERT = re.compile(r"\.experts\.[0-9]+\.")


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
    _check_experts([t.name for t in chosen.tensors], chosen.spec, root)
    items = [DcpItem(t.name, p, t.shape, t.dtype) for t, p in zip(chosen.tensors, chosen.paths)]
    items += [DcpItem(name, path, value=v) for name, path, v in chosen.values]

    def write(tmp: str) -> list[str]:
        write_dcp(tmp, items, chosen.arrays, chosen.save_id, source.pieces)
        return [METADATA_FILE, DATA_FILE]

    return chosen.exported(dst, source.write_atomically(dst, write, options.force))


def _with_optimizer(root: str, dst: str, options: TorchDcpExport) -> Exported:
    """The weights, Adam's moments and step, and the param groups, by manifest role."""
    manifest = store.read_manifest(root)
    spec = by_spec.load(options.spec, manifest, None, state_dict=True)  # the torch model's names
    available = ucp_source.available_tensors(manifest, spec)
    by_key = {k: a.sources[0] for k, a in available.items()}
    # every parameter's weight (frozen and tied ones too: get_state_dict has them), state for
    # the trained ones
    weights = {
        k: ".".join(k[1:]) for k, e in by_key.items() if e.role == "param" and e.sub_role is None
    }
    _check_experts(weights.values(), spec, root)
    found, count = source.required_adam_keys(root, by_key, "a torch DCP export of the optimizer")
    moments = found.moments
    names = {p: weights[p] for p in found.params}
    (step,) = ucp_source.read(root, manifest, [Request(count)], available=available)
    recorded = _record(options, manifest.source)
    groups = _groups(options, recorded, names, weights, root)
    tied = _tied(options.tied, recorded, weights, root)
    reads = source.Source(root, manifest, available, options.casting, options.progress)
    opt, model = options.optimizer or "", options.model
    items: list[DcpItem] = []
    arrays: list[Any] = []

    def add(path: tuple, key: tuple, dtype: Any, same_as: str | None = None) -> None:
        fqn = ".".join(map(str, path))
        check_cast(fqn, available[key].dtype, dtype, options.casting)
        torch_dtype(fqn, dtype)
        shape = tuple(available[key].shape)
        items.append(DcpItem(fqn, path, shape, np.dtype(dtype), same_as=same_as))
        if same_as is None:
            arrays.append(reads.tensor(key, dtype, fqn))

    def keyed(name: str) -> tuple:
        return (model, name) if model else (name,)

    for p, name in weights.items():
        add(keyed(name), p, options.dtype or available[p].dtype)
    for p, name in tied:  # the parameter's bytes: the tie is in the files
        add(keyed(name), p, options.dtype or available[p].dtype, ".".join(keyed(weights[p])))
    flat = options.flatten_optimizer_state_dict
    step_value = np.asarray(float(step), np.float32)  # torch's Adam keeps it so
    for p, name in names.items():
        for state, moment in (("exp_avg", "mu"), ("exp_avg_sq", "nu"), ("step", None)):
            path = (opt, f"state.{name}.{state}") if flat else (opt, "state", name, state)
            if moment:
                add(path, moments[(p, moment)], np.dtype(np.float32))
            else:
                items.append(DcpItem(".".join(path), path, (), step_value.dtype))
                arrays.append(step_value)
    for i, (hyper, members) in enumerate(groups):
        values = [*hyper.items()] if flat else [*hyper.items(), ("params", members)]
        for key, value in values:
            for at in members if flat else [i]:
                path = (opt, f"param_groups.{at}.{key}") if flat else (opt, "param_groups", i, key)
                items.append(DcpItem(".".join(map(str, path)), path, value=value))
    reads.total = len(arrays) - len(names)

    def write(tmp: str) -> list[str]:
        write_dcp(tmp, items, arrays, str(manifest.save_id), source.pieces)
        return [METADATA_FILE, DATA_FILE]

    files = source.write_atomically(dst, write, options.force)
    tensors = [it for it in items if it.shape is not None]
    written = {*weights, *moments.values(), count}
    return Exported(
        path=dst,
        files=files,
        tensors=len(tensors),
        bytes=sum(int(np.prod(t.shape or ())) * np.dtype(t.dtype).itemsize for t in tensors),
        skipped=[fmt.key_to_str(k) for k in by_key if k not in written]
        + [fmt.key_to_str(v.key) for v in manifest.values],
    )


def _check_experts(names: Any, spec: Any, root: str) -> None:
    """A ``RequestError`` when a family ``spec`` writes an MoE model's experts one by one (as
    transformers' files hold them): transformers 5's model, hence its state dict, holds them
    fused, so ``dcp.load`` would find none of them."""
    per_expert = [n for n in names if _PER_EXPERT.search(n)]
    if per_expert and spec is not None and spec.model_types:
        raise RequestError(
            f"{root}: spec {spec.name!r} writes an MoE model's experts one by one "
            f"({per_expert[0]!r}, as transformers' files hold them), but transformers 5 "
            f"holds them fused in the model (mlp.experts.gate_up_proj [E, 2F, H], "
            f"mlp.experts.down_proj [E, H, F]), as its state dict names them; give a spec "
            f"that writes those (the shipped hf_* specs' hf_names = 'state_dict' rules), or "
            f"export SafetensorsExport (from_pretrained fuses them)"
        )


def _record(options: TorchDcpExport, recorded: Any) -> dict:
    """The torch optimizer record written back: the ``run_record``'s or this checkpoint's."""
    if options.run_record is not None:
        read = locate.read_consistently(options.run_record, lambda c: store.read_manifest(c.root))
        recorded = read.source
    return torch_optimizer_record(recorded or {})


def _tied(given: Any, recorded: dict, weights: dict, root: str) -> list[tuple[tuple, str]]:
    """(the parameter's key, the tied name) of each name the torch model's state dict has
    beside its parameters (``tied=``, else the import's record) that the checkpoint lacks."""
    tied = (recorded.get("tied") or {}) if given is None else given
    by_name = {name: k for k, name in weights.items()}
    out = []
    for alias, name in tied.items():
        if name not in by_name:
            raise RequestError(
                f"{root}: tied[{alias!r}] = {name!r} is no parameter of the export "
                f"(e.g. {list(by_name)[:3]})"
            )
        if alias not in by_name:
            out.append((by_name[name], alias))
    return out


def _groups(
    options: TorchDcpExport, recorded: dict, names: dict, weights: dict, root: str
) -> list[tuple[dict, list[str]]]:
    """Each group's (hyper-parameters, parameter names): ``options.param_groups`` (a list: the
    groups; a mapping: set on every recorded group) or the recorded ones; every trained
    parameter in exactly one group, a frozen one in at most one, no other name."""
    given = options.param_groups
    trained = list(names.values())
    groups: Any = given if isinstance(given, list) else None
    if groups is None:
        groups = recorded.get("param_groups")
        if not groups and isinstance(given, Mapping):
            groups = [{**given, "params": trained}]
        if not isinstance(groups, list) or not groups:
            raise RequestError(
                f"{root}: a torch DCP export of the optimizer needs its param groups: the "
                f"checkpoint records none (a continued run: give run_record= the checkpoint "
                f"imported from torch), or give param_groups= the optimizer's hyper-parameters"
            )
        groups = [{**g, **given} if isinstance(given, Mapping) else g for g in groups]
    allowed, seen, out = set(weights.values()), set(), []
    for i, group in enumerate(groups):
        members = group.get("params") if isinstance(group, Mapping) else None
        if not isinstance(members, list):
            raise RequestError(f"param_groups[{i}]: no list of parameter names under 'params'")
        for name in members:
            if name in seen or name not in allowed:
                why = "is in two groups" if name in seen else "is no parameter of the export"
                raise RequestError(f"param_groups[{i}]: {name!r} {why} (e.g. {trained[:3]})")
            seen.add(name)
        out.append((source.plain({k: v for k, v in group.items() if k != "params"}), members))
    missing = [n for n in trained if n not in seen]
    if missing:
        raise RequestError(f"param_groups: parameters {missing[:5]} are in no group")
    return out
