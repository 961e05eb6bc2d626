"""Import Megatron-LM / megatron-core checkpoints (torch_dist and legacy TP x PP) as UCP.

Two source formats, detected from the directory:

* ``torch_dist`` (megatron-core ``dist_checkpointing``; torch Distributed Checkpoint on disk):
  every tensor already has its global shape in ``.metadata``; chunks are assembled from the
  ``.distcp`` byte ranges (:mod:`megatron_dcp`). Layers stay stacked ``[L, ...]``; only the vocab
  padding is stripped. With megatron-core's DistributedOptimizer state saved in its
  ``fully_reshardable`` (model-space) form, ``optimizer.state.{param,exp_avg,exp_avg_sq}.<name>``
  become ``params`` / ``opt_state.mu`` / ``opt_state.nu`` and the step in ``common.pt``
  becomes ``opt_state.count``.
* legacy (``latest_checkpointed_iteration.txt`` + ``iter_NNNNNNN/mp_rank_TT[_PPP]/
  model_optim_rng.pt``): per-rank state dicts merged over TP with the UCP language's kinds
  (vocab, qkv, swiglu, partitioned, replicated, pipeline_tied), per-stage layer numbers made
  global; megatron-core names and Megatron-LM's older ``language_model.*`` names both covered.

The original vocab size is not recorded by either format: it comes from ``vocab_size=`` (CLI
``--vocab-size``) or the spec's settings. Without it the padded rows are kept and the manifest
says so.

Output tree (the importer contract, docs/FORMAT.md section 2.6): ``params`` (fp32 master weights when optimizer state is
present, else the model weights), ``opt_state`` {``mu``, ``nu``, ``count``}, ``model_params``
(model-precision weights, only when they are not fp32). Keys are the source names.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jax_ucp import writer
from jax_ucp.format import UCPError
from jax_ucp.importers import torch_pickle
from jax_ucp.importers.megatron import dcp, legacy
from jax_ucp.importers.plan import (
    TENSORS,
    VALUES,
    WHOLE,
    ImportPlan,
    Share,
    agreed_step,
    host_item,
    tensor_names,
)
from jax_ucp.language import (
    QKV,
    ImportRule,
    MergeError,
    Partitioned,
    PipelineTied,
    Replicated,
    Spec,
    SwiGLU,
    Vocab,
    load_spec,
    merge,
)

__all__ = [
    "MegatronImportError",
    "plan_megatron",
    "detect_megatron",
    "is_megatron_checkpoint",
    "default_import_rules",
    "MegatronSource",
]


class MegatronImportError(UCPError, ValueError):
    """The Megatron checkpoint is incomplete, inconsistent or unsupported (names tensor + file)."""


@dataclass(frozen=True)
class MegatronSource:
    format: str  # "torch_dist" | "legacy"
    root: Path  # the directory the user gave (or its checkpoint root)
    ckpt_dir: Path  # the directory holding .metadata (torch_dist) or the mp_rank_* dirs (legacy)
    iteration: int | None


def detect_megatron(src: os.PathLike | str) -> MegatronSource | None:
    """torch_dist or legacy, from a checkpoint root (with the tracker file) or an iter directory."""
    path = Path(src)
    if not path.is_dir():
        return None
    # lexists, not is_file: a .metadata or tracker that is a FIFO, a device or too large is
    # this format's file gone wrong, reported as such by the reader, not "not a checkpoint"
    if os.path.lexists(path / ".metadata"):
        return MegatronSource("torch_dist", path, path, _iteration_of(path))
    try:
        root, iteration_dir, iteration = legacy.resolve_iteration_dir(path)
    except legacy.LegacyError:
        if os.path.lexists(path / legacy.TRACKER_FILE):
            raise
        return None
    if os.path.lexists(iteration_dir / ".metadata"):
        return MegatronSource("torch_dist", root, iteration_dir, iteration)
    if any(d.name.startswith("mp_rank_") for d in iteration_dir.iterdir() if d.is_dir()):
        return MegatronSource("legacy", root, iteration_dir, iteration)
    return None


def _iteration_of(path: Path) -> int | None:
    match = re.fullmatch(r"iter_(\d+)", path.name)
    return int(match.group(1)) if match else None


def is_megatron_checkpoint(src: os.PathLike | str) -> bool:
    return detect_megatron(src) is not None


# ----------------------------------------------------------------------------- entry point


def plan_megatron(
    src: os.PathLike | str,
    *,
    spec: Any = None,
    vocab_size: int | None = None,
    weights_only: bool = False,
    share: Share = WHOLE,
) -> ImportPlan:
    """The import of a Megatron checkpoint (torch_dist or legacy; detected).

    ``spec``: a :class:`jax_ucp.language.Spec`, a shipped spec name or a TOML path; its settings
    (e.g. ``vocab_size``) and import rules are used. ``vocab_size`` (the tokenizer's, before
    Megatron's padding) overrides the spec's. ``weights_only``: the model weights alone, the
    optimizer state (whatever its layout) skipped and listed in the manifest's source. Every
    check that needs no tensor bytes runs before this returns.
    """
    try:
        source_dir = detect_megatron(src)
    except legacy.LegacyError as e:
        raise MegatronImportError(str(e)) from None
    if source_dir is None:
        raise MegatronImportError(
            f"{src}: not a Megatron checkpoint (no .metadata, no "
            f"latest_checkpointed_iteration.txt / iter_NNNNNNN/mp_rank_* layout)"
        )
    user_spec = None if spec is None else spec if isinstance(spec, Spec) else load_spec(spec)
    settings: dict[str, Any] = dict(user_spec.env) if user_spec is not None else {}
    if vocab_size is not None:
        settings["vocab_size"] = int(vocab_size)
    try:
        if source_dir.format == "torch_dist":
            plan = _plan_torch_dist(source_dir, user_spec, settings, weights_only, share)
        else:
            plan = _plan_legacy(source_dir, user_spec, settings, weights_only, share)
    except (dcp.DcpError, legacy.LegacyError) as e:
        raise MegatronImportError(str(e)) from None
    info = dict(plan.source)
    iteration = info.pop("iteration", None)
    source = {
        "framework": "megatron",
        "path": os.path.abspath(source_dir.ckpt_dir),
        "iteration": source_dir.iteration if source_dir.iteration is not None else iteration,
        "vocab_size": settings.get("vocab_size"),
        "settings": _jsonable(settings),
        **_jsonable(info),
    }
    if settings.get("vocab_size") is None:
        source.setdefault("notes", []).append(
            "vocab padding kept: the original vocab size was not given (vocab_size= / --vocab-size)"
        )
    return ImportPlan(
        _reader_errors_named(plan.items), source, plan.total_params, plan.source_tensors
    )


def _reader_errors_named(items: Iterator[writer.HostItem]) -> Iterator[writer.HostItem]:
    """``items``, with the readers' errors met while reading raised as this importer's."""
    try:
        yield from items
    except (dcp.DcpError, legacy.LegacyError) as e:
        raise MegatronImportError(str(e)) from None


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


# ----------------------------------------------------------------------------- import rules

_VOCAB = r"(?:.*\.)?(?:embedding\.word_embeddings\.weight|output_layer\.(?:weight|bias))"

# Megatron-LM run arguments (pickled argparse.Namespace) taken as import settings.
_ARG_SETTINGS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "swiglu",
    "padded_vocab_size",
    "make_vocab_size_divisible_by",
    "untie_embeddings_and_output_weights",
    "group_query_attention",
    "normalization",
    "position_embedding_type",
    "num_experts",
    "vocab_size",
    "overlap_grad_reduce",
    "data_parallel_size",
    "ddp_bucket_size",
    "add_bias_linear",
    "max_position_embeddings",
)


def default_import_rules(settings: Mapping[str, Any]) -> list:
    """How each Megatron tensor is spread over TP ranks (megatron-core and older Megatron-LM names).

    Dims count from the end so the same rule covers per-layer and stacked ``[L, ...]`` tensors.
    ``qkv`` is used when the head counts are known (it checks the per-query-group layout),
    ``swiglu`` when the MLP is gated; otherwise plain ``partitioned``.
    """
    vocab = (
        Vocab(dim=0, vocab_size=int(settings["vocab_size"]))
        if settings.get("vocab_size") is not None
        else Partitioned(dim=0)
    )
    heads, groups = settings.get("num_attention_heads"), settings.get("num_query_groups")
    head_dim = settings.get("head_dim")
    if heads and head_dim:
        kv_heads = int(groups or heads)
        qkv_weight = QKV(
            dim=-2, num_heads=int(heads), num_kv_heads=kv_heads, head_dim=int(head_dim)
        )
        qkv_bias = QKV(dim=-1, num_heads=int(heads), num_kv_heads=kv_heads, head_dim=int(head_dim))
    else:
        qkv_weight, qkv_bias = Partitioned(dim=-2), Partitioned(dim=-1)
    gated = bool(settings.get("swiglu") or settings.get("gated_linear_unit"))
    fc1_weight, fc1_bias = (
        (SwiGLU(dim=-2), SwiGLU(dim=-1)) if gated else (Partitioned(dim=-2), Partitioned(dim=-1))
    )
    optional = dict(required=False)
    row_parallel = r".*\.(?:linear_proj|dense|linear_fc2|dense_4h_to_h)"
    return [
        ImportRule(_VOCAB, vocab, label="vocab-parallel embedding / output layer", **optional),
        ImportRule(r"(?:.*\.)?position_embeddings\.weight", Replicated(), **optional),
        ImportRule(
            r".*\.(?:linear_qkv|query_key_value)\.weight", qkv_weight, label="fused qkv", **optional
        ),
        ImportRule(
            r".*\.(?:linear_qkv|query_key_value)\.bias",
            qkv_bias,
            label="fused qkv bias",
            **optional,
        ),
        ImportRule(
            r".*\.(?:linear_fc1|dense_h_to_4h)\.weight", fc1_weight, label="fc1", **optional
        ),
        ImportRule(
            r".*\.(?:linear_fc1|dense_h_to_4h)\.bias", fc1_bias, label="fc1 bias", **optional
        ),
        ImportRule(
            rf"{row_parallel}\.weight", Partitioned(dim=-1), label="row-parallel", **optional
        ),
        ImportRule(rf"{row_parallel}\.bias", Replicated(), label="row-parallel bias", **optional),
        ImportRule(
            r".*(?:norm|layer_norm)[^.]*\.(?:weight|bias)", Replicated(), label="norms", **optional
        ),
        ImportRule(
            r".*\.router\.(?:weight|expert_bias)", Replicated(), label="MoE router", **optional
        ),
    ]


def _import_spec(user_spec: Spec | None, settings: dict) -> Spec:
    """The spec used to classify names: the user's import rules if it has any, else the defaults."""
    known = {k: v for k, v in settings.items() if v is not None}
    if user_spec is not None and user_spec.imports:
        return user_spec.with_settings(**known)
    return Spec(
        name="megatron-default-import",
        settings=known,
        imports=tuple(default_import_rules(settings)),
        strict=False,
    )


def _step_from_param_groups(groups: Any, where: str) -> int:
    """The optimizer step of a torch optimizer state's ``param_groups`` (all groups agree)."""
    if not isinstance(groups, list) or not groups:
        raise MegatronImportError(
            f"{where}: optimizer param_groups missing or empty; cannot recover the step. "
            f"{WEIGHTS_ONLY_HINT}"
        )
    seen: dict[float, str] = {}
    for index, group in enumerate(groups):
        if not isinstance(group, dict) or "step" not in group:
            raise MegatronImportError(
                f"{where}: optimizer param_groups[{index}] has no 'step'. {WEIGHTS_ONLY_HINT}"
            )
        seen.setdefault(float(np.asarray(group["step"])), f"(group {index})")
    return agreed_step(seen, where, recorded_by="parameter groups", error=MegatronImportError)


# ----------------------------------------------------------------------------- torch_dist

_OPTIMIZER_PREFIX = "optimizer.state."
SUPPORTED_LAYOUTS = (
    "supported distributed-optimizer layouts: 'dp_reshardable' (megatron-core 0.15-0.19, "
    "Megatron-LM's default; parameters of one dtype, MoE SequentialMLP experts in their own "
    "ChainedOptimizer member), 'fully_reshardable' (0.15-0.19), "
    "'fully_sharded_model_space' (0.13-0.15, Megatron-LM's default in 0.13/0.14), "
    "'dp_zero_gather_scatter' (0.13-0.19)"
)
WEIGHTS_ONLY_HINT = (
    "To import the model weights without the optimizer state: "
    "convert(..., weights_only=True) / jax-ucp convert --weights-only"
)
# megatron-core's optimizer state names, and where each goes in the output tree
_OPTIMIZER_STATE_TREES = {
    "param": ("params",),
    "fp32_param": ("params",),
    "exp_avg": ("opt_state", "mu"),
    "exp_avg_sq": ("opt_state", "nu"),
}


def _plan_torch_dist(
    source_dir: MegatronSource,
    spec: Spec | None,
    settings: dict,
    weights_only: bool = False,
    share: Share = WHOLE,
) -> ImportPlan:
    """torch_dist: tensors read whole (vocab rows stripped); its ``source`` is the format's info."""
    checkpoint, common, common_path = _open_torch_dist(source_dir.ckpt_dir)
    if not settings.get("num_layers") and isinstance(common, dict):
        for key, value in legacy.args_dict(common.get("args")).items():
            if key in _ARG_SETTINGS and settings.get(key) is None:
                settings[key] = value
    model_names = [n for n in checkpoint.tensors if not is_optimizer_name(n)]
    optimizer_names = [n for n in checkpoint.tensors if is_optimizer_name(n)]
    chained = _chained_layouts(checkpoint, common)
    skipped: dict[str, str] = {}  # source.skipped: every .metadata tensor not imported, and why
    buckets = None
    if weights_only:
        layout = (
            f"ChainedOptimizer {chained}"
            if chained is not None
            else repr(_sharding_type(common) or ("fully_reshardable" if optimizer_names else None))
        )
        # every optimizer tensor by name: none is dropped without a word
        skipped = {n: f"weights_only: optimizer state (layout {layout})" for n in optimizer_names}
        optimizer_tensors = {}
    elif chained is not None:
        buckets = _chained_states(checkpoint, model_names, settings, chained)
        optimizer_tensors = {} if buckets is not None else _optimizer_tensors(checkpoint, common)
    elif _sharding_type(common) == "dp_reshardable":
        buckets = _in_module_order(_BucketStates, checkpoint, model_names, settings)
        optimizer_tensors = {}
    elif _sharding_type(common) == "dp_zero_gather_scatter":
        if optimizer_names:  # this layout saves objects only: a tensor is something else
            raise MegatronImportError(
                f"{checkpoint.path / '.metadata'}: optimizer tensor {optimizer_names[0]!r} in a "
                f"dp_zero_gather_scatter checkpoint (whose optimizer state is objects); "
                f"{SUPPORTED_LAYOUTS}. {WEIGHTS_ONLY_HINT}"
            )
        buckets = _in_module_order(_GatheredStates, checkpoint, model_names, settings)
        optimizer_tensors = {}
    else:
        optimizer_tensors = _optimizer_tensors(checkpoint, common)
        objects = [n for n in checkpoint.objects if is_optimizer_name(n)]
        if not optimizer_tensors and objects:
            # e.g. megatron-core 0.13's dp_zero_gather_scatter: the state is pickled bucket
            # objects; importing the weights alone without saying so would lose it silently
            raise MegatronImportError(
                f"{checkpoint.path / '.metadata'}: the optimizer state is saved as "
                f"{len(objects)} objects ({objects[0]!r}, ...) in layout "
                f"{_sharding_type(common)!r}, which is not supported ({SUPPORTED_LAYOUTS}). "
                f"{WEIGHTS_ONLY_HINT}"
            )
    count = None
    if optimizer_tensors:
        _check_optimizer_tensors(checkpoint, common, common_path, optimizer_tensors, model_names)
        optimizer_state = common.get("optimizer") if isinstance(common, dict) else None
        if chained is not None:  # one param_groups per ChainedOptimizer member, one step
            steps = {
                _step_from_param_groups(_param_groups(part), f"{common_path} (optimizer {i})")
                for i, part in sorted(optimizer_state.items())
            }
            if len(steps) != 1:
                raise MegatronImportError(
                    f"{common_path}: the ChainedOptimizer's members disagree on the step "
                    f"{sorted(steps)}"
                )
            count = steps.pop()
        else:
            count = _step_from_param_groups(_param_groups(optimizer_state), str(common_path))
    elif buckets is not None:
        count = buckets.step()
    reader = _TorchDistReader(checkpoint, _import_spec(spec, settings))
    model_dtypes = {checkpoint.tensors[n].dtype for n in model_names}
    has_optimizer = bool(optimizer_tensors) or buckets is not None
    want_model = has_optimizer and any(d != np.dtype(np.float32) for d in model_dtypes)
    if has_optimizer and not want_model:
        for name in model_names:
            skipped[name] = (
                f"a float32 run's model weight: its fp32 master "
                f"({_master_of(name, optimizer_tensors, buckets)}) is imported as params/"
            )
    if buckets is not None:
        skipped.update(buckets.unread())
    iteration = common.get("iteration") if isinstance(common, dict) else None
    info = {
        "format": "torch_dist",
        "tensors": len(model_names),
        "optimizer": buckets.LAYOUT if buckets is not None else bool(optimizer_tensors),
        "iteration": iteration if type(iteration) is int else None,
        "skipped_objects": sorted(checkpoint.objects),
        "vocab_stripped": reader.stripped(model_names),  # known before any byte is read
        "mcore_metadata": checkpoint.mcore_metadata,
        "dcp_version": checkpoint.version,
        "model_dtype": ", ".join(sorted(str(d) for d in model_dtypes)),
    }
    if skipped:
        info["skipped"] = skipped
    # megatron-core stores a tied output layer only as the embedding (no output_layer.weight)
    untie = settings.get("untie_embeddings_and_output_weights")
    has_output = any(n.endswith("output_layer.weight") for n in model_names)
    info["tied_embeddings"] = (
        [n for n in model_names if n.endswith("embedding.word_embeddings.weight")]
        if not has_output and untie is not True
        else []
    )
    mine = share.pick(model_names)
    step = count if share.primary else None
    if buckets is not None:
        items = _bucket_items(reader, buckets, mine, step, want_model)
    else:
        items = _torch_dist_items(reader, mine, optimizer_tensors, step, want_model)
    return ImportPlan(items, info, len(mine), source_tensors=list(checkpoint.tensors))


def _master_of(name: str, optimizer_tensors: dict, buckets: _RankStates | None) -> str:
    """Where the fp32 master of model tensor ``name`` is read from (said in source.skipped)."""
    if buckets is not None:
        return f"the {buckets.LAYOUT} state, checked equal to this weight"
    states = optimizer_tensors.get(name, {})
    return repr(states.get("param") or states.get("fp32_param"))


def _open_torch_dist(ckpt_dir: Path) -> tuple[dcp.DcpCheckpoint, Any, Path]:
    """The checkpoint with every shard file and chunk tiling checked, and its ``common.pt``."""
    checkpoint = dcp.open_dcp(ckpt_dir)
    backend = checkpoint.mcore_metadata.get("sharded_backend")
    if backend not in (None, "torch_dist"):
        raise MegatronImportError(
            f"{checkpoint.path / 'metadata.json'}: sharded_backend {backend!r} is not supported "
            f"(only 'torch_dist')"
        )
    checkpoint.check_files()
    for tensor in checkpoint.tensors.values():
        dcp.check_coverage(tensor, checkpoint.path / ".metadata")
    common_path = checkpoint.path / "common.pt"
    common: Any = {}
    # megatron-core >= 0.19 saves the common state (args, iteration, optimizer param_groups,
    # sharding type) as one object of the checkpoint instead of common.pt
    objects = sorted(n for n in checkpoint.objects if n.startswith("common_state/"))
    if os.path.lexists(common_path):  # a FIFO or device there is an error, not "no common.pt"
        try:
            common = torch_pickle.load_torch_file(common_path, legacy.LEGACY_CLASSES)
        except torch_pickle.TorchFileError as e:
            raise MegatronImportError(str(e)) from None
    elif objects:
        if len(objects) != 1:
            raise MegatronImportError(
                f"{checkpoint.path / '.metadata'}: {len(objects)} common_state objects "
                f"({objects}); megatron-core saves one"
            )
        common = checkpoint.read_object(objects[0], legacy.LEGACY_CLASSES)
        if isinstance(common, list) and len(common) == 1:
            (common,) = common
        if not isinstance(common, dict):
            raise MegatronImportError(
                f"{checkpoint.path / '.metadata'}: object {objects[0]!r} holds "
                f"{torch_pickle.short_repr(common)}, expected the common state dict"
            )
        common_path = checkpoint.path / objects[0]
    return checkpoint, common, common_path


def _optimizer_tensors(checkpoint: dcp.DcpCheckpoint, common: Any) -> dict[str, dict[str, str]]:
    """``{parameter: {state name: tensor name}}`` of the model-space optimizer state."""
    found: dict[str, dict[str, str]] = {}
    for tensor in (n for n in checkpoint.tensors if is_optimizer_name(n)):
        # a ChainedOptimizer (MoE: dense + experts) prefixes each member's keys with chained_N.
        m = re.match(r"(chained_\d+\.)?" + re.escape(_OPTIMIZER_PREFIX), tensor)
        if m is None:
            raise MegatronImportError(
                f"tensor {tensor!r} in {checkpoint.path / '.metadata'}: unsupported "
                f"distributed-optimizer layout ({_sharding_type(common)!r}); "
                f"{SUPPORTED_LAYOUTS}. {WEIGHTS_ONLY_HINT}"
            )
        state_name, _, parameter = tensor[m.end() :].partition(".")
        if state_name in found.get(parameter, {}):
            raise MegatronImportError(
                f"{checkpoint.path / '.metadata'}: both {found[parameter][state_name]!r} and "
                f"{tensor!r} hold {state_name!r} of {parameter!r}"
            )
        if state_name not in _OPTIMIZER_STATE_TREES:
            raise MegatronImportError(
                f"tensor {tensor!r} in {checkpoint.path / '.metadata'}: unknown optimizer state "
                f"{state_name!r}"
            )
        found.setdefault(parameter, {})[state_name] = tensor
    return found


def _check_optimizer_tensors(
    checkpoint: dcp.DcpCheckpoint,
    common: Any,
    common_path: Path,
    optimizer_tensors: dict[str, dict[str, str]],
    model_names: list[str],
) -> None:
    """One master weight and both moments per parameter, shaped like it, none for an unknown one."""
    metadata = checkpoint.path / ".metadata"
    sharding = _sharding_type(common)
    if sharding not in (None, "fully_reshardable", "fully_sharded_model_space"):
        raise MegatronImportError(
            f"{common_path}: distributed optimizer sharding type {sharding!r} is not supported "
            f"({SUPPORTED_LAYOUTS}). {WEIGHTS_ONLY_HINT}"
        )
    for parameter in model_names:
        have = optimizer_tensors.get(parameter, {})
        if "param" in have and "fp32_param" in have:
            raise MegatronImportError(
                f"tensor {parameter!r}: both {have['param']!r} and {have['fp32_param']!r} "
                f"in {metadata}; expected one master-weight tensor"
            )
        missing = [k for k in ("exp_avg", "exp_avg_sq") if k not in have] + (
            [] if ("param" in have or "fp32_param" in have) else ["param"]
        )
        if missing:
            raise MegatronImportError(
                f"tensor {parameter!r}: optimizer state {missing} missing in {metadata}"
            )
    for parameter, have in optimizer_tensors.items():
        if parameter not in checkpoint.tensors:
            raise MegatronImportError(
                f"optimizer state {sorted(have.values())} refers to model tensor {parameter!r} "
                f"that is not in {metadata}"
            )
        model = checkpoint.tensors[parameter]
        chunk_shapes = {c.sizes for c in model.chunks}
        for tensor in have.values():
            shape = checkpoint.tensors[tensor].shape
            flattened = sharding == "fully_sharded_model_space" and any(
                shape == flattened_shape(model.shape, local) for local in chunk_shapes
            )
            if shape != model.shape and not flattened:
                raise MegatronImportError(
                    f"tensor {tensor!r}: shape {list(shape)} is neither the parameter's "
                    f"{list(model.shape)} nor its N-D flattened form (chunks "
                    f"{sorted(chunk_shapes)}) in {metadata}"
                )


#: megatron-core's optimizer namespace in torch_dist keys: ``optimizer.*``, and
#: ``chained_N.optimizer.*`` when a ChainedOptimizer (e.g. dense + MoE experts) prefixes them.
_OPTIMIZER_NAME = re.compile(r"(?:chained_\d+\.)?optimizer\.")


def is_optimizer_name(name: str) -> bool:
    """A torch_dist key of optimizer state, never a model weight (imported as optimizer state,
    skipped by name, or refused; never written under ``params/``)."""
    return _OPTIMIZER_NAME.match(name) is not None or ".optimizer." in name


def _chained_layouts(checkpoint: dcp.DcpCheckpoint, common: Any) -> list[str | None] | None:
    """The per-optimizer sharding types of a megatron-core ChainedOptimizer save (``common.pt``'s
    ``optimizer`` keyed by optimizer index, or ``chained_N.`` keys), else None."""
    optimizer = common.get("optimizer") if isinstance(common, dict) else None
    if isinstance(optimizer, dict) and optimizer and all(type(k) is int for k in optimizer):
        parts = [optimizer[k] for k in sorted(optimizer)]
    elif isinstance(optimizer, list) and optimizer:
        parts = optimizer
    else:
        names = itertools.chain(checkpoint.tensors, checkpoint.objects)
        prefixes = {n.partition(".")[0] for n in names if re.match(r"chained_\d+\.optimizer\.", n)}
        if not prefixes:
            return None
        parts = [None] * len(prefixes)
    return [
        part.get("param_state_sharding_type") if isinstance(part, dict) else None for part in parts
    ]


def _param_groups(optimizer_state: Any) -> Any:
    """``param_groups`` of a saved Megatron optimizer state (``{"optimizer": torch state}``)."""
    inner = optimizer_state.get("optimizer") if isinstance(optimizer_state, dict) else None
    return inner.get("param_groups") if isinstance(inner, dict) else None


def _sharding_type(common: Any) -> str | None:
    if isinstance(common, dict):
        optimizer = common.get("optimizer")
        if isinstance(optimizer, dict):
            return optimizer.get("param_state_sharding_type")
    return None


def flattened_shape(shape: tuple[int, ...], local: tuple[int, ...]) -> tuple[int, ...]:
    """How megatron-core < 0.15 saves model-space optimizer state with ``flattened_range``
    (``fully_sharded_model_space``): a tensor of global ``shape`` held in chunks of ``local``
    shape becomes ``[X // x, Y // y, ..., x * y * ...]``, the last axis each chunk's elements
    in C order, split over DP ranks by flat ranges."""
    return (*(g // n for g, n in zip(shape, local)), _numel(local))


def unflatten(flat: np.ndarray, shape: tuple[int, ...], name: str = "") -> np.ndarray:
    """The global ``shape`` array of an N-D flattened tensor (inverse of ``flattened_shape``)."""
    grid = flat.shape[:-1]
    if len(grid) != len(shape) or any(n == 0 or g % n for g, n in zip(shape, grid)):
        raise MegatronImportError(
            f"tensor {name!r}: shape {list(flat.shape)} is not an N-D flattened form of "
            f"{list(shape)}"
        )
    local = tuple(g // n for g, n in zip(shape, grid))
    if _numel(local) != flat.shape[-1]:
        raise MegatronImportError(
            f"tensor {name!r}: flattened chunks of {flat.shape[-1]} elements, but {list(shape)} "
            f"over a {list(grid)} grid has chunks of {list(local)}"
        )
    # [f0, f1, ..., n] -> [f0, l0, f1, l1, ...] -> [f0 * l0, f1 * l1, ...]
    blocks = flat.reshape(*grid, *local)
    order = [i for k in range(len(shape)) for i in (k, len(shape) + k)]
    return blocks.transpose(order).reshape(shape)


class _TorchDistReader:
    """Reads torch_dist tensors whole, keeping only the tokenizer's rows of vocab-parallel ones."""

    def __init__(self, checkpoint: dcp.DcpCheckpoint, spec: Spec):
        self.checkpoint = checkpoint
        self.spec = spec

    def vocab_kind(self, name: str) -> Vocab | None:
        """The vocab kind of ``name`` when its rule gives a vocab size (padding to strip)."""
        match = self.spec.match(name)
        if match is not None and isinstance(match.kind, Vocab):
            if isinstance(match.kind.vocab_size, int):
                return match.kind
        return None

    def stripped(self, names: list[str]) -> dict[str, list[int]]:
        """name -> [padded rows, kept rows] of every tensor whose padding is stripped."""
        out = {}
        for name in names:
            kind = self.vocab_kind(name)
            rows = self.checkpoint.tensors[name].shape[0] if kind is not None else 0
            if kind is not None and rows > int(kind.vocab_size):
                out[name] = [rows, int(kind.vocab_size)]
        return out

    def read(self, tensor: str, rule_name: str) -> tuple[np.ndarray, str]:
        """One tensor (ruled as ``rule_name``), and the pattern the provenance records."""
        kind = self.vocab_kind(rule_name)
        shape = self.checkpoint.tensors[rule_name].shape
        if self.checkpoint.tensors[tensor].shape != shape:
            # megatron-core < 0.15's flattened model-space optimizer state (see `unflatten`)
            value = unflatten(self.checkpoint.read(tensor), shape, tensor)
            if kind is None or kind.dim != 0 or shape[0] <= kind.vocab_size:
                return value, "torch_dist-nd-flattened"
            return value[
                : kind.vocab_size
            ], f"nd-flattened, vocab(strip {shape[0]} -> {kind.vocab_size})"
        if kind is None or kind.dim != 0:
            return self.checkpoint.read(tensor), "torch_dist-global"
        rows = self.checkpoint.tensors[tensor].shape[0]
        if rows < kind.vocab_size:
            raise MegatronImportError(
                f"tensor {tensor!r}: {rows} rows, fewer than vocab_size={kind.vocab_size} "
                f"({self.checkpoint.path / '.metadata'})"
            )
        value = self.checkpoint.read(tensor, rows=kind.vocab_size)
        return value, f"vocab(strip {rows} -> {kind.vocab_size})"


_BUCKET_KEY = re.compile(
    r"(?:chained_\d+\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
    r"\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)"
)


class _RankStates:
    """Distributed-optimizer state saved per model-parallel rank (``dp_group_idx`` = TP rank +
    TP x PP rank) as flat fp32 ``param`` / ``exp_avg`` / ``exp_avg_sq`` vectors over the rank's
    grad buffer, without parameter names. Their places are re-derived as megatron-core lays out
    its grad buffers (``megatron_legacy``: the rank's local parameters in module order,
    reversed, starts padded to 64, a pipeline-tied embedding alone in its bucket); every master
    weight is then checked against the model weight it must equal (fp32) or round to (bf16).

    A rank's local piece of a tensor is the tensor's saved chunks for that TP rank: the chunks
    (per layer) sorted by offset, every TP-th one (SwiGLU's fc1 is two chunks per rank, gate and
    up) joined along the split axis; a tensor saved in one chunk is replicated over TP.
    Subclasses say where the flat vectors are and how the buffer splits into buckets."""

    STATES = ("param", "exp_avg", "exp_avg_sq")
    layout: dict[int, dict[str, tuple[int, int, int]]]  # rank -> {param: (bucket, start, end)}

    #: The key prefix of a ChainedOptimizer member (``chained_N.``), else "".
    prefix = ""
    #: Whether this is the expert optimizer of a MoE ChainedOptimizer: its parameters are
    #: SequentialMLP's experts, saved stacked ``[layers, experts, ...]``.
    experts = False

    def __init__(
        self,
        checkpoint: dcp.DcpCheckpoint,
        model_names: list[str],
        settings: dict,
        ranks: int,
        pp: int | None = None,
    ):
        self.checkpoint = checkpoint
        self.where = where = checkpoint.path / ".metadata"
        self.ranks = ranks
        stacked = [n for n in model_names if n.startswith("decoder.layers.")]
        if self.experts and stacked != model_names:
            raise MegatronImportError(
                f"{where}: expert tensors {sorted(set(model_names) - set(stacked))} are not "
                f"stacked decoder layers"
            )
        first = model_names.index(stacked[0]) if stacked else len(model_names)
        if model_names[first : first + len(stacked)] != stacked:
            raise MegatronImportError(f"{where}: stacked layer tensors are not contiguous")
        # singleton_local_shards: one tensor per layer (decoder.layers.<i>.*), a SwiGLU fc1 as
        # two tensors <name>_w / <name>_v (one parameter [w; v] in the grad buffer)
        self.layer_of = {
            n: int(m.group(1)) for n in stacked if (m := _PER_LAYER.fullmatch(n)) is not None
        }
        if self.layer_of and (len(self.layer_of) != len(stacked) or self.experts):
            raise MegatronImportError(
                f"{where}: per-layer (singleton_local_shards) and stacked layer tensors mixed"
            )
        if self.layer_of:
            layers = {max(self.layer_of.values()) + 1}
        else:
            layers = {checkpoint.tensors[n].shape[0] for n in stacked}
        if len(layers) > 1:
            raise MegatronImportError(f"{where}: stacked layers disagree on the count {layers}")
        self.layers = layers.pop() if layers else 0
        self.stacked = stacked
        # SequentialMLP experts, saved [layers, experts, ...]: in the expert optimizer's own
        # buffer (EP > 1), or in the dense one with the other parameters (EP = 1)
        self.expert_names = {n for n in stacked if _SEQUENTIAL_EXPERT.fullmatch(n)}
        self.num_experts = 0
        if self.expert_names:
            counts = {checkpoint.tensors[n].shape[1] for n in self.expert_names}
            if len(counts) != 1:
                raise MegatronImportError(f"{where}: expert tensors disagree on the count {counts}")
            self.num_experts = counts.pop()
        self.before = model_names[:first]  # on the first pipeline stage
        self.after = model_names[first + len(stacked) :]  # on the last
        self.tp = self._tp_size(model_names)
        if ranks % self.tp:
            raise MegatronImportError(
                f"{where}: optimizer state of {ranks} model-parallel ranks, not a multiple of the "
                f"tensor-parallel size {self.tp} the model tensors are split by"
            )
        self.pp = ranks // self.tp if pp is None else pp
        # the expert optimizer's ranks are megatron-core's expert tensor x expert x pipeline
        # group ('tp-ep-pp' order): rank = etp_rank + ETP * (ep_rank + EP * stage)
        self.ep = ranks // (self.tp * self.pp) if self.experts else 1
        if self.experts and (
            self.tp * self.ep * self.pp != ranks or not self.ep or self.num_experts % self.ep
        ):
            raise MegatronImportError(
                f"{where}: expert optimizer state of {ranks} ranks does not split into expert "
                f"TP={self.tp} x PP={self.pp} x EP ranks of {self.num_experts} experts. "
                f"{WEIGHTS_ONLY_HINT}"
            )
        if self.layers % self.pp:
            raise MegatronImportError(
                f"{where}: {self.layers} layers over {self.pp} pipeline stages (uneven or "
                f"virtual pipeline stages are not supported). {WEIGHTS_ONLY_HINT}"
            )
        has_output = any(n.endswith("output_layer.weight") for n in model_names)
        embedding = [n for n in model_names if n.endswith("embedding.word_embeddings.weight")]
        self.tied_copy = (
            embedding[0]
            if self.pp > 1
            and embedding
            and not has_output
            and settings.get("untie_embeddings_and_output_weights") is not True
            else None
        )

    def _distinct(self, name: str) -> list[dcp.DcpChunk]:
        """One chunk per distinct place outside the layer (and expert) axes, sorted by offset."""
        skip = self._lead(name)
        seen: dict[tuple, dcp.DcpChunk] = {}
        for c in self.checkpoint.tensors[name].chunks:
            seen.setdefault(c.offsets[skip:], c)
        return [seen[k] for k in sorted(seen)]

    def _lead(self, name: str) -> int:
        """How many leading axes index layers (and experts) rather than the parameter."""
        if name in self.layer_of:
            return 0
        return 2 if name in self.expert_names else 1 if name in self.stacked else 0

    def _pair(self, name: str) -> str | None:
        """The grad-buffer parameter of a singleton_local_shards SwiGLU half (``X_w`` /
        ``X_v`` -> ``X``), else None."""
        base, half = name[:-2], name[-2:]
        if name in self.layer_of and half in ("_w", "_v"):
            if base + "_w" in self.layer_of and base + "_v" in self.layer_of:
                return base
        return None

    def _swiglu(self, name: str) -> bool:
        """Whether ``name`` is a SwiGLU ``linear_fc1`` (twice the rows its ``linear_fc2``
        takes): megatron-core saves it as two chunks per TP rank (gate, up), even at TP 1."""
        fc2 = name.replace("linear_fc1.", "linear_fc2.", 1)
        if fc2 == name:
            return False
        fc2 = fc2.rpartition(".")[0] + ".weight"
        tensors = self.checkpoint.tensors
        if fc2 not in tensors or not tensors[fc2].shape:
            return False
        axis = -2 if name.endswith(".weight") else -1
        shape = tensors[name].shape
        return len(shape) >= -axis and shape[axis] == 2 * tensors[fc2].shape[-1]

    def _tp_size(self, model_names: list[str]) -> int:
        """The TP size: the chunk count of the least-split split tensor, a SwiGLU fc1's halved
        (two chunks per rank: at TP 1 it is the only split tensor)."""
        counts = set()
        for n in model_names:
            count = len(self._distinct(n))
            counts.add(count // 2 if self._swiglu(n) and count % 2 == 0 else count)
        tp = min((c for c in counts if c > 1), default=1)
        if any(c % tp for c in counts if c > 1):
            raise MegatronImportError(
                f"{self.where}: model tensors are saved in {sorted(counts)} chunks; no common "
                f"tensor-parallel size"
            )
        return tp

    def piece(self, name: str, tp_rank: int) -> tuple[tuple[int, ...], int | None, list]:
        """TP rank ``tp_rank``'s local shape of ``name`` (per layer), the axis its chunks join
        along (None: replicated), and those chunks."""
        chunks = self._distinct(name)
        skip = self._lead(name)
        shape = self.checkpoint.tensors[name].shape[skip:]
        if len(chunks) == 1:
            return tuple(shape), None, chunks
        mine = chunks[tp_rank :: self.tp]
        axes = {a for c in chunks for a in range(len(shape)) if c.sizes[skip + a] != shape[a]}
        if len(axes) != 1 or len(chunks) % self.tp:
            raise MegatronImportError(
                f"{self.where}: tensor {name!r} is saved in {len(chunks)} chunks split along "
                f"axes {sorted(axes)}; expected a split along one axis into a multiple of "
                f"TP={self.tp}"
            )
        (axis,) = axes
        local = list(shape)
        local[axis] = sum(c.sizes[skip + axis] for c in mine)
        return tuple(local), axis, mine

    def rank_params(self, rank: int) -> tuple[list[tuple[str, int]], set[str]]:
        """The local parameters of model-parallel rank ``rank`` in module order (a stacked
        layer's as ``name#layer``), and which of them megatron-core puts alone in a bucket (a
        pipeline-tied embedding and its copy on the last stage)."""
        tp_rank, stage = rank % self.tp, rank // self.tp
        per_stage = self.layers // self.pp
        params: list[tuple[str, int]] = []
        shared: set[str] = set()
        if self.experts:  # the expert optimizer's ranks: expert TP x EP x PP
            ep_rank, stage = (rank // self.tp) % self.ep, rank // (self.tp * self.ep)
            for i in range(stage * per_stage, (stage + 1) * per_stage):
                params += self._layer_params(i, tp_rank, ep_rank)
            return params, shared
        if stage == 0:
            params += [(n, _numel(self.piece(n, tp_rank)[0])) for n in self.before]
        for i in range(stage * per_stage, (stage + 1) * per_stage):
            params += self._layer_params(i, tp_rank, 0)
        if stage == self.pp - 1:
            params += [(n, _numel(self.piece(n, tp_rank)[0])) for n in self.after]
        if self.tied_copy is not None:
            if stage == 0:
                shared.add(self.tied_copy)
            if stage == self.pp - 1:
                copy = f"{self.tied_copy}#tied_output_copy"
                params.append((copy, _numel(self.piece(self.tied_copy, tp_rank)[0])))
                shared.add(copy)
        return params, shared

    def _layer_params(self, layer: int, tp_rank: int, ep_rank: int) -> list[tuple[str, int]]:
        """Layer ``layer``'s local parameters in module order: the stacked tensors in saved
        order, a run of expert tensors expanded expert by expert (``local_experts.<e>.fc1,
        fc2``; EP rank ``ep_rank``'s experts)."""
        local = self.num_experts // self.ep if self.num_experts else 0
        out: list[tuple[str, int]] = []
        if self.layer_of:  # singleton_local_shards: this layer's own tensors
            for n in self.stacked:
                base = self._pair(n)
                if self.layer_of[n] != layer or (base is not None and n.endswith("_v")):
                    continue
                numel = _numel(self.piece(n, tp_rank)[0])
                if base is not None:
                    numel += _numel(self.piece(base + "_v", tp_rank)[0])
                out.append((base or n, numel))
            return out
        run: list[str] = []
        for n in [*self.stacked, None]:
            if n is not None and n in self.expert_names:
                run.append(n)
                continue
            out += [
                (f"{r}#{layer}#{e}", _numel(self.piece(r, tp_rank)[0]))
                for e in range(ep_rank * local, (ep_rank + 1) * local)
                for r in run
            ]
            run = []
            if n is not None:
                out.append((f"{n}#{layer}", _numel(self.piece(n, tp_rank)[0])))
        return out

    def object(self, rank: int, what: str) -> Any:
        names = [
            n
            for n in self.checkpoint.objects
            if n.startswith(f"{self.prefix}optimizer.distributed.dp_group_idx_{rank}.{what}/")
        ]
        if not names:
            return None
        return self.checkpoint.read_object(names[0], legacy.LEGACY_CLASSES)

    def step_objects(self) -> list[str]:
        """The objects the step is read from (one per model-parallel rank, when saved)."""
        prefixes = tuple(
            f"{self.prefix}optimizer.distributed.dp_group_idx_{rank}.optimizer/"
            for rank in range(self.ranks)
        )
        return sorted(n for n in self.checkpoint.objects if n.startswith(prefixes))

    def step(self) -> int:
        steps = set()
        for rank in range(self.ranks):
            state = self.object(rank, "optimizer")
            groups = state[0].get("param_groups") if isinstance(state, list) and state else None
            where = (
                f"{self.where} ({self.prefix}optimizer.distributed.dp_group_idx_{rank}.optimizer)"
            )
            steps.add(_step_from_param_groups(groups, where))
        if len(steps) != 1:
            raise MegatronImportError(
                f"{self.where}: model-parallel ranks disagree on the step {sorted(steps)}"
            )
        return steps.pop()

    #: Whether :meth:`source` names .metadata tensors (else pickled objects).
    FROM_TENSORS = True

    def files(self) -> list[str]:
        raise NotImplementedError

    def flat(self, rank: int, bucket: int, state: str, start: int, end: int) -> np.ndarray:
        raise NotImplementedError

    def source(self, rank: int, bucket: int, state: str) -> str:
        """The tensor (or object) holding ``state`` of ``rank``'s ``bucket``."""
        raise NotImplementedError

    def _pieces(self, name: str) -> Iterator[tuple]:
        """What :meth:`read` takes for ``name``: (rank, layout key, layer, local shape, join
        axis, chunks) of every TP rank's (and pipeline stage's) piece; a tensor replicated over
        TP from TP rank 0 only, a pipeline-tied embedding from the first stage only."""
        skip = self._lead(name)
        per_stage = self.layers // self.pp if self.layers else 1
        for tp_rank in range(self.tp):
            local, axis, chunks = self.piece(name, tp_rank)
            if axis is None and tp_rank:
                break  # replicated over TP: rank 0's copy
            if name in self.expert_names:  # expert e of layer i: EP rank e // local experts
                local_experts = self.num_experts // self.ep
                for layer in range(self.layers):
                    for e in range(self.num_experts):
                        ep_rank, stage = e // local_experts, layer // per_stage
                        rank = tp_rank + self.tp * (ep_rank + self.ep * stage)
                        yield rank, f"{name}#{layer}#{e}", (layer, e), local, axis, chunks
                continue
            if name in self.layer_of:
                stage = self.layer_of[name] // per_stage
                yield tp_rank + self.tp * stage, self._pair(name) or name, None, local, axis, chunks
                continue
            for layer in range(self.layers) if skip else [None]:
                if skip:
                    stage = layer // per_stage
                else:
                    stage = 0 if name in self.before else self.pp - 1
                rank = tp_rank + self.tp * stage
                key = f"{name}#{layer}" if skip else name
                yield rank, key, layer, local, axis, chunks

    def sources(self, state: str, name: str) -> list[str]:
        """The tensors (or objects) :meth:`read` takes ``state`` of ``name`` from."""
        return sorted(
            {
                self.source(rank, self.layout[rank][key][0], state)
                for rank, key, *_ in self._pieces(name)
            }
        )

    def unread(self) -> dict[str, str]:
        """Flat state tensors :meth:`read` takes nothing from, and why: buckets holding only
        the last stage's copy of a pipeline-tied embedding, or a TP rank > 0's copy of
        parameters replicated over TP. A bucket holding anything else is left out (the import
        is then refused as not accounting for it)."""
        if not self.FROM_TENSORS:
            return {}
        names = [*self.before, *self.stacked, *self.after]
        read = {(rank, key) for n in names for rank, key, *_ in self._pieces(n)}
        out: dict[str, str] = {}
        for rank, layout in self.layout.items():
            per_bucket: dict[int, list[str]] = {}
            for key, (bucket, _, _) in layout.items():
                per_bucket.setdefault(bucket, []).append(key)
            for bucket, keys in per_bucket.items():
                if any((rank, key) in read for key in keys):
                    continue
                why = [self._unread_why(rank, key) for key in keys]
                if None in why:
                    continue
                for state in self.STATES:
                    out[self.source(rank, bucket, state)] = (
                        f"{self.LAYOUT} bucket of model-parallel rank {rank} holding only "
                        f"{'; '.join(dict.fromkeys(why))}: not read"
                    )
        return out

    def _unread_why(self, rank: int, key: str) -> str | None:
        name = key.partition("#")[0]
        if not self.experts and key == f"{self.tied_copy}#tied_output_copy":
            return (
                f"the last pipeline stage's copy of the tied embedding {name!r} (the first "
                f"stage's state is imported)"
            )
        if rank % self.tp and self.piece(name, rank % self.tp)[1] is None:
            return (
                f"TP rank {rank % self.tp}'s copy of replicated {name!r} (TP rank 0's is imported)"
            )
        return None

    def spot_check(self, limit: int = 1 << 16) -> str | None:
        """The first model tensor of at most ``limit`` elements (or the smallest one) whose
        master does not equal (fp32) or round to (bf16) its weight, else None: a cheap test of
        the derived order before anything is written (every tensor is checked when written)."""
        names = [*self.before, *self.stacked, *self.after]
        tensors = self.checkpoint.tensors
        small = sorted(names, key=lambda n: _numel(tensors[n].shape))
        for i, name in enumerate(small):
            if i and _numel(tensors[name].shape) > limit:
                break
            weight = self.checkpoint.read(name)
            master = self.read("param", name).astype(weight.dtype)
            if master.tobytes() != np.ascontiguousarray(weight).tobytes():
                return name
        return None

    def read(self, state: str, name: str) -> np.ndarray:
        """One optimizer state of model tensor ``name``, in its (stacked) global shape, put
        together from every TP rank's (and pipeline stage's) local piece."""
        shape = self.checkpoint.tensors[name].shape
        out = np.empty(shape, np.float32)
        skip = self._lead(name)
        for rank, key, layer, local, axis, chunks in self._pieces(name):
            bucket, start, end = self.layout[rank][key]
            if key != name and name.endswith("_v"):  # after the _w half of [w; v]
                start += _numel(self.piece(key + "_w", rank % self.tp)[0])
            end = start + _numel(local)
            value = self.flat(rank, bucket, state, start, end).reshape(local)
            target = out[layer] if skip else out
            if axis is None:
                target[...] = value
                continue
            at = 0
            for c in chunks:  # the local piece is the rank's chunks joined along `axis`
                size = c.sizes[skip + axis]
                index = tuple(slice(o, o + n) for o, n in zip(c.offsets[skip:], c.sizes[skip:]))
                target[index] = np.take(value, range(at, at + size), axis=axis)
                at += size
        return out


class _BucketStates(_RankStates):
    """megatron-core 0.16's ``dp_reshardable`` (Megatron-LM's default): one flat tensor per
    rank, grad buffer, bucket and state, each bucket's length its recorded unpadded size; a
    bucket closes exactly there (``megatron_legacy.bucket_layout``), so the DDP ``bucket_size``
    (not saved) is not needed and every bucket size is checked."""

    LAYOUT = "dp_reshardable"

    def __init__(
        self,
        checkpoint: dcp.DcpCheckpoint,
        model_names: list[str],
        settings: dict,
        prefix: str = "",
        experts: bool = False,
        pp: int | None = None,
    ):
        self.prefix, self.experts = prefix, experts
        where = checkpoint.path / ".metadata"
        ranks: dict[int, dict[int, dict[str, str]]] = {}  # {rank: {bucket: {state: tensor}}}
        dtypes: dict[int, set[str]] = {}
        for name in checkpoint.tensors:
            if not is_optimizer_name(name) or (prefix and not name.startswith(prefix)):
                continue
            m = _BUCKET_KEY.fullmatch(name)
            if m is None or m.group(2) != "0" or (not prefix and name.startswith("chained_")):
                which = "expert" if experts else "dense"
                raise MegatronImportError(
                    f"{where}: dp_reshardable optimizer tensor {name!r} is not in grad buffer 0 "
                    f"of the {which} parameters (several parameter dtypes are not supported). "
                    f"{WEIGHTS_ONLY_HINT}"
                )
            rank, bucket = int(m.group(1)), int(m.group(4))
            ranks.setdefault(rank, {}).setdefault(bucket, {})[m.group(5)] = name
            dtypes.setdefault(rank, set()).add(m.group(3))
        if not ranks or sorted(ranks) != list(range(len(ranks))):
            raise MegatronImportError(
                f"{where}: dp_reshardable state for model-parallel ranks {sorted(ranks)}, "
                f"expected 0..N-1. {WEIGHTS_ONLY_HINT}"
            )
        self.buckets: dict[int, list[dict[str, str]]] = {}
        for rank, per_bucket in sorted(ranks.items()):
            if len(dtypes[rank]) != 1 or sorted(per_bucket) != list(range(len(per_bucket))):
                raise MegatronImportError(
                    f"{where}: dp_reshardable state of model-parallel rank {rank}: buckets "
                    f"{sorted(per_bucket)}, dtypes {sorted(dtypes[rank])}; expected buckets "
                    f"0..N-1 of one dtype. {WEIGHTS_ONLY_HINT}"
                )
            for bucket, states in per_bucket.items():
                if set(states) != set(self.STATES):
                    raise MegatronImportError(
                        f"{where}: dp_reshardable bucket {bucket} of model-parallel rank {rank} "
                        f"has states {sorted(states)}, expected {list(self.STATES)}"
                    )
                shapes = {checkpoint.tensors[n].shape for n in states.values()}
                if len(shapes) != 1 or len(next(iter(shapes))) != 1:
                    raise MegatronImportError(
                        f"{where}: dp_reshardable bucket {bucket} of model-parallel rank {rank}: "
                        f"shapes {sorted(shapes)}, expected one flat vector per state"
                    )
            self.buckets[rank] = [per_bucket[b] for b in range(len(per_bucket))]
        super().__init__(checkpoint, model_names, settings, len(ranks), pp)
        self.layout = {}
        for rank in self.buckets:
            params, shared = self.rank_params(rank)
            numels = [checkpoint.tensors[b["param"]].shape[0] for b in self.buckets[rank]]
            recorded = self._recorded_numels(rank)
            if recorded is not None and recorded != numels:
                raise MegatronImportError(
                    f"{where}: model-parallel rank {rank}: bucket tensors of {numels} elements, "
                    f"but megatron-core recorded {recorded} unpadded"
                )
            try:
                self.layout[rank] = legacy.bucket_layout(
                    params, shared, numels, f"{where} (model-parallel rank {rank})"
                )
            except legacy.LegacyError as e:
                raise MegatronImportError(
                    f"{e} (megatron-core 0.16 grad-buffer layout; another version or DDP "
                    f"config?). {WEIGHTS_ONLY_HINT}"
                ) from None

    def _recorded_numels(self, rank: int) -> list[int] | None:
        """``per_bucket_numel_unpadded``: [[{(param dtype, grad dtype): [numel per bucket]}]]."""
        value = self.object(rank, "per_bucket_numel_unpadded")
        if value is None:
            return None
        try:
            ((per_dtype,),) = value
            (numels,) = per_dtype.values()
            return [int(n) for n in numels]
        except (TypeError, ValueError, AttributeError):
            raise MegatronImportError(
                f"{self.where}: per_bucket_numel_unpadded of model-parallel rank {rank} is "
                f"{torch_pickle.short_repr(value)}, expected [[{{dtypes: [numel per bucket]}}]]"
            ) from None

    def files(self) -> list[str]:
        return sorted(
            {
                f
                for per_bucket in self.buckets.values()
                for states in per_bucket
                for n in states.values()
                for f in self.checkpoint.tensors[n].files
            }
        )

    def flat(self, rank: int, bucket: int, state: str, start: int, end: int) -> np.ndarray:
        return self.checkpoint.read_range(self.buckets[rank][bucket][state], start, end)

    def source(self, rank: int, bucket: int, state: str) -> str:
        return self.buckets[rank][bucket][state]


class _GatheredStates(_RankStates):
    """megatron-core 0.13's ``dp_zero_gather_scatter``: per model-parallel rank one pickled
    ``param_state`` object (written by DP rank 0), the same dict as a legacy
    ``distrib_optim.pt`` (the buckets' unpadded parts concatenated), laid out as for that file
    (``megatron_legacy.distrib_optim_layout``, the DDP bucket size from the saved args)."""

    LAYOUT = "dp_zero_gather_scatter"
    FROM_TENSORS = False  # the state is pickled objects, not .metadata tensors

    def __init__(self, checkpoint: dcp.DcpCheckpoint, model_names: list[str], settings: dict):
        where = checkpoint.path / ".metadata"
        found = {}
        for name in checkpoint.objects:
            m = re.fullmatch(r"optimizer\.distributed\.dp_group_idx_(\d+)\.param_state/.*", name)
            if m:
                found[int(m.group(1))] = name
        if not found or sorted(found) != list(range(len(found))):
            raise MegatronImportError(
                f"{where}: dp_zero_gather_scatter param_state objects for model-parallel ranks "
                f"{sorted(found)}, expected 0..N-1. {WEIGHTS_ONLY_HINT}"
            )
        super().__init__(checkpoint, model_names, settings, len(found))
        self.names = found
        dp = settings.get("data_parallel_size") or 1
        bucket_size = None
        if settings.get("overlap_grad_reduce"):
            bucket_size = int(settings.get("ddp_bucket_size") or max(40_000_000, 1_000_000 * dp))
        self.buffers: dict[int, legacy.DistribOptimState] = {}
        self.layout = {}
        for rank, name in found.items():
            saved = checkpoint.read_object(name, legacy.LEGACY_CLASSES)
            label = f"{where} (object {name!r})"
            try:
                if isinstance(saved, list) and len(saved) == 1:  # one model chunk
                    (saved,) = saved
                state = legacy.distrib_optim_state(saved, label)
            except legacy.LegacyError as e:
                raise MegatronImportError(f"{e}. {WEIGHTS_ONLY_HINT}") from None
            params, shared = self.rank_params(rank)
            layout, total = legacy.distrib_optim_layout(
                params, shared, bucket_size if rank < self.tp else None
            )
            if total != state.numel_unpadded:
                raise MegatronImportError(
                    f"{label}: the buffer holds {state.numel_unpadded} elements, but the "
                    f"{len(params)} local parameters of model-parallel rank {rank} lay out to "
                    f"{total} (megatron-core grad-buffer layout, bucket_size={bucket_size}); "
                    f"another version or DDP bucket setting? {WEIGHTS_ONLY_HINT}"
                )
            self.buffers[rank] = state
            self.layout[rank] = {k: (0, a, b) for k, (a, b) in layout.items()}

    def files(self) -> list[str]:
        return sorted({self.checkpoint.objects[n].file for n in self.names.values()})

    def flat(self, rank: int, bucket: int, state: str, start: int, end: int) -> np.ndarray:
        return getattr(self.buffers[rank], state)[start:end]

    def source(self, rank: int, bucket: int, state: str) -> str:
        return self.names[rank]


_EXPERT = re.compile(r"decoder\.layers\.mlp\.experts\.")
_SEQUENTIAL_EXPERT = re.compile(
    r"decoder\.layers\.mlp\.experts\.experts\.linear_fc[12]\.(weight|bias)"
)


def _chained_states(
    checkpoint: dcp.DcpCheckpoint,
    model_names: list[str],
    settings: dict,
    chained: list[str | None],
) -> _ChainedStates | None:
    """A MoE run's ChainedOptimizer (megatron-core puts expert parameters in their own grad
    buffer and optimizer, after the dense one): ``dp_reshardable`` state per member, or None
    when every member is ``fully_reshardable`` (model-space tensors, read like a single
    optimizer's). Anything else is refused naming the layouts."""
    where = checkpoint.path / ".metadata"
    experts = [n for n in model_names if _EXPERT.match(n)]
    dense = [n for n in model_names if n not in experts]
    if set(chained) == {"fully_reshardable"}:
        return None
    odd = [n for n in experts if not _SEQUENTIAL_EXPERT.fullmatch(n)]
    if set(chained) != {"dp_reshardable"} or len(chained) != 2 or not experts or odd:
        raise MegatronImportError(
            f"{where}: the optimizer state is megatron-core's ChainedOptimizer "
            f"({len(chained)} optimizers, layouts {chained}, expert tensors {odd or experts}); "
            f"supported: two members (dense, then SequentialMLP experts) both 'dp_reshardable' "
            f"or both 'fully_reshardable' ({SUPPORTED_LAYOUTS}). {WEIGHTS_ONLY_HINT}"
        )
    first = _in_module_order(_BucketStates, checkpoint, dense, settings, prefix="chained_0.")
    second = _in_module_order(
        _BucketStates, checkpoint, experts, settings, prefix="chained_1.", experts=True, pp=first.pp
    )
    return _ChainedStates([first, second])


class _ChainedStates:
    """The members of a MoE ChainedOptimizer's ``dp_reshardable`` state read as one: each
    model tensor's state from the member holding it (dense: ``chained_0``; experts:
    ``chained_1``, placed by expert-parallel rank), one step for all."""

    FROM_TENSORS = True

    def __init__(self, parts: list[_RankStates]):
        self.parts = parts
        self.owner = {n: p for p in parts for n in (*p.before, *p.stacked, *p.after)}
        self.LAYOUT = parts[0].LAYOUT
        self.tp, self.pp, self.where = parts[0].tp, parts[0].pp, parts[0].where

    def read(self, state: str, name: str) -> np.ndarray:
        return self.owner[name].read(state, name)

    def sources(self, state: str, name: str) -> list[str]:
        return self.owner[name].sources(state, name)

    def files(self) -> list[str]:
        return sorted({f for p in self.parts for f in p.files()})

    def unread(self) -> dict[str, str]:
        return {k: v for p in self.parts for k, v in p.unread().items()}

    def step_objects(self) -> list[str]:
        return sorted(n for p in self.parts for n in p.step_objects())

    def step(self) -> int:
        steps = {p.step() for p in self.parts}
        if len(steps) != 1:
            raise MegatronImportError(
                f"{self.where}: the ChainedOptimizer's members disagree on the step {sorted(steps)}"
            )
        return steps.pop()


#: megatron-core's parameter registration order within a transformer layer (what its DDP grad
#: buffer walks, reversed), by torch_dist name after ``decoder.layers.``. The local spec's
#: input_layernorm (saved as ``linear_qkv.layer_norm_*``) precedes the attention; Transformer
#: Engine's fused LayerNormLinear registers it inside linear_qkv, after linear_proj (``_TE``).
_LAYER_ORDER = [
    "input_layernorm.weight",
    "input_layernorm.bias",
    "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.linear_proj.weight",
    "self_attention.linear_proj.bias",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "self_attention.q_layernorm.weight",
    "self_attention.q_layernorm.bias",
    "self_attention.k_layernorm.weight",
    "self_attention.k_layernorm.bias",
    "pre_mlp_layernorm.weight",
    "pre_mlp_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight",
    "mlp.linear_fc1.layer_norm_bias",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight",
    "mlp.linear_fc2.bias",
    "mlp.router.weight",
    "mlp.router.bias",
    "mlp.experts.experts.linear_fc1.weight",
    "mlp.experts.experts.linear_fc1.bias",
    "mlp.experts.experts.linear_fc2.weight",
    "mlp.experts.experts.linear_fc2.bias",
    "mlp.shared_experts.linear_fc1.weight",
    "mlp.shared_experts.linear_fc1.bias",
    "mlp.shared_experts.linear_fc2.weight",
    "mlp.shared_experts.linear_fc2.bias",
    "mlp.shared_experts.gate_weight",
]
_TE = [*_LAYER_ORDER[:2], *_LAYER_ORDER[4:6], *_LAYER_ORDER[2:4], *_LAYER_ORDER[6:]]
_PER_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.*)")
_TOP_BEFORE = ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight"]
_TOP_AFTER = [
    "decoder.final_layernorm.weight",
    "decoder.final_layernorm.bias",
    "output_layer.weight",
    "output_layer.bias",
]


def _module_orders(names: list[str]) -> list[list[str]]:
    """The orders megatron-core's modules can have registered ``names`` in (local spec, then
    Transformer Engine's), when every name is known; then the order of ``.metadata``, which
    is module order only for a save that was not split over data-parallel ranks (Megatron-LM's
    default fully parallel save orders tensors by how the save work was split)."""
    out = []
    for layer in (_LAYER_ORDER, _TE):
        rank = {n: i for i, n in enumerate(_TOP_BEFORE)}
        rank.update({f"decoder.layers.{n}": len(_TOP_BEFORE) + i for i, n in enumerate(layer)})
        rank.update({n: len(rank) + i for i, n in enumerate(_TOP_AFTER)})
        known = {n: _order_key(n, rank, layer) for n in names}
        if None not in known.values():
            order = sorted(names, key=known.__getitem__)
            if order not in out:
                out.append(order)
    if names not in out:
        out.append(list(names))
    return out


def _order_key(name: str, rank: dict[str, int], layer: list[str]) -> tuple | None:
    """Where ``name`` sorts in module order (per-layer singleton_local_shards names by layer,
    then as in ``layer``; a SwiGLU ``_w`` half before its ``_v``), None if unknown."""
    if name in _TOP_BEFORE:
        return (0, _TOP_BEFORE.index(name), 0, 0)
    if name in _TOP_AFTER:
        return (2, _TOP_AFTER.index(name), 0, 0)
    if name in rank:  # stacked: all layers in one tensor
        return (1, 0, rank[name], 0)
    m = _PER_LAYER.fullmatch(name)
    if m is None:
        return None
    rest, half = m.group(2), 0
    if rest.endswith(("_w", "_v")):
        rest, half = rest[:-2], 1 if rest.endswith("_v") else 0
    if rest not in layer:
        return None
    return (1, int(m.group(1)), layer.index(rest), half)


def _in_module_order(cls: type, checkpoint: dcp.DcpCheckpoint, names: list[str], *a, **k):
    """``cls``'s state laid out over the first module order of ``names`` that fits the saved
    buckets and whose masters equal (fp32) or round to (bf16) the model weights of the small
    tensors (norms, biases: a wrong order misplaces them); the first error if none fits."""
    first = None
    orders = _module_orders(names)
    for order in orders:
        try:
            states = cls(checkpoint, order, *a, **k)
        except MegatronImportError as e:
            first = first or e
            continue
        wrong = states.spot_check()
        if wrong is None:
            return states
        if first is None:
            rounds = "equal" if checkpoint.tensors[wrong].dtype == np.float32 else "round to"
            first = MegatronImportError(
                f"tensor {wrong!r}: the fp32 master found in the {states.LAYOUT} state of "
                f"{states.where} does not {rounds} the model weight in megatron-core's parameter "
                f"order (tried {len(orders)}: local spec, Transformer Engine, .metadata); "
                f"another megatron-core version or DDP config? {WEIGHTS_ONLY_HINT}"
            )
    raise first


def _numel(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _bucket_items(
    reader: _TorchDistReader,
    buckets: _RankStates,
    model_names: list[str],
    count: int,
    want_model: bool,
) -> Iterator[writer.HostItem]:
    """dp_reshardable / dp_zero_gather_scatter: per parameter its master weight (checked against
    the model weight) and moments from the flat vectors, vocab padding stripped like the
    weights; then the step."""
    checkpoint = reader.checkpoint
    files = buckets.files()
    for name in model_names:
        weight, pattern = reader.read(name, name)
        rows = (
            weight.shape[0]
            if weight.ndim and weight.shape != checkpoint.tensors[name].shape
            else None
        )
        provenance = {
            "format": "torch_dist",
            "files": files,
            "pattern": f"{buckets.LAYOUT} (TP={buckets.tp}, PP={buckets.pp})",
        }
        for state, tree in zip(
            _RankStates.STATES, (("params",), ("opt_state", "mu"), ("opt_state", "nu"))
        ):
            sources = {TENSORS if buckets.FROM_TENSORS else VALUES: buckets.sources(state, name)}
            value = buckets.read(state, name)
            if rows is not None:
                value = value[:rows]
            if state == "param" and not np.array_equal(
                value.astype(weight.dtype).view(np.uint8),
                np.ascontiguousarray(weight).view(np.uint8),
            ):
                raise MegatronImportError(
                    f"tensor {name!r}: the fp32 master found in the {buckets.LAYOUT} state "
                    f"of {buckets.where} does not {'equal' if weight.dtype == np.float32 else 'round to'} "
                    f"the model weight: the grad-buffer layout jax_ucp derived does not match this "
                    f"checkpoint (another megatron-core version or DDP config?). {WEIGHTS_ONLY_HINT}"
                )
            yield host_item((*tree, name), value, {**provenance, **sources})
        if want_model:
            yield host_item(
                ("model_params", name),
                weight,
                {
                    "format": "torch_dist",
                    "files": checkpoint.tensors[name].files,
                    "pattern": pattern,
                    TENSORS: [name],
                },
            )
    if count is not None:  # None: another process of a shared import writes the step
        yield host_item(
            ("opt_state", "count"),
            np.asarray(count, np.int32),
            {"files": files, "pattern": "param_groups.step", VALUES: buckets.step_objects()},
        )


def _torch_dist_items(
    reader: _TorchDistReader,
    model_names: list[str],
    optimizer_tensors: dict[str, dict[str, str]],
    count: int | None,
    want_model: bool,
) -> Iterator[writer.HostItem]:
    """Per parameter: its master weight and moments (or the model weight when there is no
    optimizer state), its model-precision copy; then the step."""
    checkpoint = reader.checkpoint
    for name in model_names:
        tensor = checkpoint.tensors[name]
        provenance = {
            "format": "torch_dist",
            "files": tensor.files,
            "chunks": len(tensor.chunks),
            TENSORS: [name],
        }
        if not optimizer_tensors:
            value, pattern = reader.read(name, name)
            yield host_item(("params", name), value, {**provenance, "pattern": pattern})
            continue
        for state_name, tree in _OPTIMIZER_STATE_TREES.items():
            source_name = optimizer_tensors[name].get(state_name)
            if source_name is None:
                continue
            source = checkpoint.tensors[source_name]
            if tree == ("params",) and source.dtype != np.dtype(np.float32):
                raise MegatronImportError(
                    f"tensor {source_name!r}: master weights have dtype {source.dtype}, "
                    f"expected float32 ({', '.join(source.files)})"
                )
            value, pattern = reader.read(source_name, name)
            state_provenance = {
                "format": "torch_dist",
                "files": source.files,
                "source_name": source_name,
                "pattern": pattern,
                TENSORS: [source_name],
            }
            yield host_item((*tree, name), value, state_provenance)
        if want_model:
            value, pattern = reader.read(name, name)
            yield host_item(("model_params", name), value, {**provenance, "pattern": pattern})
    if optimizer_tensors and count is not None:
        yield host_item(
            ("opt_state", "count"),
            np.asarray(count, np.int32),
            {
                "files": ["common.pt"],
                "pattern": "param_groups.step",
                VALUES: ["common.pt:optimizer.optimizer.param_groups"],
            },
        )


# ----------------------------------------------------------------------------- legacy

_LAYER = re.compile(r"^(.*?\blayers\.)(\d+)(\..*)$")
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")
_GROUPED_EXPERT = re.compile(r"^.*\.mlp\.experts\.weight[12]$")
# distrib_optim.pt's flat buffers, and where each goes in the output tree
_OPTIMIZER_BUFFERS = (
    ("param", ("params",)),
    ("exp_avg", ("opt_state", "mu")),
    ("exp_avg_sq", ("opt_state", "nu")),
)

# global name -> {stage (or ("emb" | "out", stage) once tied): [per-TP arrays]}
_Fragments = dict[str, dict[Any, list]]


@dataclass
class _LegacyTensors:
    """Every rank's tensors, grouped by global name (per-stage layer and expert numbers made
    global), before merging."""

    fragments: _Fragments = field(default_factory=dict)
    local: dict[tuple[int, int], list] = field(
        default_factory=dict
    )  # (pp, tp) -> [(local, global, array)]
    files: dict[str, list[str]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    grouped: dict[str, dict[int, list]] = field(default_factory=dict)  # grouped-GEMM: per EP rank
    # global name -> the source tensors (``<rank dir>/<file>:model.<local name>``) merged into it
    sources: dict[str, list[str]] = field(default_factory=dict)
    # source tensors of the rank files not merged into any weight -> why (source.skipped)
    not_imported: dict[str, str] = field(default_factory=dict)


@dataclass
class _LegacyImport:
    """What the legacy items are made from: merge rules, fragments, optimizer slices."""

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


def _plan_legacy(
    source_dir: MegatronSource,
    spec: Spec | None,
    settings: dict,
    weights_only: bool = False,
    share: Share = WHOLE,
) -> ImportPlan:
    """Legacy TP x PP (x EP): fragments merged per name by the spec's kinds."""
    checkpoint = legacy.open_legacy(source_dir.ckpt_dir)
    _legacy_settings(checkpoint, settings)
    tensors = _collect_legacy_tensors(checkpoint, _stage_layer_offsets(checkpoint, settings))
    tied_pairs = _tied_output_pairs(checkpoint, tensors.fragments, settings)
    import_spec = _import_spec(spec, settings)
    names = list(tensors.fragments)
    matches = import_spec.classify(names, strict=import_spec.strict)
    if import_spec.strict is False:
        uncovered = [n for n in names if n not in matches]
        if uncovered:
            raise MegatronImportError(
                f"{checkpoint.iter_dir}: no import rule covers {uncovered[:10]} "
                f"(pass a spec with rules for them)"
            )
    if (tensors.grouped or checkpoint.ep > 1) and checkpoint.distrib_optim and not weights_only:
        raise MegatronImportError(
            f"{checkpoint.iter_dir}: distrib_optim.pt with "
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
    _fold_tied_copies(tensors.fragments, tied_pairs, tensors.files)
    _fold_tied_lists(tensors.sources, tied_pairs)
    want_model = optimizer is not None and any(d != np.dtype(np.float32) for d in dtypes)
    plan = _LegacyImport(
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
    return ImportPlan(
        _legacy_items(plan, share), info, len(share.pick(names)), source_tensors=found
    )


def _rank_dir_file(checkpoint: legacy.LegacyCheckpoint, path: Path) -> str:
    """``<rank dir>/<file>``: how a legacy rank file prefixes its source tensor names."""
    return os.path.relpath(path, checkpoint.iter_dir)


def _legacy_found(checkpoint: legacy.LegacyCheckpoint) -> list[str]:
    """Every tensor of every rank's ``model_optim_rng.pt`` and ``distrib_optim.pt`` (of every
    EP rank's directory too), as ``<rank dir>/<file>:<dotted path>``."""
    found = []
    for rank_file in checkpoint.ep_ranks.values():
        prefix = _rank_dir_file(checkpoint, rank_file.path)
        found += [f"{prefix}:{n}" for n in tensor_names(rank_file.state)]
        optim = rank_file.path.parent / "distrib_optim.pt"
        if os.path.lexists(optim):
            prefix = _rank_dir_file(checkpoint, optim)
            found += [f"{prefix}:{n}" for n in legacy.distrib_optim_tensors(optim)]
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
            f"{checkpoint.iter_dir}: the rank files hold the state of a non-distributed "
            f"optimizer ({len(held)} tensors, e.g. {held[0]!r}), which is not supported (only "
            f"the distributed optimizer's distrib_optim.pt is read). {WEIGHTS_ONLY_HINT}"
        )


def _legacy_step_sources(checkpoint: legacy.LegacyCheckpoint, found: list[str]) -> dict:
    """Where opt_state/count comes from: every rank's ``param_groups`` (a step that is a tensor
    named as one)."""
    prefixes = [_rank_dir_file(checkpoint, r.path) for r in checkpoint.ranks.values()]
    step = re.compile(
        rf"(?:{'|'.join(map(re.escape, prefixes))}):optimizer\.optimizer\.param_groups\.\d+\.step"
    )
    tensors = [n for n in found if step.fullmatch(n)]
    values = {VALUES: [f"{p}:optimizer.optimizer.param_groups" for p in prefixes]}
    return {TENSORS: tensors, **values} if tensors else values


def _legacy_skipped(plan: _LegacyImport, found: list[str], weights_only: bool) -> dict[str, str]:
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
    for key, value in checkpoint.args.items():
        if key in _ARG_SETTINGS and settings.get(key) is None:
            settings[key] = value
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
    for stage in range(checkpoint.pp):
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
            f"{checkpoint.iter_dir}: stages hold {total} layers in all, "
            f"args.num_layers={num_layers}"
        )
    return offsets


def _collect_legacy_tensors(
    checkpoint: legacy.LegacyCheckpoint, offsets: dict[int, int]
) -> _LegacyTensors:
    tensors = _LegacyTensors(local={key: [] for key in checkpoint.ranks})  # state-dict order
    for stage in range(checkpoint.pp):
        local_names = list(checkpoint.ranks[(stage, 0)].model)
        local_experts = _check_stage_names(checkpoint, stage, local_names)
        for name in local_names:
            first = checkpoint.ranks[(stage, 0)].model[name]
            if name.endswith("_extra_state") or not isinstance(first, np.ndarray):
                tensors.skipped.append(name if checkpoint.pp == 1 else f"stage{stage}:{name}")
                for (pp_rank, _, _), rank_file in checkpoint.ep_ranks.items():
                    if pp_rank == stage and isinstance(rank_file.model[name], np.ndarray):
                        prefix = _rank_dir_file(checkpoint, rank_file.path)
                        source = f"{prefix}:{rank_file.model_key}.{name}"
                        tensors.not_imported[source] = (
                            "TransformerEngine _extra_state (FP8 scaling metadata), not a weight"
                        )
                continue
            layer = _LAYER.match(name)
            global_name = (
                f"{layer.group(1)}{int(layer.group(2)) + offsets[stage]}{layer.group(3)}"
                if layer
                else name
            )
            if checkpoint.ep > 1 and _GROUPED_EXPERT.match(name):
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
    if checkpoint.tp > 1:
        raise MegatronImportError(
            f"tensor {name!r} in {checkpoint.ranks[(stage, 0)].path}: grouped-GEMM experts "
            f"with TP > 1 are not supported"
        )
    holders = [checkpoint.ep_ranks[(stage, 0, ep_rank)] for ep_rank in range(checkpoint.ep)]
    values = [r.model[name] for r in holders]
    _check_equal_shares(name, values, [r.path for r in holders], "expert-parallel")
    tensors.grouped.setdefault(global_name, {})[stage] = values
    tensors.files.setdefault(global_name, []).extend(
        os.path.relpath(r.path, checkpoint.iter_dir) for r in holders
    )
    tensors.sources.setdefault(global_name, []).extend(
        f"{_rank_dir_file(checkpoint, r.path)}:{r.model_key}.{name}" for r in holders
    )


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
    expert = _LOCAL_EXPERT.match(global_name) if checkpoint.ep > 1 else None
    for ep_rank in range(checkpoint.ep) if expert else [0]:
        expert_name = (
            f"{expert.group(1)}{ep_rank * local_experts + int(expert.group(2))}{expert.group(3)}"
            if expert
            else global_name
        )
        holders = [checkpoint.ep_ranks[(stage, tp, ep_rank)] for tp in range(checkpoint.tp)]
        per_tp = [r.model[name] for r in holders]
        _check_equal_shares(name, per_tp, [r.path for r in holders], "tensor-parallel")
        if ep_rank == 0:
            for tp_rank, value in enumerate(per_tp):
                tensors.local[(stage, tp_rank)].append((name, expert_name, value))
        tensors.fragments.setdefault(expert_name, {})[stage] = per_tp
        tensors.files.setdefault(expert_name, []).extend(
            os.path.relpath(
                checkpoint.ep_ranks[(stage, tp_rank, ep_rank)].path, checkpoint.iter_dir
            )
            for tp_rank in range(checkpoint.tp)
        )
        tensors.sources.setdefault(expert_name, []).extend(
            f"{_rank_dir_file(checkpoint, r.path)}:{r.model_key}.{name}" for r in holders
        )
    if expert is None:  # a non-expert tensor: every EP rank holds a copy, EP rank 0's is read
        for ep_rank in range(1, checkpoint.ep):
            for tp_rank in range(checkpoint.tp):
                copy = checkpoint.ep_ranks[(stage, tp_rank, ep_rank)]
                read = checkpoint.ep_ranks[(stage, tp_rank, 0)]
                source = f"{_rank_dir_file(checkpoint, copy.path)}:{copy.model_key}.{name}"
                tensors.not_imported[source] = (
                    f"expert-parallel rank {ep_rank}'s copy of a non-expert tensor: imported "
                    f"from EP rank 0's {_rank_dir_file(checkpoint, read.path)}"
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
        elif untie is None and checkpoint.pp > 1:
            first_embedding = next(iter(fragments[embedding].values()))
            first_output = next(iter(fragments[output].values()))
            if all(np.array_equal(a, b) for a, b in zip(first_embedding, first_output)):
                pairs.append((embedding, output))
    return pairs


def _fold_tied_copies(
    fragments: _Fragments, tied_pairs: list[tuple[str, str]], files: dict | None = None
) -> None:
    """The output layer's stages join the embedding's (merged as pipeline-tied copies)."""
    for embedding, output in tied_pairs:
        fragments[embedding] = {
            **{("emb", stage): v for stage, v in fragments[embedding].items()},
            **{("out", stage): v for stage, v in fragments.pop(output).items()},
        }
    if files is not None:
        _fold_tied_lists(files, tied_pairs)


def _fold_tied_lists(lists: dict[str, list], tied_pairs: list[tuple[str, str]]) -> None:
    """Per-name lists (files, source tensors): the output layer's join the embedding's."""
    for embedding, output in tied_pairs:
        lists[embedding] += lists.pop(output)


def _legacy_distrib_optim(
    checkpoint: legacy.LegacyCheckpoint, settings: dict, local: dict, tied_pairs: list
) -> tuple[dict[str, _Fragments], int, dict[str, dict[str, list[str]]]]:
    """Slice every rank's distrib_optim.pt flat buffers into per-parameter local fragments, laid
    out like megatron-core's grad buffer; returns ({state name: fragments}, step, {state name:
    {global name: the flat tensors its fragments are cut from}})."""
    missing = [key for key in checkpoint.ranks if key not in checkpoint.distrib_optim]
    if missing:
        raise MegatronImportError(
            f"missing shard file {checkpoint.ranks[missing[0]].path.parent / 'distrib_optim.pt'} "
            f"(other ranks have one)"
        )
    bucket_size = None
    if settings.get("overlap_grad_reduce"):
        dp = int(settings.get("data_parallel_size") or 1)
        bucket_size = int(settings.get("ddp_bucket_size") or max(40_000_000, 1_000_000 * dp))
    tied = settings.get("untie_embeddings_and_output_weights") is False
    out: dict[str, _Fragments] = {state_name: {} for state_name, _ in _OPTIMIZER_BUFFERS}
    sources: dict[str, dict[str, list[str]]] = {state_name: {} for state_name in out}
    steps: dict[float, str] = {}
    for (stage, tp_rank), rank_file in checkpoint.ranks.items():
        _slice_distrib_optim(checkpoint, stage, tp_rank, local, bucket_size, tied, out, sources)
        groups = _param_groups(rank_file.state.get("optimizer"))
        step = _step_from_param_groups(groups, f"{rank_file.path} ['optimizer']")
        steps.setdefault(step, f"in {rank_file.path}")
    count = agreed_step(
        steps, str(checkpoint.iter_dir), recorded_by="ranks", error=MegatronImportError
    )
    for per_name in out.values():  # the tied output layer's copy merges like the weights
        _fold_tied_copies(per_name, tied_pairs)
    for per_name in sources.values():
        _fold_tied_lists(per_name, tied_pairs)
    return out, count, sources


def _slice_distrib_optim(
    checkpoint: legacy.LegacyCheckpoint,
    stage: int,
    tp_rank: int,
    local: dict,
    bucket_size: int | None,
    tied: bool,
    out: dict[str, _Fragments],
    sources: dict[str, dict[str, list[str]]],
) -> None:
    """One rank's flat buffers cut at its parameters' places in the grad buffer."""
    buffers = legacy.read_distrib_optim(
        checkpoint.distrib_optim[(stage, tp_rank)],
        *checkpoint.distrib_optim_buffer((stage, tp_rank)),
    )
    rank_tensors = local[(stage, tp_rank)]
    params = [(local_name, int(a.size)) for local_name, _, a in rank_tensors]
    shared = set()
    if checkpoint.pp > 1:
        if stage == 0:
            shared |= {
                n for n, _, _ in rank_tensors if n.endswith("embedding.word_embeddings.weight")
            }
        if stage == checkpoint.pp - 1 and tied:
            shared |= {n for n, _, _ in rank_tensors if n.endswith("output_layer.weight")}
    layout, total = legacy.distrib_optim_layout(params, shared, bucket_size)
    if total != buffers.numel_unpadded:
        raise MegatronImportError(
            f"{buffers.path}: the flat buffers hold {buffers.numel_unpadded} elements but the "
            f"{len(params)} parameters of {checkpoint.ranks[(stage, tp_rank)].path.name} lay out "
            f"to {total} (megatron-core 0.16 buffer layout, bucket_size={bucket_size}); a "
            f"different megatron version or DDP bucket setting?"
        )
    for local_name, global_name, value in rank_tensors:
        start, end = layout[local_name]
        for state_name, per_name in out.items():
            per_stage = per_name.setdefault(global_name, {})
            per_tp = per_stage.setdefault(stage, [None] * checkpoint.tp)
            per_tp[tp_rank] = getattr(buffers, state_name)[start:end].reshape(value.shape)
            flat = f"{_rank_dir_file(checkpoint, Path(buffers.path))}:{buffers.names[state_name]}"
            sources[state_name].setdefault(global_name, []).append(flat)


class _LegacyMerger:
    """Merges one name's fragments with its kind, errors naming the files."""

    def __init__(self, plan: _LegacyImport):
        self.plan = plan

    def files_of(self, name: str) -> str:
        return ", ".join(sorted(set(self.plan.tensors.files[name])))

    def merged(self, name: str, stages: dict, what: str) -> tuple[np.ndarray, str]:
        """TP fragments merged by the name's kind; several stages: pipeline-tied copies."""
        kind = self.plan.matches[name].kind
        settings = self.plan.spec.settings
        try:
            if len(stages) == 1:
                (per_tp,) = stages.values()
                return np.asarray(merge(kind, per_tp, name=name, settings=settings)), kind.kind
            tied = PipelineTied(inner=kind)
            value = merge(tied, list(stages.values()), name=name, settings=settings)
            return np.asarray(value), f"pipeline_tied({kind.kind})"
        except MergeError as e:
            raise MegatronImportError(f"{what}: {e} (files: {self.files_of(name)})") from None

    def grouped(self, name: str) -> tuple[np.ndarray, str]:
        """megatron-core's GroupedMLP: weight1 [h, E_local*X] is used as view(E_local, h, X) and
        weight2 [E_local*ffn, h] as view(E_local, ffn, h); the EP-invariant global tensor (what one
        rank holding all E experts would have) is the EP ranks' buffers concatenated flat."""
        per_stage = []
        for per_ep in self.plan.tensors.grouped[name].values():
            shapes = {a.shape for a in per_ep}
            if len(shapes) != 1:
                raise MegatronImportError(
                    f"tensor {name!r}: EP ranks hold different shapes {sorted(shapes)} "
                    f"(files: {self.files_of(name)})"
                )
            (shape,) = shapes
            joined = np.concatenate([np.asarray(a) for a in per_ep], axis=0)
            per_stage.append(joined.reshape(shape[0], -1) if name.endswith("weight1") else joined)
        if len(per_stage) > 1:
            raise MegatronImportError(f"tensor {name!r} is held by several pipeline stages")
        return per_stage[0], f"expert(grouped, ep={self.plan.checkpoint.ep}, flat concat)"


def _legacy_items(plan: _LegacyImport, share: Share = WHOLE) -> Iterator[writer.HostItem]:
    """Per name: the merged weight, or master + moments (+ model copy) with distrib_optim.pt."""
    checkpoint, tensors = plan.checkpoint, plan.tensors
    merger = _LegacyMerger(plan)
    optimizer_files = sorted(
        os.path.relpath(f, checkpoint.iter_dir) for f in checkpoint.distrib_optim.values()
    )
    for name in share.pick(plan.names):
        files = sorted(set(tensors.files[name]))
        provenance = {
            "format": "legacy",
            "files": files,
            "tp": checkpoint.tp,
            "pp": checkpoint.pp,
            "ep": checkpoint.ep,
        }
        if name in tensors.grouped or plan.optimizer is None:
            value, pattern = (
                merger.grouped(name)
                if name in tensors.grouped
                else merger.merged(name, tensors.fragments[name], "model weights")
            )
            yield host_item(
                ("params", name),
                value,
                {**provenance, "pattern": pattern, TENSORS: tensors.sources[name]},
            )
            continue
        for state_name, tree in _OPTIMIZER_BUFFERS:
            what = f"distrib_optim.pt {state_name}"
            value, pattern = merger.merged(name, plan.optimizer[state_name][name], what)
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
            value, pattern = merger.merged(name, tensors.fragments[name], "model weights")
            yield host_item(
                ("model_params", name),
                value,
                {**provenance, "pattern": pattern, TENSORS: tensors.sources[name]},
            )
    if plan.optimizer is not None and share.primary:
        rank_files = (r.path for r in checkpoint.ranks.values())
        yield host_item(
            ("opt_state", "count"),
            np.asarray(plan.count, np.int32),
            {
                "files": sorted(os.path.relpath(f, checkpoint.iter_dir) for f in rank_files),
                "pattern": "optimizer.param_groups.step",
                **plan.step_sources,
            },
        )


def _legacy_info(plan: _LegacyImport, dtypes: set) -> dict:
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
        "tp": checkpoint.tp,
        "pp": checkpoint.pp // checkpoint.virtual_pipeline,  # virtual stages: pp * vp
        **(
            {"virtual_pipeline": checkpoint.virtual_pipeline}
            if checkpoint.virtual_pipeline > 1
            else {}
        ),
        "ep": checkpoint.ep,
        "iteration": checkpoint.iteration,
        "vocab_stripped": stripped,
        "checkpoint_version": checkpoint.checkpoint_version,
        "skipped_objects": tensors.skipped,
        "tied_embeddings": [embedding for embedding, _ in plan.tied_pairs],
        "model_dtype": ", ".join(sorted(str(d) for d in dtypes)),
        "optimizer": plan.optimizer is not None,
    }
    if not checkpoint.distrib_optim and any(
        "optimizer" in r.state for r in checkpoint.ranks.values()
    ):
        info["notes"] = [
            "model_optim_rng.pt holds a non-distributed optimizer state: not imported "
            "(only the distributed optimizer's distrib_optim.pt is supported)"
        ]
    return info
