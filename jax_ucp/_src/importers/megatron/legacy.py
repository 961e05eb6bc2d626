"""Read Megatron-LM's legacy checkpoint layout without torch.

``<root>/latest_checkpointed_iteration.txt`` names the iteration (or ``release``);
``<root>/iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` holds TP rank TT / PP stage PPP's
``{'args': argparse.Namespace, 'iteration', 'checkpoint_version', 'model': state_dict,
'rng_state': [...numpy RNG state...], 'optimizer'?}``; ``distrib_optim.pt`` next to it holds the
distributed optimizer's flat buffers.

With a virtual pipeline (``--num-layers-per-virtual-pipeline-stage``) each rank file holds
``model0``, ``model1``, ... instead of ``model``: one state dict per model chunk, layers numbered
locally in each (Megatron-LM's ``checkpointing.py``: ``state_dict['model%d' % i]``). Chunk v of
pipeline rank p is read as the virtual stage ``v * PP + p``: in that order the chunks hold the
layers in order (megatron-core's ``get_transformer_layer_offset``), the embedding in the first
and the output layer in the last, so the importer numbers layers as for a plain pipeline.

``argparse.Namespace`` and numpy's pickled arrays/dtypes (RNG state) become inert stand-ins
(:data:`LEGACY_CLASSES`); nothing pickled is executed. Tensors stay memory-mapped.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jax_ucp._src.errors import SourceError
from jax_ucp._src.format import files
from jax_ucp._src.importers import runs
from jax_ucp._src.importers.megatron.common import (
    agreed_iteration,
    listed,
    read_file,
    subfolder,
)
from jax_ucp._src.importers.rank_grid import RankGrid
from jax_ucp._src.store.storage import Storage
from jax_ucp._src.torchfiles import allow_list, torch_zip

__all__ = [
    "LEGACY_CLASSES",
    "LegacyCheckpoint",
    "RankFile",
    "args_dict",
    "flatten_state_dict",
    "load_rank_file",
    "name_of",
    "open_legacy",
    "read_tracker",
    "resolve_iteration_dir",
]


#: Classes a legacy Megatron pickle may reference (beyond torch's), as inert stand-ins.
LEGACY_CLASSES: dict[str, Any] = {
    "argparse.Namespace": allow_list.standin_class("argparse.Namespace"),
    **allow_list.NUMPY_CLASSES,
    # megatron-core enums that Megatron-LM pickles into args
    "megatron.core.enums.ModelType": allow_list.int_enum_standin("megatron.core.enums.ModelType"),
    "megatron.core.transformer.enums.AttnBackend": allow_list.int_enum_standin(
        "megatron.core.transformer.enums.AttnBackend"
    ),
}

_RANK_DIR = re.compile(r"mp_rank_([0-9]{2})(?:_([0-9]{3}))?(?:_([0-9]{3}))?\Z")


@dataclass
class RankFile:
    """One ``mp_rank_*`` file of a legacy checkpoint (its ranks: its key in
    ``LegacyCheckpoint.ep_ranks``): its model state; ``name``: ``<rank dir>/<file>`` in the
    iteration folder, ``path`` its path or URL (for messages)."""

    path: str
    name: str
    state: dict  # the unpickled top-level dict (tensors memory-mapped)
    model: dict[str, Any]  # flattened model state_dict (dotted names)
    model_key: str = "model"  # where ``model`` sits in ``state`` (``model<v>``: a VPP chunk)
    beside: tuple[str, ...] = ()  # the entries of its rank directory

    def source(self, name: str) -> str:
        """How the import names model tensor ``name`` of this file (its source tensor):
        ``<rank dir>/<file>:<model key>.<name>``."""
        return f"{self.name}:{self.model_key}.{name}"


@dataclass
class LegacyCheckpoint:
    """A legacy (``mp_rank_*``) Megatron checkpoint: its rank files and run arguments."""

    folder: Storage  # the iteration folder: its files, its ``root`` in messages
    iteration: int | None
    # TP x PP x EP; with a virtual pipeline ``pp`` counts virtual stages (chunk v of pipeline
    # rank p is stage v * (pp // vpp) + p) and ``vpp`` the model chunks per rank file
    grid: RankGrid
    ep_ranks: dict[tuple[int, int, int], RankFile]  # (pp, tp, ep) -> file
    args: dict[str, Any]
    checkpoint_version: float | None
    distrib_optim: dict[tuple[int, int], str]  # (pp, tp) -> EP rank 0's distrib_optim.pt

    @functools.cached_property
    def ranks(self) -> dict[tuple[int, int], RankFile]:
        """(pp, tp) -> EP rank 0's file."""
        return {(pp, tp): r for (pp, tp, ep), r in self.ep_ranks.items() if ep == 0}


TRACKER_FILE = runs.TRACKER_FILE


def name_of(folder: Storage) -> str:
    """The last part of ``folder``'s path or URL (``iter_0000010``)."""
    return folder.root.rstrip("/").rpartition("/")[2]


def read_tracker(
    folder: Storage, names: list[str], error: type[SourceError] = SourceError
) -> int | str | None:
    """The iteration Megatron-LM's tracker file in ``folder`` (its entries ``names``) names
    (:func:`runs.tracker_step`); None without one."""
    if TRACKER_FILE not in names:
        return None
    try:
        raw = read_file(folder, TRACKER_FILE, 4096)
    except SourceError as e:
        raise error(str(e)) from None
    return runs.tracker_step(raw, folder.join(TRACKER_FILE), error)


def resolve_iteration_dir(src: Storage, names: list[str]) -> tuple[Storage, int | None]:
    """(iteration folder, iteration) for a root holding the tracker file or an iter folder
    (``names``: the entries of ``src``)."""
    it = read_tracker(src, names)
    if it == "release":
        return subfolder(src, "release"), None
    if isinstance(it, int):
        d = subfolder(src, f"iter_{it:07d}")  # never a link to another run's
        if f"iter_{it:07d}" not in names or listed(d) is None:
            raise SourceError(
                f"{src.join(TRACKER_FILE)} names iteration {it} but {d.root} does not exist"
            )
        return d, it
    m = re.fullmatch(r"iter_([0-9]+)", name_of(src))
    if m:
        return src, int(m.group(1))
    if name_of(src) == "release":
        return src, None
    raise SourceError(
        f"{src.root}: no latest_checkpointed_iteration.txt and not an iter_NNNNNNN directory"
    )


def flatten_state_dict(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested state dicts (older Megatron-LM: model['language_model']['encoder'][...]) -> dotted."""
    out: dict[str, Any] = {}
    for k, v in d.items() if isinstance(d, dict) else ():
        name = f"{prefix}.{k}" if prefix else str(k)
        out.update(flatten_state_dict(v, name) if isinstance(v, dict) else {name: v})
    return out


def args_dict(args: Any) -> dict[str, Any]:
    """The scalar fields of a pickled ``argparse.Namespace`` (a stand-in): Megatron-LM's run
    arguments, which give the import settings (layer and head counts, vocab, ...)."""
    fields = vars(args) if hasattr(args, "__dict__") else {}  # None: no args saved
    return {
        k: v
        for k, v in fields.items()
        if k not in ("args", "kwargs") and isinstance(v, (int, float, str, bool, type(None)))
    }


def load_rank_file(folder: Storage, name: str) -> Any:
    """A rank directory's torch file ``name`` (``mp_rank_XX/<file>``) of the iteration folder
    ``folder``, through the restricted unpickler; one linked to a file outside it is never
    read."""
    try:
        return torch_zip.load_torch_file((folder, name), LEGACY_CLASSES)
    except (files.UnsafeFileError, allow_list.TorchFileError) as e:
        raise SourceError(str(e)) from None


def _load_rank(folder: Storage, name: str, present: bool) -> dict:
    """One rank's ``model_optim_rng.pt`` (``name`` in the iteration folder ``folder``;
    ``present``: listed there): its top-level dict, holding ``model`` or the virtual-pipeline
    model chunks."""
    path = folder.join(name)
    if not present:
        raise SourceError(f"missing shard file {path}")
    state = load_rank_file(folder, name)
    if not isinstance(state, dict):
        raise SourceError(f"{path}: top level is a {type(state).__name__}, expected a dict")
    if "model" not in state and not model_chunks(state, path):
        raise SourceError(f"{path}: no 'model' entry (keys: {sorted(map(str, state))})")
    return state


def model_chunks(state: dict, path: str) -> list[str]:
    """The virtual-pipeline model chunks of a rank file, ``model0`` .. ``model<N-1>`` (empty
    without a virtual pipeline); a gap in the numbering, or ``model`` beside them, is an error."""
    chunks = sorted(
        (int(k[len("model") :]), k) for k in state if re.fullmatch(r"model[0-9]+", str(k))
    )
    if not chunks:
        return []
    if "model" in state or [i for i, _ in chunks] != list(range(len(chunks))):
        raise SourceError(
            f"{path}: model chunks {[k for _, k in chunks]}"
            f"{' beside model' if 'model' in state else ''}; a virtual-pipeline rank file holds "
            f"model0 .. model<N-1>"
        )
    for _, key in chunks:
        if not isinstance(state[key], dict):
            raise SourceError(f"{path}: {key} is a {type(state[key]).__name__}, not a state dict")
    return [key for _, key in chunks]


#: a rank directory's name and its entries
RankDir = tuple[str, list[str]]


def _rank_directories(
    iteration_dir: Storage,
) -> tuple[dict[tuple[int, int, int], RankDir], Callable[[int, int, int], str]]:
    """Every ``mp_rank_TT[_PPP][_EEE]`` directory by (pp, tp, ep), and the directory Megatron-LM
    would have written for a rank (named in errors); a single 3-digit suffix is the pipeline
    stage unless the run's args say expert- but not pipeline-parallel (the expert rank then)."""
    named = []
    for name in listed(iteration_dir) or ():
        match = _RANK_DIR.match(name)
        entries = listed(subfolder(iteration_dir, name)) if match else None
        if match and entries is not None:
            named.append(((name, entries), int(match.group(1)), match.group(2), match.group(3)))
    if not named:
        raise SourceError(f"{iteration_dir.root}: no mp_rank_* directories")
    if len({(first is None, second is None) for _, _, first, second in named}) > 1:
        raise SourceError(
            f"{iteration_dir.root}: mixes mp_rank_* directory name forms: "
            f"{sorted(d for (d, _), *_ in named)}"
        )
    first_state = _rank_file(iteration_dir, named[0][0], "model_optim_rng.pt")
    first_args = args_dict(first_state.get("args"))
    expert_parallel = int(first_args.get("expert_model_parallel_size") or 1)
    pipeline_parallel = int(first_args.get("pipeline_model_parallel_size") or 1)
    suffix_is_ep = expert_parallel > 1 and pipeline_parallel == 1
    found: dict[tuple[int, int, int], RankDir] = {}
    for directory, tp_rank, first, second in named:
        if second is not None:
            key = (int(first), tp_rank, int(second))
        elif first is not None:
            key = (0, tp_rank, int(first)) if suffix_is_ep else (int(first), tp_rank, 0)
        else:
            key = (0, tp_rank, 0)
        found[key] = directory

    def expected(pp_rank: int, tp_rank: int, ep_rank: int) -> str:
        pp = f"_{pp_rank:03d}" if named[0][2] is not None and not suffix_is_ep else ""
        ep = f"_{ep_rank:03d}" if named[0][3] is not None or suffix_is_ep else ""
        return iteration_dir.join(f"mp_rank_{tp_rank:02d}{pp}{ep}")

    return found, expected


def _rank_file(folder: Storage, directory: RankDir, file: str) -> dict:
    """:func:`_load_rank` of ``file`` in the rank directory ``directory``."""
    return _load_rank(folder, f"{directory[0]}/{file}", file in directory[1])


def open_legacy(src: Storage) -> LegacyCheckpoint:
    """Find and load (lazily, memory-mapped) every rank's ``model_optim_rng.pt`` (the
    directories placed by :func:`_rank_directories`); check the grid."""
    iteration_dir, iteration = resolve_iteration_dir(src, listed(src) or [])
    found, expected = _rank_directories(iteration_dir)
    pp_size, tp_size, ep_size = (max(key[axis] for key in found) + 1 for axis in range(3))
    ep_ranks: dict[tuple[int, int, int], RankFile] = {}
    distrib_optim: dict[tuple[int, int], str] = {}
    virtual: int | None = None
    for key in itertools.product(range(pp_size), range(tp_size), range(ep_size)):
        directory = found.get(key)
        if directory is None:
            raise SourceError(
                f"missing rank directory {expected(*key)} (TP={tp_size}, "
                f"PP={pp_size}, EP={ep_size} grid from the directories present)"
            )
        pp_rank, tp_rank, ep_rank = key
        name = f"{directory[0]}/model_optim_rng.pt"
        path = iteration_dir.join(name)
        state = _rank_file(iteration_dir, directory, "model_optim_rng.pt")
        chunks = model_chunks(state, path)
        if virtual is None:
            virtual = len(chunks) or 1
        if (len(chunks) or 1) != virtual:
            raise SourceError(
                f"{path}: {len(chunks) or 1} model chunk(s), the first rank file holds {virtual}"
            )
        # (stage, model key): a virtual-pipeline chunk is its own stage
        parts = [(v * pp_size + pp_rank, k) for v, k in enumerate(chunks)] or [(pp_rank, "model")]
        for stage, key in parts:
            model = flatten_state_dict(state[key])
            rank_file = RankFile(path, name, state, model, key, tuple(directory[1]))
            ep_ranks[(stage, tp_rank, ep_rank)] = rank_file
        if ep_rank == 0 and "distrib_optim.pt" in directory[1]:
            for stage, _ in parts:
                distrib_optim[(stage, tp_rank)] = f"{directory[0]}/distrib_optim.pt"
    first = ep_ranks[(0, 0, 0)]
    assert virtual is not None  # set by the rank file of (0, 0)
    args = args_dict(first.state.get("args"))
    for name, size in (
        ("tensor_model_parallel_size", tp_size),
        ("pipeline_model_parallel_size", pp_size),
        ("expert_model_parallel_size", ep_size),
    ):
        if name in args and args[name] != size:
            raise SourceError(
                f"{first.path}: args.{name}={args[name]} but the directory grid has {size}"
            )
    recorded = args.get("virtual_pipeline_model_parallel_size")
    if virtual > 1 and recorded is not None and recorded != virtual:
        raise SourceError(
            f"{first.path}: args.virtual_pipeline_model_parallel_size={recorded} but the rank "
            f"files hold {virtual} model chunks"
        )
    version = first.state.get("checkpoint_version")
    return LegacyCheckpoint(
        iteration_dir,
        agreed_iteration(iteration, first.state.get("iteration"), str(first.path)),
        RankGrid(tp_size, pp_size * virtual, ep_size, virtual),
        ep_ranks,
        args,
        float(version) if isinstance(version, (int, float)) else None,
        distrib_optim,
    )
