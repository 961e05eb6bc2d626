"""megatron-core's ``torch_dist`` (what ``dist_checkpointing.save`` writes, and
``dist_checkpointing.load`` / Megatron-LM's ``load_checkpoint`` read), written without torch::

    DST/metadata.json   the sharded backend (torch_dist) and the common one (torch)
    DST/.metadata       torch DCP metadata: each tensor global, in one chunk
    DST/__0_0.distcp    <name> (the model dtype), optimizer.state.{param,exp_avg,exp_avg_sq}.<name>
                        (float32), the layers' ``_extra_state`` objects
    DST/common.pt       iteration, checkpoint_version, the optimizer's param groups and layout,
                        the scheduler state, ``args``, ``content_metadata``

Tensors keep megatron-core's global shapes (stacked ``decoder.layers.*`` [L, ...], a legacy
import's per-layer tensors stacked; fused QKV as the import kept it), so any TP / PP reads its own
shards; vocab-parallel tensors get zero rows up to Megatron-LM's padded vocab for ``tp``. The
optimizer state is the ``fully_reshardable`` layout, which any TP / PP / DP loads: megatron-core 0.16's default
``fully_sharded_model_space`` is refused by its own ShardedTensor check ("flattened_range is not
supported"), and ``dp_reshardable`` / ``dp_zero_gather_scatter`` hold per-rank buffers of one
TP x PP x DP layout."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_ucp._src import format as fmt
from jax_ucp._src import store
from jax_ucp._src.continuation.megatron import check_megatron_record
from jax_ucp._src.errors import RequestError
from jax_ucp._src.exporters import source
from jax_ucp._src.exporters.options import Exported, MegatronExport
from jax_ucp._src.exporters.source import RowSlabs
from jax_ucp._src.restoring import locate
from jax_ucp._src.restoring.model import Request, check_cast
from jax_ucp._src.restoring.sources import ucp_source
from jax_ucp._src.torchfiles import torch_zip
from jax_ucp._src.torchfiles.dcp import DATA_FILE, METADATA_FILE, DcpItem, write_dcp
from jax_ucp._src.torchfiles.pickle_format import Global, New, dumps
from jax_ucp._src.writer import durable

SHARDING = "fully_reshardable"
#: megatron-core's optimizer state names and the UCP moment each is read from (None: params/)
STATES = {"param": None, "exp_avg": "mu", "exp_avg_sq": "nu"}
VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")
BACKENDS = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
_NAME = re.compile(r"(embedding|decoder|output_layer|mtp)\.")
_LAYER = re.compile(r"decoder\.layers\.([0-9]+)\.(.+)")
#: megatron-core's torch_dist names of a layer's norms (its ``sharded_state_dict_keys_map``)
_NORMS = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
)
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.([0-9]+)\.(.+)")
#: a legacy GroupedMLP's buffers and the torch_dist name megatron-core saves them under
_GROUPED_GEMM = {
    "mlp.experts.weight1": "mlp.experts.experts.linear_fc1.weight",
    "mlp.experts.weight2": "mlp.experts.experts.linear_fc2.weight",
}
_ROUTER = "decoder.layers.mlp.router.weight"
_UNEVEN = {"decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"}
_LINEAR = re.compile(r"(decoder\.layers\.(?:[\w.]+\.)?linear_\w+)\.weight")
#: the param groups megatron-core's optimizer builds (decayed, not), by the keys it pairs them on
_DEFAULT_GROUPS = ({"wd_mult": 1.0}, {"wd_mult": 0.0})


def export(root: str, dst: str, options: MegatronExport) -> Exported:
    """The weights, optimizer state and run record of a checkpoint under megatron-core names.

    Args:
        root: the UCP checkpoint directory (a manager step already resolved).
        dst: the directory to create.
        options: this format's options (``engine.export`` checked them)."""
    manifest = store.read_manifest(root)
    available = ucp_source.available_tensors(manifest)
    params, moments, model, count = _keys(root, manifest)
    step = None
    if count is not None:
        (value,) = ucp_source.read(root, manifest, [Request(count)], available=available)
        step = int(value)
    recorded = _source_of(options.run_record) if options.run_record else (manifest.source or {})
    record = recorded.get("megatron_optimizer") or {}
    saved = {e.key: (tuple(e.shape), e.dtype) for e in manifest.tensors}
    given = options.run_record or os.path.join(root, fmt.MANIFEST_FILE)  # passed on to
    check_megatron_record(recorded, saved, f"{os.fspath(given)} (the run record)")  # Megatron-LM
    reads = source.Source(root, manifest, available, progress=options.progress)
    items: list[DcpItem] = []
    arrays: list[RowSlabs] = []

    def add(fqn: str, name: str, keys: list[tuple], dtype: np.dtype) -> tuple[int, ...]:
        """``fqn``: the tensor of parameter ``name`` made of ``keys`` (its layers, or one)."""
        for key in keys:
            check_cast(fqn, available[key].dtype, dtype, "same_kind")
        parts = [reads.tensor(key, dtype, fqn) for key in keys]
        array = _stack(fqn, parts, layered[name]) if name in layered else parts[0]
        if name.endswith(VOCAB_PARALLEL):
            array = _padded(array, -(-array.shape[0] // multiple) * multiple)
        items.append(DcpItem(fqn, (fqn,), array.shape, array.dtype))
        arrays.append(array)
        return array.shape

    multiple = options.make_vocab_size_divisible_by * options.tp
    shapes: dict[str, tuple[int, ...]] = {}
    grouped, layered = _stacked(list(params), lambda n: available[params[n]].shape)
    for name, parts in grouped.items():
        weights = [model.get(n, params[n]) for n in parts]
        shapes[name] = add(name, name, weights, np.dtype(available[weights[0]].dtype))
        for state, moment in STATES.items() if moments else ():
            keys = [moments.get((n, moment), params[n]) for n in parts]
            add(f"optimizer.state.{state}.{name}", name, keys, np.dtype(np.float32))
    reads.total = sum(len(parts) for parts in grouped.values()) * (4 if moments else 1)
    padded_vocab = next((s[0] for n, s in shapes.items() if n.endswith(VOCAB_PARALLEL)), None)
    _check_layout(shapes, options, root)
    objects = _extra_state_names(shapes, recorded.get("skipped_objects"))
    items += [DcpItem(name, (name,), value=[None]) for name in objects]
    iteration = _iteration(options, recorded, record, step)
    settings = recorded.get("settings")
    args = _args(record, settings, shapes, options, iteration, padded_vocab, bool(moments))
    experts = [n for n in shapes if ".experts." in n]
    common = _common(record, args, iteration, step, moments, experts, options)

    def write(tmp: str) -> list[str]:
        write_dcp(tmp, items, arrays, str(manifest.save_id), source.pieces)
        torch_zip.save_file(os.path.join(tmp, "common.pt"), common)
        durable.write_file(os.path.join(tmp, "metadata.json"), json.dumps(BACKENDS))
        return [METADATA_FILE, DATA_FILE, "common.pt", "metadata.json"]

    files = source.write_atomically(dst, write, options.force)
    written = {k for k in (*params.values(), *moments.values(), *model.values(), count)}
    tensors = [it for it in items if it.shape is not None]
    return Exported(
        path=dst,
        files=files,
        tensors=len(tensors),
        bytes=sum(math.prod(t.shape or ()) * np.dtype(t.dtype).itemsize for t in tensors),
        skipped=[fmt.key_to_str(e.key) for e in manifest.tensors if e.key not in written]
        + [fmt.key_to_str(v.key) for v in manifest.values],
    )


def _keys(root: str, manifest: fmt.Manifest):
    """By manifest role (``source.adam_keys``): {name: params key}, {(name, "mu"/"nu"): key},
    {name: model-precision key}, the step count's key; a name megatron-core does not use is a
    ``RequestError``."""
    found = source.adam_keys({e.key: e for e in manifest.tensors}, frozen=True)
    names = {key: ".".join(rel) for key, rel in found.params.items()}
    for key, name in names.items():
        if not _NAME.match(name):
            raise RequestError(
                f"{root}: tensor {fmt.key_to_str(key)!r} has no megatron-core name "
                f"({name!r}); the megatron export writes a checkpoint under megatron-core's "
                f"own names (one imported from Megatron, or continued from one); a tree under "
                f"other names needs its spec run backwards, which this export does not do"
            )
    missing, count = found.missing, found.count
    if not names or (found.moments and (missing or count is None)):
        raise RequestError(
            f"{root}: a megatron export needs the parameters under megatron-core names and, "
            f"with optimizer state, every parameter's Adam moments and the step count; missing: "
            f"{missing[:5] or ([] if names else ['params'])}"
            f"{' and opt_state count' if found.moments and count is None else ''}"
        )
    moments = {(names[k], m): key for (k, m), key in found.moments.items()}
    model = {names[k]: key for k, key in found.model.items()}
    return {n: k for k, n in names.items()}, moments, model, count


def _source_of(path: str | os.PathLike) -> dict:
    """The ``source`` record of the checkpoint at ``path`` (an import from Megatron)."""
    manifest = locate.find_checkpoint(store.storage_for(path)).read_manifest()
    if not manifest.source or not manifest.source.get("megatron_optimizer"):
        raise RequestError(f"run_record={os.fspath(path)!r}: records no Megatron run (imported?)")
    return manifest.source


def _padded(array: RowSlabs, rows: int) -> RowSlabs:
    """``array`` with zero rows appended up to ``rows`` (Megatron-LM's padded vocab)."""
    extra = rows - (array.shape[0] if array.shape else 0)
    if extra <= 0:
        return array

    def slabs():  # the source's slabs as read, then the padding (one slab at a time held)
        yield from array.slabs()
        yield np.zeros((extra, *array.shape[1:]), array.dtype)

    return RowSlabs((rows, *array.shape[1:]), array.dtype, slabs)


def _stacked(
    names: list[str], shape_of: Callable[[str], tuple[int, ...]]
) -> tuple[dict[str, list[str]], dict[str, tuple[int, int]]]:
    """{torch_dist name: the names it is made of}: a legacy import's per-layer
    ``decoder.layers.<i>.*`` stacked over its layers (its norms under megatron-core's torch_dist
    names; a SequentialMLP's ``local_experts.<e>.*`` and a GroupedMLP's ``weight1`` /
    ``weight2`` as ``experts.experts.linear_fc{1,2}.weight`` [L, E, ...]), any other name as it
    is; and each stacked name's layout: (its parts per layer, the experts a grouped one holds)."""
    grouped: dict[str, list[str]] = {}
    layers: dict[str, dict[tuple[int, int], str]] = {}
    layout: dict[str, tuple[int, int]] = {}
    for name in names:
        m = _LAYER.fullmatch(name)
        if m is None:
            grouped[name] = [name]
            continue
        layer, rest, expert = int(m[1]), m[2], 0
        for old, new in _NORMS:
            rest = new + rest[len(old) :] if rest.startswith(old) else rest
        e = _EXPERT.fullmatch(rest)
        if e:  # SequentialMLP: expert e of layer i
            expert, rest = int(e[1]), f"mlp.experts.experts.{e[2]}"
        elif rest in _GROUPED_GEMM:  # GroupedMLP: the layer's experts in one buffer
            router = f"decoder.layers.{layer}.mlp.router.weight"
            if router not in names:
                raise RequestError(f"tensor {name!r}: no {router!r} to count its experts by")
            layout[f"decoder.layers.{_GROUPED_GEMM[rest]}"] = (1, shape_of(router)[0])
            rest = _GROUPED_GEMM[rest]
        layers.setdefault(f"decoder.layers.{rest}", {})[(layer, expert)] = name
    for name, parts in layers.items():
        count = len({i for i, _ in parts}), len({e for _, e in parts})
        if sorted(parts) != [(i, e) for i in range(count[0]) for e in range(count[1])]:
            raise RequestError(f"tensor {name!r}: (layer, expert) {sorted(parts)}, not a grid")
        grouped[name] = [parts[k] for k in sorted(parts)]
        layout.setdefault(name, (count[1], 0))
    return grouped, layout


def _stack(name: str, parts: list[RowSlabs], layout: tuple[int, int]) -> RowSlabs:
    """``parts`` as ``[L, ...]``, or ``[L, E, ...]`` of ``layout[0]`` experts a layer; a grouped
    GEMM's ``weight1`` [h, E*X] / ``weight2`` [E*ffn, h] of ``layout[1]`` experts as
    megatron-core's [E, X, h] / [E, h, ffn] (``GroupedMLP.sharded_state_dict``: a view as
    [E, h, X] / [E, ffn, h], each expert transposed). A layer's parts are read when written."""
    each, split = layout
    shape = parts[0].shape
    if len({(p.shape, p.dtype) for p in parts}) != 1:
        raise RequestError(f"tensor {name!r}: its layers differ in shape or dtype, cannot stack")
    if split and (len(shape) != 2 or shape[name.endswith("linear_fc2.weight")] % split):
        raise RequestError(f"tensor {name!r}: {list(shape)} does not hold {split} experts")
    if split:
        fc1 = name.endswith("linear_fc1.weight")
        view = (split, shape[0], shape[1] // split) if fc1 else (split, shape[0] // split, shape[1])
        shape = (split, view[2], view[1])
    elif each > 1:
        shape = (each, *shape)

    def whole(part: RowSlabs) -> np.ndarray:
        return np.concatenate(list(part.slabs())).reshape(part.shape)

    def slabs():
        for i in range(0, len(parts), each):
            layer = np.stack([whole(p) for p in parts[i : i + each]])
            if split:
                layer = layer.reshape(view).transpose(0, 2, 1)
            yield layer.reshape(1, *shape)

    return RowSlabs((len(parts) // each, *shape), parts[0].dtype, slabs)


def _check_layout(shapes: dict[str, tuple], options: MegatronExport, root: str) -> None:
    """The layout asked for splits this model as megatron-core builds it: its layers evenly
    over ``pp`` (times ``vpp``) stages (unless ``args`` set Megatron-LM's uneven split), its
    experts over ``ep`` ranks; else refused, nothing written (megatron-core would stop at the
    load with an assert)."""
    if options.vpp and options.vpp > 1 and options.pp == 1:
        raise RequestError(f"vpp={options.vpp}: megatron-core's virtual pipeline needs pp > 1")
    layers = next(
        ((n, s) for n, s in shapes.items() if n.startswith("decoder.layers.") and s), None
    )
    router = shapes.get(_ROUTER)  # [L, E, h]
    vpp = f" x vpp={options.vpp}" if options.vpp else ""
    splits = [
        (f"pp={options.pp}{vpp}", options.pp * (options.vpp or 1), "layers", layers, 0),
        (f"ep={options.ep}", options.ep, "experts", router and (_ROUTER, router), 1),
    ]
    if _UNEVEN.intersection(options.args or ()):  # Megatron-LM's uneven pipeline split
        splits = splits[1:]
    for given, parts, what, found, dim in splits:
        if found and len(found[1]) > dim and found[1][dim] % parts:
            raise RequestError(
                f"{given}: the checkpoint at {root} ({fmt.MANIFEST_FILE}) holds {found[1][dim]} "
                f"{what} ({found[0]!r} {list(found[1])} as megatron-core stacks it), which "
                f"megatron-core cannot split in {parts} equal parts"
            )


def _extra_state_names(shapes: dict[str, tuple], recorded: Any) -> list[str]:
    """The layers' ``_extra_state`` objects megatron-core asks for: one per layer (and expert)
    of each stacked ``linear_*`` (its local spec's; the grid this export's shapes give, so a
    layer or shared experts added after the import count), and any other a torch_dist import
    recorded (Transformer Engine's)."""
    found, linears = [], set()
    for name, shape in shapes.items():
        m, grid = _LINEAR.fullmatch(name), shape[: 2 if ".experts." in name else 1]
        if m is not None and shape:  # an expert's: shard_<layer>.<expert>_<L>.<E>
            linears.add(m[1])
            found += [
                f"{m[1]}._extra_state/shard_{_dots(i)}_{_dots(grid)}" for i in np.ndindex(*grid)
            ]
    for name in recorded or ():
        if isinstance(name, str) and "._extra_state/shard_" in name:
            found += [] if name.split("._extra_state/")[0] in linears else [name]
    return found


def _dots(index: tuple[int, ...]) -> str:
    return ".".join(map(str, index))


def _iteration(options: MegatronExport, recorded: dict, record: dict, step: int | None) -> int:
    """The iteration ``common.pt`` records: the optimizer step plus the iterations the recorded
    run skipped (fp16 loss scaling: its iteration minus its optimizer step); without optimizer
    state the one given or recorded. An ``iteration`` or ``args['iteration']`` given that
    disagrees with the optimizer step, or a run record of a later step, is refused: Megatron-LM
    would resume its data and schedule where the optimizer has not been."""
    then = _int(record.get("iteration")) or _int(recorded.get("iteration"))
    if step is None:
        return options.iteration if options.iteration is not None else then or 0
    groups = [g for g in record.get("param_groups") or () if isinstance(g, dict)]
    then_step = groups[0].get("step") if groups else None
    then_step = int(then_step) if isinstance(then_step, (int, float)) else None
    if then_step is not None and step < then_step:
        raise RequestError(
            f"the run record is at optimizer step {then_step}, after this checkpoint's {step}: "
            f"a record of another run (run_record=: the checkpoint this run was imported from)"
        )
    skipped = then - then_step if then is not None and then_step is not None else 0
    want = step + max(skipped, 0)
    given = {
        "iteration": options.iteration,
        "args['iteration']": (options.args or {}).get("iteration"),
    }
    for name, value in given.items():
        if value is not None and value != want:
            raise RequestError(
                f"{name}={value!r}: the optimizer is at step {step} ({max(skipped, 0)} skipped "
                f"iterations recorded), so common.pt's iteration is {want}; written otherwise, "
                f"Megatron-LM would resume its data and schedule where the optimizer has not been"
            )
    return want


def _int(value: Any) -> int | None:
    return value if type(value) is int else None


def _args(
    record, settings, shapes, options: MegatronExport, iteration: int, padded, optimizer: bool
) -> dict:
    """Megatron-LM's ``args``: the recorded run's, what the export knows, ``options.args``."""
    args = source.plain(record.get("args") or {})
    then, batch = _int(record.get("iteration")), _int(args.get("global_batch_size"))
    if then is not None and batch and isinstance(args.get("consumed_train_samples"), int):
        args["consumed_train_samples"] += (iteration - then) * batch
    for key in ("num_attention_heads", "num_query_groups", "ffn_hidden_size", "kv_channels"):
        if isinstance(settings, dict) and _int(settings.get(key)):
            args.setdefault(key, settings[key])
    layers = [s[0] for n, s in shapes.items() if n.startswith("decoder.layers.") and s]
    embedding = shapes.get("embedding.word_embeddings.weight")
    router = shapes.get(_ROUTER)  # [L, E, h]
    if router and len(router) == 3:
        args.setdefault("num_experts", router[1])
    args.update(
        tensor_model_parallel_size=options.tp,
        pipeline_model_parallel_size=options.pp,
        **({"expert_model_parallel_size": options.ep} if router else {}),
        **({"expert_tensor_parallel_size": options.etp or options.tp} if router else {}),
        virtual_pipeline_model_parallel_size=options.vpp,
        make_vocab_size_divisible_by=options.make_vocab_size_divisible_by,
        iteration=iteration,
        ckpt_format="torch_dist",
        **({"num_layers": layers[0]} if layers else {}),
        **({"hidden_size": embedding[1]} if embedding and len(embedding) == 2 else {}),
        **({"padded_vocab_size": padded} if padded else {}),
    )
    if optimizer:
        args.update(use_distributed_optimizer=True, dist_ckpt_optim_fully_reshardable=True)
    args.update(options.args or {})
    return args


def _common(
    record, args: dict, iteration: int, step: int | None, moments, experts, options
) -> dict:
    """``common.pt``: what Megatron-LM's ``save_checkpoint`` keeps beside the sharded tensors."""
    common: dict[str, Any] = {
        "iteration": iteration,
        "checkpoint_version": 3.0,
        "content_metadata": {
            "distrib_optim_sharding_type": SHARDING,
            "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True,
        },
    }
    if moments:
        groups = _param_groups(record, args, step or 0, experts, options.ep)
        members = [
            [g for g in groups if bool(g.get("is_expert_parallel")) is expert]
            for expert in (False, True)
        ]
        states = [
            {"optimizer": {"param_groups": m}, "param_state_sharding_type": SHARDING}
            for m in members
            if m
        ]  # MoE: megatron-core's ChainedOptimizer, the dense optimizer then the experts'
        common["optimizer"] = states[0] if len(states) == 1 else dict(enumerate(states))
    scheduler = record.get("opt_param_scheduler")
    if isinstance(scheduler, dict):
        scheduler = source.plain(scheduler)
        then, batch = _int(record.get("iteration")), _int(args.get("global_batch_size"))
        if then is not None and batch and isinstance(scheduler.get("num_steps"), int):
            scheduler["num_steps"] += (iteration - then) * batch  # samples, as Megatron-LM counts
        common["opt_param_scheduler"] = scheduler
    common["args"] = New(Global("argparse", "Namespace"), args)  # as Megatron-LM saves it
    try:
        dumps(common)
    except TypeError as e:
        raise RequestError(f"args=: {e} (Megatron-LM arguments are plain values)") from None
    return common


def _param_groups(record, args: dict, step: int, experts: list[str], ep: int) -> list[dict]:
    """The recorded param groups (their hyper-parameters), or megatron-core's two default
    groups made from ``args``; each at the exported ``step`` (how torch's Adam counts). A MoE
    model's experts at ``ep`` > 1 are a second optimizer whose groups depend on its parameters:
    recorded (``is_expert_parallel``) or refused; at ``ep`` 1 they join the dense groups."""
    saved = record.get("param_groups")
    recorded = isinstance(saved, list) and saved and all(isinstance(g, dict) for g in saved)
    own = [g for g in saved if g.get("is_expert_parallel")] if recorded else []
    if experts and ep > 1 and not own:
        raise RequestError(
            f"ep={ep}: a megatron export of a MoE model's optimizer state needs the experts' "
            f"param groups (megatron-core's second, expert-parallel optimizer, for "
            f"{experts[0]!r} and the other experts): the run record has none; give "
            f"run_record= the checkpoint imported from megatron-core's run at EP > 1, or ep=1"
        )
    if ep == 1 and own:  # megatron-core at EP 1: the experts in the dense optimizer's groups
        dense = [{**g, "is_expert_parallel": True} for g in saved if g not in own]
        for group in own:
            if group not in dense:
                raise RequestError(
                    f"ep=1: the experts' param group {source.plain(group)} has no dense group "
                    f"of the same hyper-parameters to join (megatron-core at EP 1 keeps one "
                    f"optimizer); export with the run's ep"
                )
        saved = [g for g in saved if g not in own]
    if not recorded:
        if not isinstance(args.get("lr"), (int, float)):
            raise RequestError(
                "a megatron export of optimizer state needs its param groups: the checkpoint "
                "records none (a continued run: give run_record= the checkpoint imported from "
                "Megatron), or give args={'lr': ...} (and weight_decay, adam_beta1, adam_beta2, "
                "adam_eps) to write megatron-core's default two"
            )
        wd = float(args.get("weight_decay", 0.01))
        saved = [
            {
                **g,
                "lr_mult": 1.0,
                "is_expert_parallel": False,
                "is_decoupled_lr": False,
                "lr": float(args["lr"]),
                "betas": (float(args.get("adam_beta1", 0.9)), float(args.get("adam_beta2", 0.999))),
                "eps": float(args.get("adam_eps", 1e-8)),
                "weight_decay": wd * g["wd_mult"],
            }
            for g in _DEFAULT_GROUPS
        ]
    return [{**source.plain(g), "step": float(step)} for g in saved]
