"""Torch checkpoints read without torch: the allow-listed unpickler, the torch DCP reader and
importer, ``torch.save`` files, and torch optimizers' state conventions."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from jax_ucp._src.errors import RequestError
from jax_ucp._src.importers.plan import Detection, ImportOptions, ImportPlan
from jax_ucp._src.importers.torch import dcp, files, olmo_core, torch_checkpointing, torchtune

__all__ = [
    "TorchOptions",
    "detect",
    "plan",
]


@dataclasses.dataclass(frozen=True)
class TorchOptions(ImportOptions):
    """``ImportOptions`` and the order of an index-keyed optimizer's parameters.

    Attributes:
        parameter_order: the names of the parameters an optimizer keys by index, in the order
            torch numbered them (torch.save files, torchtune; None: from the files).
        model_config: a Hugging Face ``config.json`` (a path) to rebuild that order from, as
            from a Trainer checkpoint's own (an Accelerate ``save_state`` folder, a Trainer
            checkpoint without its ``config.json``).
    """

    parameter_order: Sequence[str] | None = None
    model_config: str | os.PathLike | None = None

    def __post_init__(self):
        if self.parameter_order is not None and self.model_config is not None:
            raise RequestError(
                "parameter_order= and model_config= both say the optimizer's parameter order; "
                "give one"
            )


def detect(src: os.PathLike | str) -> Detection:
    """Whether ``src`` is a torch DCP checkpoint or torch.save files, from names (and a zip's
    signature). A folder of ``.bin`` / ``.pt`` files is a weak claim: DeepSpeed and Megatron
    folders hold them too."""
    src = os.fspath(src)
    if os.path.isfile(src):
        if files.is_torch_files(src):
            return Detection(True, "a torch.save file")
        return Detection(False, "not a torch.save file (`.bin`/`.pt`/`.pth`/`.ckpt` zip)")
    if os.path.isdir(src) and dcp.is_torch_dcp(src):
        if olmo_core.is_step_folder(src):
            return Detection(True, "an OLMo-core step folder (model_and_optim/ torch DCP, train/)")
        return Detection(True, "torch DCP (.metadata)")
    if torch_checkpointing.is_torch_checkpointing(src):
        return Detection(True, "a torch_checkpointing checkpoint (metadata.pkl, <item>_<rank>.pt)")
    if os.path.isdir(src) and torchtune.is_torchtune(src):  # epoch_N/ (+ recipe_state/)
        return Detection(True, "a torchtune checkpoint", weak=True)
    if os.path.isdir(src) and files.is_torch_files(src):
        return Detection(True, "torch.save files", weak=True)
    return Detection(
        False,
        "no torch DCP (`.metadata` + `__R_S.distcp`, Accelerate's `pytorch_model_fsdp_0/` + "
        "`optimizer_0/`, or OLMo-core's `model_and_optim/` + `train/`), no torchtune `epoch_N/` "
        "or `dist_epoch_N/`, no torch_checkpointing `metadata.pkl` + `<item>_<rank>.pt`, and "
        "no torch.save files "
        f"(`pytorch_model.bin`, `{files.INDEX_FILE}`, "
        "`pytorch_model_fsdp.bin`, a `.bin`/`.pt`/`.pth`/`.ckpt` file)",
    )


def plan(src: os.PathLike | str, options: TorchOptions) -> ImportPlan:
    """torchtune, torch DCP (a folder with .metadata, or Accelerate's holding them) or
    torch.save files, with the options as one ``TorchOptions``."""
    common = dict(spec=options.spec, weights_only=options.weights_only, share=options.share)
    if options.model_config is not None and (torchtune.is_torchtune(src) or dcp.dcp_dirs(src)):
        raise RequestError(
            f"{src}: model_config= orders an index-keyed optimizer (torch.save files, "
            f"safetensors weights beside optimizer.bin / optimizer.pt); this torchtune or torch "
            f"DCP checkpoint does not take it"
        )
    if torch_checkpointing.is_torch_checkpointing(src):
        if options.parameter_order is not None or options.model_config is not None:
            raise RequestError(
                f"{src}: a torch_checkpointing checkpoint keys its optimizer by name; "
                f"parameter_order= / model_config= do not apply"
            )
        return torch_checkpointing.plan_torch_checkpointing(src, **common)
    if torchtune.is_torchtune(src):
        return torchtune.plan_torchtune(src, **common, parameter_order=options.parameter_order)
    if dcp.dcp_dirs(src):
        return dcp.plan_torch_dcp(src, **common, parameter_order=options.parameter_order)
    return files.plan_torch_files(
        src, **common, parameter_order=options.parameter_order, model_config=options.model_config
    )
