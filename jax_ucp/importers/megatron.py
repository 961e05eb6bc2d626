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

Output tree (DESIGN.md "Contracts"): ``params`` (fp32 master weights when optimizer state is
present, else the model weights), ``opt_state`` {``mu``, ``nu``, ``count``}, ``model_params``
(model-precision weights, only when they are not fp32). Keys are the source names.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jax_ucp.importers import megatron_dcp as dcp
from jax_ucp.importers import megatron_legacy as legacy
from jax_ucp.importers import torch_pickle as tp

__all__ = [
    "MegatronImportError",
    "convert_megatron",
    "detect_megatron",
    "is_megatron_checkpoint",
    "default_import_rules",
    "MegatronSource",
]


class MegatronImportError(ValueError):
    """The Megatron checkpoint is incomplete, inconsistent or unsupported (names tensor + file)."""


@dataclass(frozen=True)
class MegatronSource:
    format: str  # "torch_dist" | "legacy"
    root: Path  # the directory the user gave (or its checkpoint root)
    ckpt_dir: Path  # the directory holding .metadata (torch_dist) or the mp_rank_* dirs (legacy)
    iteration: int | None


def detect_megatron(src: os.PathLike | str) -> MegatronSource | None:
    """torch_dist or legacy, from a checkpoint root (with the tracker file) or an iter directory."""
    p = Path(src)
    if not p.is_dir():
        return None
    if (p / ".metadata").is_file():
        return MegatronSource("torch_dist", p, p, _iter_of(p))
    try:
        root, it_dir, it = legacy.resolve_iteration_dir(p)
    except legacy.LegacyError:
        return None
    if (it_dir / ".metadata").is_file():
        return MegatronSource("torch_dist", root, it_dir, it)
    if any(d.name.startswith("mp_rank_") for d in it_dir.iterdir() if d.is_dir()):
        return MegatronSource("legacy", root, it_dir, it)
    return None


def _iter_of(p: Path) -> int | None:
    m = re.fullmatch(r"iter_(\d+)", p.name)
    return int(m.group(1)) if m else None


def is_megatron_checkpoint(src: os.PathLike | str) -> bool:
    return detect_megatron(src) is not None


# ----------------------------------------------------------------------------- import rules

_VOCAB = r"(?:.*\.)?(?:embedding\.word_embeddings\.weight|output_layer\.(?:weight|bias))"


def default_import_rules(settings: Mapping[str, Any]) -> list:
    """How each Megatron tensor is spread over TP ranks (megatron-core and older Megatron-LM names).

    Dims count from the end so the same rule covers per-layer and stacked ``[L, ...]`` tensors.
    ``qkv`` is used when the head counts are known (it checks the per-query-group layout),
    ``swiglu`` when the MLP is gated; otherwise plain ``partitioned``.
    """
    from jax_ucp.language import QKV, ImportRule, Partitioned, Replicated, SwiGLU, Vocab

    s = settings
    vocab = (
        Vocab(dim=0, vocab_size=int(s["vocab_size"]))
        if s.get("vocab_size") is not None
        else Partitioned(dim=0)
    )
    heads, groups, hd = s.get("num_attention_heads"), s.get("num_query_groups"), s.get("head_dim")
    if heads and hd:
        qkv_w = QKV(
            dim=-2, num_heads=int(heads), num_kv_heads=int(groups or heads), head_dim=int(hd)
        )
        qkv_b = QKV(
            dim=-1, num_heads=int(heads), num_kv_heads=int(groups or heads), head_dim=int(hd)
        )
    else:
        qkv_w, qkv_b = Partitioned(dim=-2), Partitioned(dim=-1)
    gated = bool(s.get("swiglu") or s.get("gated_linear_unit"))
    fc1_w, fc1_b = (
        (SwiGLU(dim=-2), SwiGLU(dim=-1)) if gated else (Partitioned(dim=-2), Partitioned(dim=-1))
    )
    opt = dict(required=False)
    return [
        ImportRule(_VOCAB, vocab, label="vocab-parallel embedding / output layer", **opt),
        ImportRule(r"(?:.*\.)?position_embeddings\.weight", Replicated(), **opt),
        ImportRule(r".*\.(?:linear_qkv|query_key_value)\.weight", qkv_w, label="fused qkv", **opt),
        ImportRule(
            r".*\.(?:linear_qkv|query_key_value)\.bias", qkv_b, label="fused qkv bias", **opt
        ),
        ImportRule(r".*\.(?:linear_fc1|dense_h_to_4h)\.weight", fc1_w, label="fc1", **opt),
        ImportRule(r".*\.(?:linear_fc1|dense_h_to_4h)\.bias", fc1_b, label="fc1 bias", **opt),
        ImportRule(
            r".*\.(?:linear_proj|dense|linear_fc2|dense_4h_to_h)\.weight",
            Partitioned(dim=-1),
            label="row-parallel",
            **opt,
        ),
        ImportRule(
            r".*\.(?:linear_proj|dense|linear_fc2|dense_4h_to_h)\.bias",
            Replicated(),
            label="row-parallel bias",
            **opt,
        ),
        ImportRule(
            r".*(?:norm|layer_norm)[^.]*\.(?:weight|bias)", Replicated(), label="norms", **opt
        ),
        ImportRule(r".*\.router\.(?:weight|expert_bias)", Replicated(), label="MoE router", **opt),
    ]


def _resolve_spec(spec) -> Any:
    if spec is None:
        return None
    from jax_ucp.language import Spec, load_spec

    if isinstance(spec, Spec):
        return spec
    return load_spec(spec)


def _make_spec(user_spec, settings: dict):
    """The spec used to classify names: the user's import rules if it has any, else the defaults."""
    from jax_ucp.language import Spec

    if user_spec is not None and user_spec.imports:
        return user_spec.with_settings(**{k: v for k, v in settings.items() if v is not None})
    return Spec(
        name="megatron-default-import",
        settings={k: v for k, v in settings.items() if v is not None},
        imports=tuple(default_import_rules(settings)),
        strict=False,
    )


# ----------------------------------------------------------------------------- shared output


@dataclass(frozen=True)
class _Out:
    key: tuple[str, ...]
    value: Any
    provenance: dict


def _steps_from_param_groups(groups: Any, where: str) -> int:
    if not isinstance(groups, list) or not groups:
        raise MegatronImportError(
            f"{where}: optimizer param_groups missing or empty; cannot recover the step"
        )
    seen = {}
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or "step" not in g:
            raise MegatronImportError(f"{where}: optimizer param_groups[{i}] has no 'step'")
        seen.setdefault(float(np.asarray(g["step"])), i)
    if len(seen) > 1:
        raise MegatronImportError(
            f"{where}: parameter groups disagree on the optimizer step: "
            + ", ".join(f"{k:g} (group {v})" for k, v in seen.items())
        )
    (v,) = seen
    if v != int(v) or not 0 <= v < 2**31:
        raise MegatronImportError(f"{where}: optimizer step {v} is not a valid int32 count")
    return int(v)


# ----------------------------------------------------------------------------- torch_dist

_OPT_PREFIX = "optimizer.state."
_OPT_KINDS = {
    "param": ("params",),
    "fp32_param": ("params",),
    "exp_avg": ("opt_state", "mu"),
    "exp_avg_sq": ("opt_state", "nu"),
}


def _plan_torch_dist(
    src: MegatronSource, spec, settings: dict
) -> tuple[list[_Out], Iterator[_Out], dict]:
    ck = dcp.open_dcp(src.ckpt_dir)
    backend = ck.mcore_metadata.get("sharded_backend")
    if backend not in (None, "torch_dist"):
        raise MegatronImportError(
            f"{ck.path / 'metadata.json'}: sharded_backend {backend!r} is not supported "
            f"(only 'torch_dist')"
        )
    ck.check_files()
    for t in ck.tensors.values():
        dcp.check_coverage(t, ck.path / ".metadata")
    common_path = ck.path / "common.pt"
    common: Any = {}
    if common_path.is_file():
        try:
            common = tp.load_torch_file(common_path, legacy.LEGACY_CLASSES)
        except tp.TorchFileError as e:
            raise MegatronImportError(str(e)) from None
    if not settings.get("num_layers") and isinstance(common, dict):
        settings.update(
            {
                k: v
                for k, v in legacy._args_dict(common.get("args")).items()
                if k in _ARG_SETTINGS and settings.get(k) is None
            }
        )
    model_names = [n for n in ck.tensors if not n.startswith("optimizer.")]
    opt_names = [n for n in ck.tensors if n.startswith("optimizer.")]
    opt: dict[str, dict[str, str]] = {}
    for n in opt_names:
        if not n.startswith(_OPT_PREFIX):
            raise MegatronImportError(
                f"tensor {n!r} in {ck.path / '.metadata'}: unsupported distributed-optimizer layout "
                f"({_sharding_type(common)!r}); only 'fully_reshardable' (model-space) state is supported"
            )
        rest = n[len(_OPT_PREFIX) :]
        kind, _, pname = rest.partition(".")
        if kind not in _OPT_KINDS:
            raise MegatronImportError(
                f"tensor {n!r} in {ck.path / '.metadata'}: unknown optimizer state {kind!r}"
            )
        opt.setdefault(pname, {})[kind] = n
    has_opt = bool(opt)
    if has_opt:
        st = _sharding_type(common)
        if st not in (None, "fully_reshardable"):
            raise MegatronImportError(
                f"{common_path}: distributed optimizer sharding type {st!r} is not supported "
                f"(re-save with metadata['distrib_optim_sharding_type']='fully_reshardable')"
            )
        for pname in model_names:
            have = opt.get(pname, {})
            if "param" in have and "fp32_param" in have:
                raise MegatronImportError(
                    f"tensor {pname!r}: both {have['param']!r} and {have['fp32_param']!r} "
                    f"in {ck.path / '.metadata'}; expected one master-weight tensor"
                )
            miss = [k for k in ("exp_avg", "exp_avg_sq") if k not in have] + (
                [] if ("param" in have or "fp32_param" in have) else ["param"]
            )
            if miss:
                raise MegatronImportError(
                    f"tensor {pname!r}: optimizer state {miss} missing in {ck.path / '.metadata'}"
                )
        for pname, have in opt.items():
            if pname not in ck.tensors:
                raise MegatronImportError(
                    f"optimizer state {sorted(have.values())} refers to model tensor {pname!r} "
                    f"that is not in {ck.path / '.metadata'}"
                )
            for n in have.values():
                if ck.tensors[n].shape != ck.tensors[pname].shape:
                    raise MegatronImportError(
                        f"tensor {n!r}: shape {list(ck.tensors[n].shape)} differs from the parameter's "
                        f"{list(ck.tensors[pname].shape)} in {ck.path / '.metadata'} (flattened model-space "
                        f"optimizer state from megatron-core < 0.14 is not supported)"
                    )
        groups = (
            (common.get("optimizer", {}) or {}).get("optimizer", {}).get("param_groups")
            if isinstance(common, dict)
            else None
        )
        count = _steps_from_param_groups(groups, str(common_path))
    spec_c = _make_spec(spec, settings)
    from jax_ucp.language import Vocab

    def vocab_kind(name):
        m = spec_c.match(name)
        return (
            m.kind
            if m is not None and isinstance(m.kind, Vocab) and isinstance(m.kind.vocab_size, int)
            else None
        )

    # known before any byte is read, so the manifest can record it
    stripped = {
        n: [ck.tensors[n].shape[0], int(vocab_kind(n).vocab_size)]
        for n in model_names
        if vocab_kind(n) is not None and ck.tensors[n].shape[0] > int(vocab_kind(n).vocab_size)
    }

    def read(tensor: str, rule_name: str) -> tuple[np.ndarray, str]:
        """Read one tensor; vocab-parallel ones keep only the tokenizer's rows."""
        k = vocab_kind(rule_name)
        if k is None or k.dim != 0:
            return ck.read(tensor), "torch_dist-global"
        n = ck.tensors[tensor].shape[0]
        if n < k.vocab_size:
            raise MegatronImportError(
                f"tensor {tensor!r}: {n} rows, fewer than vocab_size={k.vocab_size} "
                f"({ck.path / '.metadata'})"
            )
        return ck.read(tensor, rows=k.vocab_size), f"vocab(strip {n} -> {k.vocab_size})"

    model_dtypes = {ck.tensors[n].dtype for n in model_names}
    want_model = has_opt and any(d != np.dtype(np.float32) for d in model_dtypes)

    def items() -> Iterator[_Out]:
        for name in model_names:
            t = ck.tensors[name]
            prov = {"format": "torch_dist", "files": t.files, "chunks": len(t.chunks)}
            if not has_opt:
                arr, pat = read(name, name)
                yield _Out(("params", name), arr, {**prov, "pattern": pat})
                continue
            for kind, top in _OPT_KINDS.items():
                n = opt[name].get(kind)
                if n is None:
                    continue
                if top == ("params",) and ck.tensors[n].dtype != np.dtype(np.float32):
                    raise MegatronImportError(
                        f"tensor {n!r}: master weights have dtype {ck.tensors[n].dtype}, "
                        f"expected float32 ({', '.join(ck.tensors[n].files)})"
                    )
                arr, pat = read(n, name)
                yield _Out(
                    (*top, name),
                    arr,
                    {
                        "format": "torch_dist",
                        "files": ck.tensors[n].files,
                        "source_name": n,
                        "pattern": pat,
                    },
                )
            if want_model:
                arr, pat = read(name, name)
                yield _Out(("model_params", name), arr, {**prov, "pattern": pat})
        if has_opt:
            yield _Out(
                ("opt_state", "count"),
                np.asarray(count, np.int32),
                {"files": ["common.pt"], "pattern": "param_groups.step"},
            )

    it = common.get("iteration") if isinstance(common, dict) else None
    info = {
        "format": "torch_dist",
        "tensors": len(model_names),
        "optimizer": has_opt,
        "iteration": it if type(it) is int else None,
        "skipped_objects": sorted(ck.objects),
        "vocab_stripped": stripped,
        "mcore_metadata": ck.mcore_metadata,
        "dcp_version": ck.version,
        "model_dtype": ", ".join(sorted(str(d) for d in model_dtypes)),
    }
    return model_names, items(), info


def _sharding_type(common: Any) -> str | None:
    if isinstance(common, dict):
        o = common.get("optimizer")
        if isinstance(o, dict):
            return o.get("param_state_sharding_type")
    return None


# ----------------------------------------------------------------------------- legacy

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
_LAYER = re.compile(r"^(.*?\blayers\.)(\d+)(\..*)$")
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")
_GROUPED_EXPERT = re.compile(r"^.*\.mlp\.experts\.weight[12]$")


def _global_layer_names(ck: legacy.LegacyCheckpoint, where) -> dict[int, int]:
    """Per-stage layer offset: sum of the distinct layer counts of the earlier stages."""
    offs, acc = {}, 0
    for p in range(ck.pp):
        offs[p] = acc
        idx = {int(m.group(2)) for n in ck.ranks[(p, 0)].model for m in [_LAYER.match(n)] if m}
        if idx and sorted(idx) != list(range(len(idx))):
            raise MegatronImportError(
                f"{ck.ranks[(p, 0)].path}: layer numbers {sorted(idx)} are not 0..{len(idx) - 1}"
            )
        acc += len(idx)
    nl = where.get("num_layers")
    if nl and acc and acc != nl:
        raise MegatronImportError(
            f"{ck.iter_dir}: stages hold {acc} layers in all, args.num_layers={nl}"
        )
    return offs


def _plan_legacy(src: MegatronSource, spec, settings: dict):
    from jax_ucp.language import MergeError, PipelineTied, merge

    ck = legacy.open_legacy(src.ckpt_dir)
    if ck.checkpoint_version is not None and ck.checkpoint_version < 2.0:
        # before 2.0 Megatron-LM laid fused QKV out differently (fix_query_key_value_ordering)
        raise MegatronImportError(
            f"{ck.ranks[(0, 0)].path}: checkpoint_version {ck.checkpoint_version} uses the "
            f"pre-2.0 fused QKV ordering, which is not supported"
        )
    for k, v in ck.args.items():
        if k in _ARG_SETTINGS and settings.get(k) is None:
            settings[k] = v
    if settings.get("kv_channels") and not settings.get("head_dim"):
        settings["head_dim"] = settings["kv_channels"]
    if (
        settings.get("num_attention_heads")
        and settings.get("hidden_size")
        and not settings.get("head_dim")
    ):
        settings["head_dim"] = int(settings["hidden_size"]) // int(settings["num_attention_heads"])
    if not settings.get("group_query_attention", True) or not settings.get("num_query_groups"):
        settings["num_query_groups"] = settings.get("num_attention_heads")
    offs = _global_layer_names(ck, settings)
    # global name -> {stage: [per-TP arrays]}
    frags: dict[str, dict[int, list]] = {}
    frags_local: dict[tuple[int, int], list] = {k: [] for k in ck.ranks}  # state-dict order
    files: dict[str, list[str]] = {}
    skipped: list[str] = []
    grouped: dict[
        str, dict[int, list]
    ] = {}  # grouped-GEMM expert weights: name -> {stage: [per EP]}
    for p in range(ck.pp):
        names0 = list(ck.ranks[(p, 0)].model)
        for (pp_, t, e), rf in ck.ep_ranks.items():
            if pp_ == p and (t, e) != (0, 0) and set(rf.model) != set(names0):
                diff = sorted(set(names0) ^ set(rf.model))[:5]
                raise MegatronImportError(
                    f"{rf.path} and {ck.ranks[(p, 0)].path} hold different "
                    f"tensor names (e.g. {diff})"
                )
        local_experts = {int(m.group(2)) for n in names0 for m in [_LOCAL_EXPERT.match(n)] if m}
        nl = len(local_experts)
        if local_experts and sorted(local_experts) != list(range(nl)):
            raise MegatronImportError(
                f"{ck.ranks[(p, 0)].path}: local expert indices {sorted(local_experts)} "
                f"are not 0..{nl - 1}"
            )
        for n in names0:
            v0 = ck.ranks[(p, 0)].model[n]
            if n.endswith("_extra_state") or not isinstance(v0, np.ndarray):
                skipped.append(n if ck.pp == 1 else f"stage{p}:{n}")
                continue
            m = _LAYER.match(n)
            g = f"{m.group(1)}{int(m.group(2)) + offs[p]}{m.group(3)}" if m else n
            if ck.ep > 1 and _GROUPED_EXPERT.match(n):
                if ck.tp > 1:
                    raise MegatronImportError(
                        f"tensor {n!r} in {ck.ranks[(p, 0)].path}: grouped-GEMM experts "
                        f"with TP > 1 are not supported"
                    )
                grouped.setdefault(g, {})[p] = [
                    ck.ep_ranks[(p, 0, e)].model[n] for e in range(ck.ep)
                ]
                files.setdefault(g, []).extend(
                    os.path.relpath(ck.ep_ranks[(p, 0, e)].path, ck.iter_dir) for e in range(ck.ep)
                )
                continue
            em = _LOCAL_EXPERT.match(g) if ck.ep > 1 else None
            for e in range(ck.ep) if em else [0]:
                ge = f"{em.group(1)}{e * nl + int(em.group(2))}{em.group(3)}" if em else g
                per_tp = []
                for t in range(ck.tp):
                    rf = ck.ep_ranks[(p, t, e)]
                    a = rf.model[n]
                    if not isinstance(a, np.ndarray):
                        raise MegatronImportError(
                            f"tensor {n!r} in {rf.path}: a {type(a).__name__}, "
                            f"expected a tensor (rank 0 holds one)"
                        )
                    per_tp.append(a)
                    if e == 0:
                        frags_local[(p, t)].append((n, ge, a))
                frags.setdefault(ge, {})[p] = per_tp
                files.setdefault(ge, []).extend(
                    os.path.relpath(ck.ep_ranks[(p, t, e)].path, ck.iter_dir) for t in range(ck.tp)
                )
    # tied output layer: Megatron keeps a copy on the last stage (pipeline-tied)
    untie = settings.get("untie_embeddings_and_output_weights")
    tied_pairs = []
    for emb in [n for n in frags if n.endswith("embedding.word_embeddings.weight")]:
        out = emb.replace("embedding.word_embeddings.weight", "output_layer.weight")
        if out in frags and untie is False:
            tied_pairs.append((emb, out))
        elif out in frags and untie is None and ck.pp > 1:
            same = all(
                np.array_equal(a, b)
                for a, b in zip(next(iter(frags[emb].values())), next(iter(frags[out].values())))
            )
            if same:
                tied_pairs.append((emb, out))
    spec_c = _make_spec(spec, settings)
    names = list(frags)
    matches = spec_c.classify(names, strict=spec_c.strict)
    if spec_c.strict is False:
        uncovered = [n for n in names if n not in matches]
        if uncovered:
            raise MegatronImportError(
                f"{ck.iter_dir}: no import rule covers {uncovered[:10]} "
                f"(pass a spec with rules for them)"
            )
    if grouped and ck.distrib_optim:
        raise MegatronImportError(
            f"{ck.iter_dir}: distrib_optim.pt with grouped-GEMM experts is not supported"
        )
    names += list(grouped)
    for emb, out in tied_pairs:
        frags[emb] = {
            **{("emb", s): v for s, v in frags[emb].items()},
            **{("out", s): v for s, v in frags.pop(out).items()},
        }
        files[emb] += files.pop(out)
        names.remove(out)
    dtypes = {a.dtype for st in frags.values() for per in st.values() for a in per}
    opt_frags, count = (
        _legacy_distrib_optim(ck, settings, frags_local, tied_pairs)
        if ck.distrib_optim
        else (None, None)
    )
    has_opt_entry = any("optimizer" in r.state for r in ck.ranks.values())
    want_model = opt_frags is not None and any(d != np.dtype(np.float32) for d in dtypes)

    def merged(n: str, stages: dict, what: str) -> tuple[np.ndarray, str]:
        m = matches[n]
        try:
            if len(stages) == 1:
                (per_tp,) = stages.values()
                return np.asarray(
                    merge(m.kind, per_tp, name=n, settings=spec_c.settings)
                ), m.kind.kind
            return (
                np.asarray(
                    merge(
                        PipelineTied(inner=m.kind),
                        list(stages.values()),
                        name=n,
                        settings=spec_c.settings,
                    )
                ),
                f"pipeline_tied({m.kind.kind})",
            )
        except MergeError as e:
            raise MegatronImportError(
                f"{what}: {e} (files: {', '.join(sorted(set(files[n])))})"
            ) from None

    def grouped_merged(n: str) -> tuple[np.ndarray, str]:
        """megatron-core's GroupedMLP: weight1 [h, E_local*X] is used as view(E_local, h, X) and
        weight2 [E_local*ffn, h] as view(E_local, ffn, h); the EP-invariant global tensor (what one
        rank holding all E experts would have) is the EP ranks' buffers concatenated flat."""
        stages = grouped[n]
        per_stage = []
        for per_ep in stages.values():
            shapes = {a.shape for a in per_ep}
            if len(shapes) != 1:
                raise MegatronImportError(
                    f"tensor {n!r}: EP ranks hold different shapes {sorted(shapes)} "
                    f"(files: {', '.join(sorted(set(files[n])))})"
                )
            (shape,) = shapes
            cat = np.concatenate([np.asarray(a) for a in per_ep], axis=0)
            per_stage.append(cat.reshape(shape[0], -1) if n.endswith("weight1") else cat)
        if len(per_stage) > 1:
            raise MegatronImportError(f"tensor {n!r} is held by several pipeline stages")
        return per_stage[0], f"expert(grouped, ep={ck.ep}, flat concat)"

    def items() -> Iterator[_Out]:
        for n in names:
            prov = {
                "format": "legacy",
                "files": sorted(set(files[n])),
                "tp": ck.tp,
                "pp": ck.pp,
                "ep": ck.ep,
            }
            if n in grouped:
                arr, pat = grouped_merged(n)
                yield _Out(("params", n), arr, {**prov, "pattern": pat})
                continue
            if opt_frags is None:
                arr, pat = merged(n, frags[n], "model weights")
                yield _Out(("params", n), arr, {**prov, "pattern": pat})
                continue
            for kind, top in (
                ("param", ("params",)),
                ("exp_avg", ("opt_state", "mu")),
                ("exp_avg_sq", ("opt_state", "nu")),
            ):
                arr, pat = merged(n, opt_frags[kind][n], f"distrib_optim.pt {kind}")
                yield _Out(
                    (*top, n),
                    arr,
                    {
                        **prov,
                        "files": sorted(set(files[n]) | set(opt_files)),
                        "pattern": pat,
                        "source": f"distrib_optim.pt:{kind}",
                    },
                )
            if want_model:
                arr, pat = merged(n, frags[n], "model weights")
                yield _Out(("model_params", n), arr, {**prov, "pattern": pat})
        if opt_frags is not None:
            yield _Out(
                ("opt_state", "count"),
                np.asarray(count, np.int32),
                {
                    "files": sorted(
                        os.path.relpath(r.path, ck.iter_dir) for r in ck.ranks.values()
                    ),
                    "pattern": "optimizer.param_groups.step",
                },
            )

    opt_files = sorted(os.path.relpath(f, ck.iter_dir) for f in ck.distrib_optim.values())
    from jax_ucp.language import Vocab

    stripped = {}
    for n in names:
        if n in grouped:
            continue
        k = matches[n].kind
        if isinstance(k, Vocab) and isinstance(k.vocab_size, int):
            rows = sum(int(a.shape[0]) for a in next(iter(frags[n].values())))
            if rows > k.vocab_size:
                stripped[n] = [rows, k.vocab_size]
    info = {
        "format": "legacy",
        "tp": ck.tp,
        "pp": ck.pp,
        "ep": ck.ep,
        "iteration": ck.iteration,
        "vocab_stripped": stripped,
        "checkpoint_version": ck.checkpoint_version,
        "skipped_objects": skipped,
        "tied_embeddings": [e for e, _ in tied_pairs],
        "model_dtype": ", ".join(sorted(str(d) for d in dtypes)),
        "optimizer": opt_frags is not None,
    }
    if has_opt_entry and opt_frags is None:
        info["notes"] = [
            "model_optim_rng.pt holds a non-distributed optimizer state: not imported "
            "(only the distributed optimizer's distrib_optim.pt is supported)"
        ]
    return names, items(), info


def _legacy_distrib_optim(
    ck: legacy.LegacyCheckpoint, settings: dict, frags_local: dict, tied_pairs: list
):
    """Slice every rank's distrib_optim.pt flat buffers into per-parameter local fragments, laid
    out like megatron-core's grad buffer; returns ({kind: {name: {stage: [per TP]}}}, step)."""
    missing = [(p, t) for (p, t) in ck.ranks if (p, t) not in ck.distrib_optim]
    if missing:
        p, t = missing[0]
        raise MegatronImportError(
            f"missing shard file {ck.ranks[(p, t)].path.parent / 'distrib_optim.pt'} "
            f"(other ranks have one)"
        )
    bucket_size = None
    if settings.get("overlap_grad_reduce"):
        dp = int(settings.get("data_parallel_size") or 1)
        bucket_size = int(settings.get("ddp_bucket_size") or max(40_000_000, 1_000_000 * dp))
    tied = settings.get("untie_embeddings_and_output_weights") is False
    out = {k: {} for k in ("param", "exp_avg", "exp_avg_sq")}
    steps: dict[float, str] = {}
    for (p, t), rf in ck.ranks.items():
        st = legacy.read_distrib_optim(ck.distrib_optim[(p, t)])
        local = [(ln, g, a) for ln, g, a in frags_local[(p, t)]]
        params = [(ln, int(a.size)) for ln, _, a in local]
        shared = set()
        if ck.pp > 1:
            if p == 0:
                shared |= {
                    ln for ln, _, _ in local if ln.endswith("embedding.word_embeddings.weight")
                }
            if p == ck.pp - 1 and tied:
                shared |= {ln for ln, _, _ in local if ln.endswith("output_layer.weight")}
        layout, total = legacy.distrib_optim_layout(params, shared, bucket_size)
        if total != st.numel_unpadded:
            raise MegatronImportError(
                f"{st.path}: the flat buffers hold {st.numel_unpadded} elements but the {len(params)} "
                f"parameters of {rf.path.name} lay out to {total} (megatron-core 0.16 buffer layout, "
                f"bucket_size={bucket_size}); a different megatron version or DDP bucket setting?"
            )
        for ln, g, a in local:
            s0, s1 = layout[ln]
            for kind in out:
                flat = getattr(st, kind)
                out[kind].setdefault(g, {}).setdefault(p, [None] * ck.tp)[t] = flat[s0:s1].reshape(
                    a.shape
                )
        o = rf.state.get("optimizer")
        groups = o.get("optimizer", {}).get("param_groups") if isinstance(o, dict) else None
        steps.setdefault(_steps_from_param_groups(groups, f"{rf.path} ['optimizer']"), str(rf.path))
    if len(steps) > 1:
        raise MegatronImportError(
            "ranks disagree on the optimizer step: "
            + ", ".join(f"{k} in {v}" for k, v in steps.items())
        )
    (count,) = steps
    # the tied output layer's optimizer copy merges with the embedding's, like the weights
    for kind, d in out.items():
        for emb, o_name in tied_pairs:
            d[emb] = {
                **{("emb", s): v for s, v in d[emb].items()},
                **{("out", s): v for s, v in d.pop(o_name).items()},
            }
    return out, count


# ----------------------------------------------------------------------------- entry point


def convert_megatron(
    src: os.PathLike | str,
    dst: os.PathLike | str,
    *,
    spec=None,
    vocab_size: int | None = None,
    force: bool = False,
    step: int | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    compression: str | None = None,
) -> str:
    """Convert a Megatron checkpoint (torch_dist or legacy; detected) into a UCP checkpoint.

    ``spec``: a :class:`jax_ucp.language.Spec`, a shipped spec name or a TOML path; its settings
    (e.g. ``vocab_size``) and import rules are used. ``vocab_size`` (the tokenizer's, before
    Megatron's padding) overrides the spec's. ``step`` writes ``<dst>/<step>/state`` as a
    CheckpointManager step. ``progress(name, done, total)`` is called per parameter. All checks
    that need no tensor bytes run before anything is written; any failure leaves ``dst``
    untouched. Returns the UCP directory.
    """
    from jax_ucp.handler.host_writer import (
        HostItem,
        host_items_with_progress,
        write_host_checkpoint,
    )

    dst = os.fspath(dst)
    if step is None and os.path.exists(dst) and not force:
        raise FileExistsError(f"{dst} already exists; pass force=True to replace it.")
    src_info = detect_megatron(src)
    if src_info is None:
        raise MegatronImportError(
            f"{src}: not a Megatron checkpoint (no .metadata, no "
            f"latest_checkpointed_iteration.txt / iter_NNNNNNN/mp_rank_* layout)"
        )
    user_spec = _resolve_spec(spec)
    settings: dict[str, Any] = dict(user_spec.env) if user_spec is not None else {}
    if vocab_size is not None:
        settings["vocab_size"] = int(vocab_size)
    try:
        if src_info.format == "torch_dist":
            names, stream, info = _plan_torch_dist(src_info, user_spec, settings)
        else:
            names, stream, info = _plan_legacy(src_info, user_spec, settings)
    except (dcp.DcpError, legacy.LegacyError) as e:
        raise MegatronImportError(str(e)) from None
    total = len(names)

    def items() -> Iterator[HostItem]:
        try:
            yield from host_items_with_progress(stream, total, progress)
        except (dcp.DcpError, legacy.LegacyError) as e:
            raise MegatronImportError(str(e)) from None

    vs = settings.get("vocab_size")
    it = info.pop("iteration", None)
    source = {
        "framework": "megatron",
        "path": os.path.abspath(src_info.ckpt_dir),
        "iteration": src_info.iteration if src_info.iteration is not None else it,
        "vocab_size": vs,
        "settings": _jsonable(settings),
        **_jsonable(info),
    }
    if vs is None:
        source.setdefault("notes", []).append(
            "vocab padding kept: the original vocab size was not given (vocab_size= / --vocab-size)"
        )
    return write_host_checkpoint(
        dst, items(), force=force, source=source, step=step, compression=compression
    )


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if isinstance(x, np.generic):
        return x.item()
    return str(x)
