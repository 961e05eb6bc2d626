"""DeepSpeed AutoEP checkpoints (``expert_parallel``: ``AutoEPMoELayer``), experts stacked.

DeepSpeed 0.19.8 ``_save_moe_checkpoint`` (docs/DEEPSPEED.md "DeepSpeed AutoEP"): the model
states' ``ds_autoep_layers`` records; ZeRO 1/2 (``per_expert_files``): per-expert files
``layer_<i>_expert_<g>_*`` holding ``<prefix>.w1|w2|w3.<g>`` (``g = ep_rank * L + local``), the
ZeRO partitions as DeepSpeed MoE's (:mod:`.moe`) with each EP rank's fused local ``[L, ...]``
tensors; ZeRO-3 (``zero3_partitioned``): no expert files, each EP rank's fused local tensors
partitioned over its expert-data-parallel ranks (``ds_zero_partition_groups``), each rank's
model states naming its EP rank. Output: ``<prefix>.w1`` (w2, w3) stacked ``[E, ...]``, as
DeepSpeed's universal checkpoint stores them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from jax_ucp._src import writer
from jax_ucp._src.errors import SourceError
from jax_ucp._src.importers.deepspeed import files, moe, zero, zero0
from jax_ucp._src.importers.deepspeed.files import file_name, listed, require
from jax_ucp._src.importers.plan import (
    ImportOptions,
    ImportPlan,
    Share,
    host_item,
)
from jax_ucp._src.store.storage import Storage

#: The model states keys of DeepSpeed's AutoEP layer records (and the older name).
RECORD_KEYS = ("ds_autoep_layers", "autoep_layers")
WEIGHTS = ("w1", "w2", "w3")
#: Joins a fused expert tensor's name and an EP rank while its local parts are read.
EP_PART = "@ep"


@dataclasses.dataclass(frozen=True)
class Layer:
    """One ``AutoEPMoELayer``'s record, checked: ``<module>.experts``, experts, EP size."""

    prefix: str
    experts: int
    ep: int

    @property
    def local(self) -> int:
        return self.experts // self.ep


def autoep_states(tag_dir: Storage) -> tuple[str, Mapping] | None:
    """``(path, model states)`` of a tag folder whose model states file (``mp_rank_00``, or
    ZeRO-3's rank 0) records AutoEP layers; None for any other folder."""
    names = listed(tag_dir) or []
    for name in ("mp_rank_00_model_states.pt", zero.ZERO3_MODEL_NAME.format(0, 0)):
        if name in names:
            path, states = tag_dir.join(name), files.load_model_states(tag_dir, name)
            return (path, states) if any(states.get(k) for k in RECORD_KEYS) else None
    return None


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def _contiguous_map(experts: int, ep: int, expert_shape: tuple[int, ...]) -> dict:
    """DeepSpeed's affine map (``ParamAffineMap.to_dict``) of a fused ``[E, ...]`` tensor whose
    EP rank r holds experts ``r*L .. r*L+L-1`` in order."""
    local, shape = experts // ep, [experts, *expert_shape]
    strides = [int(np.prod(shape[i + 1 :])) for i in range(len(shape))]
    part = [local, *expert_shape]
    piece = {"dest": [0, strides], "shape": part}
    return {
        "logical_shape": shape,
        "ranks": {
            r: {
                "pieces": [dict(piece, locations=[r], source=[r * local * strides[0], strides])],
                "shard_shape": part,
            }
            for r in range(ep)
        },
    }


def autoep_records(states: Mapping, path: str) -> tuple[str, list]:
    """``(key, records)`` of the model states file ``path``: no AutoTP; per-expert files, or
    ZeRO-3's partitions when ``path`` is ZeRO-3's rank-0 model states file."""
    if states.get("folding") is not None or states.get("mp_world_size", 1) != 1:
        raise SourceError(
            f"{path}: AutoEP folded with AutoTP (tensor_parallel.autotp_size > 1: 'folding' "
            f"metadata, mp_world_size {states.get('mp_world_size')}): expert shards per (TP "
            "rank, EP rank) are not read; supported: AutoEP with data parallelism, ZeRO 1/2/3"
        )
    key = next(k for k in RECORD_KEYS if states.get(k))
    records = states[key] if isinstance(states[key], list) else [states[key]]
    zero3 = file_name(path) == zero.ZERO3_MODEL_NAME.format(0, 0)
    want = "zero3_partitioned" if zero3 else "per_expert_files"
    for index, record in enumerate(records):
        fmt = require(record, "checkpoint_format", f"{path}: {key}[{index}]")
        if fmt != want:
            raise SourceError(
                f"{path}: {key}[{index}]: checkpoint_format {fmt!r}, expected {want!r}"
                + (" (ZeRO-3's model states files)" if zero3 else "")
            )
    return key, records


def autoep_layers(
    key: str, records: list, path: str, local_shapes: Mapping[str, tuple[int, ...]]
) -> list[Layer]:
    """The records of :func:`autoep_records` checked against the expert group's fused local
    ``param_shapes``: the contiguous placement and affine maps DeepSpeed names the expert files
    by (file index ``ep_rank * num_local_experts + local``, whatever the placement says)."""
    layers = []
    for index, record in enumerate(records):
        where = f"{path}: {key}[{index}]"
        prefix = require(record, "expert_key_prefix", where)
        layer = Layer(str(prefix), require(record, "num_experts", where), record.get("ep_size"))
        if not (
            isinstance(layer.experts, int)
            and isinstance(layer.ep, int)
            and layer.ep > 0
            and layer.experts % layer.ep == 0
            and record.get("num_local_experts") == layer.local
            and record.get("moe_layer_id") == index
        ):
            raise SourceError(
                f"{where}: num_experts {layer.experts!r}, ep_size {layer.ep!r}, "
                f"num_local_experts {record.get('num_local_experts')!r}, moe_layer_id "
                f"{record.get('moe_layer_id')!r}: expected E = ep_size * num_local_experts, "
                f"layer {index}"
            )
        placement = _plain(require(record, "expert_placement", where))
        ranks = [
            {"experts": list(range(r * layer.local, (r + 1) * layer.local)), "rank": r}
            for r in range(layer.ep)
        ]
        want = {"ep_size": layer.ep, "num_experts": layer.experts, "ranks": ranks, "version": 1}
        if placement != want:
            raise SourceError(
                f"{where}: expert_placement {placement!r}, expected {want!r}: DeepSpeed names "
                "an expert file by ep_rank * num_local_experts + local, which is that expert "
                "only under this contiguous placement (version 1)"
            )
        maps = _plain(require(record, "affine_maps", where))
        names = [f"{prefix}.{w}" for w in WEIGHTS]
        version = maps.get("version") if isinstance(maps, dict) else maps
        if version != 1:
            raise SourceError(f"{where}: affine_maps version {version!r}, expected 1")
        for name in names:
            shape = local_shapes.get(name)
            if shape is None or tuple(shape)[:1] != (layer.local,):
                raise SourceError(
                    f"{path}: param_shapes hold {name!r} as {shape}, expected "
                    f"[{layer.local}, ...] (the expert param group, local experts)"
                )
            want = _contiguous_map(layer.experts, layer.ep, tuple(shape)[1:])
            if (maps.get("params") or {}).get(name) != want:
                raise SourceError(
                    f"{where}: affine_maps.params[{name!r}] is not the contiguous map of "
                    f"expert_placement ({want!r})"
                )
        layers.append(layer)
    return layers


def read_expert_files(
    tag_dir: Storage, layers: list[Layer], fused: Mapping[str, tuple[int, ...]]
) -> dict[str, list[tuple[Any, str]]]:
    """``{<prefix>.<w>: [(expert g's weight, "<file>:<key>") for g in 0..E-1]}`` from exactly
    the files ``layer_<i>_expert_<g>_mp_rank_00_model_states.pt``, each holding
    ``<prefix>.<w>.<g>`` (of the fused local shape ``fused`` without its first dim) for w1, w2,
    w3 and nothing else."""
    out: dict[str, list[tuple[Any, str]]] = {}
    names = listed(tag_dir) or []
    for i, layer in enumerate(layers):
        for g in range(layer.experts):
            name = f"layer_{i}_expert_{g}_mp_rank_00_model_states.pt"
            path = tag_dir.join(name)
            if name not in names:  # a file beside them is refused as not read
                raise SourceError(
                    f"{path}: missing file of expert {g} of AutoEP layer {i} ({layer.prefix}, "
                    f"{layer.experts} experts)"
                )
            state = files.load_deepspeed_file(tag_dir, name)
            keys = {f"{layer.prefix}.{w}.{g}": f"{layer.prefix}.{w}" for w in WEIGHTS}
            if not isinstance(state, Mapping) or set(state) != set(keys):
                found = sorted(state) if isinstance(state, Mapping) else type(state).__name__
                raise SourceError(f"{path}: holds {found}, expected {sorted(keys)}")
            for key, base in keys.items():
                value, held = state[key], out.setdefault(base, [])
                want = (tuple(fused[base])[1:], held[0][0].dtype if held else None)
                if (
                    not isinstance(value, np.ndarray)
                    or value.shape != want[0]
                    or (held and value.dtype != want[1])
                ):
                    raise SourceError(
                        f"{path}: {key!r} is {getattr(value, 'shape', value)} "
                        f"{getattr(value, 'dtype', '')}; expected {want} (param_shapes, expert 0)"
                    )
                held.append((value, f"{name}:{key}"))
    return out


@dataclasses.dataclass(frozen=True)
class _WholeExperts(Share):
    """A ``Share`` that keeps every EP rank's part of one fused tensor in the same process."""

    def pick(self, names):
        names = list(names)
        mine = set(super().pick(dict.fromkeys(n.split(EP_PART)[0] for n in names)))
        return [n for n in names if n.split(EP_PART)[0] in mine]


def _zero3_expert_groups(
    optimizer: files.OptimizerStates, groups: int, ep: int, group_name: str
) -> dict[int, int]:
    """``{sub-group: ep}`` of the expert sub-groups of a ZeRO-3 save (``families``
    ``['autoep_expert']`` on DP rank 0), every rank's ``ds_zero_partition_groups`` checked to be
    DeepSpeed's expert-then-data topology: the ``groups`` sub-groups in order, the dense ones
    partitioned over all W ranks, the expert ones over the ranks ``r % ep, r % ep + ep, ...``."""
    world, where = optimizer.world_size, optimizer.files[0]
    if not (isinstance(ep, int) and ep > 0 and world % ep == 0):
        raise SourceError(f"{where}: ep_size {ep!r} of ds_autoep_layers, {world} DP ranks")
    first = _plain(require(optimizer.states[0], "ds_zero_partition_groups", where))
    listed = first if isinstance(first, list) else []
    experts = {
        i
        for i, g in enumerate(listed)
        if isinstance(g, dict) and g.get("families") == ["autoep_expert"]
    }
    for r, (path, state) in enumerate(zip(optimizer.files, optimizer.states)):
        want = []
        for i in range(groups):
            ranks = list(range(r % ep, world, ep)) if i in experts else list(range(world))
            family, name = ("autoep_expert", group_name) if i in experts else ("replicated",) * 2
            want.append({"sub_group": i, "partition_count": len(ranks)})
            want[-1].update(partition_rank=ranks.index(r), partition_ranks=ranks)
            want[-1].update(families=[family], group_names=[name])
        if _plain(state.get("ds_zero_partition_groups")) != want:
            raise SourceError(
                f"{path}: ds_zero_partition_groups {state.get('ds_zero_partition_groups')!r}, "
                f"expected {want!r}: DeepSpeed's expert-then-data topology, DP rank {r} of EP "
                f"rank {r % ep}"
            )
    return dict.fromkeys(sorted(experts), ep)


def _check_zero3_ranks(
    tag_dir: Storage, key: str, records: list, states: Mapping, world: int, ep: int
) -> None:
    """Each DP rank r's model states (ZeRO-3 writes one per rank) name it EP rank ``r % ep``,
    expert-data-parallel rank ``r // ep``, records and ``param_shapes`` otherwise rank 0's."""
    shapes = files.param_shapes_of(states, zero.ZERO3_MODEL_NAME.format(0, 0))
    for r in range(world):
        path = tag_dir.join(name := zero.ZERO3_MODEL_NAME.format(r, 0))
        held = files.load_model_states(tag_dir, name)  # once per import (files.parse_once)
        e = r % ep
        want = [dict(_plain(x), ep_rank=e, expert_data_parallel_rank=r // ep) for x in records]
        for x in want:
            x.update(ep_group_name=f"ep_size_{ep}", expert_data_parallel_world_size=world // ep)
            local = x["num_local_experts"]  # an int (autoep_layers)
            x.update(global_expert_start=e * local, global_expert_end=(e + 1) * local)
            x.update(checkpoint_format_version=1)
        if _plain(held.get(key)) != want or files.param_shapes_of(held, path) != shapes:
            raise SourceError(
                f"{path}: {key} or param_shapes other than rank 0's for EP rank {e}, "
                f"expert-data-parallel rank {r // ep} of {world // ep} ({want!r})"
            )


def plan_autoep(
    tag_dir: Storage, model_file: str, states: Mapping, options: ImportOptions
) -> ImportPlan:
    """The import of an AutoEP tag folder (ZeRO 0/1/2: per-expert files; ZeRO-3: partitions)."""
    key, records = autoep_records(states, model_file)
    if not any(files.OPTIMIZER_FILE.match(f) for f in (listed(tag_dir) or [])):
        return _plan_zero0(tag_dir, model_file, states, key, records, options)
    optimizer = files.rank0_optimizer_states(tag_dir, "AutoEP", (1, 2, 3))
    if (expected := zero.model_states_file(tag_dir, optimizer)) != model_file:
        raise SourceError(
            f"{optimizer.files[0]}: zero_stage {optimizer.stage}, whose model states are "
            f"{file_name(expected)}, beside the AutoEP records of {model_file}"
        )
    local_shapes = files.param_shapes_of(states, model_file)
    ep = require(records[0], "ep_size", f"{model_file}: {key}[0]")
    if optimizer.stage == 3:
        groups = len(local_shapes)
        ep_of_group = _zero3_expert_groups(optimizer, groups, ep, f"ep_size_{ep}")
    else:
        ep_of_group = moe.expert_groups(optimizer)
    fused = {n: s for g in ep_of_group for n, s in local_shapes[g].items()}
    layers = autoep_layers(key, records, model_file, fused)
    if optimizer.stage == 3:
        _check_zero3_ranks(tag_dir, key, records, states, optimizer.world_size, ep)
    names = {f"{x.prefix}.{w}" for x in layers for w in WEIGHTS}
    experts = {} if optimizer.stage == 3 else read_expert_files(tag_dir, layers, fused)
    if {*ep_of_group.values(), *(x.ep for x in layers)} != {ep} or set(fused) != names:
        raise SourceError(
            f"{model_file}: the expert param groups ({sorted(ep_of_group.values())} EP ranks: "
            f"{sorted(fused)}) and ds_autoep_layers ({[x.ep for x in layers]}: "
            f"{sorted(names)}) disagree"
        )
    shapes = [
        {f"{n}{EP_PART}{r}": s for n, s in group.items() for r in range(ep)}
        if g in ep_of_group
        else group
        for g, group in enumerate(local_shapes)
    ]

    def rename(dp_rank: int, group: int, name: str) -> str:  # expert-then-data topology
        return f"{name}{EP_PART}{dp_rank % ep}" if group in ep_of_group else name

    checkpoint = zero.open_zero_rank(
        tag_dir,
        model_file,
        states,
        optimizer,
        param_shapes=shapes,
        rename=rename,
        rank_stride=dict(ep_of_group),
    )
    if checkpoint.frozen:
        raise SourceError(f"{model_file}: frozen parameters {sorted(checkpoint.frozen)[:5]}")
    source = zero.zero_source_info(checkpoint)
    source.update(layout="autoep", ep_size=ep, num_experts=[x.experts for x in layers])
    source["expert_names"] = "<expert_key_prefix>.w1|w2|w3 stacked [num_experts, ...]"
    found = zero.zero_tensors(checkpoint, source, weights_only=options.weights_only)
    found += moe.expert_weights(
        checkpoint, source, [t for held in experts.values() for _, t in held]
    )
    share = _WholeExperts(options.share.index, options.share.count)
    items = zero.iter_zero_items(checkpoint, dataclasses.replace(options, share=share))
    names = list(dict.fromkeys(n.split(EP_PART)[0] for n in checkpoint.names))
    return ImportPlan(_stacked(items, experts, ep), source, len(options.share.pick(names)), found)


def _recorded_local_shapes(key: str, records: list, path: str) -> dict[str, tuple[int, ...]]:
    """Each fused expert tensor's local shape ``[L, ...]`` as its layer's affine map records it
    (ZeRO-0 keeps no ``param_shapes``), checked against the whole map by :func:`autoep_layers`
    and against every expert file by :func:`read_expert_files`."""
    out = {}
    for index, record in enumerate(records):
        where = f"{path}: {key}[{index}]"
        maps = require(require(record, "affine_maps", where), "params", f"{where}.affine_maps")
        for name, held in maps.items() if isinstance(maps, Mapping) else ():
            shape = require(held, "logical_shape", f"{where}.affine_maps.params[{name!r}]")
            shape = files.checked_shape(shape, path, f"{key}[{index}] {name!r} logical_shape")
            out[str(name)] = (record.get("num_local_experts"), *shape[1:])
    return out


def _plan_zero0(
    tag_dir: Storage,
    model_file: str,
    states: Mapping,
    key: str,
    records: list,
    options: ImportOptions,
) -> ImportPlan:
    """ZeRO-0 (no ZeRO optimizer files; an fp32 run): the dense weights from ``module``, the
    experts' from their files (the trained values themselves, no master), stacked; Adam's
    moments and step from each EP rank's torch ``optimizer.state_dict()`` (``expp_rank_<r>_*``,
    the dense group a replica on each) by :func:`moe.zero0_optimizer`, rank r's expert group
    holding its fused local tensors layer by layer, w1, w2, w3 (the layers' parameter order)."""
    fused = _recorded_local_shapes(key, records, model_file)
    layers = autoep_layers(key, records, model_file, fused)
    experts = read_expert_files(tag_dir, layers, fused)
    optimizer_files = moe.expert_optimizer_files(tag_dir, states, model_file)
    ep, dense = len(optimizer_files), zero0.module_parameters(states)
    if {x.ep for x in layers} != {ep} or set(fused) != set(experts) or not dense:
        raise SourceError(
            f"{model_file}: {ep} expp_rank_* optimizer files, ds_autoep_layers' ep_size "
            f"{[x.ep for x in layers]}, module weights {len(dense)}: expected one file per EP "
            "rank and the dense weights in module"
        )
    file = file_name(model_file)
    weights = {n: (v, f"{file}:module.{n}") for n, v in dense.items()}
    for name, held in experts.items():  # each EP rank's fused local tensor: shape and dtype
        carrier = np.broadcast_to(np.zeros((), held[0][0].dtype), fused[name])
        weights.update({f"{name}{EP_PART}{r}": (carrier, "") for r in range(ep)})
    source = files.source_record(tag_dir, states, 0, layout="autoep", ep_size=ep)
    source["num_experts"] = [x.experts for x in layers]
    local = lambda r: [f"{x.prefix}.{w}{EP_PART}{r}" for x in layers for w in WEIGHTS]
    tensors = [t for held in experts.values() for _, t in held]
    found, moments, step = moe.zero0_optimizer(
        tag_dir, model_file, states, optimizer_files, weights, tensors, local, source, options
    )
    names = options.share.pick([*dense, *experts])
    stacked = {name: _expert_files_item(("params", name), held) for name, held in experts.items()}
    parts = lambda name: [f"{name}{EP_PART}{r}" for r in range(ep)] if name in experts else [name]
    items = moe.zero0_items(names, weights, moments, step, stacked, parts)
    return ImportPlan(_stacked(items, experts, ep), source, len(names), source_tensors=found)


def _expert_files_item(key: tuple[str, ...], stored: list[tuple[Any, str]]) -> writer.HostItem:
    """The experts' weights as their files hold them, stacked ``[E, ...]`` when written."""
    arrays, tensors = [a for a, _ in stored], [t for _, t in stored]
    shape, dtype = (len(arrays), *arrays[0].shape), arrays[0].dtype
    value = writer.Deferred(shape, dtype, lambda: zero.joined_parts(arrays, shape, dtype))
    return files.sourced_item(key, value, "module", tensors)


def _stacked(
    items: Iterator[writer.HostItem], experts: dict[str, list[tuple[Any, str]]], ep: int
) -> Iterator[writer.HostItem]:
    """``items`` with each fused expert tensor's EP-rank parts (``<name>@ep<r>``, consecutive
    ranks of one name) stacked into ``[E, ...]``; its model copy the expert files' weights."""
    held: dict[tuple[str, ...], list[writer.HostItem]] = {}
    for item in items:
        *tree, name = item.key
        base, part, rank = name.partition(EP_PART)
        if not part:
            yield item
            continue
        parts = held.setdefault((*tree, base), [])
        parts.append(item)
        assert int(rank) == len(parts) - 1, item.key  # rename() orders them so
        if len(parts) == ep:
            del held[(*tree, base)]
            yield _stack(tuple(tree), base, parts, experts.get(base))
    assert not held, sorted(held)


def _stack(
    tree: tuple[str, ...],
    name: str,
    parts: list[writer.HostItem],
    stored: list[tuple[Any, str]] | None,
) -> writer.HostItem:
    """The EP-rank ``parts`` stacked; ``stored``: the expert files' weights (ZeRO 1/2)."""
    first = parts[0].value
    shape, dtype = (len(parts) * first.shape[0], *first.shape[1:]), first.dtype
    if tree == ("model_params",) and stored:  # the run's model-precision weights: expert files
        return _expert_files_item((*tree, name), stored)

    def make() -> np.ndarray:
        out = zero.joined_parts(
            [p.value.make() if isinstance(p.value, writer.Deferred) else p.value for p in parts],
            shape,
            dtype,
        )
        if tree == ("params",) and stored:
            _check_experts(name, out, stored)
        return out

    provenance = dict(parts[0].provenance or {})
    for key in ("files", "tensors", "dp_ranks"):
        provenance[key] = [x for p in parts for x in (p.provenance or {}).get(key, [])]
    provenance["files"] = sorted(set(provenance["files"]))
    provenance["pattern"] += "+autoep-stack"
    return host_item((*tree, name), writer.Deferred(shape, dtype, make), provenance)


def _check_experts(name: str, master: np.ndarray, stored: list[tuple[Any, str]]) -> None:
    """Each expert's stacked fp32 master rounds to its expert file's weight, every element: a
    part of another EP rank's partition (``use_data_before_expert_parallel``) cannot pass."""
    for g, (weight, tensor) in enumerate(stored):
        what = f"{name!r}: expert {g} of the fp32 master read from the ZeRO partitions"
        moe.check_master(what, weight, tensor, master[g])


__all__ = ["Layer", "autoep_layers", "autoep_records", "autoep_states", "plan_autoep"]
