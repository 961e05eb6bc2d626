"""megatron-core (CPU, gloo) loads a jax_ucp megatron export into a GPTModel built by the
generator (CFG: its ``kind``, ``tp``, ``pp``, ``ep``, ``tied``, ``bf16``, ``grouped``) and its
DistributedOptimizer, saves what it loaded, trains one step (forward, backward, Adam; with
``pp`` 2 one micro-batch sent between the stages by hand) and saves each parameter's gradient
and the stepped state, all with its own ``dist_checkpointing.save``. A grouped-GEMM model
(whose forward needs CUDA's grouped_gemm) only loads and saves.

Run:  python mcore_continue.py GENERATOR EXPORT OUT CFG_JSON WORLD PORT
(GENERATOR: tools/fixtures/make_megatron_fixtures.py, whose model builder and CPU shims it uses)."""

import contextlib
import dataclasses
import json
import os
import sys

GENERATOR, SRC, OUT, CFG, WORLD, PORT = sys.argv[1:7]
os.environ["TORCHDYNAMO_DISABLE"] = "1"  # the MoE router's torch.compile: no compiler on CPU here
sys.path.insert(0, os.path.dirname(GENERATOR))
import make_megatron_fixtures as m  # noqa: E402


def worker(rank: int) -> None:
    import torch
    import torch.distributed as dist

    m._shim_cuda()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT)
    dist.init_process_group("gloo", rank=rank, world_size=int(WORLD))
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.transformer.module import Float16Module

    moe_utils.te_general_gemm = None  # the router's GEMM probes Transformer Engine
    cfg = {"pp": 1, "ep": 1, **json.loads(CFG)}
    parallel_state.initialize_model_parallel(
        cfg["tp"], cfg["pp"], expert_model_parallel_size=cfg["ep"]
    )
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    stage, last = parallel_state.get_pipeline_model_parallel_rank(), cfg["pp"] - 1
    model, tc = m.build_model(cfg, stage, cfg["pp"])
    m._shim_cuda_tensors()
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True
    )
    wrapped = Float16Module(tc, model) if cfg.get("bf16") else model
    ddp = DistributedDataParallel(tc, ddp_config, module=wrapped)
    config = OptimizerConfig(
        optimizer="adam",
        lr=1e-2,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        use_distributed_optimizer=True,
        clip_grad=0.0,
        bf16=bool(cfg.get("bf16")),
    )
    opt = get_megatron_optimizer(config, [ddp])
    for p in model.parameters():  # a tensor the load misses shows as zeros
        p.data.zero_()
    for inner in getattr(opt, "chained_optimizers", [opt]):  # its state_dict needs a state
        inner._init_optimizer_states_with_dummy_values()
    meta = dist_checkpointing.load_content_metadata(SRC)  # as Megatron-LM's load_checkpoint
    assert meta["distrib_optim_sharding_type"] == "fully_reshardable", meta
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
    if cfg.get("grouped"):
        dist.destroy_process_group()
        return
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, m.VOCAB, (m.BATCH, m.SEQ), generator=g)
    labels = torch.roll(tokens, -1, 1)
    pos = torch.arange(m.SEQ)[None].expand(m.BATCH, m.SEQ)
    mask = torch.triu(torch.ones(1, 1, m.SEQ, m.SEQ, dtype=torch.bool), 1)
    ddp.zero_grad_buffer()
    loss = _forward_backward(ddp, model, tokens, pos, mask, labels, stage, last)
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
    if (
        stage == last
        and parallel_state.get_data_parallel_rank() == 0
        and (parallel_state.get_tensor_model_parallel_rank() == 0)
    ):
        with open(os.path.join(OUT, "result.json"), "w") as f:
            json.dump(
                {
                    "ok": bool(ok),
                    "loss": float(loss),
                    "grad_norm": float(grad_norm or 0),
                    "iteration": common.get("iteration"),
                    "tokens": tokens.tolist(),
                    "vocab_rows": int(model.output_layer.weight.shape[0]) * cfg["tp"],
                    "args": vars(common["args"]) if "args" in common else None,
                },
                f,
            )
    dist.destroy_process_group()


def _forward_backward(ddp, model, tokens, pos, mask, labels, stage: int, last: int):
    """One micro-batch forward and backward; between pipeline stages the activations go
    forward and their gradient back by point-to-point sends (as float32: gloo's types)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dtype = torch.bfloat16 if ddp.config.bf16 else torch.float32
    shape = (tokens.shape[1], tokens.shape[0], model.config.hidden_size)  # [s, b, h]
    x = None
    if stage > 0:
        x = torch.empty(shape)
        dist.recv(x, ps.get_pipeline_model_parallel_prev_rank())
        x = x.to(dtype).requires_grad_()
        model.set_input_tensor(x)
    if stage < last:
        out = ddp(tokens, pos, mask)
        dist.send(out.detach().float().contiguous(), ps.get_pipeline_model_parallel_next_rank())
        grad = torch.empty(shape)
        dist.recv(grad, ps.get_pipeline_model_parallel_next_rank())
        out.backward(grad.to(out.dtype))
        loss = None
    else:
        loss = ddp(tokens, pos, mask, labels=labels).float().mean()
        loss.backward()
    if x is not None:
        dist.send(x.grad.float().contiguous(), ps.get_pipeline_model_parallel_prev_rank())
    return loss


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
