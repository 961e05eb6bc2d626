"""Run by tests/exporters/test_dcp_optimizer_torch.py: two gloo ranks on CPU, a two-layer model
``fully_shard``-ed (FSDP2), ``dcp.load`` of an export into ``get_state_dict``'s flattened state
dicts, ``set_state_dict``; rank 0 writes every parameter, Adam moment and step gathered whole
(``full_tensor``) to ``loaded.npz`` beside the export. Args: EXPORT PORT."""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def model() -> torch.nn.Module:
    """The model the test's checkpoint is named after (``0.weight`` [6, 8], ...)."""
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))


def main(rank: int, world: int, export: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(1)  # other values than the export's: the load must replace each
    net = model()
    for layer in net:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    optim = torch.optim.AdamW(net.parameters(), lr=1e-3)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(net, optim, options=options)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=export)
    set_state_dict(net, optim, model_state_dict=msd, optim_state_dict=osd, options=options)
    out = {}
    for name, p in net.named_parameters():
        state = optim.state[p]
        out[name] = p.full_tensor().detach().numpy()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{key}"] = state[key].full_tensor().numpy()
        out[f"{name}.step"] = np.asarray(float(state["step"]))
    out["lr"] = np.asarray([g["lr"] for g in optim.param_groups])
    if rank == 0:
        np.savez(os.path.join(os.path.dirname(export), "loaded.npz"), **out)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(2, sys.argv[1], int(sys.argv[2])), nprocs=2)
