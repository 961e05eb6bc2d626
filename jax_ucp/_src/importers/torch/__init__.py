"""Torch checkpoints read without torch: the allow-listed unpickler, and one importer per
layout (``LAYOUTS``): torch_checkpointing, torchtune, OLMo-core, torch DCP (Accelerate's FSDP
folders too), torch.save files, and a Hugging Face Trainer / Accelerate folder's optimizer
beside its safetensors weights; torch optimizers' state conventions in ``optimizer``."""

from __future__ import annotations

from jax_ucp._src.importers.plan import Importer
from jax_ucp._src.importers.torch import (
    dcp,
    files,
    olmo_core,
    run_roots,
    torch_checkpointing,
    torchtune,
)
from jax_ucp._src.importers.torch.options import TorchOptions
from jax_ucp._src.importers.trainer_files import trainer_run

__all__ = ["LAYOUTS", "TorchOptions"]

#: The layouts of the ``torch`` format, in the order they are asked: of those that find a
#: source, the first plans it (a torch_checkpointing or torchtune folder may hold DCP or
#: torch.save files too; torch.save files come last, and plan ``--from torch`` when none finds
#: the source).
LAYOUTS = (
    Importer(
        "torch_checkpointing",
        torch_checkpointing.detect,
        torch_checkpointing.plan_torch_checkpointing,
        TorchOptions,
        format="torch",
    ),
    Importer("torchtune", torchtune.detect, torchtune.plan_torchtune, TorchOptions, format="torch"),
    Importer(
        "olmo_core",
        olmo_core.detect,
        dcp.plan_torch_dcp,
        TorchOptions,
        format="torch",
        run=run_roots.olmo_core_run,
    ),
    Importer(
        "torch_dcp",
        dcp.detect,
        dcp.plan_torch_dcp,
        TorchOptions,
        format="torch",
        given=lambda src: bool(dcp.dcp_dirs(src)),  # megatron-core's too, read as plain DCP
        run=run_roots.torchtitan_run,
        model_names=True,
    ),
    # safetensors weights beside optimizer.pt / optimizer.bin: the safetensors importer's
    # claim, taken over to map the optimizer's state too
    Importer(
        "hf_trainer",
        files.detect_optimizer,
        files.plan_torch_files,
        TorchOptions,
        format="torch",
        takes_over=("safetensors",),
        run=trainer_run,
    ),
    Importer("torch_files", files.detect, files.plan_torch_files, TorchOptions, format="torch"),
)
