"""Planning the import of a Megatron-LM legacy checkpoint (``mp_rank_*`` files over TP x PP x EP):
rank fragments merged by the import rules' kinds, ``distrib_optim.pt`` cut into per-parameter
pieces laid out like megatron-core's grad buffer."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorstore as ts

from jax_ucp._src import writer
from jax_ucp._src.errors import LanguageError
from jax_ucp._src.format import mapped_file
from jax_ucp._src.importers import rank_grid
from jax_ucp._src.importers.megatron import legacy, rank_states
from jax_ucp._src.importers.megatron.common import (
    STATE_TREES,
    WEIGHTS_ONLY_HINT,
    MegatronImportError,
    ddp_bucket_size,
    param_groups,
    step_from_param_groups,
)
from jax_ucp._src.importers.megatron.rules import add_arg_settings, import_rules_spec
from jax_ucp._src.importers.megatron.run_record import MEGATRON_OPTIMIZER, agreed_record
from jax_ucp._src.importers.megatron.source import MegatronSource
from jax_ucp._src.importers.plan import (
    TENSORS,
    VALUES,
    WHOLE,
    ImportOptions,
    ImportPlan,
    Share,
    agreed_step,
    count_item,
    host_item,
    tensor_names,
)
from jax_ucp._src.language import (
    QKV,
    Partitioned,
    Spec,
    SubParams,
    SwiGLU,
    Vocab,
    merge,
)

_LAYER = re.compile(r"^(.*?\blayers\.)([0-9]+)(\..*)$")
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)([0-9]+)(\..*)$")
_GROUPED_EXPERT = re.compile(r"^.*\.mlp\.experts\.weight[12]$")

# global name -> {stage (or ("emb" | "out", stage) once tied): [per-TP arrays]}
_Fragments = dict[str, dict[Any, list]]


@dataclass
class _LegacyTensors:
    """Every rank's tensors, grouped by global name (per-stage layer and expert numbers made
    global), before merging."""

    fragments: _Fragments = field(default_factory=dict)
    # (pp, tp) -> [(local name, global name, array)] of EP rank 0, in state-dict order
    local: dict[tuple[int, int], list] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    grouped: dict[str, dict[int, list]] = field(default_factory=dict)  # grouped-GEMM: per EP rank
    # global name -> the source tensors (``<rank dir>/<file>:model.<local name>``) merged into it
    sources: dict[str, list[str]] = field(default_factory=dict)
    # source tensors of the rank files not merged into any weight -> why (source.skipped)
    not_imported: dict[str, str] = field(default_factory=dict)

    def files(self, name: str) -> list[str]:
        """The rank files (``<rank dir>/<file>``) the fragments of ``name`` come from."""
        return sorted({source.partition(":")[0] for source in self.sources[name]})


@dataclass
class LegacyMerger:
    """What the legacy items are made from (merge rules, fragments, optimizer slices), and how
    one name's fragments merge with its kind, errors naming the files."""

    checkpoint: legacy.LegacyCheckpoint
    spec: Spec
    matches: dict
    names: list[str]
    tensors: _LegacyTensors
    tied_pairs: list[tuple[str, str]]
    optimizer: dict[str, _Fragments] | None  # state name -> fragments (distrib_optim.pt)
    count: int | None
    want_model: bool
    # state name -> global name -> the distrib_optim.pt tensors its fragments are cut from
    optimizer_sources: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    step_sources: dict[str, list[str]] = field(default_factory=dict)  # tensors / values

    def files_of(self, name: str) -> str:
        return ", ".join(self.tensors.files(name))

    def deferred(self, name: str, stages: dict, what: str) -> tuple[writer.Deferred, str]:
        """The TP fragments merged by the name's kind (several stages: pipeline-tied copies,
        ``rank_grid``), built only once the writer has room for it in the memory budget: a
        merge's result is at most its fragments' bytes (pipeline-tied copies: one stage's)."""
        kind, grid = self.matches[name].kind, list(stages.values())
        pattern = kind.kind if len(stages) == 1 else f"pipeline_tied({kind.kind})"
        bound = max(sum(np.asarray(a).nbytes for a in per_tp) for per_tp in grid)
        files, error = (lambda: self.files_of(name)), MegatronImportError
        make = lambda: rank_grid.merged(kind, grid, name, self.spec, files, what, error)
        view = self.rows_view(name, stages)
        if view is None:
            return writer.Deferred(None, None, make, bound=bound), pattern

        def rows(lo: int, hi: int) -> np.ndarray:
            out = writer.unpooled_empty((hi - lo, *shape[1:]), dtype)
            ts.array(out, copy=False, write=True).write(view[lo:hi]).result()
            return out

        shape, dtype = tuple(int(d) for d in view.shape), view.dtype.numpy_dtype
        return writer.Deferred(shape, dtype, make, bound=bound, rows=rows), pattern

    def rows_view(self, name: str, stages: dict):
        """The lazy merge (a TensorStore view over the fragments, no copy) that rows of a
        tensor larger than the memory budget are read from, for kinds that only rearrange their
        fragments; None for the others, pipeline-tied copies (checked equal when merged), or a
        merge that fails (``merged`` then raises, naming the files)."""
        kind = self.matches[name].kind
        if len(stages) != 1 or not isinstance(kind, (Partitioned, Vocab, QKV, SwiGLU, SubParams)):
            return None
        (per_tp,) = stages.values()
        try:
            view = merge(kind, per_tp, name=name, settings=self.spec.settings, lazy=True)
        except LanguageError:
            return None
        return view if view.rank >= 1 else None

    def grouped(self, name: str) -> tuple[np.ndarray, str]:
        """megatron-core's GroupedMLP: weight1 [h, E_local*X] is used as view(E_local, h, X) and
        weight2 [E_local*ffn, h] as view(E_local, ffn, h); the EP-invariant global tensor (what one
        rank holding all E experts would have) is the EP ranks' buffers concatenated flat."""
        per_stage = []
        for per_ep in self.tensors.grouped[name].values():  # equal shares (_add_grouped_experts)
            shape = per_ep[0].shape
            joined = np.concatenate([mapped_file.read_out(np.asarray(a)) for a in per_ep], axis=0)
            per_stage.append(joined.reshape(shape[0], -1) if name.endswith("weight1") else joined)
        if len(per_stage) > 1:
            raise MegatronImportError(f"tensor {name!r} is held by several pipeline stages")
        return per_stage[0], f"expert(grouped, ep={self.checkpoint.grid.ep}, flat concat)"


def plan_legacy(source_dir: MegatronSource, settings: dict, options: ImportOptions) -> ImportPlan:
    """Legacy TP x PP (x EP): fragments merged per name by the spec's kinds.

    Args:
        source_dir: the detected legacy checkpoint.
        settings: the run's model settings.
        options: ``spec``: the loaded spec whose kinds merge the fragments (None: the default
            rules); ``weights_only``: the model weights alone, the optimizer state skipped and
            listed in ``source.skipped``.
    """
    spec, weights_only, share = options.spec, options.weights_only, options.share
    checkpoint = legacy.open_legacy(source_dir.folder)
    _legacy_settings(checkpoint, settings)
    tensors = _collect_legacy_tensors(checkpoint, _stage_layer_offsets(checkpoint, settings))
    tied_pairs = _tied_output_pairs(checkpoint, tensors.fragments, settings)
    import_spec = import_rules_spec(spec, settings)
    names = list(tensors.fragments)
    matches = import_spec.classify(names, strict=import_spec.strict)
    if import_spec.strict is False:
        uncovered = [n for n in names if n not in matches]
        if uncovered:
            raise MegatronImportError(
                f"{checkpoint.folder.root}: no import rule covers {uncovered[:10]} "
                f"(pass a spec with rules for them)"
            )
    experts = tensors.grouped or checkpoint.grid.ep > 1
    if experts and checkpoint.distrib_optim and not weights_only:
        raise MegatronImportError(
            f"{checkpoint.folder.root}: distrib_optim.pt with "
            f"{'grouped-GEMM' if tensors.grouped else 'expert-parallel'} experts is not "
            f"supported. {WEIGHTS_ONLY_HINT}"
        )
    found = _legacy_found(checkpoint)
    _refuse_unread_optimizer(checkpoint, found, weights_only)
    names += list(tensors.grouped)
    for _, output_layer in tied_pairs:
        names.remove(output_layer)
    dtypes = {a.dtype for st in tensors.fragments.values() for per in st.values() for a in per}
    optimizer, count = (None, None)
    optimizer_sources: dict[str, dict[str, list[str]]] = {}
    if checkpoint.distrib_optim and not weights_only:
        optimizer, count, optimizer_sources = _legacy_distrib_optim(
            checkpoint, settings, tensors.local, tied_pairs
        )
    _fold_tied_copies(tensors.fragments, tied_pairs)
    _fold_tied_lists(tensors.sources, tied_pairs)
    want_model = optimizer is not None and any(d != np.dtype(np.float32) for d in dtypes)
    plan = LegacyMerger(
        checkpoint,
        import_spec,
        matches,
        names,
        tensors,
        tied_pairs,
        optimizer,
        count,
        want_model,
        optimizer_sources,
        _legacy_step_sources(checkpoint, found) if optimizer is not None else {},
    )
    info = _legacy_info(plan, dtypes)
    skipped = _legacy_skipped(plan, found, weights_only)
    if skipped:
        info["skipped"] = skipped
    # the run's args and scheduler: rank 0's, every other rank file's compared with them
    files = [checkpoint.ep_ranks[k] for k in sorted(checkpoint.ep_ranks)][
        : 1 if weights_only else None
    ]
    named = [(f.name, f.state) for f in files]
    record = agreed_record(named, str(checkpoint.folder.root))
    if record is not None:
        info[MEGATRON_OPTIMIZER] = record
    return ImportPlan(
        _legacy_items(plan, share), info, len(share.pick(names)), source_tensors=found
    )


def _legacy_found(checkpoint: legacy.LegacyCheckpoint) -> list[str]:
    """Every tensor of every rank's ``model_optim_rng.pt`` and ``distrib_optim.pt`` (of every
    EP rank's directory too), as ``<rank dir>/<file>:<dotted path>``."""
    found = []
    for rank_file in checkpoint.ep_ranks.values():
        found += [f"{rank_file.name}:{n}" for n in tensor_names(rank_file.state)]
        optim = f"{rank_file.name.rpartition('/')[0]}/distrib_optim.pt"
        if "distrib_optim.pt" in rank_file.beside:
            loaded = legacy.load_rank_file(checkpoint.folder, optim)
            found += [f"{optim}:{n}" for n in tensor_names(loaded)]
    return found


def _refuse_unread_optimizer(
    checkpoint: legacy.LegacyCheckpoint, found: list[str], weights_only: bool
) -> None:
    """Optimizer state in model_optim_rng.pt (Megatron-LM without the distributed optimizer:
    Adam's moments, fp32 masters) is not read: importing the weights alone must be asked for."""
    if weights_only or checkpoint.distrib_optim:
        return
    held = [n for n in found if n.partition(":")[2].startswith("optimizer.")]
    if held:
        raise MegatronImportError(
            f"{checkpoint.folder.root}: the rank files hold the state of a non-distributed "
            f"optimizer ({len(held)} tensors, e.g. {held[0]!r}), which is not supported (only "
            f"the distributed optimizer's distrib_optim.pt is read). {WEIGHTS_ONLY_HINT}"
        )


def _legacy_step_sources(checkpoint: legacy.LegacyCheckpoint, found: list[str]) -> dict:
    """Where opt_state/count comes from: every rank's ``param_groups`` (a step that is a tensor
    named as one)."""
    prefixes = [r.name for r in checkpoint.ranks.values()]
    step = re.compile(
        rf"(?:{'|'.join(map(re.escape, prefixes))}):optimizer\.optimizer\.param_groups\.[0-9]+\.step"
    )
    tensors = [n for n in found if step.fullmatch(n)]
    values = {VALUES: [f"{p}:optimizer.optimizer.param_groups" for p in prefixes]}
    return {TENSORS: tensors, **values} if tensors else values


def _legacy_skipped(plan: LegacyMerger, found: list[str], weights_only: bool) -> dict[str, str]:
    """source.skipped: every tensor of the rank files that no output is built from, and why.
    Anything not named here and not merged is left for the accounting to refuse."""
    tensors = plan.tensors
    skipped = dict(tensors.not_imported)
    if plan.optimizer is not None and not plan.want_model:
        for name in plan.names:
            for source in tensors.sources.get(name, []):
                skipped[source] = (
                    "a float32 run's model weight: its fp32 master in distrib_optim.pt is "
                    "imported as params/"
                )
    for name in found:
        file, _, path = name.partition(":")
        if path.startswith("rng_state."):
            skipped[name] = "random number generator state: not part of the imported state"
        elif weights_only and (file.endswith("distrib_optim.pt") or path.startswith("optimizer.")):
            skipped[name] = f"weights_only: optimizer state ({file})"
        elif path.startswith("optimizer.grad_scaler."):
            skipped[name] = "the fp16 loss scaler's state (grad_scaler): not imported"
    return skipped


def _legacy_settings(checkpoint: legacy.LegacyCheckpoint, settings: dict) -> None:
    """Settings the pickled run arguments give (those not set already), with the head layout."""
    if checkpoint.checkpoint_version is not None and checkpoint.checkpoint_version < 2.0:
        # before 2.0 Megatron-LM laid fused QKV out differently (fix_query_key_value_ordering)
        raise MegatronImportError(
            f"{checkpoint.ranks[(0, 0)].path}: checkpoint_version {checkpoint.checkpoint_version} "
            f"uses the pre-2.0 fused QKV ordering, which is not supported"
        )
    add_arg_settings(checkpoint.args, settings)
    if settings.get("kv_channels") and not settings.get("head_dim"):
        settings["head_dim"] = settings["kv_channels"]
    heads, hidden = settings.get("num_attention_heads"), settings.get("hidden_size")
    if heads and hidden and not settings.get("head_dim"):
        settings["head_dim"] = int(hidden) // int(heads)
    if not settings.get("group_query_attention", True) or not settings.get("num_query_groups"):
        settings["num_query_groups"] = settings.get("num_attention_heads")


def _stage_layer_offsets(checkpoint: legacy.LegacyCheckpoint, settings) -> dict[int, int]:
    """Per-stage layer offset: sum of the distinct layer counts of the earlier stages."""
    offsets, total = {}, 0
    for stage in range(checkpoint.grid.pp):
        offsets[stage] = total
        rank_file = checkpoint.ranks[(stage, 0)]
        numbers = {int(m.group(2)) for n in rank_file.model for m in [_LAYER.match(n)] if m}
        if numbers and sorted(numbers) != list(range(len(numbers))):
            raise MegatronImportError(
                f"{rank_file.path}: layer numbers {sorted(numbers)} are not 0..{len(numbers) - 1}"
            )
        total += len(numbers)
    num_layers = settings.get("num_layers")
    if num_layers and total and total != num_layers:
        raise MegatronImportError(
            f"{checkpoint.folder.root}: stages hold {total} layers in all, "
            f"args.num_layers={num_layers}"
        )
    return offsets


def _collect_legacy_tensors(
    checkpoint: legacy.LegacyCheckpoint, offsets: dict[int, int]
) -> _LegacyTensors:
    tensors = _LegacyTensors(local={key: [] for key in checkpoint.ranks})  # state-dict order
    for stage in range(checkpoint.grid.pp):
        local_names = list(checkpoint.ranks[(stage, 0)].model)
        local_experts = _check_stage_names(checkpoint, stage, local_names)
        for name in local_names:
            first = checkpoint.ranks[(stage, 0)].model[name]
            if name.endswith("_extra_state") or not isinstance(first, np.ndarray):
                tensors.skipped.append(name if checkpoint.grid.pp == 1 else f"stage{stage}:{name}")
                for (pp_rank, _, _), rank_file in checkpoint.ep_ranks.items():
                    if pp_rank == stage and isinstance(rank_file.model[name], np.ndarray):
                        tensors.not_imported[rank_file.source(name)] = (
                            "TransformerEngine _extra_state (FP8 scaling metadata), not a weight"
                        )
                continue
            layer = _LAYER.match(name)
            global_name = (
                f"{layer.group(1)}{int(layer.group(2)) + offsets[stage]}{layer.group(3)}"
                if layer
                else name
            )
            if checkpoint.grid.ep > 1 and _GROUPED_EXPERT.match(name):
                _add_grouped_experts(checkpoint, tensors, stage, name, global_name)
            else:
                _add_tp_fragments(checkpoint, tensors, stage, name, global_name, local_experts)
    return tensors


def _check_stage_names(checkpoint: legacy.LegacyCheckpoint, stage: int, names: list[str]) -> int:
    """Every TP/EP rank of a stage holds the same names; returns the local expert count."""
    first = checkpoint.ranks[(stage, 0)]
    for (pp_rank, tp_rank, ep_rank), rank_file in checkpoint.ep_ranks.items():
        if pp_rank == stage and (tp_rank, ep_rank) != (0, 0) and set(rank_file.model) != set(names):
            diff = sorted(set(names) ^ set(rank_file.model))[:5]
            raise MegatronImportError(
                f"{rank_file.path} and {first.path} hold different tensor names (e.g. {diff})"
            )
    experts = {int(m.group(2)) for n in names for m in [_LOCAL_EXPERT.match(n)] if m}
    if experts and sorted(experts) != list(range(len(experts))):
        raise MegatronImportError(
            f"{first.path}: local expert indices {sorted(experts)} are not 0..{len(experts) - 1}"
        )
    return len(experts)


def _add_grouped_experts(
    checkpoint: legacy.LegacyCheckpoint, tensors: _LegacyTensors, stage, name, global_name
) -> None:
    """A grouped-GEMM expert weight: one buffer per EP rank (no TP split supported)."""
    if checkpoint.grid.tp > 1:
        raise MegatronImportError(
            f"tensor {name!r} in {checkpoint.ranks[(stage, 0)].path}: grouped-GEMM experts "
            f"with TP > 1 are not supported"
        )
    holders = [checkpoint.ep_ranks[(stage, 0, ep_rank)] for ep_rank in range(checkpoint.grid.ep)]
    values = [r.model[name] for r in holders]
    _check_equal_shares(name, values, [r.path for r in holders], "expert-parallel")
    tensors.grouped.setdefault(global_name, {})[stage] = values
    tensors.sources.setdefault(global_name, []).extend(r.source(name) for r in holders)


def _check_equal_shares(name: str, values: list, paths: list, what: str) -> None:
    """Megatron splits a tensor evenly over TP / EP ranks (or replicates it): every rank's
    share has rank 0's shape and dtype. Unequal shares would concatenate into a tensor of the
    wrong size, mixed dtypes be silently promoted."""
    for value, path in zip(values, paths):
        if not isinstance(value, np.ndarray):
            raise MegatronImportError(
                f"tensor {name!r} in {path}: a {type(value).__name__}, expected a tensor "
                f"({paths[0]} holds one)"
            )
        first = values[0]
        if value.shape != first.shape or value.dtype != first.dtype:
            raise MegatronImportError(
                f"tensor {name!r}: {path} holds {list(value.shape)} {value.dtype}, {paths[0]} "
                f"holds {list(first.shape)} {first.dtype}; every {what} rank holds an equal "
                f"share (same shape and dtype)"
            )


def _add_tp_fragments(
    checkpoint: legacy.LegacyCheckpoint,
    tensors: _LegacyTensors,
    stage: int,
    name: str,
    global_name: str,
    local_experts: int,
) -> None:
    """The TP fragments of one tensor (of each EP rank's experts, numbered globally)."""
    expert = _LOCAL_EXPERT.match(global_name) if checkpoint.grid.ep > 1 else None
    for ep_rank in range(checkpoint.grid.ep) if expert else [0]:
        expert_name = (
            f"{expert.group(1)}{ep_rank * local_experts + int(expert.group(2))}{expert.group(3)}"
            if expert
            else global_name
        )
        holders = [checkpoint.ep_ranks[(stage, tp, ep_rank)] for tp in range(checkpoint.grid.tp)]
        per_tp = [r.model[name] for r in holders]
        _check_equal_shares(name, per_tp, [r.path for r in holders], "tensor-parallel")
        if ep_rank == 0:
            for tp_rank, value in enumerate(per_tp):
                tensors.local[(stage, tp_rank)].append((name, expert_name, value))
        tensors.fragments.setdefault(expert_name, {})[stage] = per_tp
        tensors.sources.setdefault(expert_name, []).extend(r.source(name) for r in holders)
    if expert is None:  # a non-expert tensor: every EP rank holds a copy, EP rank 0's is read
        for ep_rank in range(1, checkpoint.grid.ep):
            for tp_rank in range(checkpoint.grid.tp):
                copy = checkpoint.ep_ranks[(stage, tp_rank, ep_rank)]
                read = checkpoint.ep_ranks[(stage, tp_rank, 0)]
                tensors.not_imported[copy.source(name)] = (
                    f"expert-parallel rank {ep_rank}'s copy of a non-expert tensor: imported "
                    f"from EP rank 0's {read.name}"
                )


def _tied_output_pairs(
    checkpoint: legacy.LegacyCheckpoint, fragments: _Fragments, settings: dict
) -> list[tuple[str, str]]:
    """(embedding, output layer) pairs that are one tied weight: Megatron keeps a copy of the
    embedding on the last stage (checked equal when the run's arguments do not say)."""
    untie = settings.get("untie_embeddings_and_output_weights")
    pairs = []
    for embedding in [n for n in fragments if n.endswith("embedding.word_embeddings.weight")]:
        output = embedding.replace("embedding.word_embeddings.weight", "output_layer.weight")
        if output not in fragments:
            continue
        if untie is False:
            pairs.append((embedding, output))
        elif untie is None and checkpoint.grid.pp > 1:
            first_embedding = next(iter(fragments[embedding].values()))
            first_output = next(iter(fragments[output].values()))
            if all(
                np.array_equal(mapped_file.read_out(a), mapped_file.read_out(b))
                for a, b in zip(first_embedding, first_output)
            ):
                pairs.append((embedding, output))
    return pairs


def _fold_tied_copies(fragments: _Fragments, tied_pairs: list[tuple[str, str]]) -> None:
    """The output layer's stages join the embedding's (merged as pipeline-tied copies)."""
    for embedding, output in tied_pairs:
        fragments[embedding] = {
            **{("emb", stage): v for stage, v in fragments[embedding].items()},
            **{("out", stage): v for stage, v in fragments.pop(output).items()},
        }


def _fold_tied_lists(lists: dict[str, list], tied_pairs: list[tuple[str, str]]) -> None:
    """Per-name lists (files, source tensors): the output layer's join the embedding's."""
    for embedding, output in tied_pairs:
        lists[embedding] += lists.pop(output)


def _legacy_distrib_optim(
    checkpoint: legacy.LegacyCheckpoint, settings: dict, local: dict, tied_pairs: list
) -> tuple[dict[str, _Fragments], int, dict[str, dict[str, list[str]]]]:
    """Slice every rank's distrib_optim.pt flat buffers into per-parameter local fragments, cut
    at its parameters' places in megatron-core's grad buffer; returns ({state name: fragments},
    step, {state name: {global name: the flat tensors its fragments are cut from}})."""
    missing = [key for key in checkpoint.ranks if key not in checkpoint.distrib_optim]
    if missing:
        raise MegatronImportError(
            f"missing shard file "
            f"{checkpoint.folder.join(checkpoint.ranks[missing[0]].name.rpartition('/')[0])}/"
            f"distrib_optim.pt "
            f"(other ranks have one)"
        )
    bucket_size = ddp_bucket_size(settings)
    tied = settings.get("untie_embeddings_and_output_weights") is False
    out: dict[str, _Fragments] = {state_name: {} for state_name in STATE_TREES}
    sources: dict[str, dict[str, list[str]]] = {state_name: {} for state_name in out}
    steps: dict[float, str] = {}
    for (stage, tp_rank), rank_file in checkpoint.ranks.items():
        path = checkpoint.distrib_optim[(stage, tp_rank)]
        buffer = (checkpoint.grid.chunk(stage), checkpoint.grid.vpp)  # one per model chunk
        saved = legacy.load_rank_file(checkpoint.folder, path)
        buffers = rank_states.distrib_optim_state(saved, checkpoint.folder.join(path), *buffer)
        rank_tensors = local[(stage, tp_rank)]
        params = [(local_name, int(a.size)) for local_name, _, a in rank_tensors]
        shared = {  # a pipeline-tied embedding (and its copy on the last stage): its own bucket
            n
            for n, _, _ in rank_tensors
            if checkpoint.grid.pp > 1
            and (
                (stage == 0 and n.endswith("embedding.word_embeddings.weight"))
                or (stage == checkpoint.grid.pp - 1 and tied and n.endswith("output_layer.weight"))
            )
        }
        whose = rank_file.name
        layout = rank_states.distrib_optim_layout(params, shared, bucket_size, buffers, whose)
        for local_name, global_name, value in rank_tensors:
            start, end = layout[local_name]
            for state_name, per_name in out.items():
                per_tp = per_name.setdefault(global_name, {}).setdefault(
                    stage, [None] * checkpoint.grid.tp
                )
                per_tp[tp_rank] = buffers.arrays[state_name][start:end].reshape(value.shape)
                flat = f"{path}:{buffers.names[state_name]}"
                sources[state_name].setdefault(global_name, []).append(flat)
        groups = param_groups(rank_file.state.get("optimizer"))
        step = step_from_param_groups(groups, f"{rank_file.path} ['optimizer']")
        steps.setdefault(step, f"in {rank_file.path}")
    count = agreed_step(
        steps, str(checkpoint.folder.root), recorded_by="ranks", error=MegatronImportError
    )
    for per_name in out.values():  # the tied output layer's copy merges like the weights
        _fold_tied_copies(per_name, tied_pairs)
    for per_name in sources.values():
        _fold_tied_lists(per_name, tied_pairs)
    return out, count, sources


def _legacy_items(plan: LegacyMerger, share: Share = WHOLE) -> Iterator[writer.HostItem]:
    """Per name: the merged weight, or master + moments (+ model copy) with distrib_optim.pt."""
    checkpoint, tensors = plan.checkpoint, plan.tensors
    optimizer_files = sorted(checkpoint.distrib_optim.values())
    for name in share.pick(plan.names):
        files = tensors.files(name)
        parallel = {"tp": checkpoint.grid.tp, "pp": checkpoint.grid.pp, "ep": checkpoint.grid.ep}
        provenance = {"format": "legacy", "files": files, **parallel}
        weights = {**provenance, TENSORS: tensors.sources[name]}
        if name in tensors.grouped or plan.optimizer is None:
            value, pattern = (
                plan.grouped(name)
                if name in tensors.grouped
                else plan.deferred(name, tensors.fragments[name], "model weights")
            )
            yield host_item(("params", name), value, {**weights, "pattern": pattern})
            continue
        for state_name, tree in STATE_TREES.items():
            what = f"distrib_optim.pt {state_name}"
            value, pattern = plan.deferred(name, plan.optimizer[state_name][name], what)
            yield host_item(
                (*tree, name),
                value,
                {
                    **provenance,
                    "files": sorted(set(files) | set(optimizer_files)),
                    "pattern": pattern,
                    "source": f"distrib_optim.pt:{state_name}",
                    TENSORS: plan.optimizer_sources[state_name][name],
                },
            )
        if plan.want_model:
            value, pattern = plan.deferred(name, tensors.fragments[name], "model weights")
            yield host_item(("model_params", name), value, {**weights, "pattern": pattern})
    if plan.count is not None and share.primary:  # set with the optimizer
        rank_files = (r.name for r in checkpoint.ranks.values())
        yield count_item(
            plan.count,
            {
                "files": sorted(rank_files),
                "pattern": "optimizer.param_groups.step",
                **plan.step_sources,
            },
        )


def _legacy_info(plan: LegacyMerger, dtypes: set) -> dict:
    """What the manifest records about the legacy checkpoint (padding stripped, ties, ...)."""
    checkpoint, tensors = plan.checkpoint, plan.tensors
    stripped = {}
    for name in plan.names:
        if name in tensors.grouped:
            continue
        kind = plan.matches[name].kind
        if isinstance(kind, Vocab) and isinstance(kind.vocab_size, int):
            rows = sum(int(a.shape[0]) for a in next(iter(tensors.fragments[name].values())))
            if rows > kind.vocab_size:
                stripped[name] = [rows, kind.vocab_size]
    info = {
        "format": "legacy",
        "tp": checkpoint.grid.tp,
        "pp": checkpoint.grid.pp // checkpoint.grid.vpp,  # virtual stages: pp * vp
        "ep": checkpoint.grid.ep,
        "iteration": checkpoint.iteration,
        "vocab_stripped": stripped,
        "checkpoint_version": checkpoint.checkpoint_version,
        "skipped_objects": tensors.skipped,
        "tied_embeddings": [embedding for embedding, _ in plan.tied_pairs],
        "model_dtype": ", ".join(sorted(str(d) for d in dtypes)),
        "optimizer_layout": None if plan.optimizer is None else "distrib_optim",
    }
    if checkpoint.grid.vpp > 1:
        info["virtual_pipeline"] = checkpoint.grid.vpp
    if not checkpoint.distrib_optim and any(
        "optimizer" in r.state for r in checkpoint.ranks.values()
    ):
        info["notes"] = [
            "model_optim_rng.pt holds a non-distributed optimizer state: not imported "
            "(only the distributed optimizer's distrib_optim.pt is supported)"
        ]
    return info
