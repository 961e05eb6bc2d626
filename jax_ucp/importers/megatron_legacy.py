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

from jax_ucp.importers import torch_pickle as tp

__all__ = ["LegacyError", "LEGACY_CLASSES", "LegacyCheckpoint", "RankFile", "open_legacy",
           "resolve_iteration_dir", "flatten_state_dict"]


class LegacyError(ValueError):
    """A legacy Megatron checkpoint is incomplete or inconsistent (names the file)."""


def _np_reconstruct(*args):
    """``numpy.core.multiarray._reconstruct`` stand-in: an inert placeholder, never numpy's code."""
    return _NumpyArrayStandIn(*args)


class _NumpyArrayStandIn(tp.StandIn):
    qualname = "numpy.ndarray"


#: Classes a legacy Megatron pickle may reference (beyond torch's), as inert stand-ins.
LEGACY_CLASSES: dict[str, Any] = {
    "argparse.Namespace": tp.standin_class("argparse.Namespace"),
    "numpy.ndarray": _NumpyArrayStandIn,
    "numpy.core.multiarray._reconstruct": _np_reconstruct,
    "numpy._core.multiarray._reconstruct": _np_reconstruct,
    "numpy.dtype": tp.standin_class("numpy.dtype"),
    "numpy.core.multiarray.scalar": tp.standin_class("numpy.scalar"),
    "numpy._core.multiarray.scalar": tp.standin_class("numpy.scalar"),
    # megatron-core enums that Megatron-LM pickles into args
    "megatron.core.enums.ModelType": tp.int_enum_standin("megatron.core.enums.ModelType"),
    "megatron.core.transformer.enums.AttnBackend": tp.int_enum_standin(
        "megatron.core.transformer.enums.AttnBackend"),
}

_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


@dataclass
class RankFile:
    tp: int
    pp: int
    path: Path
    state: dict  # the unpickled top-level dict (tensors memory-mapped)
    model: dict[str, Any]  # flattened model state_dict (dotted names)


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
            raise LegacyError(f"{tracker}: expected an iteration number or 'release', found {text!r}") from None
        d = src / f"iter_{it:07d}"
        if not d.is_dir():
            raise LegacyError(f"{tracker} names iteration {it} but {d} does not exist")
        return src, d, it
    m = re.fullmatch(r"iter_(\d+)", src.name)
    if m:
        return src.parent, src, int(m.group(1))
    if src.name == "release":
        return src.parent, src, None
    raise LegacyError(f"{src}: no latest_checkpointed_iteration.txt and not an iter_NNNNNNN directory")


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


def _args_dict(a: Any) -> dict[str, Any]:
    if a is None:
        return {}
    d = {k: v for k, v in vars(a).items() if k not in ("args", "kwargs")} if hasattr(a, "__dict__") else {}
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool, type(None)))}


def open_legacy(src: os.PathLike | str) -> LegacyCheckpoint:
    """Find and load (lazily, memory-mapped) every rank's ``model_optim_rng.pt``; check the grid."""
    root, it_dir, it = resolve_iteration_dir(Path(src))
    found: dict[tuple[int, int], Path] = {}
    pp_named = None
    for d in sorted(it_dir.iterdir()):
        m = _RANK_DIR.match(d.name)
        if not d.is_dir() or not m:
            continue
        if m.group(3) is not None:
            raise LegacyError(f"{d}: expert-parallel legacy rank directories (mp_rank_TT_PPP_EEE) are not "
                              f"supported; convert from torch_dist instead")
        has_pp = m.group(2) is not None
        if pp_named is not None and has_pp != pp_named:
            raise LegacyError(f"{it_dir}: mixes mp_rank_TT and mp_rank_TT_PPP directories")
        pp_named = has_pp
        found[(int(m.group(2) or 0), int(m.group(1)))] = d
    if not found:
        raise LegacyError(f"{it_dir}: no mp_rank_* directories")
    tp_n = max(t for _, t in found) + 1
    pp_n = max(p for p, _ in found) + 1
    ranks: dict[tuple[int, int], RankFile] = {}
    dopt: dict[tuple[int, int], Path] = {}
    for p in range(pp_n):
        for t in range(tp_n):
            d = found.get((p, t))
            want = it_dir / (f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp_named else ""))
            if d is None:
                raise LegacyError(f"missing rank directory {want} (TP={tp_n}, PP={pp_n} grid from the "
                                  f"directories present)")
            f = d / "model_optim_rng.pt"
            if not f.is_file():
                raise LegacyError(f"missing shard file {f}")
            try:
                state = tp.load_torch_file(f, LEGACY_CLASSES)
            except tp.TorchFileError as e:
                raise LegacyError(str(e)) from None
            if not isinstance(state, dict):
                raise LegacyError(f"{f}: top level is a {type(state).__name__}, expected a dict")
            if "model" not in state:
                vpp = [k for k in state if re.fullmatch(r"model\d+", str(k))]
                if vpp:
                    raise LegacyError(f"{f}: virtual-pipeline checkpoints ({', '.join(vpp)}) are not supported")
                raise LegacyError(f"{f}: no 'model' entry (keys: {sorted(map(str, state))})")
            ranks[(p, t)] = RankFile(t, p, f, state, flatten_state_dict(state["model"]))
            if (d / "distrib_optim.pt").is_file():
                dopt[(p, t)] = d / "distrib_optim.pt"
    first = ranks[(0, 0)]
    args = _args_dict(first.state.get("args"))
    for key, want in (("tensor_model_parallel_size", tp_n), ("pipeline_model_parallel_size", pp_n)):
        if key in args and args[key] != want:
            raise LegacyError(f"{first.path}: args.{key}={args[key]} but the directory grid has {want}")
    cv = first.state.get("checkpoint_version")
    return LegacyCheckpoint(root, it_dir, it if it is not None else first.state.get("iteration"),
                            tp_n, pp_n, ranks, args, float(cv) if isinstance(cv, (int, float)) else None,
                            dopt)
