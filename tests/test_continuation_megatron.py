"""A Megatron run continued in optax: ``continuation.megatron.megatron_recipe`` reads what the
import records (``source.megatron_optimizer``) into a Recipe. The schedules are compared with
megatron-core's own ``OptimizerParamScheduler`` (torch-marked); the default set reads the recipe
of a megatron-core torch_dist save whose common state holds that scheduler's state and checks
every refusal."""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.continuation.megatron import MegatronSchedule, megatron_recipe
from jax_ucp._src.errors import RequestError, SourceError
from jax_ucp._src.importers.megatron import MegatronOptions, dcp, legacy, plan_megatron
from jax_ucp._src.store.storage import LocalDirectory
from jax_ucp.conversion import ImportOptions
from tests.megatron_testing import (
    DISTOPT,
    RANK_OBJECT,
    SAVED_LR,
    SAVED_WD,
    scheduled_distopt,
)
from tests.torch_edit import edit_dcp_object

FIX = Path(__file__).parent / "fixtures" / "megatron"
SCHEDULED = "gpt_distopt_dp2_scheduler_synthetic"


@pytest.fixture(scope="module")
def scheduled_run(tmp_path_factory) -> tuple[dict, dict, Path]:
    """(source, saved, converted) of gpt_distopt_dp2 with the scheduler fixture's common.pt."""
    root = tmp_path_factory.mktemp("megatron_recipe")
    src = root / "src"
    src.mkdir()
    for f in (FIX / "gpt_distopt_dp2").iterdir():
        if f.name != "common.pt":
            shutil.copyfile(f, src / f.name)
    shutil.copyfile(FIX / f"{SCHEDULED}.common.pt", src / "common.pt")
    jax_ucp.convert(src, root / "out")
    manifest = jax_ucp.inspect(root / "out")
    saved = {e.key: (tuple(e.shape), e.dtype) for e in manifest.tensors}
    return dict(manifest.source or {}), saved, root / "out"


@pytest.fixture(scope="module")
def scheduled(scheduled_run) -> tuple[dict, dict]:
    return scheduled_run[0], scheduled_run[1]


def test_recipe_from_the_scheduled_fixture(scheduled_run):
    source, saved, converted = scheduled_run
    record = source["megatron_optimizer"]
    assert record["file"] == "common.pt"
    assert record["opt_param_scheduler"]["num_steps"] == 8
    assert record["args"]["global_batch_size"] == 4
    recipe = megatron_recipe(source, saved, "ckpt")
    assert recipe is not None
    assert (recipe.optimizer, recipe.betas, recipe.eps, recipe.clip) == (
        "adamw",
        (0.9, 0.95),
        1e-8,
        1.0,
    )
    assert recipe.unrecovered == ()
    assert recipe.bias_correction
    # megatron-core's standard rule: no decay for biases and 1-D (per layer) parameters
    assert {n for n, d in recipe.decayed.items() if d} == {
        "embedding.word_embeddings.weight",
        "embedding.position_embeddings.weight",
        "decoder.layers.self_attention.linear_qkv.weight",
        "decoder.layers.self_attention.linear_proj.weight",
        "decoder.layers.mlp.linear_fc1.weight",
        "decoder.layers.mlp.linear_fc2.weight",
        "output_layer.weight",
    }
    assert set(recipe.decayed) == {k[1] for k in saved if k[0] == "params"}
    # the saved Adam step (2) is 8 samples; the rates there are those Megatron set on the groups
    lr, wd = recipe.learning_rate(2), recipe.weight_decay
    assert callable(wd)
    np.testing.assert_allclose(float(lr), SAVED_LR, rtol=1e-6)
    np.testing.assert_allclose(float(wd(2)), SAVED_WD, rtol=1e-6)
    assert float(recipe.learning_rate(0)) == 0.0  # lr_warmup_init
    np.testing.assert_allclose(float(recipe.learning_rate(1)), 0.01, rtol=1e-6)  # warm-up end
    np.testing.assert_allclose(float(recipe.learning_rate(100)), 0.001, rtol=1e-6)  # min_lr
    np.testing.assert_allclose(float(wd(100)), 0.1, rtol=1e-6)  # end_wd
    assert any("c x 4 samples" in n for n in recipe.notes)
    # the restored opt_state/count must be the step the scheduler's position maps to
    count = int(jax_ucp.restore(converted)["opt_state"]["count"])
    assert count == 2 and recipe.at_step is not None and recipe.at_step(count) == []
    with pytest.raises(SourceError, match=r"restored step is 3, but .* 8 samples = step 2 x"):
        recipe.at_step(3)


def test_recipe_of_a_megatron_bridge_save(tmp_path):
    """Bridge's own save: the scheduler state from its common state, the optimizer, batch and
    schedule arguments from its run_config.yaml."""
    jax_ucp.convert(FIX.parent / "megatron_bridge" / "llama_tp1dp2", tmp_path / "out")
    manifest = jax_ucp.inspect(tmp_path / "out")
    source = dict(manifest.source or {})
    record = source["megatron_optimizer"]
    assert record["args_file"] == "run_config.yaml" and record["args"]["global_batch_size"] == 4
    saved = {e.key: (tuple(e.shape), e.dtype) for e in manifest.tensors}
    recipe = megatron_recipe(source, saved, "ckpt")
    assert recipe is not None
    assert (recipe.optimizer, recipe.betas, recipe.eps, recipe.clip) == (
        "adamw",
        (0.9, 0.95),
        1e-8,
        None,  # clip_grad 0.0: Megatron does not clip
    )
    assert recipe.weight_decay == 0.0 and recipe.unrecovered == ()
    np.testing.assert_allclose(float(recipe.learning_rate(2)), 0.01, rtol=1e-7)
    assert recipe.decayed["decoder.final_layernorm.weight"] is False
    assert recipe.decayed["output_layer.weight"] is True


def test_optimizer_record_keeps_only_what_the_files_hold():
    """The importers' record: the optimizer arguments among the saved args, the scheduler state,
    every ChainedOptimizer member's group hyper-parameters (never their parameter lists), JSON
    values only and bounded (a pickle cannot grow it)."""
    from types import SimpleNamespace

    from jax_ucp._src.importers.megatron.run_record import optimizer_record

    args = SimpleNamespace(
        lr=np.float32(0.5),
        hidden_size=32,  # a model setting: not the optimizer's
        rampup_batch_size=["16", "16", "1000"],
        lr_decay_style="x" * 1000,
        adam_beta1=[[0.9]],
        clip_grad=object(),
        min_lr=float("inf"),
    )
    group = {"params": [0, 1], "betas": (0.9, 0.95), "step": np.int64(3), "lr": 0.5}
    state = {
        "args": args,
        "opt_param_scheduler": {"num_steps": 24, "max_lr": 0.5},
        "optimizer": {0: {"optimizer": {"param_groups": [group]}}, 1: {"optimizer": {}}},
        "iteration": 3,
    }
    record = optimizer_record(state, "common.pt")
    assert record == {
        "file": "common.pt",
        "args": {
            "lr": 0.5,
            "rampup_batch_size": ["16", "16", "1000"],
            "lr_decay_style": "<str of 1000 characters>",
            "adam_beta1": ["<list>"],
            "clip_grad": "<object>",
            "min_lr": "inf",
        },
        "opt_param_scheduler": {"num_steps": 24, "max_lr": 0.5},
        "param_groups": [{"betas": [0.9, 0.95], "step": 3, "lr": 0.5}],
        "iteration": 3,
    }
    assert optimizer_record({"model": {}}, "common.pt") is None
    many = {"opt_param_scheduler": dict.fromkeys(range(1000), 0.0)}
    assert optimizer_record(many, "common.pt") == {
        "file": "common.pt",
        "opt_param_scheduler": "<dict of 1000 keys>",
    }
    chained = {"optimizer": {i: {"optimizer": {"param_groups": [{"lr": i}]}} for i in range(12)}}
    record = optimizer_record(chained, "common.pt")
    assert record is not None and [g["lr"] for g in record["param_groups"]] == list(range(12))


def test_the_record_not_the_framework_chooses_the_reader(scheduled):
    """The recipe is read because the import recorded Megatron's scheduler, whatever
    ``source.framework`` says (verl's Megatron backend, Bridge, a later importer); a source that
    also records a torch optimizer (``source.optimizer``: torch's, DeepSpeed's), which no Megatron
    import writes, is refused rather than read by either; no record: None."""
    source, saved = scheduled
    recipe = megatron_recipe(source, saved, "ckpt")
    other = megatron_recipe({**source, "framework": "torch_dcp"}, saved, "ckpt")
    assert recipe is not None and other is not None
    counts = np.arange(0, 40)
    assert (other.how, other.decayed, other.notes) == (recipe.how, recipe.decayed, recipe.notes)
    np.testing.assert_array_equal(other.learning_rate(counts), recipe.learning_rate(counts))
    torch_record = {"param_groups": [{"lr": 0.1, "betas": [0.9, 0.999]}]}
    with pytest.raises(SourceError, match=r"both megatron_optimizer .* and optimizer"):
        megatron_recipe({**source, "optimizer": torch_record}, saved, "ckpt")
    bare = {k: v for k, v in source.items() if k != "megatron_optimizer"}
    assert megatron_recipe(bare, saved, "ckpt") is None


def test_a_megatron_core_run_continues_with_the_schedule_given():
    """megatron-core's own save without Megatron-LM's common state (no args, no scheduler): Adam
    from its param groups, the rate they hold; schedule= / clip= fill what is not recorded (as
    for FSDP2), a schedule contradicting the held rate refused."""
    src = FIX / "gpt_distopt_dp2"
    record = plan_megatron(LocalDirectory(str(src)), MegatronOptions()).source["megatron_optimizer"]
    assert "opt_param_scheduler" not in record and "args" not in record
    group = record["param_groups"][0]
    bare = jax_ucp.optax_from_torch(str(src))
    assert any("schedule=" in u for u in bare.unrecovered)
    assert any("clip=" in u for u in bare.unrecovered)
    run = jax_ucp.optax_from_torch(str(src), schedule=group["lr"], clip=1.0)
    assert run.unrecovered == [] and run.step == int(group["step"])
    assert run.optimizer == ("adamw" if group["decoupled_weight_decay"] else "adam")
    assert any("clip=), to global norm 1.0" in n for n in run.notes)
    with pytest.raises(RequestError, match=r"schedule=\) gives lr .* the optimizer holds"):
        jax_ucp.optax_from_torch(str(src), schedule=2 * group["lr"], clip=1.0)


def test_incomplete_scheduler_record_refused():
    """The legacy fixture's synthetic {'num_steps': 2}: refused naming the first missing field."""
    source = plan_megatron(
        LocalDirectory(str(FIX / "legacy_gpt_distopt_pp2dp2_synthetic")), MegatronOptions()
    ).source
    record = source["megatron_optimizer"]
    assert record["file"].endswith("mp_rank_00_000/model_optim_rng.pt")
    assert record["opt_param_scheduler"] == {"num_steps": 2}
    saved = {"params/w": ((2, 2), np.float32), "opt_state/mu/w": ((2, 2), np.float32)}
    with pytest.raises(
        SourceError, match=r"model_optim_rng\.pt\): opt_param_scheduler\.max_lr = '<missing>'"
    ):
        megatron_recipe(source, saved, "ckpt")


def _edit(source: dict, section: str, **values) -> dict:
    out = copy.deepcopy(source)
    record = out["megatron_optimizer"]
    if section == "param_groups":
        for group in record["param_groups"]:
            group.update(values)
    elif section:
        record[section].update(values)
    else:
        record.update(values)
    return out


REFUSED = [
    ("args", {"optimizer": "sgd"}, RequestError, r"args\.optimizer = 'sgd'.*SGD with momentum"),
    ("args", {"optimizer": "muon"}, RequestError, r"args\.optimizer = 'muon'"),
    ("args", {"rampup_batch_size": [1, 1, 10]}, RequestError, r"rampup_batch_size"),
    ("args", {"step_batch_size_schedule": "0:4 50:8"}, RequestError, r"step_batch_size_sch"),
    ("args", {"decoupled_lr": 0.1}, RequestError, r"args\.decoupled_lr = 0\.1"),
    ("args", {"global_batch_size": None}, SourceError, r"args\.global_batch_size = None"),
    ("args", {"global_batch_size": 0}, SourceError, r"args\.global_batch_size = 0: .*> 0"),
    ("args", {"global_batch_size": 2}, SourceError, r"multiple of micro_batch_size"),
    ("args", {"global_batch_size": 8}, SourceError, r"num_steps 8 is not the Adam step 2 x"),
    ("args", {"adam_beta1": 0.8}, SourceError, r"betas \(0\.9, 0\.95\) but args \(0\.8"),
    ("args", {"adam_eps": 1e-6}, SourceError, r"eps 1e-08 but args\.adam_eps 1e-06"),
    ("args", {"clip_grad": -1.0}, SourceError, r"args\.clip_grad = -1\.0: expected a number >= 0"),
    ("args", {"clip_grad": "1"}, SourceError, r"args\.clip_grad = '1'"),
    ("args", {"decoupled_weight_decay": False}, SourceError, r"decoupled_weight_decay True but"),
    ("args", {"decoupled_weight_decay": "yes"}, SourceError, r"expected true or false"),
    ("args", {"iteration": 3}, SourceError, r"iterations disagree: .*'args\.iteration': 3"),
    ("", {"iteration": 3}, SourceError, r"iterations disagree"),
    ("opt_param_scheduler", {"max_lr": -1.0}, SourceError, r"opt_param_scheduler\.max_lr = -1"),
    ("opt_param_scheduler", {"max_lr": float("nan")}, SourceError, r"max_lr = nan"),
    ("opt_param_scheduler", {"min_lr": 0.5}, SourceError, r"min_lr = 0\.5: .*<= 0\.01"),
    ("opt_param_scheduler", {"lr_decay_style": "step"}, SourceError, r"lr_decay_style = 'step'"),
    ("opt_param_scheduler", {"lr_decay_steps": 0}, SourceError, r"lr_decay_steps = 0"),
    ("opt_param_scheduler", {"lr_warmup_steps": 400}, SourceError, r"fewer than lr_decay_steps"),
    ("opt_param_scheduler", {"num_steps": 8.5}, SourceError, r"num_steps = 8\.5: .*integer"),
    ("opt_param_scheduler", {"num_steps": True}, SourceError, r"num_steps = True"),
    ("opt_param_scheduler", {"num_steps": 12}, SourceError, r"num_steps 12 is not the Adam"),
    ("opt_param_scheduler", {"end_wd": 0.001}, SourceError, r"end_wd = 0\.001: .*>= 0\.01"),
    ("opt_param_scheduler", {"wd_incr_style": "step"}, SourceError, r"wd_incr_style = 'step'"),
    ("opt_param_scheduler", {"wd_incr_style": "constant"}, SourceError, r"constant wd_incr"),
    ("opt_param_scheduler", {"wd_incr_steps": 0}, SourceError, r"wd_incr_steps = 0"),
    ("opt_param_scheduler", {"max_lr": 0.02}, SourceError, r"max_lr = 0\.02; args\.lr = 0\.01"),
    # the args that made the scheduler (issue 68: every record of a fact agrees)
    ("args", {"lr": 0.02}, SourceError, r"on max_lr: .*= 0\.01; args\.lr = 0\.02"),
    ("args", {"min_lr": 0.0}, SourceError, r"on min_lr: .*args\.min_lr = 0"),
    ("args", {"lr_decay_style": "linear"}, SourceError, r"args\.lr_decay_style = 'linear'"),
    ("args", {"lr_decay_iters": 50}, SourceError, r"args\.lr_decay_iters x .* = 200"),
    ("args", {"lr_warmup_iters": 3}, SourceError, r"lr_warmup_steps = 4; args\.lr_warmup_iter"),
    ("args", {"lr_warmup_fraction": 0.5}, SourceError, r"lr_warmup_fraction x .* = 200\.0"),
    ("args", {"end_weight_decay": 0.2}, SourceError, r"end_wd = 0\.1; args\.end_weight_decay"),
    ("args", {"weight_decay_incr_style": "cosine"}, SourceError, r"on wd_incr_style"),
    ("args", {"consumed_train_samples": 12}, SourceError, r"num_steps = 8; .*samples = 12"),
    ("opt_param_scheduler", {"end_iter": 5}, SourceError, r"\['end_iter'\]: an AnnealingLR"),
    ("opt_param_scheduler", {"lr_decay_style": "WSD"}, SourceError, r"lr_wsd_decay_iters"),
    ("opt_param_scheduler", {"tier_lr_multiplier": 2}, RequestError, r"\['tier_lr_multiplier'\]"),
    ("param_groups", {"lr": 0.01}, SourceError, r"param_groups\[0\]\.lr 0\.01 is not the sch"),
    ("param_groups", {"weight_decay": 0.5}, SourceError, r"param_groups\[0\]\.weight_decay 0\.5"),
    ("param_groups", {"lr_mult": 0.1}, RequestError, r"lr_mult 0\.1.*scale_lr_cond"),
    ("param_groups", {"wd_mult": 0.5}, SourceError, r"wd_mult 0\.5"),
    ("param_groups", {"is_decoupled_lr": True}, RequestError, r"is_decoupled_lr"),
    ("param_groups", {"step": 3.0}, SourceError, r"num_steps 8 is not the Adam step 3 x"),
    ("param_groups", {"betas": [0.9]}, SourceError, r"param_groups\[0\]\.betas = \[0\.9\]"),
    ("param_groups", {"start_wd": 0.02}, RequestError, r"override start_wd"),
    ("param_groups", {"lr_mult": "1"}, SourceError, r"param_groups\[0\]\.lr_mult = '1'"),
    ("args", {"no_weight_decay_cond_type": "qwen3_next"}, RequestError, r"no_weight_decay_cond"),
    ("", {"args": [1]}, SourceError, r"megatron_optimizer\.args is list, expected a mapping"),
    ("", {"param_groups": "x"}, SourceError, r"param_groups is not a list of mappings"),
]


@pytest.mark.parametrize(("section", "values", "error", "match"), REFUSED)
def test_damaged_or_untranslatable_record_refused(scheduled, section, values, error, match):
    source, saved = scheduled
    with pytest.raises(error, match=r"ckpt \(common\.pt\)|ckpt:") as raised:
        megatron_recipe(_edit(source, section, **values), saved, "ckpt")
    assert raised.match(match)


def test_wsd_from_the_scheduler_state_itself(scheduled):
    """A release whose state_dict holds WSD's anneal and the warm-up start: read from there."""
    source, saved = scheduled
    edited = _edit(
        source,
        "opt_param_scheduler",
        lr_decay_style="WSD",
        wsd_decay_steps=100,
        lr_wsd_decay_style="linear",
        init_lr=0.0,
    )
    edited = _edit(edited, "param_groups", lr=None)  # set by the cosine run: not this schedule
    edited = _edit(edited, "args", lr_decay_style="WSD", lr_wsd_decay_iters=25)  # as its args
    recipe = megatron_recipe(edited, saved, "ckpt")
    assert recipe is not None
    # 400 decay samples, the last 100 annealed linearly from max_lr 0.01 to min_lr 0.001
    np.testing.assert_allclose(float(recipe.learning_rate(75)), 0.01, rtol=1e-6)
    np.testing.assert_allclose(float(recipe.learning_rate(85)), 0.001 + 0.6 * 0.009, rtol=1e-6)
    np.testing.assert_allclose(float(recipe.learning_rate(101)), 0.001, rtol=1e-6)


def test_fp16_skipped_iterations_allowed(scheduled):
    """An fp16 run's skipped iterations stepped neither Adam nor the scheduler."""
    source, saved = scheduled
    edited = {**_edit(_edit(source, "", iteration=3), "args", iteration=3), "iteration": 3}
    with pytest.raises(SourceError, match=r"iteration 3 but .*only an fp16 run skips"):
        megatron_recipe(edited, saved, "ckpt")
    recipe = megatron_recipe(_edit(edited, "args", fp16=True), saved, "ckpt")
    assert recipe is not None and any("fp16" in n for n in recipe.notes)


def test_weights_only_import_refused(scheduled):
    source, saved = scheduled
    params = {k: v for k, v in saved.items() if k[0] == "params"}
    with pytest.raises(
        RequestError, match=r"no Adam moments \(opt_state/mu\): imported weights_only"
    ):
        megatron_recipe(source, params, "ckpt")


def test_warmup_start_unknown_while_warming_up(scheduled):
    source, saved = scheduled
    edited = _edit(source, "args", lr_warmup_init=None)
    recipe = megatron_recipe(edited, saved, "ckpt")  # warm-up over at 8 samples: unused
    assert recipe is not None and any("lr_warmup_init not recorded" in n for n in recipe.notes)
    warming = _edit(edited, "opt_param_scheduler", lr_warmup_steps=40)
    warming = _edit(warming, "args", lr_warmup_iters=10)  # 40 samples, as the scheduler says
    with pytest.raises(SourceError, match=r"lr_warmup_init is not recorded.*8 of 40"):
        megatron_recipe(warming, saved, "ckpt")


def test_a_scheduler_kept_from_the_checkpoint_is_not_compared_with_the_args(scheduled):
    """use_checkpoint_opt_param_scheduler: Megatron keeps the saved scheduler whatever its args
    say (no assert on load), so args that differ are said, not refused."""
    source, saved = scheduled
    edited = _edit(source, "args", lr=0.02, train_iters=300)
    with pytest.raises(SourceError, match=r"disagree on max_lr"):
        megatron_recipe(edited, saved, "ckpt")
    kept = _edit(edited, "args", use_checkpoint_opt_param_scheduler=True)
    recipe = megatron_recipe(kept, saved, "ckpt")
    assert recipe is not None and any(
        "use_checkpoint_opt_param_scheduler" in n for n in recipe.notes
    )
    np.testing.assert_allclose(float(recipe.learning_rate(2)), SAVED_LR, rtol=1e-6)


def test_clip_zero_is_no_clipping_and_unrecorded_clip_is_said(scheduled):
    source, saved = scheduled
    recipe = megatron_recipe(_edit(source, "args", clip_grad=0.0), saved, "ckpt")
    assert recipe is not None and recipe.clip is None and recipe.unrecovered == ()
    recipe = megatron_recipe(_edit(source, "args", clip_grad=None), saved, "ckpt")
    assert recipe is not None and recipe.clip is None
    assert any("clip_grad" in u for u in recipe.unrecovered)


def test_l2_adam_when_not_decoupled(scheduled):
    source, saved = scheduled
    edited = _edit(source, "param_groups", decoupled_weight_decay=False)
    edited = _edit(edited, "args", decoupled_weight_decay=False)
    recipe = megatron_recipe(edited, saved, "ckpt")
    assert recipe is not None and recipe.optimizer == "adam"


def test_qk_layernorm_decay_and_stacked_shapes(scheduled):
    source, _ = scheduled
    shapes = {
        "params/decoder.layers.self_attention.q_layernorm.weight": ((2, 8), np.float32),
        "params/decoder.layers.mlp.experts.experts.linear_fc1.weight": ((2, 4, 8, 8), np.float32),
        "params/decoder.layers.3.mlp.linear_fc1.weight": ((8, 8), np.float32),
        "params/decoder.layers.3.input_layernorm.weight": ((8,), np.float32),
        "opt_state/mu/x": ((1,), np.float32),
    }
    recipe = megatron_recipe(source, shapes, "ckpt")
    assert recipe is not None
    assert recipe.decayed == {
        "decoder.layers.self_attention.q_layernorm.weight": False,
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": True,
        "decoder.layers.3.mlp.linear_fc1.weight": True,
        "decoder.layers.3.input_layernorm.weight": False,
    }
    assert any("apply_wd_to_qk_layernorm" in u for u in recipe.unrecovered)
    qk = megatron_recipe(_edit(source, "args", apply_wd_to_qk_layernorm=True), shapes, "ckpt")
    assert qk is not None and qk.decayed["decoder.layers.self_attention.q_layernorm.weight"]
    bad = {**shapes, "params/decoder.layers.bias": ((2,), np.float32)}
    with pytest.raises(SourceError, match=r"params/decoder\.layers\.bias of shape \(2,\)"):
        megatron_recipe(source, bad, "ckpt")


def test_custom_no_weight_decay_rule_refused(scheduled):
    """Groups all decayed while the standard rule would exempt biases: the run had its own."""
    source, saved = scheduled
    edited = _edit(source, "param_groups", wd_mult=1.0, weight_decay=SAVED_WD)
    with pytest.raises(SourceError, match=r"no_weight_decay_cond"):
        megatron_recipe(edited, saved, "ckpt")


# ------------------------------------------------ dp_reshardable: the groups in every rank's object

DISTOPT_TP2 = FIX / "mcore_versions" / "0.19.2" / "llama_distopt_bf16_tp2_dp_reshardable"
RANK = RANK_OBJECT


def _rank_groups(change):
    """``change(group)`` on every param group of a rank object's tree (edit_dcp_object's)."""

    def edit(tree):
        for group in tree[0]["param_groups"]:
            change(group)

    return edit


def test_dp_reshardable_groups_are_read_from_every_rank_object(tmp_path):
    """megatron-core's dp_reshardable save keeps its param groups (lr, betas, eps, weight decay,
    wd_mult / lr_mult...) in each model-parallel rank's optimizer object, not in common.pt:
    they are recorded as megatron-core saved them (read through the DCP reader here) and
    continue a megatron-core run as the per-parameter layout's do; a rank whose groups state
    another betas, or another weight decay for the same wd_mult, is refused naming each rank's
    object and value (only the step was read from them, and compared)."""
    record = plan_megatron(LocalDirectory(str(DISTOPT)), MegatronOptions()).source[
        "megatron_optimizer"
    ]
    checkpoint = dcp.open_dcp(LocalDirectory(str(DISTOPT)))
    (name,) = [n for n in checkpoint.objects if n.startswith(RANK.format(0))]
    saved = checkpoint.read_object(name, legacy.LEGACY_CLASSES)[0]["param_groups"]
    assert record["groups_file"] == RANK.format(0)[:-1]
    plain = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in saved]
    assert record["param_groups"] == [{k: v for k, v in g.items() if k != "params"} for g in plain]
    run = jax_ucp.optax_from_torch(str(DISTOPT), schedule=saved[0]["lr"], clip=1.0)
    assert (run.step, run.optimizer) == (int(saved[0]["step"]), "adamw")
    assert run.notes[0].startswith("megatron-core AdamW") and RANK.format(0)[:-1] in run.notes[0]
    for field, change, match in [
        (
            "betas",
            lambda g: g.update(betas=(0.8, 0.95)),
            r"betas: .*_0\.optimizer .*\[0\.9, 0\.95\]",
        ),
        (
            "weight_decay",
            lambda g: g.update(weight_decay=g["wd_mult"] * 0.5),
            r"\[wd_mult 1\.0\]\.weight_decay = 0\.5",
        ),
        ("eps", lambda g: g.update(eps=1e-6), r"on param_groups\.eps: .*_1\.optimizer .*1e-06"),
    ]:
        src = tmp_path / field
        shutil.copytree(DISTOPT_TP2, src)
        edit_dcp_object(src, RANK.format(1), _rank_groups(change))
        with pytest.raises(SourceError, match=r"records of this save disagree") as raised:
            plan_megatron(LocalDirectory(str(src)), MegatronOptions())
        assert raised.match(match) and raised.match(RANK.format(0)[:-1])


def test_dp_reshardable_groups_are_compared_with_the_args_and_scheduler(tmp_path, scheduled):
    """The rank object's groups against common.pt's args and OptimizerParamScheduler: groups
    holding another lr than the schedule's at the saved samples are refused naming the object
    (continued at the scheduler's lr before, the optimizer's own never read); groups as the
    scheduler set them continue as the per-parameter fixture's common state does."""
    saved = scheduled[1]  # the same GPT's tensors

    def recipe(src: Path):
        return megatron_recipe(
            plan_megatron(LocalDirectory(str(src)), MegatronOptions()).source, saved, "ckpt"
        )

    src = scheduled_distopt(tmp_path / "run", consistent=False)
    with pytest.raises(
        SourceError, match=r"dp_group_idx_0\.optimizer\): param_groups\[0\]\.min_lr = None"
    ):
        recipe(src)

    src = scheduled_distopt(tmp_path / "consistent")
    run = recipe(src)
    assert run is not None and run.unrecovered == () and run.betas == (0.9, 0.95)
    np.testing.assert_allclose(float(run.learning_rate(2)), SAVED_LR, rtol=1e-6)
    for field, value, match in [
        ("lr", 0.01, r"param_groups\[0\]\.lr 0\.01 is not the schedule's"),
        ("betas", (0.8, 0.95), r"betas \(0\.8, 0\.95\) but args \(0\.9, 0\.95\)"),
        ("max_lr", 0.02, r"disagree on max_lr: .*param_groups\[0\]\.max_lr = 0\.02"),
        ("decoupled_weight_decay", False, r"decoupled_weight_decay False but args True"),
    ]:
        edited = tmp_path / field
        shutil.copytree(src, edited)
        edit_dcp_object(edited, RANK.format(0), _rank_groups(lambda g: g.update({field: value})))
        with pytest.raises(SourceError, match=r"ckpt \(common\.pt, optimizer\.distributed\.dp_gr"):
            try:
                recipe(edited)
            except SourceError as e:
                assert re.search(match, str(e)), str(e)
                raise


# ----------------------------------------------------------------------------- megatron-core


def _styles():
    lr = [(s, None) for s in ("constant", "linear", "cosine", "inverse-square-root")]
    lr += [("WSD", a) for a in ("linear", "cosine", "exponential", "minus_sqrt")]
    return [(s, a, wd) for s, a in lr for wd in ("constant", "linear", "cosine")]


class _Optimizer:
    """What OptimizerParamScheduler reads and sets: param groups (megatron-core 0.16's keys)."""

    def __init__(self, max_lr: float, min_lr: float):
        self.param_groups = [
            {"max_lr": max_lr, "min_lr": min_lr, "wd_mult": 1.0, "lr_mult": 1.0, "step": 0.0},
            {"max_lr": max_lr, "min_lr": min_lr, "wd_mult": 0.0, "lr_mult": 1.0, "step": 0.0},
        ]


def test_convert_warns_of_records_that_disagree_naming_both(tmp_path):
    """A dp_reshardable save whose common.pt args and rank object's groups disagree (betas) is
    imported as the files hold it, with a warning naming both records and that the continuation
    refuses it (probe 9: converted silently, refused first by optax_from_torch); the intact
    save converts without one."""
    src = scheduled_distopt(tmp_path / "run")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        jax_ucp.convert(src, tmp_path / "intact")
    assert not [w for w in said if "optax_from_torch" in str(w.message)]
    edit_dcp_object(src, RANK.format(0), _rank_groups(lambda g: g.update(betas=(0.8, 0.95))))
    with pytest.warns(UserWarning, match=r"betas \(0\.8, 0\.95\) but args \(0\.9, 0\.95\) \(im"):
        jax_ucp.convert(src, tmp_path / "edited")
    with pytest.raises(SourceError, match=r"betas \(0\.8, 0\.95\) but args"):
        jax_ucp.optax_from_torch(tmp_path / "edited")


@pytest.mark.torch
@pytest.mark.parametrize("warmup", [0, 42, 7.8])  # samples; 7.8: an lr_warmup_fraction's
@pytest.mark.parametrize(("style", "anneal", "wd_style"), _styles())
def test_schedules_equal_megatron_core(style, anneal, wd_style, warmup):
    """Over 150 iterations (past the decay's end), the recipe's lr and weight decay at optax's
    count equal what megatron-core's OptimizerParamScheduler sets on the param groups when
    Megatron-LM's train_step steps it by the global batch; the recipe is read at iteration 37
    from the scheduler's own state_dict and groups."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gbs, train_iters, saved_at = 6, 120, 37
    max_lr, min_lr, init_lr = 3e-3, 1e-4, 1e-5
    args = dict(
        optimizer="adam",
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_eps=1e-8,
        clip_grad=1.0,
        lr=max_lr,
        min_lr=min_lr,
        lr_warmup_init=init_lr,
        train_iters=train_iters,
        lr_wsd_decay_iters=40,
        lr_wsd_decay_style=anneal,
        global_batch_size=gbs,
        micro_batch_size=3,
        data_parallel_size=2,
        rampup_batch_size=None,
        decoupled_lr=None,
    )
    start_wd, end_wd = (0.05, 0.05) if wd_style == "constant" else (0.01, 0.1)
    optimizer = _Optimizer(max_lr, min_lr)
    scheduler = OptimizerParamScheduler(
        optimizer,  # type: ignore[arg-type]
        init_lr=init_lr,
        max_lr=max_lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=100 * gbs,  # lr_decay_iters 100 < train_iters: min_lr after it
        lr_decay_style=style,
        start_wd=start_wd,
        end_wd=end_wd,
        wd_incr_steps=train_iters * gbs,
        wd_incr_style=wd_style,
        wsd_decay_steps=40 * gbs if style == "WSD" else None,
        lr_wsd_decay_style=anneal,
    )
    lrs, wds, record = [], [], None
    for iteration in range(150):
        lrs.append(optimizer.param_groups[0]["lr"])
        wds.append(optimizer.param_groups[0]["weight_decay"])
        assert optimizer.param_groups[1]["weight_decay"] == 0.0
        if iteration == saved_at:
            groups = [
                {k: v for k, v in g.items()} | {"step": float(saved_at), "betas": [0.9, 0.999]}
                for g in optimizer.param_groups
            ]
            record = {
                "file": "common.pt",
                "args": {**args, "iteration": saved_at},
                "opt_param_scheduler": scheduler.state_dict(),
                "param_groups": groups,
            }
        for group in optimizer.param_groups:
            group["step"] += 1.0  # Adam's step, then the scheduler (train_step's order)
        scheduler.step(increment=gbs)
    source = {"framework": "megatron", "iteration": saved_at, "megatron_optimizer": record}
    saved = {
        "params/decoder.layers.mlp.linear_fc1.weight": ((2, 8, 4), np.float32),
        "params/decoder.layers.mlp.linear_fc1.bias": ((2, 8), np.float32),
        "opt_state/mu/decoder.layers.mlp.linear_fc1.weight": ((2, 8, 4), np.float32),
    }
    recipe = megatron_recipe(json.loads(json.dumps(source)), saved, "ckpt")
    assert recipe is not None
    assert recipe.decayed == {
        "decoder.layers.mlp.linear_fc1.weight": True,
        "decoder.layers.mlp.linear_fc1.bias": False,
    }
    counts = np.arange(150)
    np.testing.assert_allclose(np.asarray(recipe.learning_rate(counts)), lrs, rtol=2e-6)
    wd = recipe.weight_decay
    got_wd = np.asarray(wd(counts)) if callable(wd) else np.full(150, wd)
    np.testing.assert_allclose(got_wd, wds, rtol=2e-6)
    # the float64 schedule is megatron-core's to the last bits
    schedule = MegatronSchedule(
        init_lr=init_lr,
        max_lr=max_lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=100 * gbs,
        lr_decay_style=style,
        start_wd=start_wd,
        end_wd=end_wd,
        wd_incr_steps=train_iters * gbs,
        wd_incr_style=wd_style,
        wsd_decay_steps=40 * gbs if style == "WSD" else None,
        lr_wsd_decay_style=anneal,
    )
    for i in range(150):
        assert math.isclose(float(schedule.lr(i * gbs)), lrs[i], rel_tol=1e-12, abs_tol=1e-18)
        assert math.isclose(float(schedule.wd(i * gbs)), wds[i], rel_tol=1e-12, abs_tol=1e-18)


def _standard_overrides(config):
    """What ``get_megatron_optimizer`` hands ``_get_param_groups`` when the run gave no
    overrides: megatron-core >= 0.19 passes its standard no-weight-decay rule in
    (``get_standard_config_overrides``); earlier releases apply it for ``None``."""
    try:
        from megatron.core.optimizer import get_standard_config_overrides
    except ImportError:
        return None
    return get_standard_config_overrides(config)


#: Megatron-LM run arguments as given at start (the decay length unset: taken from the run's)
LM_RUNS = {
    "iters": dict(train_iters=100, lr_warmup_iters=1),
    "iters-fraction": dict(train_iters=100, lr_warmup_fraction=0.05),
    "samples": dict(train_samples=400, lr_warmup_samples=4),
    "iters-wsd": dict(train_iters=100, lr_warmup_iters=1, lr_decay_style="WSD",
                      lr_wsd_decay_iters=25),
}  # fmt: skip


@pytest.mark.torch
@pytest.mark.parametrize("run", sorted(LM_RUNS))
def test_decay_and_warmup_from_the_run_length_as_megatron_lm(scheduled, run):
    """Megatron-LM's ``get_optimizer_param_scheduler`` (megatron.training, where installed: the
    CI's high end) takes the decay from ``train_iters`` (x global_batch_size) or
    ``train_samples`` when ``lr_decay_iters`` / ``_samples`` is unset, the warm-up from a
    fraction of it, and writes the length back into the args it saves (a sample-based run's
    ``train_iters`` derived too): the recipe from those args and its scheduler state agrees
    with every field and continues at the rate that scheduler sets."""
    training = pytest.importorskip("megatron.training.training")
    global_vars = pytest.importorskip("megatron.training.global_vars")
    source, saved = scheduled
    given = dict(
        lr_decay_iters=None, lr_decay_samples=None, lr_wsd_decay_iters=None,
        lr_wsd_decay_samples=None, lr_warmup_fraction=None, lr_warmup_iters=0,
        lr_warmup_samples=0, train_iters=None, train_samples=None, lr_warmup_init=0.0, lr=0.01,
        min_lr=0.001, lr_decay_style="cosine", start_weight_decay=0.01, end_weight_decay=0.1,
        weight_decay_incr_style="linear", use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=False, lr_wsd_decay_style="linear", global_batch_size=4,
        rampup_batch_size=None, micro_batch_size=2, data_parallel_size=2,
        step_batch_size_schedule=None,
    )  # fmt: skip
    args = argparse.Namespace(**{**given, **LM_RUNS[run]})
    global_vars._GLOBAL_ARGS = args  # what get_args() returns
    optimizer = _Optimizer(0.01, 0.001)
    scheduler = training.get_optimizer_param_scheduler(optimizer)
    scheduler.step(8)  # the saved 2 iterations of 4 samples
    state = scheduler.state_dict()
    edited = copy.deepcopy(source)
    record = edited["megatron_optimizer"]
    record["args"].update(vars(args), consumed_train_samples=8, iteration=2)
    record["opt_param_scheduler"] = state
    for group in record["param_groups"]:  # as the scheduler set them
        group.update(lr=optimizer.param_groups[0]["lr"], weight_decay=None)
    recipe = megatron_recipe(edited, saved, "ckpt")
    assert recipe is not None
    np.testing.assert_allclose(float(recipe.learning_rate(2)), optimizer.param_groups[0]["lr"])
    scheduler.step(4)
    np.testing.assert_allclose(float(recipe.learning_rate(3)), optimizer.param_groups[0]["lr"])


@pytest.mark.torch
def test_continuation_steps_as_megatron_core(tmp_path):
    """Megatron's own pieces step a small model 12 iterations: megatron-core's param groups
    (``_get_param_groups``: its standard no-weight-decay rule), the Adam it builds without
    Apex / Transformer Engine (torch's AdamW, decoupled decay) and its OptimizerParamScheduler
    stepped by the global batch (warm-up, cosine decay, linear weight-decay increment). Saved at
    iteration 5, the recipe's optax chain, given the saved moments and step, takes the next 7
    updates to the same parameters."""
    import jax.numpy as jnp
    import optax
    import torch
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear_fc1 = torch.nn.Linear(6, 8)
            self.layer_norm = torch.nn.LayerNorm(8)
            self.output_layer = torch.nn.Linear(8, 5, bias=False)

    torch.manual_seed(0)
    model = Block()
    gbs, saved_at, total = 8, 5, 12
    args = dict(
        optimizer="adam",
        adam_beta1=0.9,
        adam_beta2=0.98,
        adam_eps=1e-6,
        clip_grad=0.0,
        lr=0.05,
        min_lr=0.005,
        lr_warmup_init=0.001,
        global_batch_size=gbs,
        micro_batch_size=4,
        data_parallel_size=2,
        rampup_batch_size=None,
        decoupled_lr=None,
        decoupled_weight_decay=True,
        iteration=saved_at,
    )
    config = OptimizerConfig(
        optimizer="adam",
        lr=0.05,
        min_lr=0.005,
        weight_decay=0.1,
        adam_beta1=0.9,
        adam_beta2=0.98,
        adam_eps=1e-6,
    )
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
        )
    try:
        groups = _get_param_groups([model], config, _standard_overrides(config))  # type: ignore[arg-type]
    finally:
        torch.distributed.destroy_process_group()
    optimizer = torch.optim.AdamW(
        groups, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.98), eps=1e-6
    )
    scheduler = OptimizerParamScheduler(
        optimizer,  # type: ignore[arg-type]
        init_lr=0.001,
        max_lr=0.05,
        min_lr=0.005,
        lr_warmup_steps=2 * gbs,
        lr_decay_steps=10 * gbs,
        lr_decay_style="cosine",
        start_wd=0.05,
        end_wd=0.2,
        wd_incr_steps=total * gbs,
        wd_incr_style="linear",
    )
    names = dict(model.named_parameters())
    grads = [
        {
            n: torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
            for n, p in names.items()
        }
        for i in range(total)
    ]
    record = saved = None
    for iteration in range(total):
        if iteration == saved_at:
            groups_record = [
                {k: v for k, v in g.items() if k != "params"} | {"step": float(saved_at)}
                for g in optimizer.param_groups
            ]
            record = {
                "file": "common.pt",
                "args": args,
                "opt_param_scheduler": scheduler.state_dict(),
                "param_groups": groups_record,
            }
            state = optimizer.state
            saved = {
                "params": {n: p.detach().numpy().copy() for n, p in names.items()},
                "mu": {n: state[p]["exp_avg"].numpy().copy() for n, p in names.items()},
                "nu": {n: state[p]["exp_avg_sq"].numpy().copy() for n, p in names.items()},
            }
        for n, p in names.items():
            p.grad = grads[iteration][n].clone()
        optimizer.step()
        scheduler.step(increment=gbs)
    assert record is not None and saved is not None
    source = {"framework": "megatron", "iteration": saved_at, "megatron_optimizer": record}
    shapes = {
        **{("params", n): (tuple(p.shape), np.float32) for n, p in names.items()},
        **{("opt_state", "mu", n): (tuple(p.shape), np.float32) for n, p in names.items()},
    }
    recipe = megatron_recipe(json.loads(json.dumps(source, default=list)), shapes, "ckpt")
    assert recipe is not None and recipe.optimizer == "adamw" and recipe.clip is None
    assert recipe.decayed == {
        "linear_fc1.weight": True,
        "linear_fc1.bias": False,
        "layer_norm.weight": False,
        "layer_norm.bias": False,
        "output_layer.weight": True,
    }
    wd = recipe.weight_decay
    assert callable(wd)
    # the chain's shape (optax_from_torch builds its own from the Recipe): Adam, then decoupled
    # decay at the schedule's rate on the decayed parameters, then the learning rate
    tx = optax.chain(
        optax.scale_by_adam(b1=recipe.betas[0], b2=recipe.betas[1], eps=recipe.eps),
        _scheduled_decay(wd, dict(recipe.decayed)),
        optax.scale_by_learning_rate(recipe.learning_rate),
    )
    params = {n: jnp.asarray(a) for n, a in saved["params"].items()}
    count = jnp.asarray(saved_at, jnp.int32)  # the saved Adam step: optax's count
    adam = optax.ScaleByAdamState(
        count=count,
        mu={n: jnp.asarray(a) for n, a in saved["mu"].items()},
        nu={n: jnp.asarray(a) for n, a in saved["nu"].items()},
    )
    state = (adam, _DecayState(count), optax.ScaleByScheduleState(count=count))
    for iteration in range(saved_at, total):
        g = {n: jnp.asarray(grads[iteration][n].numpy()) for n in names}
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
    for n, p in names.items():
        np.testing.assert_allclose(np.asarray(params[n]), p.detach().numpy(), rtol=2e-5, atol=1e-6)


class _DecayState(NamedTuple):
    count: Any


def _scheduled_decay(rate, mask: dict):
    """Decoupled weight decay at ``rate(count)`` on the parameters ``mask`` marks."""
    import jax.numpy as jnp
    import optax

    def init(params):
        del params
        return _DecayState(jnp.zeros([], jnp.int32))

    def update(updates, state, params):
        wd = rate(state.count)
        out = {n: u + wd * params[n] if mask[n] else u for n, u in updates.items()}
        return out, _DecayState(state.count + 1)

    return optax.GradientTransformation(init, update)


# megatron-core's own decision per parameter, run apart (it initialises torch.distributed):
# the standard param groups' wd_mult of each parameter of the fixtures' GPTModels, keyed by the
# name and global shape its sharded_state_dict gives the torch_dist save
_MCORE_GROUPS = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("gen", sys.argv[1])
gen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen)
import torch.distributed as dist
gen._shim_cuda()
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig, _get_param_groups
parallel_state.initialize_model_parallel(1, 1)
out = {}
from megatron.core.transformer.moe import experts
for kind, grouped in (("gpt", False), ("llama", False), ("moe", False), ("moe", True)):
    if grouped and not hasattr(experts, "gg"):  # a release without the legacy GroupedMLP path
        continue
    cfg = dict(kind=kind, tp=1, pp=1, ep=1, tied=False, grouped=grouped)
    model, _ = gen.build_model(cfg, 0, 1)
    config = OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=0.0)
    try:  # megatron-core >= 0.19: get_megatron_optimizer passes the standard rule in
        from megatron.core.optimizer import get_standard_config_overrides
        overrides = get_standard_config_overrides(config)
    except ImportError:  # earlier: the rule is _get_param_groups' own default
        overrides = None
    groups = _get_param_groups([model], config, overrides)
    exempt = {id(p) for g in groups if g["wd_mult"] == 0.0 for p in g["params"]}
    sd = model.sharded_state_dict()
    out[kind + ("_grouped" if grouped else "")] = [
        [sd[name].key, id(p) not in exempt] for name, p in model.named_parameters()
    ]
dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.torch
def test_no_weight_decay_rule_is_megatron_cores(tmp_path, scheduled):
    """The decayed parameters the recipe reads from each torch_dist fixture's names and shapes
    (layers stacked, experts stacked) are those megatron-core's own param groups decay in the
    model that wrote it (GPT with biases, Llama, MoE with sequential and grouped experts)."""
    import subprocess
    import sys

    source, _ = scheduled
    script = tmp_path / "mcore_groups.py"
    script.write_text(_MCORE_GROUPS)
    generator = Path(__file__).parents[1] / "tools" / "fixtures" / "make_megatron_fixtures.py"
    done = subprocess.run(
        [sys.executable, str(script), str(generator), str(tmp_path / "rendezvous")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    decisions = json.loads(done.stdout.strip().splitlines()[-1])
    fixtures = {"gpt": "gpt_tp2", "llama": "llama_tp2", "moe": "moe_ep2"}
    fixtures["moe_grouped"] = "moe_grouped_ep2"  # built by releases with the GroupedMLP path
    assert set(decisions) >= {"gpt", "llama", "moe"}, sorted(decisions)
    for kind, fixture in fixtures.items():
        if kind not in decisions:
            continue
        jax_ucp.convert(
            FIX / fixture, tmp_path / fixture, importing=ImportOptions(weights_only=True)
        )
        saved = {
            e.key: (tuple(e.shape), e.dtype) for e in jax_ucp.inspect(tmp_path / fixture).tensors
        }
        saved[("opt_state", "mu", "x")] = ((1,), np.float32)  # the moments are not read
        recipe = megatron_recipe(source, saved, "ckpt")
        assert recipe is not None
        megatron: dict[str, bool] = {}
        for key, decayed in decisions[kind]:
            assert megatron.setdefault(key, decayed) == decayed, key  # one per stacked tensor
        assert recipe.decayed == megatron, kind
