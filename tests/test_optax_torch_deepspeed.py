"""Continue a Hugging Face Trainer + DeepSpeed run in JAX. The fixtures are written by the
Trainer and DeepSpeed themselves (``tools/fixtures/make_hf_trainer_deepspeed_checkpoints.py``:
transformers 5.24, DeepSpeed 0.19.8, torch 2.13, two gloo ranks on CPU, 3 of 5 steps):

- ``trainer_ds_z2``: ZeRO-2, DeepSpeed's own ``"AdamW"`` (``torch_adam``: one group, every
  parameter decayed), cosine schedule;
- ``trainer_ds_z3``: ZeRO-3, the Trainer's torch AdamW with its decay / no-decay groups wrapped
  by DeepSpeed, linear schedule.

Both clip at 1.0 (DeepSpeed's ``gradient_clipping: auto``) with weight decay 0.1. And the
Trainer's FSDP layout (``pytorch_model_fsdp_0/`` + ``optimizer_0/``, ``trainer_fsdp_synthetic_layout``:
the Trainer cannot write FSDP on CPU, so its run's step-3 state is written by Accelerate's own
FSDP save functions beside the run's real side files:
``tools/fixtures/make_hf_trainer_fsdp_synthetic_layout.py``). Converted by auto-detection from
``checkpoint-3/`` (torch-free), the Trainer's side files are read (one level above
``global_step3/``), and two jitted JAX steps give torch's losses of steps 4 and 5."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.continuation.deepspeed import deepspeed_recipe
from jax_ucp._src.optax_torch import run_arguments
from jax_ucp.conversion import ImportOptions
from jax_ucp.errors import RequestError
from tests.test_optax_torch import continue_in_jax
from tests.ucp_testing import REPO, run_torchrun

pytestmark = pytest.mark.timeout(600)
FIX = os.path.join(REPO, "tests", "fixtures", "hf_trainer")
#: kind -> (its schedule, how many of the 15 flax leaves are decayed)
KINDS = {
    "trainer_ds_z2": ("cosine", 15),
    "trainer_ds_z3": ("linear", 10),
    "trainer_fsdp_synthetic_layout": ("linear", 10),
}


def _truth(kind: str) -> dict[str, np.ndarray]:
    with np.load(os.path.join(FIX, f"{kind}.truth.npz")) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module", params=sorted(KINDS))
def converted(request, tmp_path_factory):
    kind = request.param
    src = os.path.join(FIX, kind, "checkpoint-3")
    return kind, src, jax_ucp.convert(src, str(tmp_path_factory.mktemp(kind) / "ucp"))


def test_trainer_deepspeed_run_continues_in_jax_with_torchs_losses(converted):
    """Schedule, clipping, decay groups and step taken from the files: torch's steps 4-5."""
    kind, src, ckpt = converted
    schedule, decayed = KINDS[kind]
    truth = _truth(kind)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    got, run = continue_in_jax(ckpt, config, truth["next_tokens"])
    assert run.step == 3 and run.unrecovered == []
    lrs = [float(run.schedule(3 + i)) for i in range(len(truth["next_lrs"]))]
    assert lrs == pytest.approx(truth["next_lrs"], rel=1e-6)
    assert any(f"{schedule} schedule: lr 0.01, warm-up 1 steps, 5 steps" in n for n in run.notes)
    assert any("global norm 1.0" in n for n in run.notes)
    assert any(f"weight decay 0.1 on {decayed} of 15 leaves" in n for n in run.notes)
    np.testing.assert_allclose(got, truth["next_losses"], rtol=0, atol=1e-5)


def test_the_import_equals_the_runs_live_state(converted):
    """Params and both moments bit for bit, and the step, against DeepSpeed's own accessors
    in the run (safe_get_full_fp32_param / safe_get_full_optimizer_state)."""
    kind, _, ckpt = converted
    truth = _truth(kind)
    run = jax_ucp.optax_from_torch(ckpt)  # torch's names, no spec
    adam = next(s for s in run.opt_state if hasattr(s, "mu"))
    names = [k.split("/", 1)[1] for k in truth if k.startswith("param/")]
    assert sorted(names) == sorted(run.params)
    for name in names:
        for key, tree in (("param", run.params), ("exp_avg", adam.mu), ("exp_avg_sq", adam.nu)):
            want = truth[f"{key}/{name}"]
            got = np.asarray(tree[name])
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (key, name)
    assert run.step == int(truth["step"]) == 3


def test_a_manifest_of_an_earlier_release_continues_as_before(converted, tmp_path):
    """An earlier jax_ucp recorded DeepSpeed's config under ``source.optimizer.deepspeed`` (the
    record key before ``config``, docs/FORMAT.md 2.2.3): its manifest continues the run as the
    one written now does, the same schedule, clipping, notes and state."""
    import jax

    kind, _, ckpt = converted
    old = shutil.copytree(ckpt, tmp_path / "old")
    manifest = json.loads((old / "ucp.json").read_text())
    record = manifest["source"]["optimizer"]
    assert ("config" in record) == (kind != "trainer_fsdp_synthetic_layout")  # DeepSpeed's only
    if "config" in record:
        record["deepspeed"] = record.pop("config")
    (old / "ucp.json").write_text(json.dumps(manifest))
    now, before = jax_ucp.optax_from_torch(ckpt), jax_ucp.optax_from_torch(old)
    assert (before.step, before.notes, before.unrecovered) == (now.step, now.notes, now.unrecovered)
    assert [float(before.schedule(c)) for c in range(6)] == [
        float(now.schedule(c)) for c in range(6)
    ]
    assert jax.tree.structure(before.opt_state) == jax.tree.structure(now.opt_state)


def test_the_trainer_files_are_recorded_from_the_tag_folder_too(tmp_path):
    """``checkpoint-3/global_step3/`` given: the Trainer's files are read one level up, as from
    ``checkpoint-3/``; DeepSpeed's config decides the optimizer and the clipping."""
    src = os.path.join(FIX, "trainer_ds_z2", "checkpoint-3")
    ckpt = jax_ucp.convert(os.path.join(src, "global_step3"), tmp_path / "ucp")
    source = jax_ucp.inspect(ckpt).source or {}
    trainer = source["trainer"]
    assert source["trainer_path"] == os.path.abspath(src)
    assert trainer["global_step"] == 3 and trainer["max_steps"] == 5
    assert trainer["training_args"]["lr_scheduler_type"] == "cosine"
    assert trainer["scheduler"]["last_epoch"] == 3  # DeepSpeed keeps it: no scheduler.pt
    ds = source["optimizer"]["config"]
    assert ds["gradient_clipping"] == 1.0 and ds["optimizer"]["type"] == "AdamW"
    # the Trainer's optim (adamw_torch_fused) did not run: DeepSpeed made the optimizer
    assert trainer["training_args"]["optim"] != "adamw_torch"
    assert "optim" not in run_arguments(source, "x")


def test_a_trainer_file_linked_out_of_the_checkpoint_is_refused(tmp_path):
    src = tmp_path / "checkpoint-3"
    shutil.copytree(os.path.join(FIX, "trainer_ds_z3", "checkpoint-3"), src)
    outside = tmp_path / "elsewhere.bin"
    shutil.move(src / "training_args.bin", outside)
    os.symlink(outside, src / "training_args.bin")
    with pytest.raises(jax_ucp.UCPError, match=r"training_args.bin.*outside the checkpoint"):
        jax_ucp.convert(src, tmp_path / "ucp")


def test_a_weights_only_deepspeed_import_is_refused_saying_so(tmp_path):
    src = os.path.join(FIX, "trainer_ds_z3", "checkpoint-3")
    ckpt = jax_ucp.convert(src, tmp_path / "w", importing=ImportOptions(weights_only=True))
    with pytest.raises(
        jax_ucp.UCPError, match=r"no torch optimizer recorded: imported with weights_only=True"
    ):
        jax_ucp.optax_from_torch(ckpt)


def test_an_import_without_torch_param_groups_is_not_called_weights_only(tmp_path):
    """Weights alone (a safetensors file): the refusal names the source, not weights_only."""
    src = tmp_path / "weights"
    src.mkdir()
    for name in ("model.safetensors", "config.json"):
        shutil.copy(os.path.join(FIX, "trainer_ds_z2", "checkpoint-3", name), src / name)
    ckpt = jax_ucp.convert(src, tmp_path / "ucp")
    with pytest.raises(jax_ucp.UCPError, match=r"no torch optimizer recorded in this ") as e:
        jax_ucp.optax_from_torch(ckpt)
    assert "weights_only" not in str(e.value)


@pytest.mark.parametrize(
    ("deepspeed", "says"),
    [
        ({"optimizer": {"type": "Lamb", "params": {"torch_adam": True}}}, "'Lamb'"),
        ({"optimizer": {"type": "AdamW"}, "scheduler": {"type": "CyclicLR"}}, "'CyclicLR'"),
    ],
)
def test_what_deepspeed_made_and_optax_does_not_reproduce_is_refused(deepspeed, says):
    """DeepSpeed's own AdamW (FusedAdam) and its schedules are read (continuation.deepspeed,
    tests/test_optax_torch_deepspeed_recipe.py); other optimizers and schedulers are refused."""
    group = {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    group |= {"bias_correction": True, "amsgrad": False, "params": ["w"]}
    record = {"deepspeed": deepspeed, "param_groups": [group]}
    source = {"optimizer": record, "trainer": {"training_args": {}}}
    run_arguments(source, "ckpt")  # the Trainer's arguments: no refusal there
    with pytest.raises(RequestError, match=says):
        deepspeed_recipe(source, "ckpt")


def test_deepspeed_clipping_wins_over_the_trainers_unused_max_grad_norm():
    """Under DeepSpeed the Trainer never clips: without ``gradient_clipping`` nothing is."""
    args = {"max_grad_norm": 1.0, "optim": "adamw_torch"}
    source = {"optimizer": {"config": {}}, "trainer": {"training_args": args}}
    assert run_arguments(source, "ckpt")["max_grad_norm"] == 0.0
    assert run_arguments(source, "ckpt")["optim"] == "adamw_torch"  # the Trainer made it
    assert run_arguments({"trainer": {"training_args": args}}, "ckpt") == args


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_train_with_deepspeed_now_convert_continue_in_jax(tmp_path, stage):
    """The Trainer + DeepSpeed run made now (the generator, 2 gloo ranks, into tmp), converted
    from its checkpoint-3/ and continued 2 steps in JAX: torch's losses of steps 4 and 5."""
    script = os.path.join(REPO, "tools", "fixtures", "make_hf_trainer_deepspeed_checkpoints.py")
    run_torchrun(script, "--out", str(tmp_path / "run"), "--stage", str(stage))
    kind = f"trainer_ds_z{stage}"
    src = str(tmp_path / "run" / kind / "checkpoint-3")
    with np.load(tmp_path / "run" / f"{kind}.truth.npz") as z:
        tokens, want = z["next_tokens"], z["next_losses"]
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    got, run = continue_in_jax(jax_ucp.convert(src, tmp_path / "ucp"), config, tokens)
    assert run.step == 3 and run.unrecovered == []
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_a_deepspeed_run_without_the_trainers_arguments_lists_only_the_schedule(tmp_path):
    """``llama_z2_dp2``: a Trainer + DeepSpeed checkpoint without training_args.bin. Its saved
    ds_config has no gradient_clipping (accelerate set it beside the config), the ZeRO ranks'
    clip_grad, which their optimizer clips with, say 1.0: clipped so, only the schedule is
    unrecovered (before issue 68 the absent entry was read as no clipping)."""
    src = os.path.join(FIX, "llama_z2_dp2", "checkpoint-2")
    ckpt = jax_ucp.convert(src, tmp_path / "ucp")
    with pytest.warns(UserWarning, match="learning-rate schedule"):
        run = jax_ucp.optax_from_torch(ckpt)
    assert len(run.unrecovered) == 1 and "schedule" in run.unrecovered[0]
    assert any("clipped to global norm 1.0" in n for n in run.notes)
    assert run.step == 2


def test_a_trainer_global_step_other_than_deepspeeds_optimizer_step_is_said(tmp_path):
    """Trainer + DeepSpeed ZeRO-2: trainer_state.json at global_step 7, the optimizer state at
    step 3: continued at the optimizer's step with a warning naming both (it said nothing)."""
    src = str(shutil.copytree(os.path.join(FIX, "trainer_ds_z2", "checkpoint-3"), tmp_path / "c"))
    path = os.path.join(src, "trainer_state.json")
    with open(path) as f:
        state = json.load(f)
    with open(path, "w") as f:
        json.dump({**state, "global_step": 7}, f)
    ckpt = jax_ucp.convert(src, str(tmp_path / "ucp"))
    with pytest.warns(UserWarning, match=r"c/trainer_state\.json's global_step is 7, .* step .* 3"):
        run = jax_ucp.optax_from_torch(ckpt)
    assert run.step == 3
