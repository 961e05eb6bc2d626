"""Read Megatron-LM's legacy checkpoint layout without torch.

``<root>/latest_checkpointed_iteration.txt`` names the iteration (or ``release``);
``<root>/iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` holds TP rank TT / PP stage PPP's
``{'args': argparse.Namespace, 'iteration', 'checkpoint_version', 'model': state_dict,
'rng_state': [...numpy RNG state...], 'optimizer'?}``; ``distrib_optim.pt`` next to it holds the
distributed optimizer's flat buffers.

``argparse.Namespace`` and numpy's pickled arrays/dtypes (RNG state) become inert stand-ins
(:data:`LEGACY_CLASSES`); nothing pickled is executed. Tensors stay memory-mapped.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jax_ucp.importers import torch_pickle

__all__ = [
    "LegacyError",
    "LEGACY_CLASSES",
    "LegacyCheckpoint",
    "RankFile",
    "open_legacy",
    "resolve_iteration_dir",
    "flatten_state_dict",
    "distrib_optim_layout",
    "read_distrib_optim",
    "args_dict",
]


class LegacyError(ValueError):
    """A legacy Megatron checkpoint is incomplete or inconsistent (names the file)."""


def _np_reconstruct(*args):
    """``numpy.core.multiarray._reconstruct`` stand-in: an inert placeholder, never numpy's code."""
    return _NumpyArrayStandIn(*args)


class _NumpyArrayStandIn(torch_pickle.StandIn):
    qualname = "numpy.ndarray"


#: Classes a legacy Megatron pickle may reference (beyond torch's), as inert stand-ins.
LEGACY_CLASSES: dict[str, Any] = {
    "argparse.Namespace": torch_pickle.standin_class("argparse.Namespace"),
    "numpy.ndarray": _NumpyArrayStandIn,
    "numpy.core.multiarray._reconstruct": _np_reconstruct,
    "numpy._core.multiarray._reconstruct": _np_reconstruct,
    "numpy.dtype": torch_pickle.standin_class("numpy.dtype"),
    "numpy.core.multiarray.scalar": torch_pickle.standin_class("numpy.scalar"),
    "numpy._core.multiarray.scalar": torch_pickle.standin_class("numpy.scalar"),
    # megatron-core enums that Megatron-LM pickles into args
    "megatron.core.enums.ModelType": torch_pickle.int_enum_standin("megatron.core.enums.ModelType"),
    "megatron.core.transformer.enums.AttnBackend": torch_pickle.int_enum_standin(
        "megatron.core.transformer.enums.AttnBackend"
    ),
}

_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


@dataclass
class RankFile:
    tp: int
    pp: int
    path: Path
    state: dict  # the unpickled top-level dict (tensors memory-mapped)
    model: dict[str, Any]  # flattened model state_dict (dotted names)
    ep: int = 0


@dataclass
class LegacyCheckpoint:
    root: Path
    iter_dir: Path
    iteration: int | None
    tp: int
    pp: int
    ranks: dict[tuple[int, int], RankFile]  # (pp, tp) -> file
    args: dict[str, Any] = field(default_factory=dict)
    checkpoint_version: float | None = None
    distrib_optim: dict[tuple[int, int], Path] = field(default_factory=dict)
    ep: int = 1
    ep_ranks: dict[tuple[int, int, int], RankFile] = field(default_factory=dict)  # (pp, tp, ep)


def resolve_iteration_dir(src: Path) -> tuple[Path, Path, int | None]:
    """(root, iteration dir, iteration) for a root holding the tracker file or an iter dir."""
    src = Path(src)
    tracker = src / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text == "release":
            return src, src / "release", None
        try:
            it = int(text)
        except ValueError:
            raise LegacyError(
                f"{tracker}: expected an iteration number or 'release', found {text!r}"
            ) from None
        d = src / f"iter_{it:07d}"
        if not d.is_dir():
            raise LegacyError(f"{tracker} names iteration {it} but {d} does not exist")
        return src, d, it
    m = re.fullmatch(r"iter_(\d+)", src.name)
    if m:
        return src.parent, src, int(m.group(1))
    if src.name == "release":
        return src.parent, src, None
    raise LegacyError(
        f"{src}: no latest_checkpointed_iteration.txt and not an iter_NNNNNNN directory"
    )


def flatten_state_dict(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested state dicts (older Megatron-LM: model['language_model']['encoder'][...]) -> dotted."""
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            name = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict):
                out.update(flatten_state_dict(v, name))
            else:
                out[name] = v
    return out


def args_dict(args: Any) -> dict[str, Any]:
    """The scalar fields of a pickled ``argparse.Namespace`` (a stand-in): Megatron-LM's run
    arguments, which give the import settings (layer and head counts, vocab, ...)."""
    if args is None:
        return {}
    d = (
        {k: v for k, v in vars(args).items() if k not in ("args", "kwargs")}
        if hasattr(args, "__dict__")
        else {}
    )
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool, type(None)))}


def _load_rank(f: Path) -> tuple[dict, dict]:
    if not f.is_file():
        raise LegacyError(f"missing shard file {f}")
    try:
        state = torch_pickle.load_torch_file(f, LEGACY_CLASSES)
    except torch_pickle.TorchFileError as e:
        raise LegacyError(str(e)) from None
    if not isinstance(state, dict):
        raise LegacyError(f"{f}: top level is a {type(state).__name__}, expected a dict")
    if "model" not in state:
        vpp = [k for k in state if re.fullmatch(r"model\d+", str(k))]
        if vpp:
            raise LegacyError(
                f"{f}: virtual-pipeline checkpoints ({', '.join(vpp)}) are not supported"
            )
        raise LegacyError(f"{f}: no 'model' entry (keys: {sorted(map(str, state))})")
    return state, flatten_state_dict(state["model"])


def open_legacy(src: os.PathLike | str) -> LegacyCheckpoint:
    """Find and load (lazily, memory-mapped) every rank's ``model_optim_rng.pt``; check the grid.

    Directory names are Megatron-LM's ``mp_rank_TT[_PPP][_EEE]``; a single 3-digit suffix is the
    pipeline stage unless ``args.expert_model_parallel_size > 1`` with no pipeline parallelism
    (Megatron-LM then appends only the expert rank)."""
    root, it_dir, it = resolve_iteration_dir(Path(src))
    dirs = []
    for d in sorted(it_dir.iterdir()):
        m = _RANK_DIR.match(d.name)
        if d.is_dir() and m:
            dirs.append((d, int(m.group(1)), m.group(2), m.group(3)))
    if not dirs:
        raise LegacyError(f"{it_dir}: no mp_rank_* directories")
    if len({(a is None, b is None) for _, _, a, b in dirs}) > 1:
        raise LegacyError(
            f"{it_dir}: mixes mp_rank_* directory name forms: {sorted(d.name for d, *_ in dirs)}"
        )
    first_state, _ = _load_rank(dirs[0][0] / "model_optim_rng.pt")
    args0 = args_dict(first_state.get("args"))
    ep_args = int(args0.get("expert_model_parallel_size") or 1)
    pp_args = int(args0.get("pipeline_model_parallel_size") or 1)
    suffix_is_ep = ep_args > 1 and pp_args == 1
    found: dict[tuple[int, int, int], Path] = {}
    for d, t, a, b in dirs:
        if b is not None:
            key = (int(a), t, int(b))
        elif a is not None:
            key = (0, t, int(a)) if suffix_is_ep else (int(a), t, 0)
        else:
            key = (0, t, 0)
        found[key] = d
    tp_n = max(k[1] for k in found) + 1
    pp_n = max(k[0] for k in found) + 1
    ep_n = max(k[2] for k in found) + 1

    def name(p, t, e):
        n = f"mp_rank_{t:02d}"
        if dirs[0][2] is not None and not suffix_is_ep:
            n += f"_{p:03d}"
        if dirs[0][3] is not None or suffix_is_ep:
            n += f"_{e:03d}"
        return it_dir / n

    ranks: dict[tuple[int, int], RankFile] = {}
    ep_ranks: dict[tuple[int, int, int], RankFile] = {}
    dopt: dict[tuple[int, int], Path] = {}
    for p in range(pp_n):
        for t in range(tp_n):
            for e in range(ep_n):
                d = found.get((p, t, e))
                if d is None:
                    raise LegacyError(
                        f"missing rank directory {name(p, t, e)} (TP={tp_n}, PP={pp_n}, EP={ep_n} "
                        f"grid from the directories present)"
                    )
                state, model = _load_rank(d / "model_optim_rng.pt")
                rf = RankFile(t, p, d / "model_optim_rng.pt", state, model, e)
                ep_ranks[(p, t, e)] = rf
                if e == 0:
                    ranks[(p, t)] = rf
                    if (d / "distrib_optim.pt").is_file():
                        dopt[(p, t)] = d / "distrib_optim.pt"
    first = ranks[(0, 0)]
    args = args_dict(first.state.get("args"))
    for key, want in (
        ("tensor_model_parallel_size", tp_n),
        ("pipeline_model_parallel_size", pp_n),
        ("expert_model_parallel_size", ep_n),
    ):
        if key in args and args[key] != want:
            raise LegacyError(
                f"{first.path}: args.{key}={args[key]} but the directory grid has {want}"
            )
    cv = first.state.get("checkpoint_version")
    return LegacyCheckpoint(
        root,
        it_dir,
        it if it is not None else first.state.get("iteration"),
        tp_n,
        pp_n,
        ranks,
        args,
        float(cv) if isinstance(cv, (int, float)) else None,
        dopt,
        ep_n,
        ep_ranks,
    )


# ----------------------------------------------------------------------------- distrib_optim.pt


def _pad(n: int, d: int) -> int:
    return -(-n // d) * d


def distrib_optim_layout(
    params: list[tuple[str, int]], shared: set[str], bucket_size: int | None
) -> tuple[dict[str, tuple[int, int]], int]:
    """Where each parameter sits in a ``distrib_optim.pt`` flat buffer (megatron-core 0.16).

    Mirrors ``_ParamAndGradBuffer``: parameters in reverse order, each start padded to 64
    elements, a shared-embedding parameter in its own bucket, a bucket closed once it reaches
    ``bucket_size`` (None: never). ``get_parameter_state_dp_zero`` then concatenates the buckets
    without their end padding. Returns ({name: (start, end)}, total numel).
    """
    out: dict[str, tuple[int, int]] = {}
    base, rel, n_in_bucket = 0, 0, 0
    for name, numel in reversed(params):
        rel = _pad(rel, 64)
        if name in shared and n_in_bucket:
            base, rel, n_in_bucket = base + rel, 0, 0
        out[name] = (base + rel, base + rel + numel)
        rel += numel
        n_in_bucket += 1
        if name in shared or (bucket_size is not None and rel >= bucket_size):
            base, rel, n_in_bucket = base + rel, 0, 0
    return out, base + rel


@dataclass
class DistribOptimState:
    path: Path
    param: np.ndarray  # flat fp32 master weights
    exp_avg: np.ndarray
    exp_avg_sq: np.ndarray
    numel_unpadded: int


def read_distrib_optim(path: Path) -> DistribOptimState:
    """The single buffer of a ``distrib_optim.pt`` (buckets coalesced; one dtype, no experts)."""
    try:
        st = torch_pickle.load_torch_file(path, LEGACY_CLASSES)
    except torch_pickle.TorchFileError as e:
        raise LegacyError(str(e)) from None
    if not isinstance(st, dict) or st.get("buckets_coalesced") is not True:
        raise LegacyError(
            f"{path}: not a megatron-core distrib_optim.pt with buckets_coalesced=True "
            f"(older per-bucket layouts are not supported)"
        )
    bufs = [k for k in st if k != "buckets_coalesced"]
    if bufs != [0]:
        raise LegacyError(
            f"{path}: {len(bufs)} gradient buffers {bufs}; only one (a single dtype, no "
            f"expert-parallel buffer) is supported"
        )
    per_dtype = st[0]
    if not isinstance(per_dtype, dict) or len(per_dtype) != 1:
        raise LegacyError(
            f"{path}: buffer 0 holds {len(per_dtype) if isinstance(per_dtype, dict) else '?'} "
            f"dtype groups, expected 1"
        )
    (w,) = per_dtype.values()
    arrs = {}
    for k in ("param", "exp_avg", "exp_avg_sq"):
        a = w.get(k) if isinstance(w, dict) else None
        if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype != np.float32:
            raise LegacyError(
                f"{path}: buffer 0 {k!r} must be a flat float32 tensor, found "
                f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}"
            )
        arrs[k] = a
    n = w.get("numel_unpadded")
    if type(n) is not int or any(a.size != n for a in arrs.values()):
        raise LegacyError(
            f"{path}: numel_unpadded={n!r} but the flat tensors hold "
            f"{[a.size for a in arrs.values()]} elements"
        )
    return DistribOptimState(path, arrs["param"], arrs["exp_avg"], arrs["exp_avg_sq"], n)
