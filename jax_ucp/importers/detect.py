"""Which torch checkpoint format a directory holds, and ``convert`` dispatching on it."""

from __future__ import annotations

import glob
import os


def detect_format(src) -> str:
    """'deepspeed' or 'megatron', from the files a directory holds (no file is unpickled)."""
    src = os.fspath(src)
    if not os.path.isdir(src):
        raise FileNotFoundError(
            f"{src}: not a directory (expected a DeepSpeed or Megatron checkpoint folder)."
        )
    has = lambda *pats: any(glob.glob(os.path.join(src, p)) for p in pats)
    if has(
        "latest_checkpointed_iteration.txt",
        "iter_*",
        ".metadata",
        "metadata.json",
        "mp_rank_*/model_optim_rng.pt",
    ):
        return "megatron"
    if has(
        "latest",
        "global_step*",
        "*mp_rank_*_model_states.pt",
        "*zero_pp_rank_*_optim_states.pt",
        "layer_*-model_*-model_states.pt",
    ):
        return "deepspeed"
    raise ValueError(
        f"{src}: cannot tell the checkpoint format. Expected DeepSpeed (`latest`, `global_stepN/`, "
        f"`mp_rank_XX_model_states.pt`) or Megatron (`latest_checkpointed_iteration.txt`, `iter_N/`, "
        f"torch_dist `.metadata` + `*.distcp`). Use `jax-ucp convert deepspeed|megatron` to force one."
    )


def convert(source, dest, *, spec=None, format: str | None = None, **kwargs):
    """Imports ``source`` (format detected unless given) into a UCP checkpoint at ``dest``."""
    fmt = format or detect_format(source)
    if fmt == "deepspeed":
        from jax_ucp.importers import deepspeed

        if spec is not None:
            kwargs["spec"] = spec
        return deepspeed.convert_deepspeed(source, dest, **kwargs)
    if fmt == "megatron":
        from jax_ucp.importers import megatron

        return megatron.convert_megatron(source, dest, spec=spec, **kwargs)
    raise ValueError(f"Unknown checkpoint format {fmt!r} (expected 'deepspeed' or 'megatron').")
