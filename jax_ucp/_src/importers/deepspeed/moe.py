"""DeepSpeed MoE checkpoints (``deepspeed.moe.layer.MoE``, expert parallel), experts by global index.

Layout (DeepSpeed 0.19 ``runtime/engine.py`` ``_save_moe_checkpoint``), expert parallel size E
over W data-parallel ranks (the default expert-then-data topology: DP rank r is expert-parallel
rank ``r % E`` and expert-data-parallel rank ``r // E``):

* ``layer_L_expert_X_mp_rank_00_model_states.pt``: the weights of global expert X of the L-th MoE
  layer, keyed by full parameter names carrying the *global* index
  (``h.0.moe.deepspeed_moe.experts.deepspeed_experts.X.fc1.weight``);
* ``mp_rank_00_model_states.pt``: the dense weights (``module`` without the experts),
  ``param_shapes`` as DP rank 0 sees them (its own experts under their *local* index),
  ``num_experts`` per MoE layer;
* ZeRO 1/2: ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` per DP rank; the dense param
  group is partitioned over all W ranks, an expert group (``param_groups[g]["moe"]``, name
  ``ep_size_E``) over the W/E expert-data-parallel ranks of each expert-parallel rank, keyed by
  local expert names;
* ZeRO-0: ``expp_rank_P_mp_rank_00_optim_states.pt``: expert-parallel rank P's torch
  ``optimizer.state_dict()`` (keyed by parameter index), and rank 0's inside the model states
  (index -> name: :func:`zero0_index_names`).

Output: every expert parameter under its global name (as the expert files name it), e.g.
``params/h.0.moe.deepspeed_moe.experts.deepspeed_experts.1.fc1.weight``; the dense parameters
under their own names; the importer contract otherwise as for ZeRO (docs/DEEPSPEED.md).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jax_ucp._src import writer
from jax_ucp._src.errors import SourceError
from jax_ucp._src.format import mapped_file
from jax_ucp._src.format.files import numbered_names
from jax_ucp._src.importers.deepspeed import files, zero, zero0
from jax_ucp._src.importers.deepspeed.files import file_name, listed, require
from jax_ucp._src.importers.deepspeed.zero import DeepSpeedCheckpoint
from jax_ucp._src.importers.plan import (
    ADAM_TREES,
    ImportOptions,
    ImportPlan,
    agreed_step,
    skip,
    tensor_names,
)
from jax_ucp._src.store.storage import Storage

#: An expert parameter's name: ``<MoE module>.deepspeed_experts.<expert index>.<key>``.
EXPERT_NAME = re.compile(r"^(.+)\.deepspeed_experts\.([0-9]+)\.(.+)$")
#: What a moment of another shape than its parameter means in a ZeRO-0 MoE run.
ORDER_ADVICE = (
    ": the parameter order is not the module's; import the weights with weights_only=True"
)
#: The name DeepSpeed gives an expert param group: ``ep_size_<expert parallel size>``.
EP_GROUP_NAME = re.compile(r"^ep_size_([0-9]+)\Z")


@dataclass
class Experts:
    """The expert files of a tag folder, checked: every expert of every MoE layer present once."""

    weights: dict[str, tuple[np.ndarray, str]]  # global name -> (weight, "<file>:<key>")
    layer_of: dict[str, int] = field(default_factory=dict)  # MoE module prefix -> layer
    count: dict[int, int] = field(default_factory=dict)  # MoE layer -> experts

    def local_names(self, ep_size: int, ep_rank: int) -> list[str]:
        """Expert-parallel rank ``ep_rank``'s expert parameters: MoE layer by layer, local
        expert by local expert, each in its expert file's key order."""
        local: list[str] = []
        for layer in sorted(self.count):
            count = self.count[layer] // ep_size
            for expert in range(ep_rank * count, (ep_rank + 1) * count):
                prefix = f"layer_{layer}_expert_{expert}_"
                local += [n for n, (_, tensor) in self.weights.items() if tensor.startswith(prefix)]
        return local

    def global_name(self, name: str, ep_rank: int, ep_size: int, where: str) -> str:
        """The global name of a local expert parameter of expert-parallel rank ``ep_rank``.

        Args:
            name: the local expert parameter's name.
            ep_rank: the expert-parallel rank holding it.
            ep_size: the expert-parallel degree.
            where: the file, for errors.
        """
        match = EXPERT_NAME.match(name)
        if match is None:
            raise SourceError(
                f"{where}: {name!r} is in an expert param group but is no expert parameter "
                "('<module>.deepspeed_experts.<i>.<key>')"
            )
        prefix, local, rest = match.group(1), int(match.group(2)), match.group(3)
        layer = self.layer_of.get(prefix)
        if layer is None:
            raise SourceError(
                f"{where}: expert parameter {name!r} belongs to MoE module {prefix!r}, which no "
                f"layer_*_expert_* file holds (files hold {sorted(self.layer_of)})"
            )
        experts = self.count[layer]
        if experts % ep_size:
            raise SourceError(
                f"{where}: MoE layer {layer} has {experts} experts, not divisible by the expert "
                f"parallel size {ep_size}"
            )
        local_count = experts // ep_size
        if local >= local_count:
            raise SourceError(
                f"{where}: {name!r}: local expert {local}, but each of the {ep_size} expert "
                f"parallel ranks holds {local_count} of layer {layer}'s {experts} experts"
            )
        return f"{prefix}.deepspeed_experts.{ep_rank * local_count + local}.{rest}"


def read_experts(tag_dir: Storage, model_states: Mapping, model_file: str) -> Experts:
    """Reads every ``layer_L_expert_X_mp_rank_XX_model_states.pt``: experts 0..N-1 of each layer
    (N = ``num_experts`` of the model states when recorded), each file holding the parameters
    of its own expert only, one MoE module per layer.

    Args:
        tag_dir: the tag folder.
        model_states: the loaded model states file.
        model_file: its path, for errors.
    """
    by_layer: dict[int, dict[int, str]] = {}
    numbered = _rank0_files(tag_dir, files.EXPERT_FILE, "(layer, expert, model-parallel rank)")
    for (layer, expert), name in numbered.items():
        by_layer.setdefault(layer, {})[expert] = name
    recorded = model_states.get("num_experts")
    if isinstance(recorded, (list, tuple)) and len(recorded) != len(by_layer):
        raise SourceError(
            f"{model_file}: num_experts records {len(recorded)} MoE layers, the folder has expert "
            f"files of {len(by_layer)} (layers {sorted(by_layer)})"
        )
    experts = Experts({})
    for index, (layer, by_expert) in enumerate(sorted(by_layer.items())):
        if layer != index:
            raise SourceError(
                f"{tag_dir.root}: expert files of MoE layers {sorted(by_layer)}; layer {index} is "
                "missing"
            )
        count = len(by_expert)
        if isinstance(recorded, (list, tuple)):
            count = recorded[layer]
            if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
                raise SourceError(f"{model_file}: num_experts[{layer}] is {count!r}")
        for expert in range(count):
            if expert not in by_expert:
                raise SourceError(
                    f"{tag_dir.join(f'layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt')}"
                    f": missing file of expert {expert} of MoE layer {layer} ({count} experts)"
                )
        if len(by_expert) != count:
            raise SourceError(
                f"{tag_dir.root}: MoE layer {layer} has {count} experts ({model_file}: num_experts) "
                f"but expert files {sorted(by_expert)}"
            )
        experts.count[layer] = count
        for expert, name in sorted(by_expert.items()):
            _read_expert_file(experts, tag_dir, name, layer, expert)
    return experts


def _rank0_files(tag_dir: Storage, pattern: re.Pattern, what: str) -> dict[tuple[int, ...], str]:
    """The files of ``tag_dir`` ``pattern`` names (its groups: numbers, ``what``, the last the
    model-parallel rank) by their numbers but the last; two names of one number
    (``layer_1_expert_0`` and ``layer_01_expert_0``) or a model-parallel rank but 0 refused."""
    numbered = numbered_names(
        [
            (tuple(int(g) for g in m.groups()), name)
            for name in (listed(tag_dir) or [])
            if (m := pattern.match(name))
        ],
        tag_dir.root,
        what,
    )
    for numbers, name in numbered.items():
        if numbers[-1] != 0:
            raise SourceError(
                f"{tag_dir.join(name)}: a file of model-parallel rank {numbers[-1]}; "
                "DeepSpeed MoE with tensor or pipeline parallelism is not supported (supported: "
                "expert + data parallelism, ZeRO 0/1/2)"
            )
    return {numbers[:-1]: name for numbers, name in numbered.items()}


def _read_expert_file(
    experts: Experts, tag_dir: Storage, file: str, layer: int, expert: int
) -> None:
    state, path = files.load_deepspeed_file(tag_dir, file), tag_dir.join(file)
    if not isinstance(state, Mapping) or not state:
        raise SourceError(f"{path}: expected a state dict of expert weights")
    for key, value in state.items():
        match = EXPERT_NAME.match(str(key))
        if match is None or int(match.group(2)) != expert:
            raise SourceError(
                f"{path}: key {key!r} is not a parameter of expert {expert} "
                "('<module>.deepspeed_experts.<expert>.<key>')"
            )
        if not isinstance(value, np.ndarray):
            raise SourceError(f"{path}: {key!r} is a {type(value).__name__}, not a tensor")
        prefix = match.group(1)
        if experts.layer_of.setdefault(prefix, layer) != layer:
            raise SourceError(
                f"{path}: MoE module {prefix!r} is layer {experts.layer_of[prefix]} in other "
                f"expert files, layer {layer} here"
            )
        experts.weights[str(key)] = (value, f"{file}:{key}")
    prefixes = {m.group(1) for k in state if (m := EXPERT_NAME.match(str(k))) is not None}
    if len(prefixes) != 1:
        raise SourceError(f"{path}: parameters of several MoE modules: {sorted(prefixes)}")


# --------------------------------------------------------------------------- ZeRO 1/2


def expert_groups(optimizer: files.OptimizerStates) -> dict[int, int]:
    """{param group: expert parallel size} of the expert groups, from DP rank 0's
    ``base_optimizer_state.param_groups`` (``moe``, ``name`` = ``ep_size_E``), checked against
    ``partition_count`` (an expert group is partitioned over W / E ranks)."""
    path = optimizer.files[0]
    base = require(optimizer.states[0], "base_optimizer_state", path)
    groups = require(base, "param_groups", f"{path} base_optimizer_state")
    counts = optimizer.partition_count
    if not isinstance(counts, (list, tuple)) or len(counts) != len(groups):
        raise SourceError(
            f"{path}: partition_count {counts!r} does not give one count per param group "
            f"({len(groups)} groups)"
        )
    out = {}
    for index, group in enumerate(groups):
        if not (isinstance(group, Mapping) and group.get("moe")):
            if int(counts[index]) != optimizer.world_size:
                raise SourceError(
                    f"{path}: dense param group {index} partitioned over {counts[index]} ranks, "
                    f"expected all {optimizer.world_size}"
                )
            continue
        match = EP_GROUP_NAME.match(str(group.get("name")))
        if match is None:
            raise SourceError(
                f"{path}: expert param group {index} is named {group.get('name')!r}, expected "
                "'ep_size_<expert parallel size>'"
            )
        ep_size = int(match.group(1))
        if ep_size <= 0 or ep_size * int(counts[index]) != optimizer.world_size:
            raise SourceError(
                f"{path}: expert param group {index} ({group.get('name')}) is partitioned over "
                f"{counts[index]} ranks; {optimizer.world_size} DP ranks with expert parallel "
                f"size {ep_size} give {optimizer.world_size // max(ep_size, 1)}"
            )
        out[index] = ep_size
    if not out:
        raise SourceError(
            f"{path}: expert files beside a ZeRO optimizer with no expert ('moe') param group"
        )
    return out


def open_moe_zero_checkpoint(
    tag_dir: Storage,
) -> tuple[DeepSpeedCheckpoint, Experts, dict[int, int]]:
    """The ZeRO 1/2 files of a MoE tag folder as one :class:`DeepSpeedCheckpoint` whose expert
    parameters carry their global names; every expert file's tensor is one of them."""
    optimizer = files.rank0_optimizer_states(tag_dir, "DeepSpeed MoE", (1, 2))
    model_file = tag_dir.join(name := "mp_rank_00_model_states.pt")
    model_states = files.load_model_states(tag_dir, name)
    experts = read_experts(tag_dir, model_states, model_file)
    ep_of_group = expert_groups(optimizer)
    local_shapes = files.param_shapes_of(model_states, model_file)
    if len(local_shapes) != len(optimizer.states[0]["single_partition_of_fp32_groups"]):
        raise SourceError(
            f"{model_file}: {len(local_shapes)} param groups in param_shapes, the optimizer "
            f"files have {len(optimizer.states[0]['single_partition_of_fp32_groups'])}"
        )
    shapes = [  # an expert group's local names, as every expert-parallel rank's global ones
        {
            experts.global_name(name, ep_rank, ep_of_group[group], model_file): shape
            for ep_rank in range(ep_of_group[group])
            for name, shape in group_shapes.items()
        }
        if group in ep_of_group
        else group_shapes
        for group, group_shapes in enumerate(local_shapes)
    ]
    expert_names = {name for group in ep_of_group for name in shapes[group]}
    if expert_names != set(experts.weights):
        missing = sorted(set(experts.weights) - expert_names)
        extra = sorted(expert_names - set(experts.weights))
        raise SourceError(
            f"{tag_dir.root}: the expert param groups ({model_file}: param_shapes, local names "
            f"of every expert-parallel rank) and the expert files disagree: only in the expert "
            f"files {missing[:5]}, only in the optimizer groups {extra[:5]}"
        )
    for name in expert_names:
        shape = next(group[name] for group in shapes if name in group)
        weight, tensor = experts.weights[name]
        if tuple(weight.shape) != tuple(shape):
            raise SourceError(
                f"{tensor.split(':', 1)[0]}: {name!r} has shape {tuple(weight.shape)}, "
                f"param_shapes in {file_name(model_file)} say {tuple(shape)}"
            )

    def rename(dp_rank: int, group: int, name: str) -> str:
        ep_size = ep_of_group.get(group)
        if ep_size is None:
            return name
        return experts.global_name(name, dp_rank % ep_size, ep_size, optimizer.files[dp_rank])

    module = dict(model_states.get("module") or {})
    module.update({name: weight for name, (weight, _) in experts.weights.items()})
    checkpoint = zero.open_zero_rank(
        tag_dir,
        model_file,
        model_states,
        optimizer,
        param_shapes=shapes,
        module=module,
        rename=rename,
        rank_stride=dict(ep_of_group),
        module_tensors={name: tensor for name, (_, tensor) in experts.weights.items()},
    )
    if checkpoint.frozen:
        raise SourceError(
            f"{model_file}: frozen parameters {sorted(checkpoint.frozen)[:5]} in a MoE "
            "checkpoint; not supported"
        )
    return checkpoint, experts, ep_of_group


def _checked_experts(
    items: Iterator[writer.HostItem], experts: Experts
) -> Iterator[writer.HostItem]:
    """Each expert's fp32 master, assembled from its expert-parallel rank's partitions, must
    round to the weight its expert file holds, every element: an expert read from another
    rank's partition (a topology we mis-assume) cannot pass."""
    for item in items:
        if item.key[0] == "params" and item.key[1] in experts.weights:
            files_ = (item.provenance or {}).get("files")
            what = f"expert parameter {item.key[1]!r}: the fp32 master from {files_}"
            check = functools.partial(check_master, what, *experts.weights[item.key[1]])
            if isinstance(item.value, writer.Deferred):  # checked once the writer builds it
                make = item.value.make
                item.value = dataclasses.replace(item.value, make=lambda c=check, m=make: c(m()))
            else:
                check(item.value)
        yield item


def check_master(what: str, stored, tensor: str, master) -> Any:
    """``master``, an expert's fp32 master (``what``), once checked to round to the weight its
    expert file holds (``stored``, source tensor ``tensor``), every element: an expert read
    from another rank's partition (a topology we mis-assume) cannot pass."""
    cast = mapped_file.read_out(np.asarray(master)).astype(stored.dtype)
    stored = mapped_file.read_out(np.asarray(stored))
    if cast.tobytes() != np.ascontiguousarray(stored).tobytes():
        flat = int(np.argmax(cast.reshape(-1) != stored.reshape(-1)))
        raise SourceError(
            f"{what} disagrees with {tensor} (first at flat index {flat}: "
            f"{cast.reshape(-1)[flat]!r} vs {stored.reshape(-1)[flat]!r}): expert-parallel "
            "ranks assigned otherwise than DeepSpeed's default expert-then-data topology, or "
            "files from different saves"
        )
    return master


def expert_weights(checkpoint, source: dict, tensors: list[str]) -> list[str]:
    """``tensors``, the experts' own weight files' tensors: in an fp32 run the same values as
    their fp32 masters (checked element by element), so listed in ``source.skipped``."""
    if checkpoint.model_dtype == np.dtype(np.float32):
        skip(
            source,
            tensors,
            "the expert's weight in the run's precision (fp32): the same values as its fp32 "
            "master (checked), imported as params/",
        )
    return tensors


def plan_moe(tag_dir: Storage, options: ImportOptions) -> ImportPlan:
    """The import of a DeepSpeed MoE tag folder: ZeRO 1/2, or ZeRO-0 (optimizer state in
    ``expp_rank_*`` files)."""
    if not any(files.OPTIMIZER_FILE.match(f) for f in (listed(tag_dir) or [])):
        return plan_moe_zero0(tag_dir, options)
    weights_only, share = options.weights_only, options.share
    checkpoint, experts, ep_of_group = open_moe_zero_checkpoint(tag_dir)
    source = zero.zero_source_info(checkpoint)
    source.update(_moe_source(experts, sorted(set(ep_of_group.values()))))
    found = zero.zero_tensors(checkpoint, source, weights_only=weights_only)
    found += expert_weights(checkpoint, source, [t for _, t in experts.weights.values()])
    items = _checked_experts(zero.iter_zero_items(checkpoint, options), experts)
    return ImportPlan(items, source, len(share.pick(checkpoint.names)), source_tensors=found)


def _moe_source(experts: Experts, ep_sizes: list[int]) -> dict:
    return {
        "layout": "moe",
        "ep_size": ep_sizes[0] if len(ep_sizes) == 1 else ep_sizes,
        "num_experts": [experts.count[layer] for layer in sorted(experts.count)],
        "expert_names": "global expert index (as the layer_L_expert_X files name them)",
    }


# --------------------------------------------------------------------------- ZeRO-0


def plan_moe_zero0(tag_dir: Storage, options: ImportOptions) -> ImportPlan:
    """ZeRO-0 MoE: the weights (fp32, the trained values themselves: no separate master) from
    ``module`` and the expert files; Adam's moments and step from the torch
    ``optimizer.state_dict()`` of every expert-parallel rank (``expp_rank_P_*``), mapped from
    index to name as :func:`zero0_index_names` says."""
    model_file = tag_dir.join(name := "mp_rank_00_model_states.pt")
    model_states = files.load_model_states(tag_dir, name)
    experts = read_experts(tag_dir, model_states, model_file)
    optimizer_files = expert_optimizer_files(tag_dir, model_states, model_file)
    if not isinstance(model_states.get("module"), Mapping) or not model_states["module"]:
        raise SourceError(f"{model_file}: no 'module' weights to import")
    file = file_name(model_file)
    weights = {  # the dense weights (buffers left out), each with the tensor it is read from
        n: (v, f"{file}:module.{n}") for n, v in zero0.module_parameters(model_states).items()
    }
    clash = sorted(set(weights) & set(experts.weights))
    if clash:
        raise SourceError(
            f"{model_file}: expert parameters {clash[:5]} are also in module (expected apart)"
        )
    weights.update(experts.weights)
    names = options.share.pick(weights)
    source = files.source_record(
        tag_dir, model_states, 0, **_moe_source(experts, [len(optimizer_files)])
    )
    local = functools.partial(experts.local_names, len(optimizer_files))
    tensors = [tensor for _, tensor in experts.weights.values()]
    found, moments, step = zero0_optimizer(
        tag_dir, model_file, model_states, optimizer_files, weights, tensors, local, source, options
    )
    items = zero0_items(names, weights, moments, step)
    return ImportPlan(items, source, len(names), source_tensors=found)


def zero0_optimizer(
    tag_dir, model_file, model_states, optimizer_files, weights, tensors, local, source, options
):
    """Every tensor of a ZeRO-0 expert-parallel run's files (DeepSpeed MoE's, AutoEP's); the
    Adam moments and ``(step, tensors)`` of :func:`zero0_moments` (none under
    ``options.weights_only``; the step given to the primary process only); the tensors not
    imported listed in ``source.skipped``.

    Args:
        tag_dir: the tag folder.
        model_file: rank 0's model states file.
        model_states: that file, loaded.
        optimizer_files: each expert-parallel rank's torch optimizer file.
        weights: every parameter's ``(weight, source tensor)`` by name; those of the model
            states file are the dense ones.
        tensors: the expert files' tensors.
        local: ``local(ep_rank)``: the rank's expert parameters, in group order.
        source: the manifest's source record, whose ``skipped`` is filled.
        options: ``weights_only`` and ``share``.
    """
    file = file_name(model_file)
    found = [f"{file}:{n}" for n in tensor_names(model_states)] + tensors
    states = {p: files.load_deepspeed_file(tag_dir, file_name(p)) for p in optimizer_files}
    for path, state in states.items():
        found += [f"{file_name(path)}:{n}" for n in tensor_names(state)]
    moments: dict[str, tuple[np.ndarray, np.ndarray, list[str]]] = {}
    step = None
    if options.weights_only:
        skip(
            source,
            [n for n in found if ":optimizer." in n],
            "weights_only: ZeRO-0 optimizer state (torch optimizer.state_dict(), keyed by index)",
        )
    else:
        dense = [n for n, (_, t) in weights.items() if t.startswith(f"{file}:")]
        moments, step = zero0_moments(
            model_states, model_file, states, dense, local, weights, source
        )
    imported = {t for _, t in weights.values() if t.startswith(f"{file}:")} | set(tensors)
    imported |= {t for *_, held in moments.values() for t in held}
    imported |= set(step[1]) if step is not None else set()
    skip(source, sorted(set(found) - imported), "not a module weight")  # the first reason stays
    return found, moments, step if options.share.primary else None


def zero0_items(
    names, weights, moments, step, stacked: Mapping = {}, parts=lambda name: [name]
) -> Iterator[writer.HostItem]:
    """Each parameter of ``names`` (``stacked[name]``: its own item, else its module weight of
    ``weights``) with the Adam moments of its ``parts(name)`` when imported (AutoEP: one per EP
    rank, stacked after), then the step (None: not given): written in this order, so a
    parameter's state follows it."""
    for name in names:
        if name in stacked:
            yield stacked[name]
        else:
            value, tensor = weights[name]
            yield files.sourced_item(("params", name), value, "module", [tensor])
        for part in parts(name):
            if part not in moments:  # weights_only
                continue
            mu, nu, tensors = moments[part]
            for (state, tree), value in zip(ADAM_TREES.items(), (mu, nu)):
                held = [t for t in tensors if t.endswith("." + state)]
                yield files.sourced_item((*tree, part), value, "zero0-optimizer-index", held)
    if step is not None:
        value, tensors = step
        count = np.asarray(value, np.int32)
        yield files.sourced_item(("opt_state", "count"), count, "step", tensors)


def zero0_index_names(
    groups: list, dense: list[str], local: list[str], ep_rank: int, where: str
) -> dict[int, str]:
    """Parameter index -> name of one expert-parallel rank's ZeRO-0 torch optimizer.

    ZeRO-0 hands the torch optimizer the parameter groups of the training script, and its
    ``state_dict()`` keys the state by position; DeepSpeed's own resume loads it back by
    position. DeepSpeed MoE requires the groups of ``split_params_into_different_moe_groups_
    for_optimizer``, which keeps the module order within each group: one dense group (the
    module's parameters without the experts) and one expert group ``ep_size_E`` (this rank's
    experts: :meth:`Experts.local_names`; AutoEP's fused local tensors). Anything else
    (several dense groups, e.g. weight-decay groups, or other sizes) is refused: which
    parameter sits at which position would be a guess. The caller checks every
    moment's shape against its parameter.

    Args:
        groups: the torch optimizer's ``param_groups``.
        dense: the module's parameters without the experts, in module order.
        local: this rank's expert parameters, in the expert group's order.
        ep_rank: this expert-parallel rank.
        where: the optimizer file, for errors.
    """
    dense_groups = [g for g in groups if isinstance(g, Mapping) and not g.get("moe")]
    expert_groups = [g for g in groups if isinstance(g, Mapping) and g.get("moe")]
    if len(groups) != 2 or len(dense_groups) != 1 or len(expert_groups) != 1:
        raise SourceError(
            f"{where}: {len(dense_groups)} dense and {len(expert_groups)} expert param groups; "
            "the index -> parameter mapping of ZeRO-0 optimizer state is known for one dense "
            "group and one expert group (split_params_into_different_moe_groups_for_optimizer "
            "of model.parameters()); import the weights with weights_only=True"
        )
    out: dict[int, str] = {}
    for group, names in ((dense_groups[0], dense), (expert_groups[0], local)):
        params = group.get("params")
        if not isinstance(params, (list, tuple)) or len(params) != len(names):
            raise SourceError(
                f"{where}: param group {group.get('name')!r} holds "
                f"{len(params) if isinstance(params, (list, tuple)) else params!r} parameters, "
                f"the checkpoint's {'expert' if group.get('moe') else 'dense'} parameters of "
                f"expert-parallel rank {ep_rank} are {len(names)}; import the weights with "
                "weights_only=True"
            )
        for index, name in zip(params, names):
            if not isinstance(index, int) or isinstance(index, bool) or index in out:
                raise SourceError(f"{where}: bad or repeated parameter index {index!r}")
            out[index] = name
    return out


def zero0_moments(model_states, model_file, states, dense, local_names, weights, source):
    """``{name: (exp_avg, exp_avg_sq, source tensors)}`` and ``(step, tensors)`` of a ZeRO-0 MoE
    run: each expert's from its expert-parallel rank's file, the dense ones from rank 0's, which
    every other rank (and the model states' ``optimizer``, rank 0's own copy) must hold bit for
    bit (data-parallel replicas; their copies are listed in ``source.skipped``).

    Args:
        model_states: rank 0's loaded model states file.
        model_file: its path.
        states: each expert-parallel rank's optimizer file, loaded.
        dense: the dense parameters' names.
        local_names: ``local_names(ep_rank)``: the rank's expert parameters, in group order.
        weights: every parameter's weight, by name (for the shape checks).
        source: the manifest's source record, whose ``skipped`` is filled.
    """
    if any(np.asarray(weights[n][0]).dtype != np.float32 for n in weights):
        raise SourceError(
            f"{model_file}: ZeRO-0 optimizer state is imported for fp32 runs (the weights are "
            "then the trained values); import the weights with weights_only=True"
        )
    moments: dict[str, tuple[np.ndarray, np.ndarray, list[str]]] = {}
    steps: dict[float, str] = {}
    step_tensors: list[str] = []
    copies = [(model_file, model_states, 0)] + [
        (path, state, rank) for rank, (path, state) in enumerate(states.items())
    ]
    for path, state, ep_rank in copies:
        file = file_name(path)
        optimizer = require(state, "optimizer", path)
        groups = require(optimizer, "param_groups", f"{path} optimizer")
        inner = require(optimizer, "state", f"{path} optimizer")
        by_index = zero0_index_names(list(groups), dense, local_names(ep_rank), ep_rank, path)
        if set(inner) != set(by_index):
            raise SourceError(
                f"{path}: optimizer state for parameter indices {sorted(inner)[:8]}..., the param "
                f"groups list {sorted(by_index)[:8]}...; every parameter needs its Adam state"
            )
        for index, name in by_index.items():
            shape = np.asarray(weights[name][0]).shape
            where = f"{file}:optimizer.state.{index}"
            pair, tensors = zero0.adam_entry(
                inner[index], where, name, shape, steps, step_tensors, ORDER_ADVICE
            )
            held = moments.get(name)
            _check_replica(held[:2] if held else (), pair, tensors, name)
            if held is None or not held[2]:  # rank 0's own copy is listed below, not here
                first = held or pair
                moments[name] = (first[0], first[1], [] if path == model_file else tensors)
            else:
                skip(source, tensors, f"replica of {held[2][0].rsplit('.', 1)[0]} (bit-identical)")
    model_copy = file_name(model_file)
    skip(
        source,
        [
            f"{model_copy}:optimizer.state.{i}.{k}"
            for i in require(model_states["optimizer"], "state", model_file)
            for k in ("exp_avg", "exp_avg_sq")
        ],
        "rank 0's optimizer state, the same as expp_rank_0's (checked bit-identical)",
    )
    count = agreed_step(
        steps,
        model_file.rpartition("/")[0],
        recorded_by="ranks or parameters",
        error=SourceError,
    )
    return moments, (count, step_tensors)


def _check_replica(stored, pair, tensors: list[str], name: str) -> None:
    """Another rank's copy of a parameter's moments (``pair``) equals the one kept
    (``stored``, empty for the first): data-parallel replicas hold the same Adam state, so a
    difference means files from different saves."""
    for kept, value, tensor in zip(stored, pair, tensors):
        if kept.tobytes() != value.tobytes():
            raise SourceError(
                f"{tensor}: {name!r} differs from the same parameter's state on another "
                "rank (data-parallel replicas hold the same Adam state): files from "
                "different saves"
            )


def expert_optimizer_files(tag_dir: Storage, model_states: Mapping, model_file: str) -> list[str]:
    """``expp_rank_P_mp_rank_00_optim_states.pt`` for P = 0..E-1 (E from the expert param
    group's name ``ep_size_E`` in the model states' optimizer), no other."""
    numbered = _rank0_files(
        tag_dir, files.EXPERT_OPTIMIZER_FILE, "(expert-parallel rank, model-parallel rank)"
    )
    found = {ep_rank: tag_dir.join(name) for (ep_rank,), name in numbered.items()}
    optimizer = model_states.get("optimizer")
    groups = optimizer.get("param_groups") if isinstance(optimizer, Mapping) else None
    sizes = {
        int(m.group(1))
        for g in groups or []
        if isinstance(g, Mapping) and (m := EP_GROUP_NAME.match(str(g.get("name"))))
    }
    if len(sizes) > 1:
        raise SourceError(f"{model_file}: several expert parallel sizes {sorted(sizes)}")
    ep_size = sizes.pop() if sizes else len(found)
    for rank in range(ep_size):
        if rank not in found:
            raise SourceError(
                f"{tag_dir.join(f'expp_rank_{rank}_mp_rank_00_optim_states.pt')}: "
                f"missing optimizer file of expert-parallel rank {rank} (expert parallel size "
                f"{ep_size})"
            )
    extra = sorted(set(found) - set(range(ep_size)))
    if extra:
        raise SourceError(
            f"{tag_dir.root}: optimizer files of expert-parallel ranks {extra} beyond the expert "
            f"parallel size {ep_size}: {[file_name(found[r]) for r in extra]}"
        )
    return [found[rank] for rank in range(ep_size)]


__all__ = ["Experts", "open_moe_zero_checkpoint", "plan_moe", "plan_moe_zero0", "read_experts"]
