"""Torch checkpoints read without torch: the allow-listed unpickler, the torch DCP reader and
importer, ``torch.save`` files, and torch optimizers' state conventions."""

from __future__ import annotations

import os

from jax_ucp.importers.plan import Detection, ImportOptions, ImportPlan
from jax_ucp.importers.torch import dcp, files


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
        return Detection(True, "torch DCP (.metadata)")
    if os.path.isdir(src) and files.is_torch_files(src):
        return Detection(True, "torch.save files", weak=True)
    return Detection(
        False,
        "no torch DCP (`.metadata` + `__R_S.distcp`, or Accelerate's `pytorch_model_fsdp_0/` + "
        f"`optimizer_0/`) and no torch.save files (`pytorch_model.bin`, `{files.INDEX_FILE}`, "
        "`pytorch_model_fsdp.bin`, a `.bin`/`.pt`/`.pth`/`.ckpt` file)",
    )


def plan(src: os.PathLike | str, options: ImportOptions) -> ImportPlan:
    """torch DCP (a folder with .metadata, or Accelerate's holding them) or torch.save files,
    with the options as one ``ImportOptions``."""
    planner = dcp.plan_torch_dcp if dcp.dcp_dirs(src) else files.plan_torch_files
    return planner(src, spec=options.spec, weights_only=options.weights_only, share=options.share)
