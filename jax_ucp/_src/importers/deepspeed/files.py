"""The files of one DeepSpeed checkpoint tag, found and checked once for every reader.

Shared by the ZeRO reader (:mod:`deepspeed.zero`) and the Megatron-DeepSpeed TP/PP reader
(:mod:`deepspeed.megatron`): which tag folder to read, which optimizer file holds which
(model-parallel, data-parallel) rank, that one model-parallel rank's optimizer files form one
complete and consistent ZeRO partitioning, and what its model states file says.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jax_ucp._src.errors import RequestError, SourceError
from jax_ucp._src.format import files
from jax_ucp._src.importers import runs
from jax_ucp._src.importers.plan import host_item, listed, tensor_names, trainer_checkpoints
from jax_ucp._src.store.storage import Storage
from jax_ucp._src.torchfiles.allow_list import int_enum_standin, standin_class
from jax_ucp._src.torchfiles.torch_zip import TorchArchive

_ZERO_STAGES = {0: "disabled", 1: "optimizer_states", 2: "gradients", 3: "weights"}

#: DeepSpeed classes pickled into checkpoint files, mapped to inert stand-ins.
DS_CLASSES: dict[str, Any] = {
    name: standin_class(name)
    for name in (
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.utils.tensor_fragment.fragment_address",
        "deepspeed.checkpoint.constants.SubparamShape",
        "deepspeed.runtime.zero.stage3.SubParamGroupInfo",
    )
}
DS_CLASSES["deepspeed.runtime.zero.config.ZeroStageEnum"] = int_enum_standin(
    "deepspeed.runtime.zero.config.ZeroStageEnum", _ZERO_STAGES
)

#: ``[bf16_]zero_pp_rank_<DP rank>_mp_rank_<MP rank>_optim_states.pt``: one ZeRO partition.
OPTIMIZER_FILE = re.compile(r"^(bf16_)?zero_pp_rank_([0-9]+)_mp_rank_([0-9]+)_optim_states\.pt\Z")
#: ``zero_pp_rank_<DP rank>_mp_rank_<MP rank>_model_states.pt``: stage 3 keeps one per DP rank.
ZERO3_MODEL_FILE = re.compile(r"^zero_pp_rank_([0-9]+)_mp_rank_([0-9]+)_model_states\.pt\Z")
#: ``mp_rank_<MP rank>_model_states.pt``: param_shapes, module, config of a model-parallel rank.
MP_MODEL_FILE = re.compile(r"^mp_rank_([0-9]+)_model_states\.pt\Z")
#: ``layer_<layer>-model_<TP rank>-model_states.pt``: a pipeline layer's model weights. Without a
#: model axis in the topology (``PipelineModule(num_stages=...)``) DeepSpeed names it
#: ``layer_<layer>-model_states.pt`` (group 2 is then None: TP rank 0).
LAYER_FILE = re.compile(r"^layer_([0-9]+)(?:-model_([0-9]+))?-model_states\.pt\Z")
#: ``layer_<MoE layer>_expert_<global expert>_mp_rank_<MP rank>_model_states.pt``: one expert's
#: weights (DeepSpeed MoE), keyed by its full parameter names with the global expert index.
EXPERT_FILE = re.compile(r"^layer_([0-9]+)_expert_([0-9]+)_mp_rank_([0-9]+)_model_states\.pt\Z")
#: ``expp_rank_<EP rank>_mp_rank_<MP rank>_optim_states.pt``: DeepSpeed MoE without ZeRO: the
#: torch ``optimizer.state_dict()`` of one expert-parallel rank (its experts + the dense part).
EXPERT_OPTIMIZER_FILE = re.compile(r"^expp_rank_([0-9]+)_mp_rank_([0-9]+)_optim_states\.pt\Z")


def load_deepspeed_file(folder: Storage, name: str, *, lazy_crc: bool = False) -> Any:
    """One torch file of a DeepSpeed checkpoint, DeepSpeed's own classes as inert stand-ins.
    ``lazy_crc``: each tensor's CRC-32 is checked when its bytes are first read, not now
    (:class:`TorchArchive`): the ZeRO rank files, whose moments a weights-only import skips.

    Its rank is in its name only, so the name it was saved under (kept inside the archive by
    ``torch.save``) must be the name it has: rank files renamed or swapped would otherwise be
    read as other ranks' partitions, i.e. wrong parameters.
    """
    path = folder.join(name)  # a rank file linked out of its folder is never read (``inside``)
    archive = TorchArchive(folder, name, lazy_crc=lazy_crc)
    try:
        saved = archive.saved_name
        # "archive": saved through a file object, no name kept
        if saved not in (name.removesuffix(".pt"), "archive"):
            raise SourceError(
                f"{path}: this file was saved as '{saved}.pt' (the name inside its zip archive) "
                f"but is named '{name}'. DeepSpeed's rank is in the file name, so renamed or "
                "swapped rank files would import as wrong parameters; give the files back their "
                "saved names"
            )
        return archive.load(DS_CLASSES)
    finally:
        archive.close()


@contextlib.contextmanager
def unsafe_files_refused(note: str = "") -> Iterator[None]:
    """A file the format layer refuses to read (not regular, linked outside) refused as a
    ``SourceError`` (its message and ``note``)."""
    try:
        yield
    except files.UnsafeFileError as e:
        raise SourceError(f"{e}{note}") from None


def require(mapping: Any, key: Any, where: str) -> Any:
    """``mapping[key]``, or an error naming the file (``where``) that lacks it.

    Args:
        mapping: the loaded object.
        key: the entry it must have.
        where: the file it was loaded from.
    """
    if not isinstance(mapping, Mapping) or key not in mapping:
        raise SourceError(f"{where}: missing {key!r}")
    return mapping[key]


def sourced_item(key: tuple[str, ...], value: Any, pattern: str, tensors: list[str]) -> Any:
    """A ``host_item`` whose provenance names its source ``tensors`` and the files holding them.

    Args:
        key: the item's key in the output tree.
        value: its value (an array or a ``writer.Deferred``).
        pattern: how the value was built (the provenance's ``pattern``).
        tensors: the source tensors it is read from (``<file>:<path>``).
    """
    held = sorted({t.split(":", 1)[0] for t in tensors})
    return host_item(key, value, {"files": held, "pattern": pattern, "tensors": tensors})


# --------------------------------------------------------------------------- the tag folder


def resolve_tag_dir(src: Storage, tag: str | None) -> Storage:
    """The tag folder to read: ``tag``, ``src`` itself when it is one (:func:`is_tag_dir`), or
    ``latest`` (which may only name a folder inside ``src``)."""
    names = listed(src)
    if names is None:
        raise SourceError(f"{src.root}: not a directory")
    if tag is not None:
        with unsafe_files_refused():
            tag_dir = src.folder(tag)
        if not listed(tag_dir):
            raise SourceError(f"{tag_dir.root}: tag folder {tag!r} not found")
        return tag_dir
    if is_tag_dir(names):
        return src
    if "latest" in names:
        return follow_tracker(src, "latest")
    if runs := trainer_checkpoints(src.root):
        raise SourceError(
            f"{src.root}: a Hugging Face Trainer output directory with {len(runs)} checkpoints: "
            f"{', '.join(runs)}. Convert one of them (e.g. {src.join(runs[-1])})."
        )
    raise SourceError(
        f"{src.root}: no DeepSpeed checkpoint here (expected a 'latest' file or "
        f"'*zero_pp_rank_*_optim_states.pt' files; for a universal checkpoint, a "
        f"'latest_universal' file or a '<tag>_universal' folder holding 'zero/' and "
        f"'mp_rank_XX_model_states.pt')"
    )


def follow_tracker(src: Storage, tracker: str) -> Storage:
    """The tag folder a tracker file of ``src`` (``latest``, ``latest_universal``) names, which
    may only be a folder inside ``src``."""
    tag = read_tag_file(src, tracker)
    try:  # symlinks resolved, strictly inside: a tracker never leads out of its checkpoint
        tag_dir = None if tag in ("", ".", "..") else src.folder(tag)
    except (files.UnsafeFileError, ValueError):
        tag_dir = None
    if tag_dir is None:
        raise SourceError(
            f"{src.join(tracker)} names tag {tag[:100]!r}, which is not a folder inside "
            f"{src.root}; refusing to follow it"
        )
    if not listed(tag_dir):
        raise SourceError(
            f"{src.join(tracker)} names tag {tag!r} but {tag_dir.root} does not exist"
        )
    return tag_dir


def read_tag_file(folder: Storage, name: str) -> str:
    """The tag a tracker file (DeepSpeed's ``latest``) names: one line of printable UTF-8 text.
    A NUL or another control character would otherwise reach the file system as a raw
    "embedded null byte" error, or name a folder nobody wrote."""
    path = folder.join(name)
    try:
        with unsafe_files_refused():
            raw = folder.read(name, 4096)
    except RequestError as e:  # a remote one served larger: never fetched whole
        raise SourceError(f"{e}: a record naming the tag folder, refused unread") from None
    if raw is None:  # listed, yet no file: a link to nothing, never read as no tracker
        raise SourceError(f"{path}: listed, but no file there (a link to nothing?)")
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise SourceError(
            f"{path}: not UTF-8 text (byte {e.start}); expected the name of a tag folder"
        ) from None
    if not tag.isprintable():
        bad = next(c for c in tag if not c.isprintable())
        raise SourceError(
            f"{path}: names tag {tag[:100]!r}, which holds the control character {bad!r}; "
            "expected the name of a tag folder"
        )
    return tag


def is_tag_dir(names: Collection[str]) -> bool:
    """A checkpoint tag folder itself (its entries ``names``): ZeRO optimizer files, or (ZeRO-0,
    MoE) model states or expert files and no ``latest`` (a run folder holding both is read
    through ``latest``)."""
    if any(OPTIMIZER_FILE.match(f) for f in names):
        return True
    return "latest" not in names and any(
        pattern.match(f) for f in names for pattern in (MP_MODEL_FILE, EXPERT_FILE)
    )


def is_moe(names: Collection[str]) -> bool:
    """True when a tag folder holding ``names`` holds DeepSpeed MoE expert files."""
    return any(EXPERT_FILE.match(f) for f in names)


def check_every_file_read(tag_dir: Storage, source_tensors) -> None:
    """Every entry of the tag folder is a file the import reads (it holds a tensor the import
    accounts for: ``source_tensors``, named ``<file>:<path>``), else the import is refused
    naming it: a file nobody reads is part of the checkpoint silently lost (an unknown layout,
    or another save's leftovers). A DeepSpeed file with no tensor at all (a pipeline layer
    without parameters) counts as read once it loads."""
    covered = {name.split(":", 1)[0] for name in source_tensors or ()}
    unread = []
    for name in listed(tag_dir) or ():
        if name in covered:
            continue
        known = any(
            pattern.match(name)
            for pattern in (LAYER_FILE, MP_MODEL_FILE, ZERO3_MODEL_FILE, OPTIMIZER_FILE)
        )
        if known and not any(True for _ in tensor_names(parsed_file(tag_dir, name))):
            continue
        unread.append(name)
    if unread:
        raise SourceError(
            f"{tag_dir.root}: the import would not read {len(unread)} of the folder's entries: "
            f"{unread[:10]}{' ...' if len(unread) > 10 else ''}. Refusing to import part of a "
            "checkpoint: this layout is not supported, or the files are not DeepSpeed's (move "
            "them out of the tag folder)"
        )


def is_model_parallel(names: Collection[str]) -> bool:
    """True when a tag folder holding ``names`` holds more than one model-parallel rank or
    pipeline layer files (a Megatron-DeepSpeed TP/PP checkpoint)."""
    if any(LAYER_FILE.match(f) for f in names):
        return True
    mp_ranks = {int(m.group(3)) for m in map(OPTIMIZER_FILE.match, names) if m}
    mp_ranks |= {int(m.group(1)) for m in map(MP_MODEL_FILE.match, names) if m}
    return len(mp_ranks) > 1


def optimizer_files_by_rank(tag_dir: Storage) -> tuple[dict[int, dict[int, str]], str]:
    """``{MP rank: {DP rank: name}}`` of the tag's ZeRO optimizer files, and their name prefix.

    One file per (MP, DP) rank, all with or all without DeepSpeed's ``bf16_`` prefix: anything
    else is two saves mixed in one folder.
    """
    by_rank: dict[int, dict[int, str]] = {}
    prefixes = set()
    for name in listed(tag_dir) or ():
        match = OPTIMIZER_FILE.match(name)
        if not match:
            continue
        dp_rank, mp_rank = int(match.group(2)), int(match.group(3))
        same_rank = by_rank.setdefault(mp_rank, {})
        if dp_rank in same_rank:
            raise SourceError(
                f"{tag_dir.root}: two optimizer files for DP rank {dp_rank}: "
                f"{same_rank[dp_rank]} and {name}"
            )
        same_rank[dp_rank] = name
        prefixes.add(match.group(1) or "")
    if len(prefixes) > 1:
        raise SourceError(f"{tag_dir.root}: both 'bf16_' and plain optimizer files present")
    return by_rank, prefixes.pop() if prefixes else ""


def rank0_optimizer_states(
    tag_dir: Storage, layout: str, stages: Collection[int]
) -> OptimizerStates:
    """The checked optimizer files of model-parallel rank 0 of a layout (``layout``, for
    errors) without tensor or pipeline parallelism: rank 0's must be present, no other
    rank's, and of one of the ZeRO ``stages`` it is read for."""
    by_rank, _ = optimizer_files_by_rank(tag_dir)
    if not by_rank.get(0):
        raise SourceError(
            f"{tag_dir.root}: no '*zero_pp_rank_*_mp_rank_00_optim_states.pt' files (a {layout} "
            "checkpoint at ZeRO stage 0 keeps its optimizer state elsewhere: read it with convert)"
        )
    if set(by_rank) != {0}:  # a plain ZeRO folder's: unreachable (dispatched first)
        raise SourceError(
            f"{tag_dir.root}: {layout} optimizer files of model-parallel ranks {sorted(by_rank)}; "
            f"tensor or pipeline parallelism is not supported with {layout}"
        )
    optimizer = read_optimizer_states(tag_dir, by_rank[0])
    if optimizer.stage not in stages:
        raise SourceError(
            f"{optimizer.files[0]}: zero_stage {optimizer.stage}; the ZeRO optimizer files of "
            f"{layout} checkpoints are read for ZeRO stages {', '.join(map(str, sorted(stages)))}"
        )
    return optimizer


# --------------------------------------------------------------------------- optimizer files

#: What DeepSpeed's ``BF16_Optimizer`` saves (bf16 at ZeRO-1 with ``data_types.grad_accum_dtype``
#: fp32, and Megatron-DeepSpeed's bf16 runs): ZeRO-1's flat fp32 partitions, fragment maps and
#: padding, and no ``zero_stage`` (runtime/bf16_optimizer.py ``state_dict``).
BF16_OPTIMIZER_KEYS = (
    "single_partition_of_fp32_groups",
    "param_slice_mappings",
    "base_optimizer_state",
    "group_paddings",
    "partition_count",
)


def zero_stage_of(state: Any, path: str) -> int:
    """The ZeRO stage of one rank's ``optimizer_state_dict``: its ``zero_stage``, or 1 for a
    ``BF16_Optimizer``'s (:func:`is_bf16_optimizer`), whose partitions are laid out as ZeRO-1's.

    Args:
        state: the rank file's ``optimizer_state_dict``.
        path: the rank file (for errors).
    """
    if is_bf16_optimizer(state):
        return 1
    if isinstance(state, Mapping) and "zero_stage" not in state:
        raise SourceError(
            f"{path}: missing 'zero_stage' and not a BF16_Optimizer's state either (it holds "
            f"{sorted(map(str, state))[:8]}; expected a ZeRO optimizer's 'zero_stage', or "
            f"{list(BF16_OPTIMIZER_KEYS)})"
        )
    return int(require(state, "zero_stage", path))


def is_bf16_optimizer(state: Any) -> bool:
    """True for the ``optimizer_state_dict`` of DeepSpeed's ``BF16_Optimizer``: ZeRO-1's entries
    without a ``zero_stage``."""
    return (
        isinstance(state, Mapping)
        and "zero_stage" not in state
        and all(key in state for key in BF16_OPTIMIZER_KEYS)
    )


@dataclass
class OptimizerStates:
    """The ZeRO optimizer files of one model-parallel rank: one complete, consistent partitioning."""

    stage: int
    world_size: int  # DP ranks, from partition_count
    partition_count: Any  # as recorded (an int, or one per param group)
    files: list[str]  # per DP rank (shown: its folder joined)
    states: list[dict]  # per DP rank: its 'optimizer_state_dict'
    #: per DP rank: the file's own copy of the run's config (``ds_config``; None: not written)
    configs: list[Any] = field(default_factory=list)


def read_optimizer_states(
    tag_dir: Storage, files_by_dp_rank: Mapping[int, str], *, of_rank: str = ""
) -> OptimizerStates:
    """Reads one model-parallel rank's optimizer files; every DP rank of ``partition_count``
    present, no other, all with the same stage and partition count.

    Args:
        tag_dir: the tag folder.
        files_by_dp_rank: the optimizer file (its name) of each data-parallel rank.
        of_rank: names the model-parallel rank in messages.
    """
    first_rank = min(files_by_dp_rank)
    first = tag_dir.join(files_by_dp_rank[first_rank])
    # each partition's CRC-32 checked when it is first read: a weights-only import reads the
    # fp32 masters, never the moments (two thirds of the files)
    first_file = load_deepspeed_file(tag_dir, files_by_dp_rank[first_rank], lazy_crc=True)
    first_state = require(first_file, "optimizer_state_dict", first)
    configs = [first_file.get("ds_config")]
    stage = zero_stage_of(first_state, first)
    partition_count = require(first_state, "partition_count", first)
    world = (
        max(partition_count) if isinstance(partition_count, (list, tuple)) else int(partition_count)
    )
    for dp_rank in range(world):
        if dp_rank not in files_by_dp_rank:
            name = files_by_dp_rank[first_rank]
            name = name.replace(f"zero_pp_rank_{first_rank}_", f"zero_pp_rank_{dp_rank}_")
            raise SourceError(
                f"{tag_dir.join(name)}: missing optimizer file for DP rank {dp_rank}{of_rank} "
                f"(partition_count in {first} is {world})"
            )
    if len(files_by_dp_rank) != world:
        extra = sorted(set(files_by_dp_rank) - set(range(world)))
        raise SourceError(
            f"{tag_dir.root}: world size metadata says {world} DP ranks (partition_count in "
            f"{first}) but found optimizer files{of_rank} for ranks {sorted(files_by_dp_rank)} "
            f"(unexpected: {[files_by_dp_rank[r] for r in extra]})"
        )
    files = [tag_dir.join(files_by_dp_rank[dp_rank]) for dp_rank in range(world)]
    states = [first_state]
    for dp_rank, path in enumerate(files[1:], 1):  # every further DP rank agrees with the first
        loaded = load_deepspeed_file(tag_dir, files_by_dp_rank[dp_rank], lazy_crc=True)
        state = require(loaded, "optimizer_state_dict", path)
        configs.append(loaded.get("ds_config"))
        if (bf16 := is_bf16_optimizer(state)) != is_bf16_optimizer(first_state):
            raise SourceError(
                f"{path}: {'a' if bf16 else 'not a'} BF16_Optimizer's state, {first} is "
                f"{'not ' if bf16 else ''}one: files of different runs"
            )
        if (found := zero_stage_of(state, path)) != stage:
            raise SourceError(f"{path}: zero_stage {found}, {first} has {stage}")
        count = require(state, "partition_count", path)
        if count != partition_count:
            raise SourceError(f"{path}: partition_count {count}, {first} has {partition_count}")
        states.append(state)
    return OptimizerStates(stage, world, partition_count, files, states, configs)


# --------------------------------------------------------------------------- model states files


#: The files parsed while :func:`parse_once` is open, by path (shown).
_PARSED: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "parsed_model_states", default=None
)


@contextlib.contextmanager
def parse_once() -> Iterator[None]:
    """While open (one import: its planning and :func:`check_every_file_read`),
    :func:`parsed_file` parses each file once and hands every later reader the same content:
    the layout's detection (AutoEP's records), its importer, then the check of the folder."""
    token = _PARSED.set({})
    try:
        yield
    finally:
        _PARSED.reset(token)


def parsed_file(folder: Storage, name: str) -> Any:
    """:func:`load_deepspeed_file` of ``name``, parsed once while :func:`parse_once` is open."""
    parsed, path = _PARSED.get(), folder.join(name)
    if parsed is None:
        return load_deepspeed_file(folder, name)
    if path not in parsed:
        parsed[path] = load_deepspeed_file(folder, name)
    return parsed[path]


def load_model_states(folder: Storage, name: str, *, of_rank: str = "") -> Mapping:
    """A ``*model_states.pt`` file (param_shapes, module, ds_config, ...), which must exist."""
    path = folder.join(name)
    with unsafe_files_refused():
        here = folder.exists(name)
    if not here:  # present but not a regular file: the reader says what it is
        raise SourceError(f"{path}: missing model states file{of_rank}")
    model_states = parsed_file(folder, name)
    if not isinstance(model_states, Mapping):
        raise SourceError(f"{path}: expected a dict, found {type(model_states).__name__}")
    return model_states


def frozen_shapes_of(
    model_states: Mapping, model_file: str, trained: Collection[str] = ()
) -> dict[str, tuple[int, ...]]:
    """``frozen_param_shapes``: the parameters the run did not train (requires_grad=False); one
    of them among the ``trained`` names is an error.

    Args:
        model_states: the loaded model states file.
        model_file: its path (for errors).
        trained: the trained parameters' names, none of which may be frozen too.
    """
    shapes = model_states.get("frozen_param_shapes") or {}
    if not isinstance(shapes, Mapping):
        raise SourceError(f"{model_file}: frozen_param_shapes is not a dict")
    out = {}
    for name, shape in shapes.items():
        if not isinstance(name, str):
            raise SourceError(f"{model_file}: bad frozen_param_shapes entry {name!r}")
        out[name] = checked_shape(shape, model_file, f"frozen_param_shapes[{name!r}]")
    overlap = sorted(set(out) & set(trained))
    if overlap:
        raise SourceError(f"{model_file}: parameters both frozen and trained: {overlap}")
    return out


#: Largest dimension accepted in a shape read from a file (2**48 elements is 1 PiB of fp32).
MAX_DIM = 2**48


def checked_shape(shape: Any, model_file: str, what: str) -> tuple[int, ...]:
    """A shape read from a file: a tuple or list of ints in ``[0, MAX_DIM)``. A negative
    dimension would pass an element count check in pairs ((-2, -8) has 16 elements).

    Args:
        shape: the value read.
        model_file: the file it was read from.
        what: the entry it was read from.
    """
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < MAX_DIM for d in shape
    ):
        raise SourceError(
            f"{model_file}: {what} is {shape!r}; expected a shape of non-negative integers"
        )
    return tuple(int(d) for d in shape)


def param_shapes_of(model_states: Mapping, model_file: str) -> list[dict[str, tuple[int, ...]]]:
    """``param_shapes`` per param group (a single dict is one group)."""
    groups = require(model_states, "param_shapes", model_file)
    if isinstance(groups, Mapping):
        groups = [groups]
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, Mapping) for g in groups):
        raise SourceError(f"{model_file}: param_shapes is not a list of dicts")
    return [
        {
            str(name): checked_shape(shape, model_file, f"param_shapes[{name!r}]")
            for name, shape in group.items()
        }
        for group in groups
    ]


def source_record(tag_dir: Storage, model_states: Mapping, stage: int | None, **more: Any) -> dict:
    """What the manifest records about every DeepSpeed source, and the layout's own ``more``.

    Args:
        tag_dir: the tag folder.
        model_states: its (first) model states file, loaded.
        stage: the ZeRO stage.
        more: further entries (they win over these).
    """
    steps = model_states.get("global_steps")
    runs.say_renamed(
        tag_dir.root,
        rf"global_step({files.DIGITS})(_universal)?",
        steps,
        "tag folder's name says step {named}, its model states' global_steps {step} (renamed or "
        "copied?); the files' step {step} is recorded and continued",
    )
    return {
        "framework": "deepspeed",
        "path": tag_dir.absolute(),
        "zero_stage": stage,
        "ds_version": version_string(model_states),
        "global_steps": steps if type(steps) is int else None,
        **more,
    }


def version_string(model_states: Mapping) -> str | None:
    """``ds_version`` as the manifest records it: a short string, or None. It is copied from an
    untrusted pickle into JSON, so anything else (a nested structure) is not copied."""
    version = model_states.get("ds_version")
    if isinstance(version, str) and len(version) <= 64 and version.isprintable():
        return version
    return None


def dtype_of_run(ds_config: Mapping, module: Mapping[str, Any]) -> np.dtype:
    """The model precision of the run: from its bf16 / fp16 config, else from its module weights."""
    import ml_dtypes

    if (ds_config.get("bf16") or ds_config.get("bfloat16") or {}).get("enabled"):
        return np.dtype(ml_dtypes.bfloat16)
    if (ds_config.get("fp16") or {}).get("enabled"):
        return np.dtype(np.float16)
    for value in module.values():
        if isinstance(value, np.ndarray) and value.dtype.kind in "fV" and value.size:
            return value.dtype
    return np.dtype(np.float32)


def deepspeed_run(root: Storage) -> runs.TrainerRun | None:
    """A DeepSpeed ``save_dir``: its ``global_stepN`` tag folders (DeepSpeed's default tags).
    DeepSpeed writes ``latest`` once every rank has saved a tag, so a tag newer than the one
    ``latest`` names did not complete; a tag folder without ZeRO optimizer or model-state
    files neither."""
    found = runs.step_folders(root, rf"global_step({files.DIGITS})")
    tracked = None
    if found and "latest" in (listed(root) or ()):
        tag = read_tag_file(root, "latest")
        named = re.fullmatch(rf"global_step({files.DIGITS})", tag, re.ASCII)
        tracked = ("DeepSpeed's `latest`", int(named.group(1)) if named else None)

    def complete(step: Storage) -> str | None:
        if is_tag_dir(listed(step) or ()):
            return None
        return f"{step.root}: no ZeRO optimizer or model-state files: its save did not complete"

    return runs.trainer_run(root, "a DeepSpeed save_dir", found, complete, tracked)


def file_name(shown: str) -> str:
    """The name in its tag folder of a file shown as the folder joined with it (``join``)."""
    return shown.rpartition("/")[2]
