"""Every record of a save that states a fact of the run must agree (``jax_ucp/_src/facts.py``):
one copy edited among several is refused, each record named with its value, never continued from
the one copy a reader happened to read (issue 68). The saves are the real DeepSpeed and Trainer
fixtures with one field changed in one file, torch-free (``tests/torch_edit.py``)."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest

import jax_ucp
from jax_ucp._src.facts import Facts
from jax_ucp._src.torchfiles.pickle_format import Call
from jax_ucp.conversion import TorchOptions
from tests.torch_edit import edit_torch_file
from tests.ucp_testing import REPO

FIX = os.path.join(REPO, "tests", "fixtures")
STEP = "global_step3"
MODEL = "mp_rank_00_model_states.pt"


def _copy(tmp_path, rel: str) -> str:
    dst = str(tmp_path / "src")
    shutil.copytree(os.path.join(FIX, rel), dst)
    return dst


def _continue(path: str, options=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return jax_ucp.optax_from_torch(path, options=options)


def _trainer_order(kind: str):
    """The Trainer's optimizer order (decayed, then the norms), so no transformers is imported
    to rebuild it (as tests/hostile gives it)."""
    import numpy as np

    with np.load(os.path.join(FIX, "hf_trainer", f"{kind}.truth.npz")) as z:
        names = [k.split("/", 1)[1] for k in z.files if k.startswith("param/")]
    norms = [n for n in names if n.endswith("norm.weight")]
    order = [n for n in names if n not in norms] + norms
    return jax_ucp.RestoreOptions(importing=TorchOptions(parameter_order=order))


def _ranks(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if "zero_pp_rank_" in n)


def test_facts_agree_or_name_every_record():
    facts = Facts("ck")
    facts.state("betas", "a.pt betas", (0.9, 0.95))
    facts.state("betas", "b.pt betas", [0.9, 0.95])  # a tuple in one file, a list in another
    facts.state("clip", "a.pt clip", 1)
    facts.state("clip", "b.pt clip", 1.0)
    assert facts.agree_all() == {"betas": (0.9, 0.95), "clip": 1}
    facts.state("clip", "c.pt clip", 0.0)
    with pytest.raises(
        jax_ucp.SourceError, match=r"ck: .* on clip: a.pt clip = 1; .*c.pt clip = 0.0"
    ):
        facts.agree("clip")
    assert facts.agree("absent") is None


def test_clipping_edited_in_the_model_states_alone_is_refused(tmp_path):
    """gradient_clipping 1.0 -> 0 in the model states' ds_config: the ranks' ds_config and their
    clip_grad (what DeepSpeed's optimizer clips with, kept on resume) still say 1.0."""
    src = _copy(tmp_path, "deepspeed/recipe_z1_fp32_adamw_cosine/ckpt")
    edit_torch_file(
        os.path.join(src, STEP, MODEL), lambda t: t["ds_config"].update(gradient_clipping=0.0)
    )
    with pytest.raises(jax_ucp.SourceError, match=r"disagree on gradient_clipping") as e:
        _continue(src)
    said = str(e.value)
    assert f"{MODEL} ds_config.gradient_clipping = 0.0" in said
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt optimizer_state_dict.clip_grad = 1.0" in said


def test_a_trainer_deepspeed_save_whose_arguments_clip_otherwise_is_refused(tmp_path):
    """Every DeepSpeed copy says gradient_clipping 0, training_args.bin max_grad_norm 1.0: the
    Trainer fills the one from the other and refuses to start when they differ."""
    root = _copy(tmp_path, "hf_trainer/trainer_ds_z2")
    folder = os.path.join(root, "checkpoint-3", STEP)
    edit_torch_file(
        os.path.join(folder, MODEL), lambda t: t["ds_config"].update(gradient_clipping=0.0)
    )

    def rank(t):
        t["ds_config"]["gradient_clipping"] = 0.0
        t["optimizer_state_dict"]["clip_grad"] = 0.0

    for name in _ranks(folder):
        edit_torch_file(os.path.join(folder, name), rank)
    with pytest.raises(jax_ucp.SourceError, match=r"disagree on gradient_clipping") as e:
        _continue(os.path.join(root, "checkpoint-3"))
    assert "training_args.bin max_grad_norm = 1.0" in str(e.value)
    assert "ds_config.gradient_clipping) = 0.0" in str(e.value)


def test_a_schedule_length_edited_in_one_copy_is_refused(tmp_path):
    """WarmupDecayLR total_num_steps 10 -> 30 in one rank's copy, saved mid warm-up (where the
    held learning rate cannot tell them apart)."""
    src = _copy(tmp_path, "deepspeed/recipe_z2_bf16_adamw_decay/ckpt")
    folder = os.path.join(src, STEP)
    rank0 = _ranks(folder)[0]

    def longer(t):
        t["ds_config"]["scheduler"]["params"]["total_num_steps"] = 30

    edit_torch_file(os.path.join(folder, rank0), longer)
    with pytest.raises(jax_ucp.SourceError, match=r"disagree on scheduler") as e:
        _continue(src)
    assert f"{rank0} ds_config.scheduler = " in str(e.value) and "'total_num_steps': 30" in str(
        e.value
    )


def test_one_ranks_betas_are_refused(tmp_path):
    """Rank 0's param groups say betas (0.8, 0.95) where the config and rank 1 say 0.9."""
    src = _copy(tmp_path, "deepspeed/recipe_z1_fp32_adamw_cosine/ckpt")
    folder = os.path.join(src, STEP)
    rank0, rank1 = _ranks(folder)

    def betas(t):
        t["optimizer_state_dict"]["base_optimizer_state"]["param_groups"][0]["betas"] = (0.8, 0.95)

    edit_torch_file(os.path.join(folder, rank0), betas)
    with pytest.raises(jax_ucp.SourceError, match=r"disagree on param_groups\[0\].betas") as e:
        _continue(src)
    assert "base_optimizer_state.param_groups[0].betas = [0.8, 0.95]" in str(e.value)
    assert f"{rank1} optimizer_state_dict" in str(e.value)


def test_the_optimizer_edited_in_the_model_states_is_refused(tmp_path):
    """The model states' optimizer AdamW -> Adam with adam_w_mode false (L2 decay); both ranks'
    ds_config still say AdamW."""
    src = _copy(tmp_path, "deepspeed/recipe_z1_fp32_adamw_cosine/ckpt")

    def adam(t):
        made = t["ds_config"]["optimizer"]
        made["type"] = "Adam"
        made["params"]["adam_w_mode"] = False

    edit_torch_file(os.path.join(src, STEP, MODEL), adam)
    with pytest.raises(jax_ucp.SourceError, match=r"disagree on optimizer") as e:
        _continue(src)
    assert "'adam_w_mode': False" in str(e.value) and "'type': 'AdamW'" in str(e.value)


def test_groups_overriding_the_config_on_purpose_are_continued_and_said(tmp_path):
    """Every rank's groups say betas (0.8, 0.95), the config 0.9: the client's param groups (or a
    resumed save's) override the config on purpose; the groups' are continued, in a note."""
    src = _copy(tmp_path, "deepspeed/recipe_z1_fp32_adamw_cosine/ckpt")
    folder = os.path.join(src, STEP)

    def betas(t):
        t["optimizer_state_dict"]["base_optimizer_state"]["param_groups"][0]["betas"] = (0.8, 0.95)

    for name in _ranks(folder):
        edit_torch_file(os.path.join(folder, name), betas)
    run = _continue(src)
    said = [n for n in run.notes if "the DeepSpeed config's optimizer params" in n]
    assert said and "betas [0.8, 0.95]" in said[0] and "[0.9, 0.95]" in said[0]


def test_a_doubled_initial_lr_is_refused(tmp_path):
    """optimizer.pt's initial_lr doubled (and its held lr with it, consistent with the schedule
    at the saved step), scheduler.pt's base_lrs and training_args.learning_rate as they were: a
    LambdaLR's base_lrs are its groups' initial_lr, so the run cannot have written this."""
    root = _copy(tmp_path, "hf_trainer/trainer_fp32")
    opt = os.path.join(root, "checkpoint-3", "optimizer.pt")

    def doubled(t):
        for g in t["param_groups"]:
            g["initial_lr"] *= 2
            g["lr"] *= 2

    edit_torch_file(opt, doubled)
    with pytest.raises(jax_ucp.SourceError, match=r"disagree on the base learning rate") as e:
        _continue(os.path.join(root, "checkpoint-3"), _trainer_order("trainer_fp32"))
    assert "optimizer.pt param_groups[0].initial_lr = 0.02" in str(e.value)
    assert "scheduler.pt base_lrs[0] = 0.01" in str(e.value)


def test_a_schedule_kind_the_logged_rates_do_not_follow_is_refused(tmp_path):
    """training_args.bin's lr_scheduler_type linear -> cosine; trainer_state.json's log_history
    holds the linear schedule's rates."""
    root = _copy(tmp_path, "hf_trainer/trainer_fp32")
    args = os.path.join(root, "checkpoint-3", "training_args.bin")

    def cosine(t):
        kind = t.state["lr_scheduler_type"]  # SchedulerType("linear"), as pickled
        assert kind.args == ("linear",)
        t.state["lr_scheduler_type"] = Call(kind.fn, ("cosine",))

    edit_torch_file(args, cosine)
    with pytest.raises(jax_ucp.SourceError, match=r"log_history") as e:
        _continue(os.path.join(root, "checkpoint-3"), _trainer_order("trainer_fp32"))
    assert "step 2: 0.01, step 3: 0.0075; training_args.bin's cosine schedule" in str(e.value)


def test_a_verl_scheduler_whose_base_lrs_are_not_the_groups_initial_lr_is_refused(tmp_path):
    """verl's extra state (every rank's, alike) with base_lrs doubled: its LambdaLR copied them
    from the groups' initial_lr, which optim_world_size_2_rank_*.pt still hold."""
    src = _copy(tmp_path, "verl/fsdp2")
    actor = os.path.join(src, "global_step_3", "actor")

    def doubled(t):
        t["lr_scheduler"]["base_lrs"] = [2 * v for v in t["lr_scheduler"]["base_lrs"]]

    for rank in (0, 1):
        edit_torch_file(os.path.join(actor, f"extra_state_world_size_2_rank_{rank}.pt"), doubled)
    with pytest.raises(jax_ucp.SourceError, match=r"disagree on the base learning rate") as e:
        _continue(src)
    assert "extra_state_world_size_*_rank_0.pt lr_scheduler base_lrs[0]" in str(e.value)


LEGACY = "megatron/legacy_gpt_distopt_pp2dp2_synthetic"


@pytest.mark.parametrize(("field", "value"), [("maximize", True), ("amsgrad", True)])
def test_megatron_groups_of_an_adam_variant_are_not_continued_as_adam(tmp_path, field, value):
    """common.pt's param groups saying maximize (gradient ascent) or amsgrad: refused naming the
    field; before: continued as plain Adam, nothing said."""
    src = _copy(tmp_path, "megatron/gpt_distopt_dp2")
    common = os.path.join(FIX, "megatron", "gpt_distopt_dp2_scheduler_synthetic.common.pt")
    shutil.copyfile(common, os.path.join(src, "common.pt"))
    intact = _continue(src)
    assert intact.step == 2

    def flagged(t):
        for g in t["optimizer"]["optimizer"]["param_groups"]:
            g[field] = value

    edit_torch_file(os.path.join(src, "common.pt"), flagged)
    with pytest.raises(jax_ucp.RequestError, match=rf"param_groups\[0\]\.{field} = True: not"):
        _continue(src)


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lambda t: t["args"].state.update(lr=0.02), r"args\.lr: .*000/model_optim_rng\.pt"),
        (lambda t: t.update(iteration=5), r"iteration: .*001/model_optim_rng\.pt iteration = 5"),
        (lambda t: t["opt_param_scheduler"].update(num_steps=3), r"num_steps: .* = 3"),
        (
            lambda t: t["optimizer"]["optimizer"]["param_groups"][1].update(betas=(0.8, 0.95)),
            r"param_groups\.betas: .*000/model_optim_rng\.pt optimizer param_groups\[\*\]\.betas",
        ),
    ],
)
def test_a_megatron_rank_file_that_differs_from_the_others_is_refused(tmp_path, edit, said):
    """Every legacy rank file saves the run's args, scheduler state, iteration and group
    hyper-parameters: pipeline stage 1's edited alone is refused at import (rank 0's was the
    only one read), each file named; weights_only reads no optimizer and imports."""
    src = _copy(tmp_path, LEGACY)
    stage = os.path.join(src, "iter_0000002", "mp_rank_00_001", "model_optim_rng.pt")

    def change(t):
        groups = t["optimizer"]["optimizer"]["param_groups"]
        if "betas" in said:  # both groups of this rank, so it holds one value, another rank's
            groups[0]["betas"] = (0.8, 0.95)
        edit(t)

    edit_torch_file(stage, change)
    with pytest.raises(jax_ucp.SourceError, match=r"records of this save disagree on") as e:
        jax_ucp.convert(src, str(tmp_path / "out"))
    assert e.match(said), str(e.value)
    jax_ucp.convert(
        src, str(tmp_path / "w"), importing=jax_ucp.conversion.ImportOptions(weights_only=True)
    )


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        ({"max_steps_per_epoch": 2}, r"step = 3, epochs_run = 1, max_steps_per_epoch = 2"),
        ({"epochs_run": 2}, r"step = 3, epochs_run = 2: not a whole number of steps per epoch"),
        ({"total_epochs": 0}, r"epochs_run = 1, total_epochs = 0: more epochs run"),
    ],
)
def test_a_torchtune_step_its_progress_records_do_not_allow_is_refused(tmp_path, edit, said):
    """torchtune resumes its schedule at epochs_run x one epoch's steps, not at the Adam step:
    a recipe_state.pt whose progress cannot have made its step is refused, both named."""
    src = _copy(tmp_path, "torchtune/tt_fp32")
    if "epochs_run" in edit:  # its weights are then epoch_1's, as the recipe names them
        os.rename(os.path.join(src, "epoch_0"), os.path.join(src, "epoch_1"))
    recipe = os.path.join(src, "recipe_state", "recipe_state.pt")
    edit_torch_file(recipe, lambda t: t.update(edit))
    with pytest.raises(jax_ucp.SourceError, match=said):
        jax_ucp.convert(src, str(tmp_path / "out"))


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lambda g: g[0].update(betas=(0.8, 0.999)), r"on param_groups\[0\]\.betas: .*rank_1\.pt "),
        (
            lambda g: g[0].update(weight_decay=0.5),
            r"rank_1\.pt param_groups\[0\]\.weight_decay = 0\.5",
        ),
        (
            lambda g: g.append(dict(g[0])),
            r"on the number of param groups: .*rank_1\.pt param_groups = 2",
        ),
    ],
)
def test_a_verl_rank_whose_param_groups_differ_is_refused(tmp_path, edit, said):
    """Rank 1's optimizer file edited alone: each rank steps its shard with one optimizer's
    groups, so the import is refused naming both ranks' files and values (it said only that
    rank 1's differed)."""
    src = _copy(tmp_path, "verl/fsdp2")
    optim = os.path.join(src, "global_step_3", "actor", "optim_world_size_2_rank_1.pt")
    edit_torch_file(optim, lambda t: edit(t["param_groups"]))
    with pytest.raises(jax_ucp.SourceError, match=r"records of this save disagree") as e:
        jax_ucp.convert(src, str(tmp_path / "out"))
    assert e.match(said) and "optim_world_size_2_rank_0.pt param_groups" in str(e.value)


def test_trainer_groups_not_built_from_its_arguments_are_said_and_warned(tmp_path):
    """optimizer.pt's betas[0] lowered by 0.1 (training_args.bin's adam_beta1 as it was): the
    Trainer builds its optimizer from its arguments, so this is a client optimizer or an edited
    file; the groups' betas are continued, said in a note and warned (silent before). The intact
    save warns nothing."""
    root = _copy(tmp_path, "hf_trainer/trainer_fp32")
    ckpt, order = os.path.join(root, "checkpoint-3"), _trainer_order("trainer_fp32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        intact = jax_ucp.optax_from_torch(ckpt, options=order)
    assert not [w for w in caught if "Trainer builds" in str(w.message)]
    assert not [n for n in intact.notes if "Trainer builds" in n]

    def lowered(t):
        for g in t["param_groups"]:
            g["betas"] = (g["betas"][0] - 0.1, g["betas"][1])

    edit_torch_file(os.path.join(ckpt, "optimizer.pt"), lowered)
    with pytest.warns(UserWarning, match=r"optimizer.pt param_groups' betas \[0\.8, 0\.999\]"):
        run = jax_ucp.optax_from_torch(ckpt, options=order)
    assert any("(training_args.bin [0.9, 0.999])" in n for n in run.notes)


def test_a_schedule_length_trainer_state_and_training_args_disagree_on_is_refused(tmp_path):
    """trainer_state.json's max_steps 5 -> 7, training_args.bin's 5: refused naming both (the
    held-rate check refused it only past warm-up, saying the schedule's rate and the held one;
    within warm-up it continued on the longer decay)."""
    root = _copy(tmp_path, "hf_trainer/trainer_fp32")
    path = os.path.join(root, "checkpoint-3", "trainer_state.json")
    with open(path) as f:
        state = json.load(f)
    state["max_steps"] = 7
    with open(path, "w") as f:
        json.dump(state, f)
    with pytest.raises(jax_ucp.SourceError, match=r"disagree on max_steps") as e:
        _continue(os.path.join(root, "checkpoint-3"), _trainer_order("trainer_fp32"))
    assert "trainer_state.json max_steps = 7; training_args.bin max_steps = 5" in str(e.value)
