"""Continue a PyTorch run in JAX: a Hugging Face Trainer run (3 AdamW steps, decay / no-decay
groups, linear warm-up schedule, clipping) converted by auto-detection, restored into the flax
``TransformerLM`` through the ``hf_llama`` spec, and continued 2 steps with
``jax_ucp.optax_from_torch``: the losses equal torch's own steps 4 and 5 (<= 1e-5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_ucp
from jax_ucp.language import load_spec
from jax_ucp.models import LMConfig, TransformerLM
from tests.ucp_testing import REPO

pytestmark = pytest.mark.timeout(600)
FIX = os.path.join(REPO, "tests", "fixtures", "hf_trainer")


def continue_in_jax(ckpt: str, config: dict, tokens: np.ndarray) -> tuple[list[float], object]:
    """The losses of the next len(tokens) steps, each before its update, as the Trainer logs."""
    cfg = LMConfig.from_hf_llama(config)
    spec = load_spec("hf_llama", **cfg.head_settings)
    run = jax_ucp.optax_from_torch(ckpt, spec=spec)
    model = TransformerLM(cfg)

    def loss_fn(params, ids):
        logits = model.apply({"params": params}, ids)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

    @jax.jit
    def step(params, opt_state, ids):
        loss, grads = jax.value_and_grad(loss_fn)(params, ids)
        updates, opt_state = run.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = jax.tree.map(jnp.asarray, run.params)
    opt_state, losses = run.opt_state, []
    for ids in tokens:
        params, opt_state, loss = step(params, opt_state, jnp.asarray(ids, jnp.int32))
        losses.append(float(loss))
    return losses, run


def _check(src: str, truth_path: str, tmp_path, per_token: bool = False, **convert) -> None:
    """``per_token``: the Trainer divided the summed loss by every label, the one the shift
    drops included (transformers 4.46's ``num_items_in_batch``), so its logged loss is the
    mean times (T - 1) / T; the gradient direction, hence AdamW's clipped step, is the same."""
    ckpt = jax_ucp.convert(src, tmp_path / "ucp", **convert)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with np.load(truth_path) as z:
        tokens, want, lrs = z["next_tokens"], z["next_losses"], z["next_lrs"]
    got, run = continue_in_jax(ckpt, config, tokens)
    if per_token:
        got = [g * (tokens.shape[-1] - 1) / tokens.shape[-1] for g in got]
    assert run.step == 3
    assert [float(run.schedule(3 + i)) for i in range(len(lrs))] == pytest.approx(lrs, rel=1e-6)
    assert any("linear schedule" in n for n in run.notes)
    assert any("global norm 1.0" in n for n in run.notes)
    assert any("weight decay 0.1 on" in n for n in run.notes)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["trainer_fp32", "trainer_fp32_tf4", "trainer_tied"])
def test_trainer_run_continues_in_jax_with_torchs_losses(tmp_path, monkeypatch, kind):
    """The committed Trainer fixtures of transformers 5.23 and 4.46 (torch-free: the Trainer's
    order given as parameter_order, decay group then norms) continue with torch's recorded
    losses of steps 4 and 5."""
    monkeypatch.setitem(sys.modules, "transformers", None)
    src = os.path.join(FIX, kind, "checkpoint-3")
    with np.load(os.path.join(FIX, f"{kind}.truth.npz")) as z:
        names = [k.split("/", 1)[1] for k in z.files if k.startswith("param/")]
    norms = [n for n in names if n.endswith("norm.weight")]
    order = [n for n in names if n not in norms] + norms
    truth_path = os.path.join(FIX, f"{kind}.truth.npz")
    per_token = kind.endswith("_tf4")
    _check(src, truth_path, tmp_path, per_token=per_token, parameter_order=order)


@pytest.mark.torch
def test_train_in_torch_convert_continue_in_jax(tmp_path):
    """Trains 3 steps with transformers' Trainer now (the fixture generator, into tmp), converts
    the checkpoint-3/ by auto-detection (the optimizer mapped through transformers), continues
    2 steps in JAX: the losses equal torch's steps 4 and 5 within 1e-5."""
    subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "tools", "fixtures", "make_hf_trainer_checkpoints.py"),
            "--out",
            str(tmp_path / "run"),
            "--only",
            "trainer_fp32",
        ],
        check=True,
        capture_output=True,
        timeout=500,
    )
    src = str(tmp_path / "run" / "trainer_fp32" / "checkpoint-3")
    _check(src, str(tmp_path / "run" / "trainer_fp32.truth.npz"), tmp_path)


def test_optax_from_torch_refuses_a_weights_only_import(tmp_path):
    src = os.path.join(FIX, "trainer_fp32", "checkpoint-3")
    ckpt = jax_ucp.convert(src, tmp_path / "w", weights_only=True)
    with pytest.raises(jax_ucp.UCPError, match=r"no torch optimizer recorded"):
        jax_ucp.optax_from_torch(ckpt)


@pytest.mark.torch
def test_optax_step_equals_torch_adamw_step_without_a_spec(tmp_path):
    """A plain torch run (AdamW over named decay / no-decay groups, no scheduler recorded),
    saved as torch.save({"model", "optimizer"}): with torch's names (no spec) the optax step from
    optax_from_torch, fed torch's own gradients, gives torch's next parameters within 1e-6, the
    no-decay parameters included; the learning rate is the optimizer's, constant, and said so."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
    )
    named = list(model.named_parameters())
    groups = [
        {"params": [(n, p) for n, p in named if p.ndim >= 2], "weight_decay": 0.3},
        {"params": [(n, p) for n, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=0.05, betas=(0.8, 0.95), eps=1e-6)
    x = torch.randn(5, 8)

    def grads_of():
        opt.zero_grad()
        model(x).pow(2).mean().backward()

    for _ in range(3):
        grads_of()
        opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "run.pt")
    grads_of()
    grads = {n: p.grad.numpy().copy() for n, p in named}
    opt.step()
    want = {n: p.detach().numpy().copy() for n, p in named}

    ckpt = jax_ucp.convert(str(tmp_path / "run.pt"), tmp_path / "ucp")
    run = jax_ucp.optax_from_torch(ckpt)
    assert run.step == 3
    assert any("learning rate 0.05" in n and "no schedule" in n for n in run.notes)
    assert any("weight decay 0.3 on 2 of 6 leaves" in n for n in run.notes)
    params = jax.tree.map(jnp.asarray, run.params)
    updates, _ = run.tx.update(jax.tree.map(jnp.asarray, grads), run.opt_state, params)
    got = optax.apply_updates(params, updates)
    for name, value in want.items():
        np.testing.assert_allclose(np.asarray(got[name]), value, rtol=0, atol=1e-6, err_msg=name)
