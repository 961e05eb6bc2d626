"""What every part of the Megatron importer shares: its error, the hints its refusals give,
the optimizer-state names and the step of a saved torch optimizer state."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jax_ucp._src.errors import RequestError, SourceError
from jax_ucp._src.format import files
from jax_ucp._src.importers.plan import ADAM_TREES, agreed_step, listed
from jax_ucp._src.store.storage import Storage
from jax_ucp._src.torchfiles.allow_list import TorchFileError


class MegatronImportError(SourceError):
    """A Megatron checkpoint (torch_dist, legacy or Bridge) is incomplete, inconsistent or
    unsupported. A class of its own because the importer tries its next module order on this
    error alone: a read error of the checkpoint (any other ``SourceError``) is not retried."""


@contextlib.contextmanager
def named_errors() -> Iterator[None]:
    """The readers' errors (torch_dist ``.metadata`` and chunks, legacy rank files), which name
    the file, raised as this importer's (a torch file refusal keeps its class)."""
    try:
        yield
    except (TorchFileError, MegatronImportError):
        raise
    except SourceError as e:
        raise MegatronImportError(str(e)) from None


def entries_of(folder: Storage, name: str) -> list[str]:
    """The entries of folder ``name`` of ``folder`` ([] when none, or a link out of it)."""
    try:
        return listed(folder.folder(name)) or []
    except OSError:
        return []


def subfolder(parent: Storage, name: str) -> Storage:
    """Folder ``name`` of ``parent``: never a link to another run's."""
    try:
        return parent.folder(name)
    except files.UnsafeFileError as e:
        raise MegatronImportError(str(e)) from None


def read_file(folder: Storage, name: str, limit: int) -> bytes:
    """File ``name`` of ``folder``, listed there: a regular file in it of at most ``limit``
    bytes, else an error naming it."""
    try:
        raw = folder.read(name, limit)
    except (files.UnsafeFileError, RequestError) as e:
        raise MegatronImportError(str(e)) from None
    if raw is None:  # listed, yet no file: a link to nothing, never read as no file
        raise MegatronImportError(f"{folder.join(name)}: listed, but no file there")
    return raw


@dataclass
class OptimizerFound:
    """The optimizer state of a megatron-core DCP checkpoint, as its layout reads it:
    model-space tensors (``tensors``: {model tensor: {state: tensor}}, ``"param"`` the model
    tensor itself where that is the master) or per-rank flat state (``buckets``: a
    ``RankStates`` per optimizer, a ChainedOptimizer's members dense then experts), or neither
    (no state, or weights only); ``skipped``: the optimizer tensors not imported, and why;
    ``step``: the step and where it was read (None: none)."""

    tensors: dict[str, dict[str, str]] = field(default_factory=dict)
    buckets: list = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    step: tuple[int, dict] | None = None

    @property
    def present(self) -> bool:
        return bool(self.tensors or self.buckets)


SUPPORTED_LAYOUTS = (
    "supported distributed-optimizer layouts: 'dp_reshardable' (megatron-core 0.15-0.19, "
    "Megatron-LM's default; parameters of one dtype, MoE SequentialMLP or GroupedMLP experts in "
    "their own ChainedOptimizer member), 'fully_reshardable' (0.15-0.19), "
    "'fully_sharded_model_space' (0.13-0.15, Megatron-LM's default in 0.13/0.14), "
    "'dp_zero_gather_scatter' (0.13-0.19)"
)
#: Adam's state in megatron-core's flat buffers (``distrib_optim.pt``, the per-rank layouts),
#: and where each goes in the output tree.
STATE_TREES = {"param": ("params",), **ADAM_TREES}
WEIGHTS_ONLY_HINT = (
    "To import the model weights without the optimizer state: "
    "convert(..., importing=ImportOptions(weights_only=True)) / jax-ucp convert --weights-only"
)


def step_from_param_groups(groups: Any, where: str) -> int:
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
        step = np.asarray(group["step"])
        if step.size != 1 or step.dtype.kind not in "iuf":
            raise MegatronImportError(
                f"{where}: optimizer param_groups[{index}]['step'] is {str(group['step'])[:80]!r}, "
                f"expected one number. {WEIGHTS_ONLY_HINT}"
            )
        seen.setdefault(float(step.reshape(())), f"(group {index})")
    return agreed_step(seen, where, recorded_by="parameter groups", error=MegatronImportError)


#: megatron-core's optimizer namespace in torch_dist keys: ``optimizer.*``, and
#: ``chained_N.optimizer.*`` when a ChainedOptimizer (e.g. dense + MoE experts) prefixes them.
_OPTIMIZER_NAME = re.compile(r"(?:chained_[0-9]+\.)?optimizer\.")


def agreed_iteration(folder: int | None, recorded: Any, where: str) -> int | None:
    """The iteration, from the folder's name (``iter_NNNNNNN``) and the files' ``iteration``,
    which must agree (an ``iter_0000002`` copied as ``iter_0000005`` keeps its files' 2); either
    alone is taken."""
    recorded = recorded if type(recorded) is int else None
    if folder is not None and recorded is not None and folder != recorded:
        raise MegatronImportError(
            f"{where}: the folder's name says iteration {folder}, its files' 'iteration' "
            f"says {recorded} (copied or renamed under another iteration?); neither is recorded"
        )
    return folder if folder is not None else recorded


def is_optimizer_name(name: str) -> bool:
    """A torch_dist key of optimizer state, never a model weight (imported as optimizer state,
    skipped by name, or refused; never written under ``params/``)."""
    return _OPTIMIZER_NAME.match(name) is not None or ".optimizer." in name


def param_groups(optimizer_state: Any) -> Any:
    """``param_groups`` of a saved Megatron optimizer state (``{"optimizer": torch state}``)."""
    inner = optimizer_state.get("optimizer") if isinstance(optimizer_state, dict) else None
    return inner.get("param_groups") if isinstance(inner, dict) else None


def sharding_type(common: Any) -> str | None:
    """The distributed optimizer's layout recorded in the common state (None: not recorded)."""
    optimizer = common.get("optimizer") if isinstance(common, dict) else None
    return optimizer.get("param_state_sharding_type") if isinstance(optimizer, dict) else None


def ddp_bucket_size(settings: dict) -> int | None:
    """Megatron-LM's DDP bucket size in elements (None: one bucket, without overlap_grad_reduce)."""
    if not settings.get("overlap_grad_reduce"):
        return None
    dp = int(settings.get("data_parallel_size") or 1)
    return int(settings.get("ddp_bucket_size") or max(40_000_000, 1_000_000 * dp))


def tied_embeddings(model_names: list[str], settings: dict) -> list[str]:
    """The word embeddings that are the output layer too: megatron-core saves a tied output
    layer only as the embedding (no ``output_layer.weight``)."""
    untied = settings.get("untie_embeddings_and_output_weights") is True
    if untied or any(n.endswith("output_layer.weight") for n in model_names):
        return []
    return [n for n in model_names if n.endswith("embedding.word_embeddings.weight")]


def element_count(shape) -> int:
    """Elements of ``shape``, in 64-bit integers (a torch_dist shape may exceed 2**31)."""
    return int(np.prod(shape, dtype=np.int64))
