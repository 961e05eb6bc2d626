"""torch DCP with the optimizer, both ways: a transformers Llama trained 2 AdamW steps in torch
(decay / no-decay groups), saved by ``dcp.save`` of ``get_state_dict`` (flattened optimizer
state, FSDP2's and torchtitan's layout), imported, continued one step in JAX
(``optax_from_torch``, the flax tree of ``hf_llama``), saved, exported with
``TorchDcpExport(spec=, optimizer="optim", run_record=<the import>)``; torch loads it into a
fresh model and AdamW (``dcp.load`` + ``set_state_dict``): the weights, moments and step are the
JAX state's bit for bit, and torch's next step is JAX's next step (loss and every weight)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.exporters import TorchDcpExport
from jax_ucp.errors import RequestError
from jax_ucp.language import load_spec

pytestmark = pytest.mark.torch

CONFIG = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def _torch_run(seed: int = 0, **config):
    """A fresh model and AdamW (decay on matrices, none on norms)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**CONFIG, **config})).float()
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    rest = [p for n, p in model.named_parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return model, torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))


def _torch_step(model, optim, ids) -> float:
    import torch

    loss = model(torch.as_tensor(ids), labels=torch.as_tensor(ids)).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    return float(loss.detach())


def _jax_step(run, cfg):
    """A jitted step of ``run``'s optimizer on ``TransformerLM(cfg)``'s next-token loss:
    ``step(params, opt_state, ids)`` -> (params, opt_state, the loss before the update)."""
    import optax

    from jax_ucp.models import TransformerLM

    lm = TransformerLM(cfg)

    def loss_fn(params, ids):
        logits = lm.apply({"params": params}, ids)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

    @jax.jit
    def step(params, opt_state, ids):
        loss, grads = jax.value_and_grad(loss_fn)(params, ids)
        updates, opt_state = run.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def _state_dicts(model, optim, flat: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=flat))


@pytest.mark.timeout(300)
def test_a_run_continued_in_jax_goes_back_to_torch_with_its_optimizer(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    from jax_ucp._src.models.transformer import hf_model

    tokens = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (4, 2, 8))
    model, optim = _torch_run()
    for ids in tokens[:2]:
        _torch_step(model, optim, ids)
    msd, osd = _state_dicts(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "torch"))

    imported = jax_ucp.convert(tmp_path / "torch", tmp_path / "ucp")
    cfg, name = hf_model({"model_type": "llama", **CONFIG})
    spec = load_spec(name, **cfg.head_settings)
    run = jax_ucp.optax_from_torch(imported, spec=spec, clip=None)
    step = _jax_step(run, cfg)
    params, opt_state, _ = step(run.params, run.opt_state, tokens[2])
    continued = jax_ucp.save(str(tmp_path / "jax"), {"params": params, "opt_state": opt_state})
    next_params, _, next_loss = step(params, opt_state, tokens[3])

    with pytest.raises(RequestError, match="give run_record="):
        jax_ucp.export(continued, tmp_path / "x", TorchDcpExport(spec=spec, optimizer="optim"))
    options = TorchDcpExport(spec=spec, optimizer="optim", run_record=imported)
    done = jax_ucp.export(continued, tmp_path / "back", options)
    assert done.tensors == 4 * len(msd)  # weight, 2 moments, step each

    model, optim = _torch_run(seed=1)  # other weights: the load must replace every one
    msd, osd = _state_dicts(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(tmp_path / "back"))
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd, options=flat)

    # what torch holds is the JAX state, bit for bit (the spec's names and layout)
    hf = _hf_tree(spec, params, opt_state)
    for pname, p in model.named_parameters():
        assert np.array_equal(p.detach().numpy(), hf["params"][pname]), pname
        s = optim.state[p]
        assert np.array_equal(s["exp_avg"].numpy(), hf["mu"][pname]), pname
        assert np.array_equal(s["exp_avg_sq"].numpy(), hf["nu"][pname]), pname
        assert float(s["step"]) == 3.0
    assert [g["weight_decay"] for g in optim.param_groups] == [0.1, 0.0]
    assert [g["betas"] for g in optim.param_groups] == [(0.9, 0.95)] * 2

    loss = _torch_step(model, optim, tokens[3])
    assert abs(loss - float(next_loss)) < 1e-5
    after = _hf_tree(spec, next_params, opt_state)["params"]
    for pname, p in model.named_parameters():
        moved = np.abs(after[pname] - hf["params"][pname]).max()
        assert moved > 1e-4, pname  # the step moved it: the comparison can fail
        np.testing.assert_allclose(p.detach().numpy(), after[pname], rtol=0, atol=2e-6)


@pytest.mark.timeout(300)
def test_fsdp2_on_two_ranks_loads_the_model_and_optimizer(tmp_path):
    """FSDP2 (``fully_shard``, two gloo ranks on CPU) loads an export of a torch-named run with
    ``dcp.load`` + ``set_state_dict``: each rank its shards of the one-chunk tensors; gathered,
    every weight and moment is the checkpoint's bit for bit, the step and the lr given."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.ucp_testing import free_port

    rng = np.random.default_rng(0)
    shapes = {"0.weight": (6, 8), "0.bias": (6,), "1.weight": (4, 6), "1.bias": (4,)}
    tree = {
        "params": {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()},
        "opt_state": {
            "mu": {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()},
            "nu": {k: rng.random(s).astype(np.float32) for k, s in shapes.items()},
            "count": np.int32(4),
        },
    }
    ckpt = jax_ucp.save(str(tmp_path / "run"), tree)
    group = {"lr": 5e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    group.update(amsgrad=False, maximize=False, foreach=None, capturable=False)
    group.update(differentiable=False, fused=None, decoupled_weight_decay=True)
    options = TorchDcpExport(optimizer="optim", param_groups=group)
    jax_ucp.export(ckpt, tmp_path / "dcp", options)
    script = Path(__file__).with_name("fsdp2_load.py")
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "dcp"), str(free_port())],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    with np.load(tmp_path / "loaded.npz") as loaded:
        assert list(loaded["lr"]) == [5e-3]
        for name in shapes:
            assert np.array_equal(loaded[name], tree["params"][name]), name
            assert np.array_equal(loaded[f"{name}.exp_avg"], tree["opt_state"]["mu"][name])
            assert np.array_equal(loaded[f"{name}.exp_avg_sq"], tree["opt_state"]["nu"][name])
            assert float(loaded[f"{name}.step"]) == 4.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flat", [True, False])
def test_a_tied_model_loads_in_either_layout_and_continues(tmp_path, flat):
    """A Llama with ``tie_word_embeddings`` (``lm_head.weight`` is ``embed_tokens.weight``:
    ``get_state_dict`` gives both names, one optimizer state) trained 2 AdamW steps, saved in
    ``get_state_dict``'s flattened or nested layout, imported; exported in that layout from the
    import (``lm_head.weight`` a weight without state) and from a tree without it (a JAX
    continuation of a tied model holds the embedding alone: ``tied=``); each loaded by
    ``dcp.load`` + ``set_state_dict`` into a fresh tied model is the run bit for bit, one state,
    and its next step is the run's."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    tokens = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (3, 2, 8))
    model, optim = _torch_run(tie_word_embeddings=True)
    for ids in tokens[:2]:
        _torch_step(model, optim, ids)
    msd, osd = _state_dicts(model, optim, flat)
    assert "lm_head.weight" in msd and "state.lm_head.weight.step" not in str(osd)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "torch"))
    imported = jax_ucp.convert(tmp_path / "torch", tmp_path / "ucp")
    run = jax_ucp.restore(imported)
    del run["params"]["lm_head.weight"]
    embedding_only = jax_ucp.save(str(tmp_path / "jax"), run)

    layout = dict(optimizer="optim", flatten_optimizer_state_dict=flat, run_record=imported)
    tied = {"lm_head.weight": "model.embed_tokens.weight"}
    jax_ucp.export(imported, tmp_path / "a", TorchDcpExport(**layout))
    jax_ucp.export(embedding_only, tmp_path / "b", TorchDcpExport(**layout, tied=tied))
    jax_ucp.export(embedding_only, tmp_path / "c", TorchDcpExport(**layout))
    state = dict(zip(("model", "optim"), _state_dicts(*_torch_run(tie_word_embeddings=True), flat)))
    with pytest.raises(dcp.CheckpointException, match=r"model\.lm_head\.weight"):  # tied= is for
        dcp.load(state, checkpoint_id=str(tmp_path / "c"))
    with pytest.raises(RequestError, match=r"tied\['x'\] = 'y' is no parameter"):
        jax_ucp.export(embedding_only, tmp_path / "d", TorchDcpExport(**layout, tied={"x": "y"}))
    want = _torch_step(model, optim, tokens[2])
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    for export in ("a", "b"):
        fresh, adamw = _torch_run(seed=1, tie_word_embeddings=True)
        msd, osd = _state_dicts(fresh, adamw, flat)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / export))
        set_state_dict(fresh, adamw, model_state_dict=msd, optim_state_dict=osd, options=options)
        assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
        assert len(adamw.state) == len(list(fresh.parameters())) == len(msd) - 1
        assert [g["weight_decay"] for g in adamw.param_groups] == [0.1, 0.0]
        assert _torch_step(fresh, adamw, tokens[2]) == want, export
        for (name, p), q in zip(fresh.named_parameters(), model.parameters()):
            assert torch.equal(p, q), (export, name)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(adamw.state[p][key], optim.state[q][key]), (export, name, key)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("saved", ["dcp", "pt"])
def test_a_tied_torch_run_continues_in_jax(tmp_path, saved):
    """A tied Llama trained 2 AdamW steps, saved by ``dcp.save`` of ``get_state_dict`` (nothing
    records the tie: the spec says ``tie_word_embeddings``, the bytes agree) or by
    ``torch.save`` (one storage: the files say it): ``optax_from_torch`` continues it as one
    parameter (no lm_head leaf), its next step torch's (loss and weights). Without the setting,
    or with an lm_head that is not the embedding, the DCP run is refused saying why."""
    import optax
    import torch
    import torch.distributed.checkpoint as dcp

    from jax_ucp._src.models.transformer import hf_model
    from jax_ucp.conversion import TorchOptions
    from jax_ucp.models import TransformerLM

    tokens = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (3, 2, 8))
    model, optim = _torch_run(tie_word_embeddings=True)
    for ids in tokens[:2]:
        _torch_step(model, optim, ids)
    importing = None
    if saved == "dcp":
        msd, osd = _state_dicts(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "torch"))
        msd["lm_head.weight"] = msd["lm_head.weight"] + 1  # another head, saved alike
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "other"))
    else:
        (tmp_path / "torch").mkdir()
        state = {"model": model.state_dict(), "optimizer": optim.state_dict()}
        torch.save(state, tmp_path / "torch" / "checkpoint.pt")
        named = list(model.named_parameters())  # numbered by group: decayed, then norms
        order = [n for n, p in named if p.ndim > 1] + [n for n, p in named if p.ndim <= 1]
        importing = jax_ucp.RestoreOptions(importing=TorchOptions(parameter_order=order))
    cfg, name = hf_model({"model_type": "llama", **{**CONFIG, "tie_word_embeddings": True}})
    spec = load_spec(name, **cfg.head_settings, tie_word_embeddings=True)
    run = jax_ucp.optax_from_torch(tmp_path / "torch", spec=spec, clip=None, options=importing)
    assert "lm_head" not in run.params
    if saved == "dcp":
        untied = load_spec(name, **cfg.head_settings)
        with pytest.raises(RequestError, match=r"lm_head\.weight.*tie_word_embeddings"):
            jax_ucp.optax_from_torch(tmp_path / "torch", spec=untied, clip=None)
        with pytest.raises(RequestError, match=r"lm_head\.weight.*bytes differ"):
            jax_ucp.optax_from_torch(tmp_path / "other", spec=spec, clip=None)
        # not tied (its own bytes) and without state: a frozen head, held and said
        held = jax_ucp.optax_from_torch(tmp_path / "other", spec=untied, clip=None)
        assert [n for n in held.notes if "without optimizer state held" in n and "lm_head" in n]
    lm = TransformerLM(cfg)

    def loss_fn(params, ids):
        logits = lm.apply({"params": params}, ids)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(run.params, tokens[2])
    updates, _ = run.tx.update(grads, run.opt_state, run.params)
    after = _hf_tree(spec, optax.apply_updates(run.params, updates), run.opt_state)["params"]
    want = _torch_step(model, optim, tokens[2])
    assert abs(float(loss) - want) < 1e-5
    assert len(after) == len(list(model.parameters()))
    for pname, p in model.named_parameters():
        np.testing.assert_allclose(p.detach().numpy(), after[pname], rtol=0, atol=1e-5)


def test_transformers_holds_moe_experts_fused():
    """What the refusal of a per-expert MoE export says (tests/exporters/test_dcp_optimizer.py):
    a transformers Qwen3-MoE's ``get_state_dict`` names its experts fused, none one by one."""
    import re

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        moe_intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
    )
    names = list(Qwen3MoeForCausalLM(config).state_dict())
    experts = {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}
    assert experts <= set(names) and not any(re.search(r"\.experts\.\d+\.", n) for n in names)


def _hf_tree(spec, params, opt_state) -> dict:
    """The flax params and Adam moments under the torch model's names (the spec run
    backwards in memory)."""
    from jax_ucp._src.language import apply_spec_to_tree
    from jax_ucp._src.language.inverse import invert_spec

    back = invert_spec(spec)
    trees = {"params": params}
    for leaf in jax.tree_util.tree_leaves(opt_state, is_leaf=_moments):
        if _moments(leaf):
            trees.update(mu=leaf.mu, nu=leaf.nu)
    out = {k: apply_spec_to_tree(back, {"params": t})["params"] for k, t in trees.items()}
    return {k: {n: np.asarray(v) for n, v in t.items()} for k, t in out.items()}


def _moments(node) -> bool:
    return hasattr(node, "mu") and hasattr(node, "nu")
