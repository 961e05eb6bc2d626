"""megatron-core 0.16 (CPU, gloo) loads a jax_ucp megatron export into a bf16 Llama-style GPTModel
(the generator's ``llama`` kind) and its DistributedOptimizer, saves what it loaded, trains one
step (forward, backward, Adam) and saves each parameter's gradient and the stepped state, all
with its own ``dist_checkpointing.save``.

Run:  python mcore_continue.py GENERATOR EXPORT OUT TP WORLD PORT
(GENERATOR: tools/fixtures/make_megatron_fixtures.py, whose model builder and CPU shims it uses)."""

import contextlib
import dataclasses
import json
import os
import sys

GENERATOR, SRC, OUT, TP, WORLD, PORT = sys.argv[1:7]
sys.path.insert(0, os.path.dirname(GENERATOR))
import make_megatron_fixtures as m  # noqa: E402


def worker(rank: int) -> None:
    import torch
    import torch.distributed as dist

    m._shim_cuda()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT)
    dist.init_process_group("gloo", rank=rank, world_size=int(WORLD))
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.transformer.module import Float16Module

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=int(TP))
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    cfg = dict(kind="llama", tp=int(TP), pp=1, ep=1, tied=False, bf16=True)
    model, tc = m.build_model(cfg, 0, 1)
    m._shim_cuda_tensors()
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True
    )
    ddp = DistributedDataParallel(tc, ddp_config, module=Float16Module(tc, model))
    config = OptimizerConfig(
        optimizer="adam",
        lr=1e-2,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        use_distributed_optimizer=True,
        clip_grad=0.0,
        bf16=True,
    )
    opt = get_megatron_optimizer(config, [ddp])
    for p in model.parameters():  # a tensor the load misses shows as zeros
        p.data.zero_()
    for inner in getattr(opt, "chained_optimizers", [opt]):  # its state_dict needs a state
        inner._init_optimizer_states_with_dummy_values()
    meta = {"distrib_optim_sharding_type": "fully_reshardable"}
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_states

    def state():
        sd = model.sharded_state_dict()
        sd["optimizer"] = opt.sharded_state_dict(sd, is_loading=True, metadata=meta)
        return sd

    loaded = dist_checkpointing.load(state(), SRC)
    opt_sd = loaded.pop("optimizer")
    common = {k: loaded.pop(k) for k in ("iteration", "checkpoint_version", "args") if k in loaded}
    loaded.pop("content_metadata", None)
    model.load_state_dict(loaded)
    opt.load_state_dict(opt_sd)
    for inner in getattr(opt, "chained_optimizers", [opt]):
        for per_param in inner.optimizer.state.values():  # CPU shim: one step tensor each
            per_param["step"] = per_param["step"].clone()  # (the load shares one: +1 per param)

    def save(name):
        os.makedirs(os.path.join(OUT, name), exist_ok=True)
        dist.barrier()
        sd = model.sharded_state_dict()
        sd["optimizer"] = opt.sharded_state_dict(sd, metadata=meta)
        dist_checkpointing.save(sd, os.path.join(OUT, name))

    save("loaded")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, m.VOCAB, (m.BATCH, m.SEQ), generator=g)
    labels = torch.roll(tokens, -1, 1)
    pos = torch.arange(m.SEQ)[None].expand(m.BATCH, m.SEQ)
    mask = torch.triu(torch.ones(1, 1, m.SEQ, m.SEQ, dtype=torch.bool), 1)
    ddp.zero_grad_buffer()
    loss = ddp(tokens, pos, mask, labels=labels).float().mean()
    loss.backward()
    grads = {}  # each parameter's gradient, saved by megatron-core under the parameter's key
    main_grads = {id(p): p.main_grad.clone() for p in model.parameters()}
    for key, sh in model.sharded_state_dict().items():
        if id(sh.data) in main_grads:
            typed = {} if hasattr(sh, "build_fn") else {"dtype": torch.float32}  # a factory
            grads[key] = dataclasses.replace(sh, data=main_grads[id(sh.data)], **typed)
    os.makedirs(os.path.join(OUT, "grads"), exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(grads, os.path.join(OUT, "grads"))
    ddp.finish_grad_sync()
    ok, grad_norm, _ = opt.step()
    save("stepped")
    if rank == 0:
        with open(os.path.join(OUT, "result.json"), "w") as f:
            json.dump(
                {
                    "ok": bool(ok),
                    "loss": float(loss),
                    "grad_norm": float(grad_norm or 0),
                    "iteration": common.get("iteration"),
                    "tokens": tokens.tolist(),
                    "vocab_rows": int(model.output_layer.weight.shape[0]) * int(TP),
                    "args": vars(common["args"]) if "args" in common else None,
                },
                f,
            )
    dist.destroy_process_group()


def _set_states(self, model_param, tensors):
    """CPU shim: megatron-core 0.16.1's loader copies every per-parameter state of the inner
    optimizer, and torch's Adam (no Apex / Transformer Engine here) keeps a ``step`` tensor
    there, which the fully_reshardable state never holds (KeyError 'step'); the states it
    holds are copied, the step stays the one the param groups set (as FusedAdam keeps it)."""
    group, order = self.model_param_group_index_map[model_param]
    main = self.optimizer.param_groups[group]["params"][order]
    found = {"param": main, **self.optimizer.state[main]}
    for key, value in tensors.items():
        found[key].copy_(value)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    mp.spawn(worker, nprocs=int(WORLD), join=True)
