"""megatron-core (CPU, gloo) loads a jax_ucp megatron export into a GPTModel built by the
generator (CFG: its ``kind``, ``tp``, ``pp``, ``vpp``, ``ep``, ``etp``, ``shared``, ``layers``,
``tied``, ``bf16``, ``grouped``) and its DistributedOptimizer, saves what it loaded, trains one
step (forward, backward, Adam; with ``pp`` 2 one micro-batch sent between the stages by hand,
through each stage's model chunks with ``vpp``; tied embeddings' gradients summed over the
embedding group as ``finalize_model_grads`` does) and saves each parameter's gradient
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
        cfg["tp"],
        cfg["pp"],
        virtual_pipeline_model_parallel_size=cfg.get("vpp"),
        expert_model_parallel_size=cfg["ep"],
        expert_tensor_parallel_size=cfg.get("etp"),
    )
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    stage, last = parallel_state.get_pipeline_model_parallel_rank(), cfg["pp"] - 1
    chunks = [None] if not cfg.get("vpp") else list(range(cfg["vpp"]))  # VPP: model0, model1..
    built = [m.build_model(cfg, stage, cfg["pp"], v) for v in chunks]
    models, tc = [b[0] for b in built], built[0][1]
    m._shim_cuda_tensors()
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True
    )
    ddps = [
        DistributedDataParallel(
            tc, ddp_config, module=Float16Module(tc, c) if cfg.get("bf16") else c
        )
        for c in models
    ]
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
    opt = get_megatron_optimizer(config, ddps)
    for model in models:  # a tensor the load misses shows as zeros
        for p in model.parameters():
            p.data.zero_()
    for inner in getattr(opt, "chained_optimizers", [opt]):  # its state_dict needs a state
        inner._init_optimizer_states_with_dummy_values()
    meta = dist_checkpointing.load_content_metadata(SRC)  # as Megatron-LM's load_checkpoint
    assert meta["distrib_optim_sharding_type"] == "fully_reshardable", meta
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_states

    def model_sd():  # as Megatron-LM's generate_state_dict: model0, model1, .. with VPP
        sds = [c.sharded_state_dict() for c in models]
        return sds[0] if len(sds) == 1 else {f"model{i}": sd for i, sd in enumerate(sds)}

    def state(**kw):
        sd = model_sd()
        sd["optimizer"] = opt.sharded_state_dict(sd, metadata=meta, **kw)
        return sd

    loaded = dist_checkpointing.load(state(is_loading=True), SRC)
    opt_sd = loaded.pop("optimizer")
    common = {k: loaded.pop(k) for k in ("iteration", "checkpoint_version", "args") if k in loaded}
    for key in ("content_metadata", "opt_param_scheduler"):  # Megatron-LM's, not the model's
        loaded.pop(key, None)
    for i, model in enumerate(models):
        model.load_state_dict(loaded[f"model{i}"] if len(models) > 1 else loaded)
    opt.load_state_dict(opt_sd)
    for inner in getattr(opt, "chained_optimizers", [opt]):
        for per_param in inner.optimizer.state.values():  # CPU shim: one step tensor each
            per_param["step"] = per_param["step"].clone()  # (the load shares one: +1 per param)

    def save(name):
        os.makedirs(os.path.join(OUT, name), exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(state(), os.path.join(OUT, name))

    save("loaded")
    if cfg.get("grouped") or cfg.get("load_only"):
        dist.destroy_process_group()
        return
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, m.VOCAB, (m.BATCH, m.SEQ), generator=g)
    labels = torch.roll(tokens, -1, 1)
    pos = torch.arange(m.SEQ)[None].expand(m.BATCH, m.SEQ)
    mask = torch.triu(torch.ones(1, 1, m.SEQ, m.SEQ, dtype=torch.bool), 1)
    for ddp in ddps:
        ddp.zero_grad_buffer()
        # megatron-core refuses to train MoE under TP without sequence parallelism (whose
        # reduce-scatter gloo lacks): eval mode is the same forward here (no dropout) and backward
        ddp.train(not (cfg["tp"] > 1 and m.model_settings(cfg["kind"])["num_experts"]))
    loss = _forward_backward(ddps, models, tokens, pos, mask, labels, stage, last)
    if cfg["tied"] and cfg["pp"] > 1:  # as finalize_model_grads: the tied copies' grads summed
        emb = models[0] if stage == 0 else models[-1]
        weight = emb.shared_embedding_or_output_weight()
        dist.all_reduce(weight.main_grad, group=parallel_state.get_embedding_group())
    grads = {}  # each parameter's gradient, saved by megatron-core under the parameter's key
    main_grads = {id(p): p.main_grad.clone() for c in models for p in c.parameters()}
    for sd in [c.sharded_state_dict() for c in models]:
        for key, sh in sd.items():
            if id(sh.data) in main_grads:
                typed = {} if hasattr(sh, "build_fn") else {"dtype": torch.float32}  # a factory
                grads[key] = dataclasses.replace(sh, data=main_grads[id(sh.data)], **typed)
    os.makedirs(os.path.join(OUT, "grads"), exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(grads, os.path.join(OUT, "grads"))
    for ddp in ddps:
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
                    "vocab_rows": int(models[-1].output_layer.weight.shape[0]) * cfg["tp"],
                    "args": vars(common["args"]) if "args" in common else None,
                },
                f,
            )
    dist.destroy_process_group()


def _forward_backward(ddps, models, tokens, pos, mask, labels, stage: int, last: int):
    """One micro-batch forward through each stage's model chunks in pipeline order (with VPP:
    stage 0 chunk 0, stage 1 chunk 0, stage 0 chunk 1, ..., the ring of stages), then backward
    in reverse; between stages the activations go forward and their gradient back by
    point-to-point sends (as float32: gloo's types)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dtype = torch.bfloat16 if ddps[0].config.bf16 else torch.float32
    shape = (tokens.shape[1], tokens.shape[0], models[0].config.hidden_size)  # [s, b, h]
    prev, after = (
        ps.get_pipeline_model_parallel_prev_rank(),
        ps.get_pipeline_model_parallel_next_rank(),
    )
    steps, loss = [], None  # (input, output) of each chunk
    for v, (ddp, model) in enumerate(zip(ddps, models)):
        first, final = stage == 0 and v == 0, stage == last and v == len(models) - 1
        x = None
        if not first:
            x = torch.empty(shape)
            dist.recv(x, prev)
            x = x.to(dtype).requires_grad_()
            model.set_input_tensor(x)
        if final:
            loss = ddp(tokens, pos, mask, labels=labels).float().mean()
            steps.append((x, loss))
        else:
            out = ddp(tokens, pos, mask)
            dist.send(out.detach().float().contiguous(), after)
            steps.append((x, out))
    for v in reversed(range(len(models))):
        x, out = steps[v]
        if out is loss:
            loss.backward()
        else:
            grad = torch.empty(shape)
            dist.recv(grad, after)
            out.backward(grad.to(out.dtype))
        if x is not None:
            dist.send(x.grad.float().contiguous(), prev)
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
