"""Continue a PyTorch run in JAX: a Hugging Face Trainer run (3 AdamW steps, decay / no-decay
groups, linear warm-up schedule, clipping) converted by auto-detection, restored into the flax
``TransformerLM`` through the ``hf_llama`` spec, and continued 2 steps with
``jax_ucp.optax_from_torch``: the losses equal torch's own steps 4 and 5 (<= 1e-5)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_ucp
from jax_ucp.conversion import ImportOptions, TorchOptions
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
    losses, _ = _steps(run, cfg, tokens)
    return losses, run


def _steps(run, cfg: LMConfig, tokens: np.ndarray) -> tuple[list[float], object]:
    """``run``'s state stepped by a jitted train step on each batch of ``tokens`` (its arrays
    consumed where they are placed): the losses, each before its update, and the last state."""
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
    return losses, opt_state


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
    _check(
        src,
        truth_path,
        tmp_path,
        per_token=per_token,
        importing=TorchOptions(parameter_order=order),
    )


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
    ckpt = jax_ucp.convert(src, tmp_path / "w", importing=ImportOptions(weights_only=True))
    with pytest.raises(jax_ucp.UCPError, match=r"no torch optimizer recorded"):
        jax_ucp.optax_from_torch(ckpt)


@pytest.mark.torch
def test_optax_step_equals_torch_adamw_step_without_a_spec(tmp_path):
    """A plain torch run (AdamW over named decay / no-decay groups, no scheduler recorded),
    saved as torch.save({"model", "optimizer"}) alone in a folder: with torch's names (no spec) the optax step from
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
    (tmp_path / "run").mkdir()  # a folder holding one torch.save file is that file
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "run/s.pt")
    grads_of()
    grads = {n: p.grad.numpy().copy() for n, p in named}
    opt.step()
    want = {n: p.detach().numpy().copy() for n, p in named}

    ckpt = jax_ucp.convert(str(tmp_path / "run"), tmp_path / "ucp")
    run = jax_ucp.optax_from_torch(ckpt)
    assert run.step == 3
    assert any("learning rate 0.05" in n and "no schedule" in n for n in run.notes)
    assert any("weight decay 0.3 on 2 of 6 leaves" in n for n in run.notes)
    params = jax.tree.map(jnp.asarray, run.params)
    updates, _ = run.tx.update(jax.tree.map(jnp.asarray, grads), run.opt_state, params)
    got = optax.apply_updates(params, updates)
    for name, value in want.items():
        np.testing.assert_allclose(np.asarray(got[name]), value, rtol=0, atol=1e-6, err_msg=name)


# --- what the files identify, and nothing else (issue 38) -----------------------------------

from jax_ucp._src.optax_torch import (  # noqa: E402
    check_groups,
    hf_schedule,
    identify,
    schedule_kwargs,
)

ADAM_KEYS = dict(
    lr=0.01, betas=[0.9, 0.999], eps=1e-8, amsgrad=False, maximize=False, foreach=None,
    capturable=False, differentiable=False, fused=None, params=["w"],
)  # fmt: skip


@pytest.mark.parametrize(
    "extra, looks_like",
    [
        ({"amsgrad": None, "decoupled_weight_decay": False}, "RAdam"),
        ({"momentum_decay": 0.004, "decoupled_weight_decay": False}, "NAdam"),
        ({"momentum": 0.9, "nesterov": False, "dampening": 0}, "SGD"),
        ({"rho": 0.9}, "Adadelta"),
    ],
)
def test_an_optimizer_that_is_not_adam_is_refused_by_the_name_it_looks_like(extra, looks_like):
    group = {k: v for k, v in {**ADAM_KEYS, **extra}.items() if v is not None or k != "amsgrad"}
    if looks_like in ("SGD", "Adadelta"):
        group = {k: v for k, v in group.items() if k not in ("betas", "amsgrad")}
    with pytest.raises(
        jax_ucp.UCPError, match=rf"param_groups\[0\] holds the keys of torch's {looks_like}"
    ):
        identify([group], {}, "ckpt")


def test_adam_and_adamw_are_told_apart_only_by_what_was_written():
    dec = {**ADAM_KEYS, "weight_decay": 0.1}
    assert identify([{**dec, "decoupled_weight_decay": True}], {}, "c")[0] == "adamw"
    assert identify([{**dec, "decoupled_weight_decay": False}], {}, "c")[0] == "adam"
    # an older torch writes the same keys for both: a record decides, or the caller, or refused
    assert identify([dec], {"optim": "adamw_torch"}, "c")[0] == "adamw"
    assert identify([dec], {}, "c", "adam")[0] == "adam"
    with pytest.raises(jax_ucp.UCPError, match=r"optimizer='adam' or optimizer='adamw'"):
        identify([dec], {}, "c")
    assert identify([{**ADAM_KEYS, "weight_decay": 0.0}], {}, "c")[0] == "adamw"  # same update
    with pytest.raises(jax_ucp.UCPError, match=r"optimizer='adam', but .* says 'adamw'"):
        identify([{**dec, "decoupled_weight_decay": True}], {}, "c", "adam")
    with pytest.raises(jax_ucp.UCPError, match=r"the Trainer ran optim='adafactor'"):
        identify([dec], {"optim": "adafactor"}, "c")


@pytest.mark.parametrize("flag", ["amsgrad", "maximize"])
def test_an_adam_variant_optax_does_not_step_is_refused_naming_its_flag(flag):
    """AMSGrad and maximize are torch's Adam keys: identified as Adam, then refused by name."""
    groups = [dict(ADAM_KEYS), {**ADAM_KEYS, flag: True, "decoupled_weight_decay": True}]
    with pytest.raises(jax_ucp.UCPError, match=rf"param_groups\[1\]: torch {flag}=True is not"):
        identify(groups, {}, "ckpt")


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("betas", [0.9, 0.99, 0.5], r"param_groups\[1\]\.betas = \[0\.9, 0\.99, 0\.5\]"),
        ("betas", None, r"param_groups\[1\]\.betas = None"),
        ("eps", None, r"param_groups\[1\]\.eps = None"),
        ("lr", "abc", r"param_groups\[1\]\.lr = 'abc'"),
        ("lr", float("nan"), r"param_groups\[1\]\.lr = nan"),
        ("betas", [1.5, 0.99], r"param_groups\[1\]\.betas\[0\] = 1\.5"),
        ("weight_decay", -0.1, r"param_groups\[1\]\.weight_decay = -0\.1"),
    ],
)
def test_a_damaged_hyper_parameter_is_refused_naming_group_and_field(field, value, says):
    groups = [dict(ADAM_KEYS), {**ADAM_KEYS, field: value}]
    with pytest.raises(jax_ucp.UCPError, match=rf"^ckpt/optimizer\.pt: {says}"):
        check_groups(groups, "ckpt/optimizer.pt")


def test_optax_from_torch_lists_what_it_could_not_recover(tmp_path):
    """A plain torch run (no Trainer record): no schedule and no clipping are known; the
    translation goes on, listing both on the result and in a warning at the caller's line."""
    src = os.path.join(REPO, "tests", "fixtures", "torch", "accelerate_fsdp")
    ckpt = jax_ucp.convert(src, tmp_path / "ucp")
    with pytest.warns(UserWarning, match=r"gradient clipping") as said:
        run = jax_ucp.optax_from_torch(ckpt)
    assert {w.filename for w in said} == {__file__}  # the warning points at the user's call
    assert any("schedule" in u for u in run.unrecovered)
    assert any("clipping" in u for u in run.unrecovered)
    assert any(n.startswith("not recovered: gradient clipping") for n in run.notes)


@pytest.mark.torch
def test_cosine_schedule_arguments_match_transformers_get_scheduler():
    """Every recorded scheduler argument is used: cosine with num_cycles=2 equals transformers'
    own get_scheduler at several future steps."""
    import torch
    from transformers import get_scheduler

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    sched = get_scheduler(
        "cosine", opt, num_warmup_steps=5, num_training_steps=50,
        scheduler_specific_kwargs={"num_cycles": 2},
    )  # fmt: skip
    want = []
    for _ in range(50):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    ours = hf_schedule("cosine", 0.01, 5, 50, num_cycles=2)
    np.testing.assert_allclose([float(ours(s)) for s in range(50)], want, rtol=1e-5, atol=1e-9)


TRAINER_SCHEDULES = [
    ("linear", {}),
    ("constant", {}),
    ("constant_with_warmup", {}),
    ("cosine", {"num_cycles": 0.75}),
    ("cosine_with_restarts", {}),
    ("cosine_with_restarts", {"num_cycles": 3}),
    ("polynomial", {}),
    ("polynomial", {"power": 2.0, "lr_end": 1e-4}),
    ("inverse_sqrt", {}),
    ("inverse_sqrt", {"timescale": 12}),
    ("warmup_stable_decay", {"num_decay_steps": 20}),
    ("warmup_stable_decay", {"num_decay_steps": 15, "num_stable_steps": 10, "min_lr_ratio": 0.1,
                             "warmup_type": "cosine", "decay_type": "1-sqrt"}),
    ("warmup_stable_decay", {"num_decay_steps": 30, "warmup_type": "1-sqrt",
                             "decay_type": "linear", "num_cycles": 1.5}),
]  # fmt: skip


@pytest.mark.torch
@pytest.mark.parametrize("kind, kwargs", TRAINER_SCHEDULES)
def test_every_trainer_schedule_equals_transformers_get_scheduler_at_every_step(kind, kwargs):
    """Each reproduced schedule, with the lr_scheduler_kwargs the Trainer passes through, gives
    the learning rate transformers' own scheduler sets at every step of a 60-step run (and past
    its end)."""
    import torch
    from transformers import get_scheduler

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    sched = get_scheduler(
        kind, opt, num_warmup_steps=6, num_training_steps=60,
        scheduler_specific_kwargs=dict(kwargs) or None,
    )  # fmt: skip
    want = []
    for _ in range(66):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    args = {"lr_scheduler_kwargs": kwargs, "learning_rate": 0.01}
    ours = hf_schedule(kind, 0.01, 6, 60, **schedule_kwargs(args, kind, "c"))
    np.testing.assert_allclose([float(ours(s)) for s in range(66)], want, rtol=2e-6, atol=1e-9)


@pytest.mark.parametrize(
    "kind, kwargs, says",
    [
        ("warmup_stable_decay", {}, r"needs lr_scheduler_kwargs \['num_decay_steps'\]"),
        (
            "warmup_stable_decay",
            {"num_decay_steps": 5, "decay_type": "exp"},
            r"'decay_type'\] = 'exp'",
        ),
        ("warmup_stable_decay", {"num_decay_steps": 2.5}, r"'num_decay_steps'\] = 2\.5"),
        (
            "warmup_stable_decay",
            {"num_decay_steps": 5, "min_lr_ratio": 1.5},
            r"'min_lr_ratio'\] = 1\.5",
        ),
        ("inverse_sqrt", {"timescale": 0}, r"'timescale'\] = 0"),
        ("polynomial", {"power": True}, r"'power'\] = True"),
        ("polynomial", {"power": float("nan")}, r"'power'\] = nan"),
        ("polynomial", {"lr_end": 0.5}, r"'lr_end'\] = 0\.5 is not below the learning rate 0\.01"),
        ("cosine_with_restarts", {"num_cycles": "3"}, r"'num_cycles'\] = '3'"),
        ("inverse_sqrt", {"num_cycles": 2}, r"'num_cycles'=2, which is not reproduced"),
    ],
)
def test_a_schedule_argument_transformers_would_not_run_is_refused_naming_it(kind, kwargs, says):
    args = {"lr_scheduler_kwargs": kwargs, "learning_rate": 0.01}
    with pytest.raises(jax_ucp.UCPError, match=rf"^ckpt: .*{says}"):
        schedule_kwargs(args, kind, "ckpt")


def test_the_new_schedules_keep_their_shape_without_torch():
    """Hand-computed points of transformers' formulas (no torch needed): the WSD floor after the
    decay, inverse_sqrt's 1/sqrt past warm-up, polynomial's lr_end past the end, the restarts'
    hard zero at the end."""
    wsd = hf_schedule("warmup_stable_decay", 1.0, 4, 40, num_decay_steps=10, min_lr_ratio=0.25)
    assert [float(wsd(s)) for s in (0, 2, 4, 29, 40, 99)] == pytest.approx(
        [0.25, 0.625, 1.0, 1.0, 0.25, 0.25]
    )
    inv = hf_schedule("inverse_sqrt", 2.0, 4, 0)
    assert float(inv(16)) == pytest.approx(2.0 / 2.0)  # timescale = warm-up: 1/sqrt(16/4)
    poly = hf_schedule("polynomial", 1.0, 0, 10, lr_end=0.1, power=2.0)
    assert [float(poly(s)) for s in (0, 5, 10, 11)] == pytest.approx([1.0, 0.325, 0.1, 0.1])
    restarts = hf_schedule("cosine_with_restarts", 1.0, 0, 10, num_cycles=2)
    assert [float(restarts(s)) for s in (0, 5, 10)] == pytest.approx([1.0, 1.0, 0.0], abs=1e-6)


def _torch_run(tmp_path, make_opt, drop_key=None):
    """Three torch steps of a small model, saved as torch.save({"model", "optimizer"}); the
    fourth step's gradients and torch's parameters after it."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    named = list(model.named_parameters())
    opt = make_opt([p for _, p in named])
    x = torch.randn(5, 8)

    def grads_of():
        opt.zero_grad()
        model(x).pow(2).mean().backward()

    for _ in range(3):
        grads_of()
        opt.step()
    state = opt.state_dict()
    if drop_key:
        for g in state["param_groups"]:
            g.pop(drop_key, None)
    torch.save({"model": model.state_dict(), "optimizer": state}, tmp_path / "run.pt")
    grads_of()
    grads = {n: p.grad.numpy().copy() for n, p in named}
    opt.step()
    return (
        jax_ucp.convert(str(tmp_path / "run.pt"), tmp_path / "ucp"),
        grads,
        {n: p.detach().numpy().copy() for n, p in named},
    )


def _one_step(run, grads):
    params = jax.tree.map(jnp.asarray, run.params)
    updates, _ = run.tx.update(jax.tree.map(jnp.asarray, grads), run.opt_state, params)
    return optax.apply_updates(params, updates)


@pytest.mark.torch
def test_radam_is_refused_not_continued_as_adam(tmp_path):
    import torch

    ckpt, _, _ = _torch_run(tmp_path, lambda p: torch.optim.RAdam(p, lr=1e-2))
    with pytest.raises(jax_ucp.UCPError, match=r"keys of torch's RAdam"):
        jax_ucp.optax_from_torch(ckpt)


@pytest.mark.torch
def test_adam_l2_decay_without_the_key_is_refused_then_translated_exactly(tmp_path):
    """torch.optim.Adam(weight_decay=0.1) saved without decoupled_weight_decay (older torch
    layouts): refused naming both readings; with optimizer='adam' the optax step equals torch's
    (L2 added to the gradient before the moments) within 1e-6."""
    import torch

    ckpt, grads, want = _torch_run(
        tmp_path,
        lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1),
        drop_key="decoupled_weight_decay",
    )
    with pytest.raises(jax_ucp.UCPError, match=r"optimizer='adam' or optimizer='adamw'"):
        jax_ucp.optax_from_torch(ckpt)
    with pytest.warns(UserWarning, match="not record"):
        run = jax_ucp.optax_from_torch(ckpt, optimizer="adam")
    assert run.optimizer == "adam"
    got = _one_step(run, grads)
    for name, value in want.items():
        np.testing.assert_allclose(np.asarray(got[name]), value, rtol=0, atol=1e-6, err_msg=name)


def test_every_recorded_scheduler_argument_is_used_or_refused():
    from jax_ucp._src.optax_torch import schedule_kwargs

    assert schedule_kwargs({"lr_scheduler_kwargs": {"num_cycles": 2}}, "cosine", "c") == {
        "num_cycles": 2.0
    }
    assert schedule_kwargs({"lr_scheduler_kwargs": {}}, "linear", "c") == {}
    with pytest.raises(jax_ucp.UCPError, match=r"lr_scheduler_kwargs 'power'=2"):
        schedule_kwargs({"lr_scheduler_kwargs": {"power": 2}}, "linear", "c")
    with pytest.raises(jax_ucp.UCPError, match=r"'min_lr'"):
        schedule_kwargs({"lr_scheduler_kwargs": {"num_cycles": 1, "min_lr": 0.1}}, "cosine", "c")


def test_a_spec_by_name_takes_the_recorded_config_settings(tmp_path, monkeypatch):
    """``optax_from_torch(ckpt, spec="hf_llama")``: the head settings come from the config.json
    the import recorded, as ``load_spec("hf_llama", **LMConfig...head_settings)`` by hand."""
    monkeypatch.setitem(sys.modules, "transformers", None)
    src = os.path.join(FIX, "trainer_fp32", "checkpoint-3")
    with np.load(os.path.join(FIX, "trainer_fp32.truth.npz")) as z:
        names = [k.split("/", 1)[1] for k in z.files if k.startswith("param/")]
    norms = [n for n in names if n.endswith("norm.weight")]
    order = [n for n in names if n not in norms] + norms  # the Trainer's: decayed, then norms
    ckpt = jax_ucp.convert(src, tmp_path / "ucp", importing=TorchOptions(parameter_order=order))
    with open(os.path.join(src, "config.json")) as f:
        cfg = LMConfig.from_hf_llama(json.load(f))
    by_hand = jax_ucp.optax_from_torch(ckpt, spec=load_spec("hf_llama", **cfg.head_settings))
    by_name = jax_ucp.optax_from_torch(ckpt, spec="hf_llama")
    assert jax.tree.structure(by_name.params) == jax.tree.structure(by_hand.params)
    for a, b in zip(jax.tree.leaves(by_name.params), jax.tree.leaves(by_hand.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any("recorded config.json" in n for n in by_name.notes)


@pytest.mark.slow  # ~6 s; test_optax_torch_direct continues a run on a mesh in the default run
def test_a_trainer_run_continues_on_a_mesh_sharded_by_rules(tmp_path, monkeypatch):
    """``optax_from_torch(ckpt, spec=, options=RestoreOptions(mesh=, rules=))`` on 8 devices
    (data=2 x model=4): params and Adam's moments come back as jax.Arrays placed alike by the
    rules (sharded, not whole on one device), and a jitted step consuming them as they are
    gives torch's recorded losses of steps 4 and 5."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    monkeypatch.setitem(sys.modules, "transformers", None)
    kind = "trainer_fp32"
    src = os.path.join(FIX, kind, "checkpoint-3")
    with np.load(os.path.join(FIX, f"{kind}.truth.npz")) as z:
        names = [k.split("/", 1)[1] for k in z.files if k.startswith("param/")]
        tokens, want = z["next_tokens"], z["next_losses"]
    norms = [n for n in names if n.endswith("norm.weight")]
    ckpt = jax_ucp.convert(
        src,
        tmp_path / "ucp",
        importing=TorchOptions(
            parameter_order=[*sorted(set(names) - set(norms), key=names.index), *norms]
        ),
    )
    with open(os.path.join(src, "config.json")) as f:
        cfg = LMConfig.from_hf_llama(json.load(f))
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    rules = [("embed", "data"), ("heads", "model"), ("mlp", "model"), ("vocab", "model")]
    run = jax_ucp.optax_from_torch(
        ckpt, spec="hf_llama", options=jax_ucp.RestoreOptions(mesh=mesh, rules=rules)
    )
    adam = next(s for s in run.opt_state if isinstance(s, optax.ScaleByAdamState))
    params = jax.tree.leaves(run.params)
    sharded = 0
    for p, mu, nu in zip(params, jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu)):
        assert isinstance(p, jax.Array) and isinstance(mu, jax.Array) and isinstance(nu, jax.Array)
        assert isinstance(p.sharding, NamedSharding) and p.sharding.mesh.shape == mesh.shape
        assert mu.sharding == p.sharding and nu.sharding == p.sharding
        if p.sharding.spec != P() and not p.sharding.is_fully_replicated:
            sharded += 1
            assert p.addressable_shards[0].data.size < p.size  # a slice per device, not whole
    assert sharded >= len(params) // 2, sharded
    unsharded = jax_ucp.optax_from_torch(ckpt, spec="hf_llama")
    for a, b in zip(params, jax.tree.leaves(unsharded.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    losses, opt_state = _steps(run, cfg, tokens)
    np.testing.assert_allclose(losses, want, rtol=0, atol=1e-5)
    mu_after = next(s for s in opt_state if isinstance(s, optax.ScaleByAdamState)).mu
    assert jax.tree.leaves(mu_after)[0].sharding == params[0].sharding  # stays where it was


def test_optax_from_torch_options_refuse_a_second_spec(tmp_path):
    src = os.path.join(REPO, "tests", "fixtures", "torch", "accelerate_fsdp")
    ckpt = jax_ucp.convert(src, tmp_path / "ucp")
    with pytest.raises(jax_ucp.RequestError, match=r"optax_from_torch\(spec=\)"):
        jax_ucp.optax_from_torch(ckpt, options=jax_ucp.RestoreOptions(spec="hf_llama"))


def _trainer_at_global_step(tmp_path, kind: str, global_step: int) -> str:
    """A copy of a Trainer fixture whose trainer_state.json says ``global_step``."""
    src = str(shutil.copytree(os.path.join(FIX, kind, "checkpoint-3"), tmp_path / kind))
    path = os.path.join(src, "trainer_state.json")
    with open(path) as f:
        state = json.load(f)
    state["global_step"] = global_step
    with open(path, "w") as f:
        json.dump(state, f)
    return src


def test_a_trainer_global_step_other_than_the_optimizers_is_said(tmp_path, monkeypatch):
    """trainer_state.json at global_step 5, optimizer.pt at step 3: the continuation takes the
    optimizer's step (Adam's bias correction runs on it) and says so, naming both (it was
    continued at 3 with no note)."""
    monkeypatch.setitem(sys.modules, "transformers", None)
    src = _trainer_at_global_step(tmp_path, "trainer_fp32", 5)
    with np.load(os.path.join(FIX, "trainer_fp32.truth.npz")) as z:
        names = [k.split("/", 1)[1] for k in z.files if k.startswith("param/")]
    norms = [n for n in names if n.endswith("norm.weight")]
    ckpt = jax_ucp.convert(
        src,
        tmp_path / "ucp",
        importing=TorchOptions(parameter_order=[n for n in names if n not in norms] + norms),
    )
    said = r"trainer_state\.json's global_step is 5, the optimizer's step \(optimizer\.pt\) 3"
    with pytest.warns(UserWarning, match=said):
        run = jax_ucp.optax_from_torch(ckpt)
    assert run.step == 3 and any("global_step is 5" in n for n in run.notes)
