"""Import DeepSpeed ZeRO 1/2/3 checkpoints (fp32 / bf16 / fp16) as UCP checkpoints.

Reads the checkpoint with :mod:`jax_ucp.importers.torch_pickle` (no torch, no pickled code
executed; tensors are memory-mapped) and streams one parameter at a time into
:func:`jax_ucp.handler.host_writer.write_host_checkpoint`, so peak anonymous memory is about one
parameter (its fp32 master, Adam moments, model-precision copy), not the checkpoint.

Layouts (DeepSpeed 0.19, checked against ``ds_to_universal`` and ``zero_to_fp32``):

* stage 1/2: rank r's ``optimizer_state_dict`` holds, per param group g, a flat fp32 partition
  ``single_partition_of_fp32_groups[g]`` and flat ``base_optimizer_state.state[g]`` {step,
  exp_avg, exp_avg_sq}; ``param_slice_mappings[g][name] = fragment_address(numel, start)`` says
  which slice of rank r's partition holds which part of the parameter (a parameter can straddle
  ranks; group ends are padded, ``group_paddings``). Concatenating the fragments in rank order
  gives the flattened parameter.
* stage 3: rank r holds ``fp32_flat_groups`` (one flat tensor per sub-group; virtually
  concatenated) and ``optimizer_state_dict.state[i]`` per sub-group. Each parameter of
  ``param_shapes`` (in order) takes ``ceil(numel / W)`` elements of every rank's flat vector;
  rank r holds elements ``[r*p, (r+1)*p)`` of the flattened parameter, the tail padded.

Output tree (DESIGN.md "Contracts"): ``params`` = fp32 master weights keyed by DeepSpeed's
``param_shapes`` names, ``opt_state`` = {``mu``, ``nu`` (same keys), ``count`` (int32 step)},
``model_params`` = model-precision weights when the run was bf16/fp16.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jax_ucp.importers.torch_pickle import (
    StandIn,
    int_enum_standin,
    load_torch_file,
    standin_class,
)

__all__ = [
    "DeepSpeedImportError",
    "DeepSpeedCheckpoint",
    "DS_CLASSES",
    "convert_deepspeed",
    "is_deepspeed_checkpoint",
    "open_deepspeed_checkpoint",
    "iter_deepspeed_tensors",
]


class DeepSpeedImportError(ValueError):
    """The DeepSpeed checkpoint is incomplete or inconsistent (message names the file)."""


_ZERO_STAGES = {0: "disabled", 1: "optimizer_states", 2: "gradients", 3: "weights"}

#: DeepSpeed classes pickled into checkpoint files, mapped to inert stand-ins.
DS_CLASSES: dict[str, Any] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": standin_class(
        "deepspeed.runtime.fp16.loss_scaler.LossScaler"
    ),
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": standin_class(
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"
    ),
    "deepspeed.runtime.zero.config.ZeroStageEnum": int_enum_standin(
        "deepspeed.runtime.zero.config.ZeroStageEnum", _ZERO_STAGES
    ),
    "deepspeed.utils.tensor_fragment.fragment_address": standin_class(
        "deepspeed.utils.tensor_fragment.fragment_address"
    ),
    "deepspeed.checkpoint.constants.SubparamShape": standin_class(
        "deepspeed.checkpoint.constants.SubparamShape"
    ),
    "deepspeed.runtime.zero.stage3.SubParamGroupInfo": standin_class(
        "deepspeed.runtime.zero.stage3.SubParamGroupInfo"
    ),
}

_OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_Z3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")


def _load(path: str) -> Any:
    return load_torch_file(path, DS_CLASSES)


def _numel(shape: Sequence[int]) -> int:
    return int(math.prod(shape))


@dataclass
class DeepSpeedCheckpoint:
    """What the importer needs from one tag folder, validated up front."""

    tag_dir: str
    stage: int
    world_size: int
    model_dtype: np.dtype
    param_shapes: list[dict[str, tuple[int, ...]]]  # per param group (stage 3: as stored)
    model_file: str
    optim_files: list[str]
    model_states: dict
    optim_states: list[dict]  # per DP rank: the 'optimizer_state_dict'
    global_steps: int | None = None
    module: Mapping[str, np.ndarray] = field(default_factory=dict)
    shared_params: Mapping[str, str] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [n for g in self.param_shapes for n in g]

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: s for g in self.param_shapes for n, s in g.items()}


def is_deepspeed_checkpoint(path: os.PathLike | str) -> bool:
    """True for a folder holding ``latest`` + tag folders, or a tag folder with ZeRO files."""
    p = os.fspath(path)
    if os.path.isfile(os.path.join(p, "latest")):
        return True
    return os.path.isdir(p) and any(_OPTIM_RE.match(f) for f in os.listdir(p))


def _resolve_tag_dir(src: str, tag: str | None) -> str:
    if not os.path.isdir(src):
        raise DeepSpeedImportError(f"{src}: not a directory")
    if tag is not None:
        d = os.path.join(src, tag)
        if not os.path.isdir(d):
            raise DeepSpeedImportError(f"{d}: tag folder {tag!r} not found")
        return d
    if any(_OPTIM_RE.match(f) for f in os.listdir(src)):
        return src
    latest = os.path.join(src, "latest")
    if os.path.isfile(latest):
        t = open(latest).read().strip()
        d = os.path.join(src, t)
        if not os.path.isdir(d):
            raise DeepSpeedImportError(f"{latest} names tag {t!r} but {d} does not exist")
        return d
    raise DeepSpeedImportError(
        f"{src}: no DeepSpeed checkpoint here (expected a 'latest' file or "
        f"'*zero_pp_rank_*_optim_states.pt' files)"
    )


def _dtype_of_run(cfg: Mapping, module: Mapping[str, Any]) -> np.dtype:
    import ml_dtypes

    if (cfg.get("bf16") or cfg.get("bfloat16") or {}).get("enabled"):
        return np.dtype(ml_dtypes.bfloat16)
    if (cfg.get("fp16") or {}).get("enabled"):
        return np.dtype(np.float16)
    for v in module.values():
        if isinstance(v, np.ndarray) and v.dtype.kind in "fV" and v.size:
            return v.dtype
    return np.dtype(np.float32)


def _get(d: Any, key: str, where: str) -> Any:
    if not isinstance(d, Mapping) or key not in d:
        raise DeepSpeedImportError(f"{where}: missing {key!r}")
    return d[key]


def open_deepspeed_checkpoint(src: os.PathLike | str, tag: str | None = None, *, spec: Any = None):
    """Find and validate the files of one checkpoint tag; tensors stay memory-mapped.

    A Megatron-DeepSpeed checkpoint with tensor/pipeline parallelism (several ``mp_rank_XX`` ranks or
    ``layer_XX-model_YY`` files) gives a
    :class:`jax_ucp.importers.deepspeed_megatron.MegatronDeepSpeedCheckpoint` (``spec``: import rules
    to use instead of its ``universal_checkpoint_info``)."""
    tag_dir = _resolve_tag_dir(os.fspath(src), tag)
    from jax_ucp.importers import deepspeed_megatron as _meg

    if _meg.is_model_parallel(tag_dir):
        return _meg.open_megatron_deepspeed_checkpoint(tag_dir, spec=spec)
    files = sorted(os.listdir(tag_dir))
    optim: dict[int, str] = {}
    mp_ranks: set[int] = set()
    for f in files:
        m = _OPTIM_RE.match(f)
        if m:
            mp_ranks.add(int(m.group(3)))
            if int(m.group(3)) == 0:
                rank = int(m.group(2))
                if rank in optim:
                    raise DeepSpeedImportError(
                        f"{tag_dir}: two optimizer files for DP rank {rank}: "
                        f"{os.path.basename(optim[rank])} and {f}"
                    )
                optim[rank] = os.path.join(tag_dir, f)
    if not optim:
        raise DeepSpeedImportError(
            f"{tag_dir}: no '*zero_pp_rank_*_mp_rank_00_optim_states.pt' files"
        )
    if mp_ranks != {0}:  # unreachable through open_deepspeed_checkpoint (dispatched above)
        raise DeepSpeedImportError(f"{tag_dir}: model-parallel ranks {sorted(mp_ranks)} found")
    bf16_prefixed = {bool(_OPTIM_RE.match(os.path.basename(p)).group(1)) for p in optim.values()}
    if len(bf16_prefixed) > 1:
        raise DeepSpeedImportError(f"{tag_dir}: both 'bf16_' and plain optimizer files present")

    first = optim[min(optim)]
    osd0 = _get(_load(first), "optimizer_state_dict", first)
    stage = int(_get(osd0, "zero_stage", first))
    pc = _get(osd0, "partition_count", first)
    world = max(pc) if isinstance(pc, (list, tuple)) else int(pc)
    expected = [
        os.path.join(
            tag_dir,
            os.path.basename(first).replace(f"zero_pp_rank_{min(optim)}_", f"zero_pp_rank_{r}_"),
        )
        for r in range(world)
    ]
    for r, path in enumerate(expected):
        if r not in optim:
            raise DeepSpeedImportError(
                f"{path}: missing optimizer file for DP rank {r} (partition_count in {first} is {world})"
            )
    if len(optim) != world:
        extra = sorted(set(optim) - set(range(world)))
        raise DeepSpeedImportError(
            f"{tag_dir}: world size metadata says {world} DP ranks (partition_count in {first}) but "
            f"found optimizer files for ranks {sorted(optim)} (unexpected: "
            f"{[os.path.basename(optim[r]) for r in extra]})"
        )

    if stage in (1, 2):
        model_file = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    elif stage == 3:
        model_file = os.path.join(tag_dir, "zero_pp_rank_0_mp_rank_00_model_states.pt")
        for r in range(world):
            p = os.path.join(tag_dir, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
            if not os.path.isfile(p):
                raise DeepSpeedImportError(
                    f"{p}: missing stage-3 model states file for DP rank {r}"
                )
        z3_models = [f for f in files if _Z3_MODEL_RE.match(f)]
        if len(z3_models) != world:
            raise DeepSpeedImportError(
                f"{tag_dir}: world size metadata says {world} DP ranks but found {len(z3_models)} "
                f"stage-3 model states files"
            )
    else:
        raise DeepSpeedImportError(f"{first}: unsupported zero_stage {stage}")
    if not os.path.isfile(model_file):
        raise DeepSpeedImportError(f"{model_file}: missing model states file")
    ms = _load(model_file)
    if not isinstance(ms, Mapping):
        raise DeepSpeedImportError(f"{model_file}: expected a dict, found {type(ms).__name__}")
    dp_meta = ms.get("dp_world_size")
    if dp_meta is not None and int(dp_meta) != world:
        raise DeepSpeedImportError(
            f"{model_file}: dp_world_size is {dp_meta} but the optimizer files say {world} "
            f"(partition_count in {first})"
        )
    if ms.get("mp_world_size", 1) not in (None, 1):
        raise DeepSpeedImportError(
            f"{model_file}: mp_world_size is {ms['mp_world_size']} but the folder holds "
            f"the files of model-parallel rank 0 only (missing mp_rank_01_* files?)"
        )
    ps = _get(ms, "param_shapes", model_file)
    if isinstance(ps, Mapping):
        ps = [ps]
    param_shapes = [{str(n): tuple(int(d) for d in s) for n, s in g.items()} for g in ps]
    if ms.get("frozen_param_shapes"):
        raise DeepSpeedImportError(
            f"{model_file}: frozen parameters "
            f"({list(ms['frozen_param_shapes'])[:3]}...) are not supported yet"
        )

    osds = [osd0]
    for r in range(1, world):
        sd = _load(optim[r])
        o = _get(sd, "optimizer_state_dict", optim[r])
        if int(_get(o, "zero_stage", optim[r])) != stage:
            raise DeepSpeedImportError(
                f"{optim[r]}: zero_stage {int(o['zero_stage'])}, rank 0 has {stage}"
            )
        pcr = _get(o, "partition_count", optim[r])
        if pcr != pc:
            raise DeepSpeedImportError(f"{optim[r]}: partition_count {pcr}, {first} has {pc}")
        osds.append(o)
    module = ms.get("module") or {}
    ck = DeepSpeedCheckpoint(
        tag_dir=tag_dir,
        stage=stage,
        world_size=world,
        model_dtype=_dtype_of_run(ms.get("ds_config") or {}, module),
        param_shapes=param_shapes,
        model_file=model_file,
        optim_files=[optim[r] for r in range(world)],
        model_states=ms,
        optim_states=osds,
        global_steps=ms.get("global_steps"),
        module=module,
        shared_params=dict(ms.get("shared_params") or {}),
    )
    _validate_layout(ck)
    return ck


# --------------------------------------------------------------------------- fragment maps


@dataclass(frozen=True)
class _Piece:
    rank: int
    start: int  # in the rank's (virtual) flat vector
    numel: int


class _Flat:
    """Several flat arrays of one rank seen as one vector (stage-3 sub-groups)."""

    def __init__(self, arrays: Sequence[np.ndarray], what: str):
        self.arrays = [np.asarray(a).reshape(-1) for a in arrays]
        self.offsets = np.cumsum([0] + [a.size for a in self.arrays]).tolist()
        self.what = what

    @property
    def size(self) -> int:
        return self.offsets[-1]

    def take(self, start: int, n: int) -> list[np.ndarray]:
        if start + n > self.size:
            raise DeepSpeedImportError(
                f"{self.what}: needs elements [{start}, {start + n}) but holds {self.size}"
            )
        out = []
        for a, o in zip(self.arrays, self.offsets):
            lo, hi = max(start, o), min(start + n, o + a.size)
            if lo < hi:
                out.append(a[lo - o : hi - o])
        return out


def _plan_stage12(ck: DeepSpeedCheckpoint) -> dict[str, tuple[int, list[_Piece]]]:
    """name -> (param group, pieces in rank order)."""
    plan: dict[str, tuple[int, list[_Piece]]] = {}
    for g, shapes in enumerate(ck.param_shapes):
        for name in shapes:
            plan[name] = (g, [])
    for r, osd in enumerate(ck.optim_states):
        f = ck.optim_files[r]
        psm = _get(osd, "param_slice_mappings", f)
        if len(psm) != len(ck.param_shapes):
            raise DeepSpeedImportError(
                f"{f}: {len(psm)} param groups in param_slice_mappings, "
                f"{ck.model_file} has {len(ck.param_shapes)}"
            )
        for g, mapping in enumerate(psm):
            for name, frag in mapping.items():
                if name not in plan:
                    raise DeepSpeedImportError(
                        f"{f}: parameter {name!r} in param_slice_mappings is not in "
                        f"param_shapes of {ck.model_file}"
                    )
                if plan[name][0] != g:
                    raise DeepSpeedImportError(
                        f"{f}: parameter {name!r} in group {g}, expected {plan[name][0]}"
                    )
                if (
                    not isinstance(frag, StandIn)
                    or not hasattr(frag, "numel")
                    or not hasattr(frag, "start")
                ):
                    raise DeepSpeedImportError(f"{f}: bad fragment_address for {name!r}: {frag!r}")
                plan[name][1].append(_Piece(r, int(frag.start), int(frag.numel)))
    return plan


def _plan_stage3(ck: DeepSpeedCheckpoint) -> dict[str, tuple[int, list[_Piece]]]:
    plan: dict[str, tuple[int, list[_Piece]]] = {}
    offset = 0
    w = ck.world_size
    for g, shapes in enumerate(ck.param_shapes):
        for name, shape in shapes.items():
            n = _numel(shape)
            part = math.ceil(n / w)
            pieces = []
            for r in range(w):
                take = max(0, min(part, n - r * part))
                if take:
                    pieces.append(_Piece(r, offset, take))
            plan[name] = (g, pieces)
            offset += part
    return plan


def _validate_layout(ck: DeepSpeedCheckpoint) -> None:
    shapes = ck.shapes
    if ck.stage in (1, 2):
        plan = _plan_stage12(ck)
        for r, osd in enumerate(ck.optim_states):
            f = ck.optim_files[r]
            fp32 = _get(osd, "single_partition_of_fp32_groups", f)
            st = _get(_get(osd, "base_optimizer_state", f), "state", f)
            if len(fp32) != len(ck.param_shapes):
                raise DeepSpeedImportError(
                    f"{f}: {len(fp32)} fp32 partitions for {len(ck.param_shapes)} groups"
                )
            for g in range(len(fp32)):
                for key in ("exp_avg", "exp_avg_sq"):
                    a = _get(_get(st, g, f"{f} state"), key, f"{f} state[{g}]")
                    if a.size < fp32[g].size:
                        raise DeepSpeedImportError(
                            f"{f}: group {g} {key} has {a.size} elements, "
                            f"fp32 partition has {fp32[g].size}"
                        )
    else:
        plan = _plan_stage3(ck)
        need = sum(math.ceil(_numel(s) / ck.world_size) for s in shapes.values())
        for r, osd in enumerate(ck.optim_states):
            f = ck.optim_files[r]
            fp32 = _Flat(_get(osd, "fp32_flat_groups", f), f"{f} fp32_flat_groups")
            if fp32.size != need:
                raise DeepSpeedImportError(
                    f"{f}: fp32_flat_groups hold {fp32.size} elements; param_shapes in {ck.model_file} with "
                    f"{ck.world_size} DP ranks need {need}"
                )
    for name, (g, pieces) in plan.items():
        got = sum(p.numel for p in pieces)
        if got != _numel(shapes[name]):
            raise DeepSpeedImportError(
                f"{ck.tag_dir}: parameter {name!r} shape {shapes[name]} has {_numel(shapes[name])} elements "
                f"but the optimizer files hold {got} (ranks {[p.rank for p in pieces]})"
            )
    ck.__dict__["_plan"] = plan


# --------------------------------------------------------------------------- streaming


@dataclass(frozen=True)
class ImportedTensor:
    """One output tensor and where it came from."""

    key: tuple[str, ...]
    value: Any
    provenance: dict


def _state_vectors(ck: DeepSpeedCheckpoint, r: int, kind: str) -> _Flat | list[np.ndarray]:
    osd, f = ck.optim_states[r], ck.optim_files[r]
    if ck.stage in (1, 2):
        if kind == "fp32":
            return list(osd["single_partition_of_fp32_groups"])
        st = osd["base_optimizer_state"]["state"]
        return [np.asarray(st[g][kind]).reshape(-1) for g in range(len(ck.param_shapes))]
    if kind == "fp32":
        return _Flat(osd["fp32_flat_groups"], f"{f} fp32_flat_groups")
    inner = _get(_get(osd, "optimizer_state_dict", f), "state", f"{f} optimizer_state_dict")
    arrays = [_get(inner[i], kind, f"{f} state[{i}]") for i in sorted(inner)]
    return _Flat(arrays, f"{f} {kind}")


def _steps(ck: DeepSpeedCheckpoint) -> int:
    seen: dict[float, str] = {}
    for r, osd in enumerate(ck.optim_states):
        f = ck.optim_files[r]
        st = (
            osd["base_optimizer_state"]["state"]
            if ck.stage in (1, 2)
            else osd["optimizer_state_dict"]["state"]
        )
        for g, s in st.items():
            if "step" not in s:
                continue
            v = float(np.asarray(s["step"]))
            seen.setdefault(v, f"{os.path.basename(f)} group {g}")
    return single_step(seen, ck.tag_dir)


def single_step(seen: Mapping[float, str], where: str) -> int:
    """The one optimizer step all ranks and groups agree on (``seen``: step → where found)."""
    if not seen:
        raise DeepSpeedImportError(f"{where}: no optimizer step recorded in any group")
    if len(seen) > 1:
        raise DeepSpeedImportError(
            f"{where}: ranks or parameter groups disagree on the optimizer step: "
            + ", ".join(f"{k:g} in {v}" for k, v in seen.items())
        )
    (v,) = seen
    if v != int(v) or not (0 <= v < 2**31):
        raise DeepSpeedImportError(f"{where}: optimizer step {v} is not a valid int32 count")
    return int(v)


def iter_deepspeed_tensors(ck) -> Iterator[ImportedTensor]:
    """Yield params / mu / nu / model_params one parameter at a time, then ``opt_state.count``."""
    if not isinstance(ck, DeepSpeedCheckpoint):
        from jax_ucp.importers.deepspeed_megatron import iter_megatron_deepspeed_tensors

        yield from iter_megatron_deepspeed_tensors(ck)
        return
    plan = ck.__dict__["_plan"]
    shapes = ck.shapes
    cache: dict[tuple[int, str], Any] = {}

    def vec(r: int, kind: str):
        k = (r, kind)
        if k not in cache:
            cache[k] = _state_vectors(ck, r, kind)
        return cache[k]

    want_model = ck.model_dtype != np.dtype(np.float32)
    files = [os.path.basename(f) for f in ck.optim_files]
    for name in ck.names:
        g, pieces = plan[name]
        shape = shapes[name]
        prov = {
            "files": sorted({files[p.rank] for p in pieces}),
            "zero_stage": ck.stage,
            "pattern": f"zero{ck.stage}-flat",
            "dp_ranks": [p.rank for p in pieces],
        }
        for kind, top in (
            ("fp32", ("params",)),
            ("exp_avg", ("opt_state", "mu")),
            ("exp_avg_sq", ("opt_state", "nu")),
        ):
            parts: list[np.ndarray] = []
            for p in pieces:
                v = vec(p.rank, kind)
                if isinstance(v, _Flat):
                    parts.extend(v.take(p.start, p.numel))
                else:
                    flat = v[g]
                    if p.start + p.numel > flat.size:
                        raise DeepSpeedImportError(
                            f"{ck.optim_files[p.rank]}: parameter {name!r} {kind} fragment "
                            f"[{p.start}, {p.start + p.numel}) exceeds group {g} partition of {flat.size}"
                        )
                    parts.append(flat[p.start : p.start + p.numel])
            arr = (
                np.concatenate(parts) if len(parts) != 1 else parts[0]
            )  # a view of the mmap: no copy
            yield ImportedTensor((*top, name), arr.reshape(shape), prov)
            if kind == "fp32":
                fp32 = arr.reshape(shape)
        if want_model:
            m = ck.module.get(name) if ck.stage in (1, 2) else None
            if isinstance(m, np.ndarray) and m.shape == tuple(shape) and m.size:
                if m.dtype != ck.model_dtype:
                    raise DeepSpeedImportError(
                        f"{ck.model_file}: {name!r} has dtype {m.dtype}, run dtype is "
                        f"{ck.model_dtype}"
                    )
                yield ImportedTensor(
                    ("model_params", name),
                    m,
                    {"files": [os.path.basename(ck.model_file)], "pattern": "module"},
                )
            else:  # stage 3 keeps no model-precision weights: DeepSpeed re-derives them the same way
                yield ImportedTensor(
                    ("model_params", name),
                    fp32.astype(ck.model_dtype),
                    {"files": prov["files"], "pattern": f"cast(fp32 -> {ck.model_dtype})"},
                )
        del fp32
    yield ImportedTensor(
        ("opt_state", "count"),
        np.asarray(_steps(ck), np.int32),
        {"files": files, "pattern": "step"},
    )


def convert_deepspeed(
    src: os.PathLike | str,
    dst: os.PathLike | str,
    *,
    force: bool = False,
    step: int | None = None,
    tag: str | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    compression: str | None = None,
    spec: Any = None,
) -> str:
    """Convert a DeepSpeed checkpoint folder (``latest`` + tags, or one tag) into a UCP checkpoint.

    ``step`` writes ``<dst>/<step>/state`` as a CheckpointManager step; ``tag`` picks a tag
    instead of ``latest``. ``progress(name, done, total)`` is called per parameter. Returns the
    UCP directory. All validation happens before anything is written; a failure leaves ``dst``
    untouched.
    """
    from jax_ucp.handler.host_writer import write_host_checkpoint
    from jax_ucp.importers import deepspeed_megatron as _meg

    dst = os.fspath(dst)
    if step is None and os.path.exists(dst) and not force:
        raise FileExistsError(f"{dst} already exists; pass force=True to replace it.")
    tag_dir = _resolve_tag_dir(os.fspath(src), tag)
    if _meg.is_model_parallel(tag_dir):
        # Megatron-DeepSpeed TP/PP: fragments merged by the universal_checkpoint_info patterns
        # (translated into the UCP language), or by the import rules of ``spec``
        mck = _meg.open_megatron_deepspeed_checkpoint(tag_dir, spec=spec)
        return write_host_checkpoint(
            dst,
            _host_items(_meg.iter_megatron_deepspeed_tensors(mck), len(mck.names), progress),
            force=force,
            source=_meg.source_info(mck),
            step=step,
            compression=compression,
        )
    if spec is not None:
        raise ValueError(
            "convert_deepspeed: a ZeRO checkpoint (no tensor/pipeline parallelism) is imported raw, keyed by "
            "DeepSpeed's parameter names, so an import spec has nothing to do; apply the name mapping at "
            "restore time: jax_ucp.restore(path, spec=...)"
        )
    ck = open_deepspeed_checkpoint(tag_dir)

    source = {
        "framework": "deepspeed",
        "path": os.path.abspath(ck.tag_dir),
        "zero_stage": ck.stage,
        "dp_world_size": ck.world_size,
        "model_dtype": str(ck.model_dtype),
        "global_steps": ck.global_steps,
        "ds_version": ck.model_states.get("ds_version"),
    }
    return write_host_checkpoint(
        dst,
        _host_items(iter_deepspeed_tensors(ck), len(ck.names), progress),
        force=force,
        source=source,
        step=step,
        compression=compression,
    )


def _host_items(
    tensors: Iterator[ImportedTensor], total: int, progress: Callable[[str, int, int], None] | None
) -> Iterator[Any]:
    from jax_ucp.handler.host_writer import host_items_with_progress

    return host_items_with_progress(tensors, total, progress)
