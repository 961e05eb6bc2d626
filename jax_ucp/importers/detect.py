"""Which torch checkpoint format a directory holds, and the importer that plans its import."""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import Any

from jax_ucp.format import UCPError
from jax_ucp.importers import deepspeed, megatron, orbax
from jax_ucp.importers import safetensors as safetensors_hf
from jax_ucp.importers.deepspeed import files as deepspeed_files
from jax_ucp.importers.megatron import bridge as megatron_bridge
from jax_ucp.importers.plan import WHOLE, ImportPlan, accounted
from jax_ucp.importers.torch import dcp as torch_dcp
from jax_ucp.importers.torch import files as torch_files
from jax_ucp.importers.torch import torchtune


class SourceFormatError(UCPError, ValueError):
    """The source is not a checkpoint of a format jax_ucp imports (or not there at all)."""


class SourceNotFoundError(SourceFormatError, FileNotFoundError):
    """The source path does not exist or is not a directory."""


def detect_format(src) -> str:
    """'deepspeed', 'megatron', 'orbax', 'safetensors' or 'torch' (torch DCP or torch.save
    files), from the files a path holds (none is unpickled)."""
    src = os.fspath(src)
    if os.path.isfile(src) and src.endswith(".safetensors"):
        return "safetensors"
    if os.path.isfile(src) and torch_files.is_torch_files(src):
        return "torch"
    if not os.path.isdir(src):
        raise SourceNotFoundError(
            f"{src}: not a directory (expected a checkpoint folder, or a .safetensors, .bin, "
            f".pt, .pth or .ckpt file)."
        )
    if torch_dcp.is_torch_dcp(src):  # .metadata without megatron-core's common.pt/metadata.json
        return "torch"
    if orbax.is_orbax(src):  # _METADATA / _CHECKPOINT_METADATA, or a manager root of steps
        return "orbax"

    def has(*patterns: str) -> bool:
        return any(glob.glob(os.path.join(src, pattern)) for pattern in patterns)

    if has(
        "latest_checkpointed_iteration.txt",
        megatron_bridge.LATEST_TRAIN_STATE_FILE,  # Megatron Bridge (also run_config.yaml)
        megatron_bridge.RUN_CONFIG_FILE,
        "iter_*",
        ".metadata",
        "metadata.json",
        "mp_rank_*/model_optim_rng.pt",
    ):
        return "megatron"
    if has(
        "latest",
        "latest_universal",
        "global_step*",
        "*mp_rank_*_model_states.pt",
        "*zero_pp_rank_*_optim_states.pt",
        "layer_*-model_*-model_states.pt",
    ):
        return "deepspeed"
    if safetensors_hf.is_safetensors(src):
        return "safetensors"
    if torchtune.is_torchtune(src):  # epoch_N/ safetensors (+ recipe_state/recipe_state.pt)
        return "torch"
    if torch_files.is_torch_files(src):
        return "torch"
    runs = deepspeed_files.trainer_checkpoints(src)
    if runs:
        raise SourceFormatError(
            f"{src}: a Hugging Face Trainer output directory with {len(runs)} checkpoints: "
            f"{', '.join(runs)}. Convert one of them (e.g. {os.path.join(src, runs[-1])})."
        )
    found = sorted(os.listdir(src))
    listing = ", ".join(found[:12]) + (f", ... ({len(found)} entries)" if len(found) > 12 else "")
    raise SourceFormatError(
        f"{src}: cannot tell the checkpoint format; it holds: {listing or 'nothing'}. Expected "
        f"DeepSpeed (`latest`, `global_stepN/`, `mp_rank_XX_model_states.pt`; universal: "
        f"`latest_universal`, `<tag>_universal/zero/`), Megatron "
        f"(`latest_checkpointed_iteration.txt`, `iter_N/`, torch_dist `.metadata` + `*.distcp` "
        f"with `common.pt`), torch DCP (`.metadata` + `__R_S.distcp`, or Accelerate's "
        f"`pytorch_model_fsdp_0/` + `optimizer_0/`), torch.save files (`pytorch_model.bin`, "
        f"`{torch_files.INDEX_FILE}`, `pytorch_model_fsdp.bin`, a `.bin`/`.pt`/`.pth`/`.ckpt` "
        f"file) or Hugging Face safetensors (`*.safetensors`, `{safetensors_hf.INDEX_FILE}`). "
        f"Orbax (`_CHECKPOINT_METADATA`, `_METADATA`, step folders). "
        f"Use `jax-ucp convert deepspeed|megatron|orbax|safetensors|torch` to force one."
    )


def plan_import(
    source, *, format: str | None = None, spec: Any = None, **options: Any
) -> ImportPlan:
    """The import of ``source`` by the importer of its format (detected unless given), its items
    held to the accounting rule (:func:`plan.accounted`): every tensor of the checkpoint is
    imported or listed in ``source["skipped"]`` with a reason, or nothing is committed.

    ``spec``: a UCP-language spec with import rules / settings. ``options`` are the importer's
    own (DeepSpeed: ``tag=``; Megatron: ``vocab_size=``).

    Args:
        source: the checkpoint file or folder.
        format: the importer's format name (detected when None).
        spec: a UCP-language spec (``Spec``, shipped name or TOML path) with import rules /
            settings.
        **options: the importer's own options (``tag=``, ``vocab_size=``).
    """
    checkpoint_format = format or detect_format(source)
    importer = _IMPORTERS.get(checkpoint_format)
    if importer is None:
        raise SourceFormatError(
            f"Unknown checkpoint format {checkpoint_format!r} (expected 'deepspeed', 'megatron', "
            f"'orbax', 'safetensors' or 'torch')."
        )
    plan = importer(source, spec=spec, **options)
    whole = options.get("share", WHOLE).count == 1
    items = accounted(plan, f"{os.fspath(source)} ({checkpoint_format})", whole=whole)
    return dataclasses.replace(plan, items=items)


def _plan_megatron(source, **options) -> ImportPlan:
    """Megatron Bridge (``latest_train_state.pt``, ``train_state.pt`` + ``run_config.yaml``) or
    Megatron-LM / megatron-core."""
    if megatron_bridge.is_megatron_bridge(source):
        return megatron_bridge.plan_megatron_bridge(source, **options)
    return megatron.plan_megatron(source, **options)


def _plan_safetensors(source, **options) -> ImportPlan:
    """safetensors weights; beside a torch optimizer (a Trainer ``checkpoint-N/``, Accelerate's
    ``save_state``) the torch files importer maps its state, unless only weights are wanted."""
    if not options.get("weights_only") and torch_files.has_torch_optimizer(source):
        return torch_files.plan_torch_files(source, **options)
    return safetensors_hf.plan_safetensors(source, **options)


def _plan_torch(source, **options) -> ImportPlan:
    """torch DCP (a folder with .metadata, or Accelerate's holding them) or torch.save files."""
    if torchtune.is_torchtune(source):
        return torchtune.plan_torchtune(source, **options)
    if torch_dcp.dcp_dirs(source):
        return torch_dcp.plan_torch_dcp(source, **options)
    return torch_files.plan_torch_files(source, **options)


_IMPORTERS = {
    "deepspeed": deepspeed.plan_deepspeed,
    "megatron": _plan_megatron,
    "orbax": orbax.plan_orbax,
    "safetensors": _plan_safetensors,
    "torch": _plan_torch,
}
