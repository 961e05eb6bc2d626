"""DeepSpeed AutoTP with ZeRO stage 3 (DeepSpeed 0.19.8 accepts it for training: its engine's
``_configure_tensor_parallel_states`` says "AutoTP + ZeRO stage 3 is supported for both inference
and training"): a real TP2 x DP2 bf16 run of the tiny Hugging Face Llama
(``tools/fixtures/make_deepspeed_fixtures.py --autotp autotp_tp2_dp2_z3_bf16``). Each TP rank is
its own ZeRO-3 checkpoint (``zero_pp_rank_D_mp_rank_XX_model_states.pt`` per DP rank, the weights
only in the fp32 partitions), merged across TP by the affine maps.

Truth: ``ref_universal.npz`` (DeepSpeed's own ``ds_to_universal`` of the run: fp32 masters, Adam
moments, step) and ``live.npz`` (the engine's TP-gathered bf16 weights right after the save).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import jax_ucp
from jax_ucp.conversion import ImportOptions
from tests.importers.deepspeed.test_autotp import check_against_the_run, same_bits
from tests.ucp_testing import REPO

RUN = os.path.join(REPO, "tests", "fixtures", "deepspeed", "autotp_tp2_dp2_z3_bf16")


@pytest.mark.timeout(120)
def test_autotp_zero3_imports_bit_exact(tmp_path):
    names = sorted(os.listdir(os.path.join(RUN, "ckpt", "global_step2")))
    assert "zero_pp_rank_1_mp_rank_01_model_states.pt" in names  # what the fixture covers
    tree, manifest = check_against_the_run(RUN, tmp_path / "u")
    assert "model_params" in tree  # bf16 run: the live weights are the model copy
    source = manifest["source"]
    assert (source["tp"], source["zero_stage"], source["layout"]) == (2, 3, "megatron-deepspeed")
    # ZeRO-3's module entries are placeholders: listed as skipped, not imported
    placeholder = "zero_pp_rank_0_mp_rank_01_model_states.pt:module.lm_head.weight"
    assert source["skipped"][placeholder].startswith("ZeRO-3 placeholder")


@pytest.mark.timeout(60)
def test_autotp_zero3_missing_dp_rank_model_states_is_named(tmp_path):
    """A TP rank's ZeRO-3 model states must exist for every DP rank; nothing is written."""
    src = tmp_path / "ckpt"
    shutil.copytree(os.path.join(RUN, "ckpt"), src)
    (src / "global_step2" / "zero_pp_rank_1_mp_rank_01_model_states.pt").unlink()
    with pytest.raises(
        jax_ucp.UCPError,
        match=r"zero_pp_rank_1_mp_rank_01_model_states\.pt: missing stage-3 model states file "
        r"for DP rank 1",
    ):
        jax_ucp.convert(src, tmp_path / "u")
    assert not (tmp_path / "u").exists()


@pytest.mark.timeout(60)
def test_autotp_zero3_weights_only(tmp_path):
    """weights_only: the merged fp32 masters and bf16 weights alone; the moments and the step
    named in source.skipped."""
    jax_ucp.convert(
        os.path.join(RUN, "ckpt"), tmp_path / "u", importing=ImportOptions(weights_only=True)
    )
    tree = jax_ucp.restore(tmp_path / "u")
    assert sorted(tree) == ["model_params", "params"]
    ref = np.load(os.path.join(RUN, "ref_universal.npz"))
    for name, value in tree["params"].items():
        assert same_bits(value, ref[f"{name}/fp32"]), name
    with open(tmp_path / "u" / "ucp.json") as f:
        skipped = json.load(f)["source"]["skipped"]
    moment = (
        "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt:"
        "optimizer_state_dict.optimizer_state_dict.state.0.exp_avg"
    )
    assert skipped[moment] == "weights_only: Adam moment"
