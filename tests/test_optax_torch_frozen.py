"""Parameters a torch run did not train (no optimizer state: a LoRA base, ``requires_grad=False``)
are held by ``optax_from_torch``'s continuation: zero updates whatever gradient is fed, the
trained ones stepped as torch steps them (issue 70). Against torch itself: a model with a frozen
base layer, AdamW over ``model.parameters()`` (as torchtune's LoRA recipe builds it), saved by
torch DCP from ``get_state_dict`` and stepped once more; and DeepSpeed's own frozen-parameter
run (tests/fixtures/deepspeed/z2_bf16_dp2_frozen)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import jax_ucp
from tests.ucp_testing import REPO


def _updates(run, grads):
    updates, state = run.tx.update(grads, run.opt_state, run.params)
    return {n: np.asarray(v) for n, v in updates.items()}, state


@pytest.mark.torch  # torch-free, but seconds of JAX compiling: in the torch stage
def test_deepspeeds_frozen_parameters_get_no_update():
    src = os.path.join(REPO, "tests", "fixtures", "deepspeed", "z2_bf16_dp2_frozen", "ckpt")
    run = jax_ucp.optax_from_torch(src)
    frozen = {"wpe.weight", "h.0.ln_1.bias"}  # requires_grad=False in the run (test_reach.py)
    assert any("2 leaves without optimizer state held" in n for n in run.notes)
    grads = {n: np.ones(np.shape(v), np.float32) for n, v in run.params.items()}
    for name, update in _updates(run, grads)[0].items():
        assert (not update.any()) == (name in frozen), name


@pytest.mark.torch
def test_a_frozen_base_continues_as_torch_steps_it(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    net[0].requires_grad_(False)  # the base
    optim = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    x = torch.randn(5, 8)

    def backward():
        optim.zero_grad()
        net(x).square().sum().backward()

    for _ in range(3):
        backward()
        optim.step()
    model, optimizer = get_state_dict(net, optim)
    dcp.save({"model": model, "optimizer": optimizer}, checkpoint_id=str(tmp_path / "dcp"))
    backward()
    grads = {n: p.grad.numpy().copy() for n, p in net.named_parameters() if p.grad is not None}
    optim.step()
    want = {n: p.detach().numpy().copy() for n, p in net.named_parameters()}

    run = jax_ucp.optax_from_torch(str(tmp_path / "dcp"), schedule=1e-2, clip=None)
    assert run.step == 3
    names = {n: next(k for k in run.params if k.endswith(n)) for n in want}
    rng = np.random.default_rng(0)  # a jax.grad over the whole model: the base's too
    fed = {
        names[n]: grads.get(n, rng.standard_normal(v.shape, np.float32)) for n, v in want.items()
    }
    updates, state = _updates(run, fed)
    for n, value in want.items():
        got = np.asarray(run.params[names[n]]) + updates[names[n]]
        np.testing.assert_allclose(got, value, rtol=0, atol=1e-6, err_msg=n)
    assert not updates[names["0.weight"]].any() and not updates[names["0.bias"]].any()
    (exported,) = run.torch_state_dicts(state)  # back to torch: the base without state, as torch
    torchs = optim.state_dict()["state"]
    assert sorted(exported["state"]) == sorted(torchs) == [2, 3]
    for i, per in torchs.items():
        for key in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_allclose(exported["state"][i][key], per[key], rtol=1e-6, atol=1e-9)


def _sgd(torch, model):
    return [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)]


def _adafactor(torch, model):
    from transformers.optimization import Adafactor

    return [Adafactor(model.parameters(), lr=None)]  # relative step, factored matrices


def _muon(torch, model):
    named = list(model.named_parameters())
    muon = [(n, p) for n, p in named if n in ("1.weight", "2.weight")]
    rest = [(n, p) for n, p in named if n not in ("1.weight", "2.weight")]
    return [torch.optim.Muon(muon, lr=0.02), torch.optim.AdamW(rest, lr=3e-3)]


@pytest.mark.torch
@pytest.mark.parametrize("make", [_sgd, _adafactor, _muon], ids=["sgd", "adafactor", "muon"])
def test_a_frozen_layer_of_another_optimizers_run_is_held(tmp_path, make):
    """torch's SGD (momentum), transformers' Adafactor, torch's Muon beside AdamW (the frozen
    layer's weight Muon's, its bias AdamW's), every parameter given to the optimizer, one layer
    frozen: three JAX steps fed torch's gradients (ones for the frozen layer, as a jax.grad over
    the model feeds it) give torch's parameters within 1e-6, the frozen ones unchanged; the
    state goes back to torch without the frozen layer's, as torch's own."""
    import warnings

    import torch

    from tests.test_optax_torch_families import _continue, _torch_steps

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(10, 8),
        torch.nn.Linear(8, 16),
        torch.nn.Linear(16, 16),
        torch.nn.LayerNorm(16),
        torch.nn.Linear(16, 10),
    )
    model[1].requires_grad_(False)
    before = {n: p.detach().numpy().copy() for n, p in model[1].named_parameters()}
    optimizers = make(torch, model)
    x = torch.randint(0, 10, (6,))
    path, grads, want = _torch_steps(tmp_path, model, optimizers, x, saved=list)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no schedule or clipping recorded
        run = jax_ucp.optax_from_torch(path)
    assert any(n.startswith("2 leaves without optimizer state held") for n in run.notes)
    params, state = _continue(run, grads, want)
    for n, value in before.items():
        np.testing.assert_array_equal(np.asarray(params[f"1.{n}"]), value, err_msg=n)
    for exported, opt in zip(run.torch_state_dicts(state), optimizers, strict=True):
        torchs = opt.state_dict()["state"]
        assert sorted(exported["state"]) == sorted(torchs)
        for i, per in exported["state"].items():
            for key, value in per.items():
                np.testing.assert_allclose(value, torchs[i][key], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize(
    ("file", "frozen"), [("adafactor", ["0.weight"]), ("muon_adamw", ["0.weight", "1.weight"])]
)
def test_a_saved_run_without_a_parameters_state_holds_it(tmp_path, file, frozen):
    """The saved Adafactor and Muon + AdamW runs (tools/fixtures/make_optimizer_family_fixtures.py)
    without the state of each optimizer's first parameter, as a run that froze it saves: held,
    no state kept for it (its zero updates are checked against torch in the torch stage)."""
    import shutil

    import jax

    from tests.torch_edit import edit_torch_file

    path = str(tmp_path / f"{file}_synthetic.pt")
    shutil.copyfile(os.path.join(REPO, "tests", "fixtures", "torch", f"{file}_synthetic.pt"), path)
    edit_torch_file(path, lambda t: [o["state"].pop(0) for o in np.atleast_1d(t["optimizer"])])
    with pytest.warns(UserWarning):  # no clipping recorded
        run = jax_ucp.optax_from_torch(path)
    said = ", ".join(f"['{n}']" for n in frozen)
    note = next(n for n in run.notes if "without optimizer state held" in n)
    assert note.startswith(f"{len(frozen)} leaves") and note.endswith(said)
    kept = {
        getattr(p[-1], "key", None) for p, _ in jax.tree_util.tree_leaves_with_path(run.opt_state)
    }
    assert kept.isdisjoint(frozen) and "1.bias" in kept
