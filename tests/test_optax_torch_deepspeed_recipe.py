"""Continue a DeepSpeed run configured the usual way: the optimizer DeepSpeed builds from its
config (type ``AdamW``/``Adam`` without ``torch_adam``: FusedAdam, or DeepSpeedCPUAdam under
offload), a DeepSpeed scheduler, ``gradient_clipping`` 1.0 -- read from the files alone by
``optax_from_torch`` (``jax_ucp/_src/continuation/deepspeed.py``).

The runs ``recipe_*`` are written by DeepSpeed 0.19.8 itself on CPU (2 gloo ranks,
``tools/fixtures/make_deepspeed_recipe_fixtures.py``), with DeepSpeed's next 3 steps recorded
(the fp32 masters after each): JAX's continuation is compared to them (fp32 <= 1e-6; bf16 runs,
whose forward JAX computes in bf16 too, within bf16's rounding). The torch-marked tests check
each schedule against DeepSpeed's own class over 150 steps and the Adam step against
DeepSpeed's own FusedAdam / DeepSpeedCPUAdam on CPU. The refusals run without torch."""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_ucp
from jax_ucp._src.continuation.deepspeed import (
    SCHEDULERS,
    deepspeed_recipe,
    deepspeed_schedule,
    scheduler_params,
)
from jax_ucp._src.continuation.recipe import Recipe
from jax_ucp._src.optax_torch import chain_of
from jax_ucp.errors import RequestError
from tests.ucp_testing import REPO, run_torchrun

pytestmark = pytest.mark.timeout(600)
FIX = os.path.join(REPO, "tests", "fixtures", "deepspeed")
#: run -> (its optimizer class, the schedule's name, max |params - DeepSpeed's| allowed)
RUNS = {
    "z1_fp32_adamw_cosine": ("FusedAdam", "WarmupCosineLR", 1e-6),
    "z2_bf16_adamw_decay": ("FusedAdam", "WarmupDecayLR", 1e-3),
    "z3_bf16_adamw_cosine": ("FusedAdam", "WarmupCosineLR", 1e-3),
    "z2_fp32_cpuadam_l2_nobias_warmup": ("DeepSpeedCPUAdam", "WarmupLR", 2e-6),
    "z1_fp32_adam_onecycle": ("FusedAdam", "OneCycle", 1e-6),
}
PRESENT = sorted(n for n in RUNS if os.path.isdir(os.path.join(FIX, f"recipe_{n}")))


def _loss(params, x, y, dtype):
    """ds_recipe_train.py's MLP and loss, its forward in the run's dtype."""
    p = jax.tree.map(lambda a: a.astype(dtype), params)
    h = jnp.tanh(x.astype(dtype) @ p["fc1.weight"].T + p["fc1.bias"])
    out = h @ p["fc2.weight"].T + p["fc2.bias"]
    return jnp.mean((out.astype(jnp.float32) - y) ** 2)


@pytest.mark.parametrize("name", PRESENT)
def test_deepspeeds_default_optimizer_and_schedule_continue_in_jax(name):
    """``optax_from_torch(ckpt)`` alone (no option): the next 3 steps are DeepSpeed's."""
    kind, schedule, tol = RUNS[name]
    src = os.path.join(FIX, f"recipe_{name}")
    with np.load(os.path.join(src, "truth.npz")) as z:
        truth = {k: z[k] for k in z.files}
    assert str(truth["optimizer"]) == kind
    run = jax_ucp.optax_from_torch(os.path.join(src, "ckpt"))
    assert run.step == int(truth["step"]) == 3 and run.unrecovered == []
    assert any(f"DeepSpeed {schedule} schedule" in n for n in run.notes)
    assert any("global norm 1.0" in n for n in run.notes)
    dtype = jnp.bfloat16 if "bf16" in name else jnp.float32
    step = jax.jit(
        lambda p, s, x, y: (
            lambda g: (lambda u, s2: (optax.apply_updates(p, u), s2))(
                *run.tx.update(jax.tree.map(lambda a: a.astype(jnp.float32), g), s, p)
            )
        )(jax.grad(_loss)(p, x, y, dtype))
    )
    params, state = jax.tree.map(jnp.asarray, dict(run.params)), run.opt_state
    worst = 0.0
    for i in range(3):
        assert float(run.schedule(3 + i)) == pytest.approx(float(truth[f"lr{i}"]), rel=1e-6)
        params, state = step(params, state, truth[f"x{i}"], truth[f"y{i}"])
        for k, v in params.items():
            worst = max(worst, float(np.max(np.abs(np.asarray(v) - truth[f"after{i}/{k}"]))))
    print(f"{name}: max |JAX - DeepSpeed| over 3 steps = {worst:.3g}")
    assert worst <= tol


def test_the_saved_scheduler_position_is_recorded_and_checked(tmp_path):
    """The import records DeepSpeed's ``last_batch_iteration``; one that is not the optimizer's
    step - 1 is refused (the schedule's position unknown)."""
    name = PRESENT[0] if PRESENT else pytest.skip("no recipe fixture")
    ckpt = jax_ucp.convert(os.path.join(FIX, f"recipe_{name}", "ckpt"), tmp_path / "ucp")
    source = jax_ucp.inspect(ckpt).source or {}
    assert source["optimizer"]["scheduler"] == {"last_batch_iteration": 2}
    recipe = deepspeed_recipe(source, "x")
    assert recipe is not None and recipe.at_step is not None
    assert recipe.at_step(3) == []
    with pytest.raises(RequestError, match=r"last_batch_iteration 2, the optimizer stepped 4"):
        recipe.at_step(4)


def _source(optimizer=None, scheduler=None, groups=None, saved=None, clip=1.0) -> dict:
    group = {"lr": 0.0, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    group |= {"bias_correction": True, "params": ["w"]}
    ds = {"gradient_clipping": clip}
    if optimizer is not None:
        ds["optimizer"] = optimizer
    if scheduler is not None:
        ds["scheduler"] = scheduler
    record = {"param_groups": groups or [group], "config": ds}
    if saved is not None:
        record["scheduler"] = saved
    return {"optimizer": record}


ADAMW = {"type": "AdamW", "params": {"lr": 0.01}}


@pytest.mark.parametrize(
    ("optimizer", "says"),
    [
        ({"type": "Lamb"}, r"'Lamb' \(a DeepSpeed optimizer\)"),
        ({"type": "OneBitAdam"}, r"'OneBitAdam' \(a DeepSpeed optimizer\)"),
        ({"type": "ZeroOneAdam"}, r"'ZeroOneAdam'"),
        ({"type": "OneBitLamb"}, r"'OneBitLamb'"),
        ({"type": "Adagrad"}, r"'Adagrad'"),
        ({"type": "MuAdam"}, r"'MuAdam'"),
        ({"type": "SGD"}, r"'SGD' \(not one DeepSpeed builds as Adam\)"),
        ({"type": "AdamW", "params": {"max_grad_norm": 1.0}}, r"params.max_grad_norm: not a"),
        ({"type": "AdamW", "params": {"amsgrad": True}}, r"amsgrad = true is not translated"),
        ({"type": "AdamW", "params": {"adam_w_mode": "yes"}}, r"adam_w_mode = 'yes'"),
        ({"type": "AdamW", "params": {"lr": -1}}, r"params.lr = -1"),
        ({"type": "AdamW", "params": {"betas": [0.9]}}, r"params.betas = \[0.9\]"),
        ({"type": "AdamW", "params": {"betas": [0.9, 1.0]}}, r"params.betas\[1\] = 1.0"),
        ({"type": "AdamW", "params": {"eps": "1e-8"}}, r"params.eps = '1e-8'"),
        ({"type": "AdamW", "params": {"weight_decay": -0.1}}, r"params.weight_decay = -0.1"),
        ({"type": "AdamW", "params": {"fp32_optimizer_states": False}}, r"fp32_optimizer_states"),
        ({"type": "AdamW", "params": {"fp32_optimizer_states": 0}}, r"states = 0: expected true"),
        ({"type": "Adam", "params": {"torch_adam": True, "bias_correction": False}}, r"torch Adam"),
        ({"params": {}}, r"expected a 'type'"),
    ],
)
def test_what_deepspeed_made_and_optax_does_not_reproduce_is_refused_by_name(optimizer, says):
    with pytest.raises(RequestError, match=says):
        deepspeed_recipe(_source(optimizer), "ckpt")


@pytest.mark.parametrize(
    ("kind", "params", "says"),
    [
        ("WarmupLR", {"warmup_num_steps": 0}, r"warmup_num_steps = 0: expected a whole number > 0"),
        ("WarmupLR", {"warmup_num_steps": 2.5}, r"warmup_num_steps = 2.5"),
        ("WarmupLR", {"warmup_type": "cos"}, r"warmup_type = 'cos'"),
        ("WarmupLR", {"warmup_min_lr": -0.1}, r"warmup_min_lr = -0.1"),
        ("WarmupLR", {"warmup_min_lr": True}, r"warmup_min_lr = True"),
        ("WarmupLR", {"warmup_max_lr": math.inf}, r"warmup_max_lr = inf"),
        ("WarmupLR", {"warmup_steps": 10}, r"params.warmup_steps: not a parameter"),
        ("WarmupLR", {"last_batch_iteration": 5}, r"begun mid-way"),
        ("WarmupLR", {"warmup_min_lr": [0.1, 0.2]}, r"expected one value, or 1 equal"),
        ("WarmupDecayLR", {}, r"needs params.total_num_steps"),
        ("WarmupCosineLR", {"total_num_steps": "10"}, r"total_num_steps = '10'"),
        ("OneCycle", {"cycle_min_lr": 0.1}, r"needs params.cycle_max_lr"),
        ("OneCycle", {"cycle_min_lr": 0, "cycle_max_lr": 1, "cycle_momentum": 1}, r"true or"),
        ("OneCycle", {"cycle_min_lr": 0, "cycle_max_lr": 1, "cycle_first_step_size": 0}, r"> 0"),
        ("LRRangeTest", {"lr_range_test_step_size": -3}, r"lr_range_test_step_size = -3"),
        ("ReduceLROnPlateau", {}, r"reproduced are WarmupLR"),
    ],
)
def test_a_scheduler_parameter_is_typed_range_checked_and_known(kind, params, says):
    with pytest.raises(RequestError, match=says):
        scheduler_params(kind, params, 1, "ckpt")
    with pytest.raises(RequestError, match=says):
        deepspeed_recipe(_source(ADAMW, {"type": kind, "params": params}), "ckpt")


def test_a_client_scheduler_saved_under_a_config_scheduler_is_refused():
    saved = {"last_epoch": 3}
    source = _source(ADAMW, {"type": "WarmupLR"}, saved=saved)
    with pytest.raises(RequestError, match=r"client's scheduler ran, not the config's"):
        deepspeed_recipe(source, "ckpt")


def test_deepspeeds_adam_type_is_adamw_unless_adam_w_mode_is_false():
    """DeepSpeed's rule (engine._configure_basic_optimizer): 'Adam' is AdamW by default."""
    for optimizer, want in (
        ({"type": "Adam"}, "adamw"),
        ({"type": "adam", "params": {"adam_w_mode": False}}, "adam"),
        ({"type": "AdamW", "params": {"adam_w_mode": False}}, "adamw"),
        ({"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False}}, "adam"),
    ):
        groups = [{"lr": 0.001, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1}]
        groups[0] |= {"params": ["w"], "amsgrad": False, "bias_correction": True}
        recipe = deepspeed_recipe(_source(optimizer, groups=groups), "ckpt")
        assert recipe is not None and recipe.optimizer == want, optimizer


def test_a_schedule_the_optimizer_does_not_hold_is_refused():
    """The held learning rate (the next step's) is checked against the schedule at the step."""
    sched = {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 10}}
    groups = [{"lr": 0.5, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.0}]
    groups[0] |= {"params": ["w"], "bias_correction": True}
    recipe = deepspeed_recipe(_source(ADAMW, sched, groups, {"last_batch_iteration": 2}), "c")
    assert recipe is not None and recipe.at_step is not None
    with pytest.raises(
        RequestError, match=r"WarmupLR schedule gives lr .* the optimizer holds 0.5"
    ):
        recipe.at_step(3)


#: parameter sets each schedule is compared on (DeepSpeed's class, 150 steps)
SCHEDULE_CASES = [
    ("WarmupLR", {}),
    ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.05, "warmup_num_steps": 30}),
    ("WarmupLR", {"warmup_num_steps": 17, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 120, "warmup_num_steps": 20}),
    ("WarmupDecayLR", {"total_num_steps": 100, "warmup_num_steps": 1, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 10, "warmup_num_steps": 40, "warmup_max_lr": 0.3}),
    ("WarmupCosineLR", {"total_num_steps": 130, "warmup_num_steps": 25}),
    (
        "WarmupCosineLR",
        {
            "total_num_steps": 90,
            "warmup_num_steps": 10,
            "warmup_type": "linear",
            "warmup_min_ratio": 0.2,
            "cos_min_ratio": 0.05,
        },
    ),
    ("OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 40}),
    (
        "OneCycle",
        {
            "cycle_min_lr": 0.002,
            "cycle_max_lr": 0.02,
            "cycle_first_step_size": 30,
            "cycle_second_step_size": 50,
            "decay_lr_rate": 0.1,
            "decay_step_size": 7,
            "decay_mom_rate": 0.01,
            "cycle_min_mom": 0.85,
            "cycle_max_mom": 0.95,
        },
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": 0.0,
            "cycle_max_lr": 1.0,
            "cycle_first_step_size": 21,
            "cycle_second_step_size": 13,
            "cycle_first_stair_count": 4,
            "cycle_second_stair_count": 3,
            "cycle_momentum": False,
        },
    ),
    ("LRRangeTest", {"lr_range_test_step_size": 7, "lr_range_test_step_rate": 0.5}),
    (
        "LRRangeTest",
        {
            "lr_range_test_min_lr": 0.01,
            "lr_range_test_step_size": 9,
            "lr_range_test_staircase": True,
        },
    ),
]


@pytest.mark.torch
@pytest.mark.parametrize(("kind", "params"), SCHEDULE_CASES)
def test_each_schedule_is_deepspeeds_own_at_every_step(kind, params):
    """The lr (and OneCycle's beta1 / beta2) the optimizer holds before each of 150 steps, as
    DeepSpeed's class sets them stepping once per optimizer step, against ours at optax's count."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    from deepspeed.runtime import lr_schedules

    base = 0.007
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=base, betas=(0.9, 0.999))
    made = getattr(lr_schedules, kind)(opt, **params)
    ours = deepspeed_schedule(kind, scheduler_params(kind, params, 1, "t"), base)
    for count in range(150):
        group = opt.param_groups[0]
        assert float(ours["lr"](count)) == pytest.approx(group["lr"], rel=2e-6, abs=1e-12), count
        if ours["beta1"] is not None:
            assert float(ours["beta1"](count)) == pytest.approx(group["betas"][0], rel=2e-6)
            assert group["betas"][1] == 0.99
        else:
            assert tuple(group["betas"]) == (0.9, 0.999)
        made.step()
    assert set(params) <= set(SCHEDULERS[kind])


def _recipe(kind: str, bias_correction: bool, beta1=None) -> Recipe:
    return Recipe(
        optimizer=kind,
        how="test",
        betas=(0.85, 0.97),
        eps=1e-6,
        learning_rate=lambda c: 0.01 / (1.0 + c),
        weight_decay=0.05,
        decayed={"w": True, "b": False},
        clip=0.5,
        bias_correction=bias_correction,
        beta1=beta1,
    )


@pytest.mark.torch
@pytest.mark.parametrize("cls", ["FusedAdam", "DeepSpeedCPUAdam"])
@pytest.mark.parametrize(("kind", "bias_correction"), [("adamw", True), ("adam", False)])
@pytest.mark.parametrize("cycled", [False, True])
def test_the_chain_steps_as_deepspeeds_own_optimizer(cls, kind, bias_correction, cycled):
    """5 steps of DeepSpeed's FusedAdam (its CPU op) / DeepSpeedCPUAdam on the same clipped
    gradients, learning rates and (OneCycle-like) beta1s: the chain's params within fp32."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    from deepspeed.ops import adam

    rng = np.random.default_rng(0)
    start = {
        "w": rng.normal(size=(5, 7)).astype(np.float32),
        "b": rng.normal(size=7).astype(np.float32),
    }
    beta1 = (lambda c: 0.8 + 0.02 * jnp.asarray(c, jnp.float32)) if cycled else None
    recipe = _recipe(kind, bias_correction, beta1)
    mask = {"w": True, "b": False}
    tx = chain_of(recipe, mask)
    params = jax.tree.map(jnp.asarray, start)
    state = tx.init(params)
    tparams = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in start.items()}
    groups = [
        {"params": [tparams["w"]], "weight_decay": 0.05},
        {"params": [tparams["b"]], "weight_decay": 0.0},
    ]
    kw = {"lr": 0.01, "betas": (0.85, 0.97), "eps": 1e-6, "bias_correction": bias_correction}
    mode = (
        {"adam_w_mode": kind == "adamw"} if cls == "FusedAdam" else {"adamw_mode": kind == "adamw"}
    )
    opt = getattr(adam, cls)(groups, **kw, **mode)
    for count in range(5):
        grads = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in start.items()}
        norm = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads.values()))
        for k, p in tparams.items():  # DeepSpeed's clipping: by max_norm / (norm + 1e-6)
            p.grad = torch.tensor(grads[k]) * min(1.0, 0.5 / (norm + 1e-6))
        for g in opt.param_groups:
            g["lr"] = 0.01 / (1.0 + count)
            if beta1 is not None:
                g["betas"] = (float(beta1(count)), 0.97)
        opt.step()
        updates, state = tx.update(jax.tree.map(jnp.asarray, grads), state, params)
        params = dict(optax.apply_updates(params, updates))  # pyright: ignore[reportArgumentType]
        for k, p in tparams.items():
            np.testing.assert_allclose(np.asarray(params[k]), p.detach().numpy(), rtol=0, atol=2e-6)


# -- what the files do not record, supplied: optax_from_torch(schedule=, clip=) -------------------

PLAIN = os.path.join(REPO, "tests", "fixtures", "torch", "accelerate_fsdp")  # no schedule, no clip


def _kinds(run) -> list[str]:
    return [type(s).__name__ for s in run.opt_state]


def test_one_chain_shape_for_every_source():
    """A plain torch run, a Trainer + DeepSpeed run and a DeepSpeed-configured run: the same
    five pieces (clip, L2 decay, Adam, decoupled decay, learning rate), each one's state."""
    shape = [
        "EmptyState",
        "ScaleByScheduleState",
        "ScaleByAdamState",
        "ScaleByScheduleState",
        "ScaleByScheduleState",
    ]
    with pytest.warns(UserWarning, match="schedule"):
        plain = jax_ucp.optax_from_torch(PLAIN)
    trainer = os.path.join(REPO, "tests", "fixtures", "hf_trainer", "trainer_ds_z2", "checkpoint-3")
    runs = [plain, jax_ucp.optax_from_torch(trainer)]
    runs += [jax_ucp.optax_from_torch(os.path.join(FIX, f"recipe_{n}", "ckpt")) for n in PRESENT]
    for run in runs:
        assert _kinds(run) == shape
        counted = (optax.ScaleByAdamState, optax.ScaleByScheduleState)
        assert [int(s.count) for s in run.opt_state if isinstance(s, counted)] == [run.step] * 4


def test_a_plain_runs_schedule_and_clipping_are_supplied():
    """schedule= (an optax schedule of the step count) and clip= fill what the files do not
    record: nothing is left unrecovered, no warning, and the chain clips and schedules."""
    import warnings

    schedule = optax.cosine_decay_schedule(0.01 / (0.5 * (1 + math.cos(math.pi * 3 / 10))), 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run = jax_ucp.optax_from_torch(PLAIN, schedule=schedule, clip=0.5)
    assert run.unrecovered == []
    assert any("schedule: given (schedule=)" in n for n in run.notes)
    assert any("clipping: given (clip=), to global norm 0.5" in n for n in run.notes)
    assert float(run.schedule(4)) == pytest.approx(float(schedule(4)))
    params = jax.tree.map(jnp.asarray, dict(run.params))
    grads = jax.tree.map(lambda p: jnp.full_like(p, 3.0), params)
    norm = float(optax.tree.norm(grads))
    unclipped = jax_ucp.optax_from_torch(PLAIN, schedule=schedule, clip=None)
    scaled = jax.tree.map(lambda g: g * (0.5 / (norm + 1e-6)), grads)
    got, _ = run.tx.update(grads, run.opt_state, params)
    want, _ = unclipped.tx.update(scaled, unclipped.opt_state, params)
    same, _ = unclipped.tx.update(grads, unclipped.opt_state, params)
    for k in params:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-6, atol=1e-9)
    name = "tok_embeddings.weight"
    assert not np.allclose(np.asarray(got[name]), np.asarray(same[name]), rtol=1e-3)
    quiet = jax_ucp.optax_from_torch(PLAIN, schedule=0.01, clip=None)
    assert quiet.unrecovered == [] and any(
        "clipping: given (clip=), none" in n for n in quiet.notes
    )


@pytest.mark.parametrize(
    ("source", "given", "says"),
    [
        (
            "plain",
            {"schedule": 0.02},
            r"schedule=\) gives lr 0.02 at step 3; the optimizer holds 0.01",
        ),
        ("plain", {"clip": -1.0}, r"clip=\) = -1.0"),
        ("plain", {"schedule": "cosine"}, r"schedule=\) = 'cosine'"),
        ("trainer", {"schedule": 0.01}, r"the files record the run's schedule"),
        ("trainer", {"clip": 2.0}, r"clip=2.0\), but the files record clipping to 1.0"),
        ("trainer", {"clip": None}, r"clip=None\), but the files record clipping to 1.0"),
        ("recipe", {"schedule": optax.constant_schedule(0.01)}, r"record the run's schedule"),
    ],
)
def test_what_contradicts_the_files_is_refused(source, given, says):
    path = {
        "plain": PLAIN,
        "trainer": os.path.join(
            REPO, "tests", "fixtures", "hf_trainer", "trainer_ds_z2", "checkpoint-3"
        ),
        "recipe": os.path.join(FIX, "recipe_z1_fp32_adamw_cosine", "ckpt"),
    }[source]
    with pytest.raises(RequestError, match=says):
        jax_ucp.optax_from_torch(path, **given)


def test_a_recorded_clipping_given_again_is_accepted():
    trainer = os.path.join(REPO, "tests", "fixtures", "hf_trainer", "trainer_ds_z2", "checkpoint-3")
    run = jax_ucp.optax_from_torch(trainer, clip=1.0)
    assert run.unrecovered == [] and any("global norm 1.0" in n for n in run.notes)


@pytest.mark.torch
def test_a_plain_torch_run_with_a_schedule_and_clipping_continues_exactly(tmp_path):
    """A plain torch run (AdamW, CosineAnnealingLR, clip_grad_norm_ 0.5; torch.save): its files
    record neither; given as schedule= / clip=, JAX's next 3 steps are torch's (<= 1e-6)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, betas=(0.8, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    xs = [torch.randn(8, 6, generator=torch.Generator().manual_seed(i)) for i in range(6)]

    def step(x):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()

    for x in xs[:3]:
        step(x)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "run.pt")
    want = []
    for x in xs[3:]:
        step(x)
        want.append({n: p.detach().numpy().copy() for n, p in model.named_parameters()})

    with pytest.warns(UserWarning, match="schedule"):
        jax_ucp.optax_from_torch(str(tmp_path / "run.pt"))  # without: both unrecovered
    schedule = optax.cosine_decay_schedule(0.05, 10)  # CosineAnnealingLR(T_max=10), eta_min 0
    run = jax_ucp.optax_from_torch(str(tmp_path / "run.pt"), schedule=schedule, clip=0.5)
    assert run.unrecovered == [] and run.step == 3

    def loss(p, x):
        h = jnp.tanh(x @ p["0.weight"].T + p["0.bias"])
        return jnp.mean((h @ p["2.weight"].T + p["2.bias"]) ** 2)

    params, state = jax.tree.map(jnp.asarray, dict(run.params)), run.opt_state
    for x, after in zip(xs[3:], want):
        updates, state = run.tx.update(jax.grad(loss)(params, x.numpy()), state, params)
        params = dict(optax.apply_updates(params, updates))  # pyright: ignore[reportArgumentType]
        for name, value in after.items():
            np.testing.assert_allclose(np.asarray(params[name]), value, rtol=0, atol=1e-6)


def test_a_megatron_recipe_is_continued_by_the_same_chain(tmp_path):
    """Megatron's recorded arguments and OptimizerParamScheduler (continuation.megatron) are
    wired into optax_from_torch: the same five pieces, and one update equals the recipe's step
    written out (clip by clip_grad / (norm + 1e-6), Adam, decoupled decay at the scheduled rate
    on Megatron's decayed parameters, the scheduled learning rate)."""
    import shutil

    from jax_ucp._src.continuation.megatron import megatron_recipe

    meg = os.path.join(REPO, "tests", "fixtures", "megatron")
    src = tmp_path / "src"
    shutil.copytree(os.path.join(meg, "gpt_distopt_dp2"), src)
    shutil.copyfile(
        os.path.join(meg, "gpt_distopt_dp2_scheduler_synthetic.common.pt"), src / "common.pt"
    )
    run = jax_ucp.optax_from_torch(str(src))
    assert run.notes[0].startswith("megatron-core AdamW") and run.unrecovered == []
    assert _kinds(run) == _kinds(jax_ucp.optax_from_torch(PLAIN, schedule=0.01, clip=None))
    ckpt = jax_ucp.convert(str(src), tmp_path / "ucp")
    manifest = jax_ucp.inspect(ckpt)
    saved = {e.key: (tuple(e.shape), e.dtype) for e in manifest.tensors}
    recipe = megatron_recipe(dict(manifest.source or {}), saved, "ckpt")
    assert recipe is not None and recipe.clip is not None and callable(recipe.weight_decay)
    params = jax.tree.map(jnp.asarray, dict(run.params))
    rng = np.random.default_rng(1)
    grads = {k: jnp.asarray(rng.normal(size=v.shape), v.dtype) for k, v in params.items()}
    # one compiled update, not one dispatch (and compile) per operation and parameter
    got, _ = jax.jit(run.tx.update)(grads, run.opt_state, params)
    adam = next(s for s in run.opt_state if isinstance(s, optax.ScaleByAdamState))
    c, (b1, b2) = run.step, recipe.betas
    norm = math.sqrt(sum(float(np.sum(np.asarray(g, np.float64) ** 2)) for g in grads.values()))
    scale = min(1.0, recipe.clip / (norm + 1e-6))
    lr, wd = float(recipe.learning_rate(c)), float(recipe.weight_decay(c))
    for k, p in params.items():
        g = np.asarray(grads[k], np.float64) * scale
        m = b1 * np.asarray(adam.mu[k], np.float64) + (1 - b1) * g
        v = b2 * np.asarray(adam.nu[k], np.float64) + (1 - b2) * g * g
        step = (m / (1 - b1 ** (c + 1))) / (np.sqrt(v / (1 - b2 ** (c + 1))) + recipe.eps)
        step = step + (wd * np.asarray(p, np.float64) if recipe.decayed[k] else 0.0)
        np.testing.assert_allclose(np.asarray(got[k]), -lr * step, rtol=2e-5, atol=1e-9)


def test_a_client_made_fusedadam_is_told_by_its_keys_and_asks_what_they_cannot_tell():
    """FusedAdam's groups (bias_correction, a step counter, no amsgrad), made by the client and
    handed to DeepSpeed: not refused as RAdam/Adamax; with weight decay its adam_w_mode is not
    recorded, so optimizer= decides; bias_correction=False is kept."""
    from jax_ucp._src.optax_torch import identify, torch_recipe

    group = {"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.0, "step": 0}
    group |= {"bias_correction": False, "params": ["w"]}
    assert identify([group], {}, "ckpt")[0] == "adamw"
    decayed = {**group, "weight_decay": 0.1}
    with pytest.raises(RequestError, match=r"FusedAdam / DeepSpeedCPUAdam .* adam_w_mode"):
        identify([decayed], {}, "ckpt")
    assert identify([decayed], {}, "ckpt", "adam")[0] == "adam"
    recipe = torch_recipe({"optimizer": {"param_groups": [decayed]}}, [decayed], 3, "adam", "c")
    assert recipe.optimizer == "adam" and recipe.bias_correction is False
    with pytest.raises(RequestError, match=r"RAdam"):  # betas without amsgrad or bias_correction
        identify([{k: v for k, v in group.items() if k != "bias_correction"}], {}, "ckpt")


@pytest.mark.torch
@pytest.mark.slow
def test_a_deepspeed_run_made_now_continues_in_jax(tmp_path):
    """The ZeRO-2 bf16 run (FusedAdam, WarmupDecayLR, gradient_clipping 1.0) trained now by
    DeepSpeed (2 gloo ranks, CPU), read straight from its folder: DeepSpeed's next 3 steps."""
    import json
    import sys

    sys.path.insert(0, os.path.join(REPO, "tools", "fixtures"))
    from make_deepspeed_recipe_fixtures import RUNS as CONFIGS  # pyright: ignore[reportMissingImports]

    script = os.path.join(REPO, "tools", "fixtures", "ds_recipe_train.py")
    config = json.dumps(CONFIGS["z2_bf16_adamw_decay"])
    run_torchrun(script, "--out", str(tmp_path), "--config", config)
    with np.load(tmp_path / "truth.npz") as z:
        truth = {k: z[k] for k in z.files}
    run = jax_ucp.optax_from_torch(str(tmp_path / "ckpt"))
    assert run.step == 3 and run.unrecovered == [] and str(truth["optimizer"]) == "FusedAdam"
    params, state = jax.tree.map(jnp.asarray, dict(run.params)), run.opt_state
    for i in range(3):
        grads = jax.grad(_loss)(params, truth[f"x{i}"], truth[f"y{i}"], jnp.bfloat16)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, state = run.tx.update(grads, state, params)
        params = dict(optax.apply_updates(params, updates))  # pyright: ignore[reportArgumentType]
        for k, v in params.items():
            np.testing.assert_allclose(np.asarray(v), truth[f"after{i}/{k}"], rtol=0, atol=1e-3)


def test_onecycle_momentum_is_checked_against_the_held_betas():
    """OneCycle's cycle_momentum rewrites the groups' betas to (its momentum, 0.99) every step:
    the held beta1 must be its value at the step, beta2 0.99."""
    sched = {"type": "OneCycle", "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01}}
    saved = {"last_batch_iteration": 2}
    kw = scheduler_params("OneCycle", sched["params"], 1, "t")
    made = deepspeed_schedule("OneCycle", kw, 0.01)
    lr, mom = float(made["lr"](3)), float(made["beta1"](3))
    group = {"lr": lr, "betas": [mom, 0.99], "eps": 1e-8, "weight_decay": 0.0}
    group |= {"bias_correction": True, "params": ["w"]}
    recipe = deepspeed_recipe(_source(ADAMW, sched, [group], saved), "c")
    assert recipe is not None and recipe.at_step is not None and recipe.beta1 is not None
    assert recipe.at_step(3) == [] and recipe.betas == (mom, 0.99)
    wrong = {**group, "betas": [0.5, 0.99]}
    recipe = deepspeed_recipe(_source(ADAMW, sched, [wrong], saved), "c")
    assert recipe is not None and recipe.at_step is not None
    with pytest.raises(RequestError, match=r"OneCycle gives beta1 .* the optimizer holds 0.5"):
        recipe.at_step(3)
    with pytest.raises(RequestError, match=r"beta2 to 0.99, the groups hold 0.999"):
        deepspeed_recipe(_source(ADAMW, sched, [{**group, "betas": [mom, 0.999]}], saved), "c")


def test_a_config_scheduler_over_the_clients_optimizer():
    """No "optimizer" in the config: the client's torch optimizer (identified from its groups)
    stepped under DeepSpeed's scheduler; one that scales the optimizer's learning rate at its
    making (unrecorded) is refused, asking for schedule=."""
    group = {"lr": 0.0, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    group |= {"amsgrad": False, "params": ["w"]}
    decay = {"type": "WarmupDecayLR", "params": {"total_num_steps": 20, "warmup_num_steps": 5}}
    kw = scheduler_params("WarmupDecayLR", decay["params"], 1, "t")
    held = float(deepspeed_schedule("WarmupDecayLR", kw, math.nan)["lr"](3))
    source = _source(None, decay, [{**group, "lr": held}], {"last_batch_iteration": 2})
    recipe = deepspeed_recipe(source, "c", ("adamw", "param_groups' decoupled_weight_decay"))
    assert recipe is not None and recipe.at_step is not None and recipe.at_step(3) == []
    assert recipe.how.startswith("torch AdamW") and recipe.clip == 1.0
    cosine = {"type": "WarmupCosineLR", "params": {"total_num_steps": 20}}
    with pytest.raises(RequestError, match=r"WarmupCosineLR scales the client optimizer's"):
        deepspeed_recipe(_source(None, cosine, [group]), "c", ("adamw", "x"))
