"""Continue a DeepSpeed Lion run (config ``"optimizer": {"type": "Lion"}``) in JAX with
``optax.lion``, and take it back.

``recipe_z2_fp32_cpulion_warmup`` is written by DeepSpeed 0.19.8 itself on CPU (2 gloo ranks,
ZeRO-2 with ``offload_optimizer``: DeepSpeed builds DeepSpeedCPULion; FusedLion has no CPU op),
WarmupLR, ``gradient_clipping`` 1.0, weight decay 0.1, saved at step 3 with DeepSpeed's next 3
steps recorded (``tools/fixtures/make_deepspeed_recipe_fixtures.py``). The torch-marked tests step
DeepSpeed's own DeepSpeedCPULion (its CPU op, built on first use) beside the chain, and load the
JAX-continued state back into it. The refusals run without torch."""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_ucp
from jax_ucp._src.continuation.deepspeed import deepspeed_recipe
from jax_ucp._src.continuation.recipe import Recipe
from jax_ucp._src.optax_torch import chain_of
from jax_ucp.errors import RequestError
from tests.ucp_testing import REPO

pytestmark = pytest.mark.timeout(600)
RUN = os.path.join(REPO, "tests", "fixtures", "deepspeed", "recipe_z2_fp32_cpulion_warmup")
LION = {"type": "Lion", "params": {"lr": 0.01, "betas": [0.9, 0.99], "weight_decay": 0.1}}


def _loss(params, x, y):
    """ds_recipe_train.py's MLP and loss (fp32)."""
    h = jnp.tanh(x @ params["fc1.weight"].T + params["fc1.bias"])
    return jnp.mean((h @ params["fc2.weight"].T + params["fc2.bias"] - y) ** 2)


def _truth() -> dict:
    with np.load(os.path.join(RUN, "truth.npz")) as z:
        return {k: z[k] for k in z.files}


def _jax_step(run, params, state, x, y):
    grads = jax.grad(_loss)(params, x, y)
    updates, state = run.tx.update(grads, state, params)
    return dict(optax.apply_updates(params, updates)), state, grads  # pyright: ignore[reportArgumentType]


def test_deepspeeds_lion_continues_in_jax_as_deepspeed_steps():
    """``optax_from_torch(ckpt)`` alone: Lion known from the config's type, its momentum from
    ``exp_avg``, WarmupLR and clipping from the config; DeepSpeed's next 3 steps within 1e-6."""
    truth = _truth()
    assert str(truth["optimizer"]) == "DeepSpeedCPULion"
    run = jax_ucp.optax_from_torch(os.path.join(RUN, "ckpt"))
    assert run.step == 3 and run.unrecovered == [] and run.optimizer == "lion"
    assert run.notes[0].startswith("DeepSpeed Lion") and run.kinds == ["lion"]
    assert any("DeepSpeed WarmupLR schedule" in n for n in run.notes)
    assert "weight decay 0.1 on 4 of 4 leaves, decoupled (Lion)" in run.notes
    params, state = jax.tree.map(jnp.asarray, dict(run.params)), run.opt_state
    worst = 0.0
    for i in range(3):
        assert float(run.schedule(3 + i)) == pytest.approx(float(truth[f"lr{i}"]), rel=1e-6)
        params, state, _ = _jax_step(run, params, state, truth[f"x{i}"], truth[f"y{i}"])
        for k, v in params.items():
            worst = max(worst, float(np.max(np.abs(np.asarray(v) - truth[f"after{i}/{k}"]))))
    print(f"Lion: max |JAX - DeepSpeed| over 3 steps = {worst:.3g}")
    assert worst <= 1e-6


def _source(optimizer, groups=None, scheduler=None) -> dict:
    group = {"lr": 0.01, "betas": [0.9, 0.99], "weight_decay": 0.1, "params": ["w"]}
    ds = {"gradient_clipping": 1.0, "optimizer": optimizer}
    if scheduler is not None:
        ds["scheduler"] = scheduler
    return {"optimizer": {"param_groups": groups or [group], "config": ds}}


@pytest.mark.parametrize(
    ("optimizer", "groups", "says"),
    [
        ({"type": "Lion", "params": {"eps": 1e-8}}, None, r"params.eps: not a parameter .*Lion"),
        ({"type": "Lion", "params": {"betas": [0.9, 1.0]}}, None, r"betas\[1\] = 1.0"),
        ({"type": "Lion", "params": {"weight_decay": -1}}, None, r"weight_decay = -1"),
        ({"type": "Lion", "params": {"fp32_optimizer_states": False}}, None, r"low precision"),
        (LION, [{"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.0}], r"eps"),
        (LION, [{"lr": 0.01, "weight_decay": 0.0, "params": ["w"]}], r"not the groups of the Lion"),
    ],
)
def test_what_is_not_deepspeeds_lion_is_refused_naming_it(optimizer, groups, says):
    with pytest.raises(RequestError, match=says):
        deepspeed_recipe(_source(optimizer, groups), "ckpt")


def test_a_lion_recipe_is_read_from_the_groups_and_onecycle_momentum_refused():
    recipe = deepspeed_recipe(_source(LION), "ckpt")
    assert recipe is not None and recipe.optimizer == "lion"
    assert recipe.betas == (0.9, 0.99) and recipe.weight_decay == 0.1 and recipe.clip == 1.0
    cycle = {"type": "OneCycle", "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01}}
    with pytest.raises(RequestError, match=r"cycles Lion's beta1"):
        deepspeed_recipe(_source(LION, scheduler=cycle), "ckpt")


def _cpu_lion(groups, **kw):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.lion import DeepSpeedCPULion

    return DeepSpeedCPULion(groups, **kw)


@pytest.mark.torch
def test_the_chain_steps_as_deepspeeds_own_cpu_lion():
    """5 steps of DeepSpeedCPULion (its CPU op) on the same clipped gradients and learning
    rates, one group decayed, one not: the chain's params within 1e-6."""
    import torch

    rng = np.random.default_rng(0)
    start = {
        "w": rng.normal(size=(5, 37)).astype(np.float32),  # past the op's vector width
        "b": rng.normal(size=7).astype(np.float32),
    }
    recipe = Recipe(
        optimizer="lion",
        how="test",
        learning_rate=lambda c: 0.01 / (1.0 + jnp.asarray(c, jnp.float32)),
        weight_decay=0.05,
        decayed={"w": True, "b": False},
        clip=0.5,
        betas=(0.85, 0.97),
    )
    tx = chain_of(recipe, {"w": True, "b": False})
    params = jax.tree.map(jnp.asarray, start)
    state = tx.init(params)
    tparams = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in start.items()}
    groups = [
        {"params": [tparams["w"]], "weight_decay": 0.05},
        {"params": [tparams["b"]], "weight_decay": 0.0},
    ]
    opt = _cpu_lion(groups, lr=0.01, betas=(0.85, 0.97))
    worst = 0.0
    for count in range(5):
        grads = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in start.items()}
        norm = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads.values()))
        for k, p in tparams.items():  # DeepSpeed's clipping: by max_norm / (norm + 1e-6)
            p.grad = torch.tensor(grads[k]) * min(1.0, 0.5 / (norm + 1e-6))
        for g in opt.param_groups:
            g["lr"] = 0.01 / (1.0 + count)
        opt.step()
        updates, state = tx.update(jax.tree.map(jnp.asarray, grads), state, params)
        params = dict(optax.apply_updates(params, updates))  # pyright: ignore[reportArgumentType]
        for k, p in tparams.items():
            worst = max(worst, float(np.max(np.abs(np.asarray(params[k]) - p.detach().numpy()))))
    print(f"chain vs DeepSpeedCPULion, 5 steps: max |diff| = {worst:.3g}")
    assert worst <= 1e-6


@pytest.mark.torch
def test_a_jax_continued_lion_goes_back_to_deepspeeds_lion():
    """The run continued one step in JAX, its state as ``run.torch_state_dicts`` loaded into
    DeepSpeedCPULion over the JAX params: DeepSpeed's next step equals JAX's within 1e-6."""
    import torch

    truth = _truth()
    run = jax_ucp.optax_from_torch(os.path.join(RUN, "ckpt"))
    params = jax.tree.map(jnp.asarray, dict(run.params))
    params, state, _ = _jax_step(run, params, run.opt_state, truth["x0"], truth["y0"])
    (exported,) = run.torch_state_dicts(state)
    names = [n for g in run.groups for n in g["params"]]
    assert sorted(exported["state"][0]) == ["exp_avg", "step"] and exported["state"][0]["step"] == 4
    model = {n: torch.nn.Parameter(torch.from_numpy(np.array(params[n]))) for n in names}
    opt = _cpu_lion([{"params": [model[n] for n in names]}], lr=0.01, betas=(0.9, 0.99))
    for per in exported["state"].values():
        per["exp_avg"] = torch.from_numpy(np.array(per["exp_avg"]))
    opt.load_state_dict(exported)
    assert opt.param_groups[0]["lr"] == run.groups[0]["lr"]  # the groups as recorded
    opt.param_groups[0]["lr"] = float(truth["lr1"])  # WarmupLR's, as DeepSpeed's scheduler sets
    params, state, grads = _jax_step(run, params, state, truth["x1"], truth["y1"])
    norm = math.sqrt(sum(float((np.asarray(g, np.float64) ** 2).sum()) for g in grads.values()))
    for n, p in model.items():
        p.grad = torch.from_numpy(np.array(grads[n])) * min(1.0, 1.0 / (norm + 1e-6))
    opt.step()
    worst = max(
        float(np.max(np.abs(np.asarray(params[n]) - p.detach().numpy()))) for n, p in model.items()
    )
    print(f"JAX-continued Lion loaded into DeepSpeedCPULion, next step: max |diff| = {worst:.3g}")
    assert worst <= 1e-6
    for n in names:
        np.testing.assert_allclose(np.asarray(params[n]), truth[f"after1/{n}"], rtol=0, atol=1e-6)


@pytest.mark.torch
def test_a_cpu_lion_exp_avg_sq_that_is_not_zeros_is_refused(tmp_path):
    """DeepSpeedCPULion makes ``exp_avg_sq`` and never steps it: values there are not a Lion's."""
    import shutil

    import torch

    shutil.copytree(os.path.join(RUN, "ckpt"), tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    saved = torch.load(path, weights_only=False)
    state = saved["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
    state["exp_avg_sq"] = torch.ones_like(state["exp_avg_sq"])
    torch.save(saved, path)
    with pytest.raises(RequestError, match=r"exp_avg_sq\) holds non-zero values"):
        jax_ucp.optax_from_torch(str(tmp_path / "ckpt"))
