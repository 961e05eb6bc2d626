"""Run by tests/exporters/test_deepspeed_moe_torch.py under torchrun (one process, gloo, CPU):
DeepSpeed (ZeRO 2, fp32, torch's Adam) built over the family's tiny transformers model
(tests/models/test_hf_families.py's), ``load_checkpoint`` of a universal checkpoint
(``"load_universal": true``); writes OUT.npz: each parameter's fp32 master, ``exp_avg/<name>``
and ``exp_avg_sq/<name>`` as the engine holds them after the load, and ``step``.
Args: FAMILY LOAD OUT."""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def main(family: str, load: str, out: str) -> None:
    import deepspeed
    import transformers
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from tests.models.test_hf_families import FAMILIES

    deepspeed.init_distributed("gloo")
    config_class, model_class, kwargs, _, _ = FAMILIES[family]
    torch.manual_seed(1)  # weights other than the export's: the load must replace every one
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**kwargs))
    adam = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "torch_adam": True}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Adam", "params": adam},
        "zero_optimization": {"stage": 2},
        "checkpoint": {"load_universal": True},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=model.float(), model_parameters=model.parameters(), config=config
    )
    engine.load_checkpoint(load)
    found = {}
    for name, p in engine.module.named_parameters():
        found[name] = safe_get_full_fp32_param(p).detach().numpy().copy()
        for state in ("exp_avg", "exp_avg_sq"):
            found[f"{state}/{name}"] = safe_get_full_optimizer_state(p, state).numpy().copy()
    steps = {float(s["step"]) for s in engine.optimizer.optimizer.state.values() if "step" in s}
    found["step"] = np.asarray(sorted(steps), np.float32)
    np.savez(out, **found)


if __name__ == "__main__":
    main(*sys.argv[1:4])
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
