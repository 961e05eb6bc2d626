"""torch runs of SGD (momentum, Nesterov, coupled decay), Muon beside AdamW, and transformers'
Adafactor, saved as a plain torch run saves them (``torch.save`` of the model's and the
optimizer's state_dicts), continue through ``optax_from_torch``: the next three steps fed torch's
gradients give torch's own parameters within 1e-6. Other optimizers are refused by name."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.continuation import families
from jax_ucp._src.optax_torch import identify
from jax_ucp.conversion import TorchOptions


def _continue(run, grads, want):
    """The run's next steps, fed torch's gradients, against torch's parameters after each."""
    import optax

    params, state = run.params, run.opt_state
    for g, w in zip(grads, want):
        updates, state = run.tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
        for name, value in w.items():
            np.testing.assert_allclose(
                np.asarray(params[name]), value, rtol=0, atol=1e-6, err_msg=name
            )
    return params, state


def _torch_steps(tmp_path, model, optimizers, x, saved=None):
    """Three torch steps, the save, three more: (file, each step's grads, params after it)."""
    import torch

    named = list(model.named_parameters())

    def grads():
        for opt in optimizers:
            opt.zero_grad()
        model(x).pow(2).mean().backward()

    for _ in range(3):
        grads()
        for opt in optimizers:
            opt.step()
    states = [opt.state_dict() for opt in optimizers]
    path = tmp_path / "run.pt"
    torch.save(
        {"model": model.state_dict(), "optimizer": saved(states) if saved else states[0]}, path
    )
    g, want = [], []
    for _ in range(3):
        grads()
        g.append(  # a frozen parameter (no grad): ones, as a jax.grad over the model feeds it
            {
                n: np.ones(p.shape, np.float32) if p.grad is None else p.grad.numpy().copy()
                for n, p in named
            }
        )
        for opt in optimizers:
            opt.step()
        want.append({n: p.detach().numpy().copy() for n, p in named})
    return str(path), g, want


@pytest.mark.torch
@pytest.mark.parametrize("nesterov", [True, False])
def test_torch_sgd_with_momentum_continues_exactly(tmp_path, nesterov):
    """SGD(momentum 0.9, weight decay 0.01 on the matrices, none on the rest): the momentum
    buffer is the chain's trace; torch's L2 decay is added to the gradient before it."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
    )
    named = list(model.named_parameters())
    groups = [
        {"params": [(n, p) for n, p in named if p.ndim == 2], "weight_decay": 0.01},
        {"params": [(n, p) for n, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=nesterov)
    path, grads, want = _torch_steps(tmp_path, model, [opt], torch.randn(5, 8))
    with pytest.warns(UserWarning, match="not record") as said:
        run = jax_ucp.optax_from_torch(path)
    assert {w.filename for w in said} == {__file__}  # the user's call, not the library's
    assert run.optimizer == "sgd"
    assert f"torch SGD: momentum 0.9{', Nesterov' if nesterov else ''}" in run.notes
    _continue(run, grads, want)


@pytest.mark.torch
@pytest.mark.parametrize("adjust", [None, "match_rms_adamw"])
def test_torch_muon_beside_adamw_continues_exactly(tmp_path, adjust):
    """torch.optim.Muon on the hidden matrix, AdamW on embedding, head and the 1-D parameters,
    both built from named parameters and saved as a list: one chain per optimizer, the Muon
    buffer its momentum, AdamW's moments and step its own; Muon's bfloat16 Newton-Schulz is
    torch's (its products summed in torch's order)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(10, 8),
        torch.nn.Linear(8, 16),
        torch.nn.LayerNorm(16),
        torch.nn.Linear(16, 10),
    )
    named = list(model.named_parameters())
    hidden = [(n, p) for n, p in named if n == "1.weight"]
    muon = torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust)
    adamw = torch.optim.AdamW(
        [(n, p) for n, p in named if n != "1.weight"], lr=3e-3, weight_decay=0.01
    )
    x = torch.randint(0, 10, (6,))
    path, grads, want = _torch_steps(tmp_path, model, [muon, adamw], x, saved=list)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no schedule or clipping recorded
        run = jax_ucp.optax_from_torch(path)
    assert run.optimizer == "muon+adamw" and run.step == 3
    assert any(
        n.startswith("torch Muon (bfloat16 Newton-Schulz): momentum 0.95") for n in run.notes
    )
    _continue(run, grads, want)


def test_groups_are_told_by_the_keys_their_optimizer_writes():
    sgd = dict(lr=0.1, momentum=0.9, dampening=0, weight_decay=0, nesterov=True, maximize=False)
    muon = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_coefficients=(3.4, -4.7, 2.0),
                eps=1e-7, ns_steps=5, adjust_lr_fn=None)  # fmt: skip
    assert [families.kind_of(g) for g in (sgd, muon, {"lr": 1, "betas": (0.9, 0.99)})] == [
        "sgd",
        "muon",
        "adam",
    ]


@pytest.mark.torch
@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda torch, p: torch.optim.RMSprop(p, lr=1e-2), r"keys of torch's RMSprop"),
        (lambda torch, p: torch.optim.Adagrad(p, lr=1e-2), r"keys of torch's Adagrad"),
        (lambda torch, p: torch.optim.Adafactor(p, lr=1e-2), r"keys of torch's Adafactor"),
        (lambda torch, p: torch.optim.NAdam(p, lr=1e-2), r"keys of torch's NAdam"),
        (
            lambda torch, p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1),
            r"torch SGD with dampening=0\.1 is not translated",
        ),
        (
            lambda torch, p: torch.optim.SGD(p, lr=0.1, momentum=0.9, maximize=True),
            r"torch SGD with maximize=True is not translated",
        ),
    ],
)
def test_any_other_optimizer_is_refused_naming_it(tmp_path, make, says):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    path, _, _ = _torch_steps(tmp_path, model, [make(torch, model.parameters())], torch.randn(5, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(jax_ucp.UCPError, match=says):
            jax_ucp.optax_from_torch(path)


@pytest.mark.torch
def test_deepspeeds_muon_with_aux_adam_is_refused_naming_it(tmp_path):
    """DeepSpeed's MuonWithAuxAdam, its groups built by its engine's own split (the Muon half
    and the Adam half, each with use_muon), three steps saved: refused by its name, both when
    its Muon group comes first and when only its Adam half is read."""
    import torch

    ds = pytest.importorskip("deepspeed.runtime.zero.muon.muon_optimizer")
    from deepspeed.runtime.engine import DeepSpeedEngine

    if not hasattr(DeepSpeedEngine, "_muon_param_groups"):
        pytest.skip("this DeepSpeed's engine does not split Muon's groups")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    for p in model.parameters():  # as deepspeed.initialize tags them: matrices to Muon
        p.use_muon = p.ndim >= 2  # type: ignore[attr-defined]
    groups = DeepSpeedEngine._muon_param_groups(
        list(model.parameters()), {"lr": 0.02, "momentum": 0.9, "betas": (0.9, 0.95), "eps": 1e-8}
    )
    path, _, _ = _torch_steps(tmp_path, model, [ds.MuonWithAuxAdam(groups)], torch.randn(5, 8))
    order = ["0.weight", "1.weight", "0.bias", "1.bias"]  # the Muon half's, then the Adam's
    ckpt = jax_ucp.convert(path, tmp_path / "ucp", importing=TorchOptions(parameter_order=order))
    with pytest.raises(jax_ucp.UCPError, match=r"keys of DeepSpeed's .*MuonWithAuxAdam"):
        jax_ucp.optax_from_torch(ckpt)
    adam = {k: v for k, v in groups[1].items() if k != "params"}
    assert adam["use_muon"] is False and "betas" in adam
    with pytest.raises(jax_ucp.UCPError, match=r"keys of DeepSpeed's .*MuonWithAuxAdam"):
        identify([{**adam, "amsgrad": False, "params": [0]}], {}, "ckpt")


def test_a_lion_group_is_refused_naming_it():
    """No framework here records Lion (bitsandbytes and lion-pytorch are not installed; the
    Trainer's ``lion_*`` needs bitsandbytes): lion-pytorch's group keys are refused naming it."""
    group = {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0, "params": ["w"]}
    with pytest.raises(jax_ucp.UCPError, match=r"keys of .*a Lion \(betas\)"):
        identify([group], {}, "ckpt")
    with pytest.raises(jax_ucp.UCPError, match=r"the Trainer ran optim='lion_32bit'"):
        identify([{**group, "amsgrad": False}], {"optim": "lion_32bit"}, "ckpt")


def _back_in_torch(run, params, state, model, optimizers, x):
    """The JAX-continued params and state loaded into torch (``load_state_dict`` of
    ``run.torch_state_dicts``): two more torch steps against two more JAX steps on torch's
    gradients, within 1e-6."""
    import optax
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(np.array(params[name])))
    for opt, sd in zip(optimizers, run.torch_state_dicts(state), strict=True):
        for per in sd["state"].values():
            for k, v in per.items():
                per[k] = torch.from_numpy(np.array(v)) if isinstance(v, np.ndarray) else v
        opt.load_state_dict(sd)
    for _ in range(2):
        for opt in optimizers:
            opt.zero_grad()
        model(x).pow(2).mean().backward()
        grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
        for opt in optimizers:
            opt.step()
        updates, state = run.tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        for name, p in model.named_parameters():
            got = p.detach().numpy()
            np.testing.assert_allclose(
                np.asarray(params[name]), got, rtol=0, atol=1e-6, err_msg=name
            )


@pytest.mark.torch
def test_a_jax_continued_sgd_and_muon_run_goes_back_to_torch(tmp_path):
    """Both ways: SGD (Nesterov) and Muon + AdamW continued three steps in JAX, then loaded into
    fresh torch optimizers, step on as JAX does."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    sgd = torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01
    )
    x = torch.randn(5, 8)
    path, grads, want = _torch_steps(tmp_path, model, [sgd], x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        run = jax_ucp.optax_from_torch(path)
    params, state = _continue(run, grads, want)
    fresh = torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01
    )
    _back_in_torch(run, params, state, model, [fresh], x)

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(10, 8), torch.nn.Linear(8, 16), torch.nn.Linear(16, 10)
    )
    named = list(model.named_parameters())

    def pair():
        muon = torch.optim.Muon([(n, p) for n, p in named if n == "1.weight"], lr=0.02)
        return [muon, torch.optim.AdamW([(n, p) for n, p in named if n != "1.weight"], lr=3e-3)]

    x = torch.randint(0, 10, (6,))
    path, grads, want = _torch_steps(
        tmp_path / "m" if (tmp_path / "m").mkdir() is None else tmp_path,
        model,
        pair(),
        x,
        saved=list,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        run = jax_ucp.optax_from_torch(path)
    params, state = _continue(run, grads, want)
    _back_in_torch(run, params, state, model, pair(), x)


@pytest.mark.parametrize(
    ("file", "edit", "error", "said"),
    [
        # a raw ValueError before (harness optimizer_groups seed 0 #11)
        ("adafactor", lambda o: o["param_groups"][0].update(weight_decay="x"),
         jax_ucp.SourceError, r"param_groups\[0\]\.weight_decay = 'x': expected a number >= 0"),
        # continued undecayed before (#32)
        ("muon_adamw", lambda o: o[1]["param_groups"][0].pop("weight_decay"),
         jax_ucp.SourceError, r"weight_decay = '<missing>'"),
        # continued with it before (#78)
        ("muon_adamw", lambda o: o[0]["param_groups"][0].update(eps=1e308),
         jax_ucp.RequestError, r"eps = 1e\+308: expected a number in \[0, 1\.0\)"),
        ("muon_adamw", lambda o: o[1]["param_groups"][0].update(eps=2.0),
         jax_ucp.RequestError, r"eps = 2\.0: 1 or more swamps every update"),
    ],
)  # fmt: skip
def test_a_fuzzed_group_of_a_saved_run_is_refused_by_name(tmp_path, file, edit, error, said):
    """The saved Muon + AdamW and Adafactor runs (tools/fixtures/make_optimizer_family_fixtures.py)
    with one group field fuzzed, as the harness's group-fuzz does: refused naming the field."""
    import os
    import shutil

    from tests.torch_edit import edit_torch_file
    from tests.ucp_testing import REPO

    path = str(tmp_path / f"{file}_synthetic.pt")
    shutil.copyfile(os.path.join(REPO, "tests", "fixtures", "torch", f"{file}_synthetic.pt"), path)
    edit_torch_file(path, lambda t: edit(t["optimizer"]))
    with warnings.catch_warnings(), pytest.raises(error, match=said):
        warnings.simplefilter("ignore", UserWarning)
        jax_ucp.optax_from_torch(path)
