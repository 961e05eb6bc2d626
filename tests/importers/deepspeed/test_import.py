"""DeepSpeed importer on real checkpoints written by DeepSpeed: equal to DeepSpeed's own tools.

References (committed with the fixtures, made by tools/fixtures/make_deepspeed_fixtures.py):
``ref_universal.npz`` from ``ds_to_universal --inject_missing_state`` and ``ref_zero_to_fp32.npz``
from ``deepspeed.utils.zero_to_fp32``. No torch needed here.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest

import jax_ucp
from jax_ucp.conversion import convert_deepspeed
from jax_ucp.importers.deepspeed import (
    DeepSpeedImportError,
    is_deepspeed_checkpoint,
    open_deepspeed_checkpoint,
)
from jax_ucp.importers.deepspeed.zero import optimizer_step
from jax_ucp.importers.torch.unpickler import TorchFileError
from tests.ucp_testing import REPO, assert_destination_untouched, copy_deepspeed_fixture

FIX = os.path.join(REPO, "tests", "fixtures", "deepspeed")
# the stage x dtype x DP grid (frozen-parameter and ZeRO-0 runs: tests/importers/test_reach.py)
REAL = sorted(
    os.path.basename(d)
    for d in glob.glob(os.path.join(FIX, "z[123]_*"))
    if "synthetic" not in d and not d.endswith("_frozen")
)
SYNTH = sorted(os.path.basename(d) for d in glob.glob(os.path.join(FIX, "*synthetic*")))


def test_fixture_matrix_is_complete():
    # every stage x {fp32, bf16} x DP {2, 3}, all real
    assert REAL == sorted(
        f"z{s}_{d}_dp{w}" for s in (1, 2, 3) for d in ("bf16", "fp32") for w in (2, 3)
    )
    for name in REAL:
        run = json.load(open(os.path.join(FIX, name, "run.json")))
        assert run["n_params"] % run["world"] != 0, (
            f"{name}: parameter count divides the world size"
        )


_converted: dict[str, str] = {}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    def get(name: str) -> str:
        if name not in _converted:
            out = tmp_path_factory.mktemp("ucp") / name
            _converted[name] = convert_deepspeed(os.path.join(FIX, name, "ckpt"), out)
        return _converted[name]

    return get


@pytest.mark.parametrize("name", REAL + SYNTH)
def test_equals_ds_to_universal_and_zero_to_fp32(converted, name):
    d = os.path.join(FIX, name)
    run = json.load(open(os.path.join(d, "run.json")))
    got = jax_ucp.restore(converted(name))
    U = np.load(os.path.join(d, "ref_universal.npz"))
    Z = np.load(os.path.join(d, "ref_zero_to_fp32.npz"))
    names = sorted({k.rsplit("/", 1)[0] for k in U.files})
    assert sorted(got["params"]) == names == sorted(Z.files)
    assert sorted(got["opt_state"]["mu"]) == names == sorted(got["opt_state"]["nu"])
    for n in names:
        shape = Z[n].shape  # the parameter's real shape (ds_to_universal's stage 3 output is flat)
        for state, tree in (
            ("fp32", got["params"]),
            ("exp_avg", got["opt_state"]["mu"]),
            ("exp_avg_sq", got["opt_state"]["nu"]),
        ):
            ref = U[f"{n}/{state}"]
            if run["stage"] == 3:
                assert ref.ndim == 1
            ref = ref.reshape(shape)
            assert tree[n].shape == shape and tree[n].dtype == np.float32, (n, state)
            np.testing.assert_array_equal(tree[n], ref, err_msg=f"{name} {n} {state}")
        np.testing.assert_array_equal(got["params"][n], Z[n], err_msg=f"{name} {n} zero_to_fp32")
        if f"{n}/step" in U.files:
            assert int(U[f"{n}/step"]) == int(got["opt_state"]["count"])
    count = got["opt_state"]["count"]
    assert np.asarray(count).dtype == np.int32 and int(count) == run["steps"]
    lowp = run["dtype"] != "fp32"
    assert ("model_params" in got) == lowp
    if lowp:
        want = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}[run["dtype"]]
        for n in names:
            m = got["model_params"][n]
            assert m.dtype == want and m.shape == Z[n].shape
            # model weights are DeepSpeed's low-precision copy of the fp32 master
            np.testing.assert_allclose(m.astype(np.float32), Z[n], rtol=2**-7, atol=1e-6)


def test_bf16_model_params_are_the_stored_module_weights(converted):
    """Stage 1/2 store the bf16 module; it must come through bit for bit (not re-cast)."""
    from jax_ucp.importers.deepspeed import DS_CLASSES
    from jax_ucp.importers.torch.unpickler import load_torch_file

    name = "z2_bf16_dp3"
    ms = load_torch_file(
        os.path.join(FIX, name, "ckpt", "global_step2", "mp_rank_00_model_states.pt"), DS_CLASSES
    )
    got = jax_ucp.restore(converted(name))
    for n, v in ms["module"].items():
        assert np.array_equal(got["model_params"][n].view(np.uint16), v.view(np.uint16)), n


def test_tag_folder_latest_and_manager_step(tmp_path):
    src = os.path.join(FIX, "z2_fp32_dp3", "ckpt")
    assert is_deepspeed_checkpoint(src) and is_deepspeed_checkpoint(
        os.path.join(src, "global_step2")
    )
    assert not is_deepspeed_checkpoint(tmp_path)
    seen = []
    a = convert_deepspeed(
        os.path.join(src, "global_step2"), tmp_path / "a", progress=lambda *x: seen.append(x)
    )
    assert len(seen) == 30 and seen[-1][1:] == (30, 30)
    b = convert_deepspeed(src, tmp_path / "mgr", step=2)
    assert b == os.path.join(str(tmp_path / "mgr"), "2", "state")
    ra, rb = jax_ucp.restore(a), jax_ucp.restore(os.path.join(tmp_path / "mgr", "2"))
    for n in ra["params"]:
        np.testing.assert_array_equal(ra["params"][n], rb["params"][n])
    m = jax_ucp.inspect(a)
    assert m.source["framework"] == "deepspeed" and m.source["zero_stage"] == 2


def test_existing_destination_refused_unless_force(tmp_path):
    src = os.path.join(FIX, "z1_fp32_dp2", "ckpt")
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        convert_deepspeed(src, dst)
    assert (dst / "keep.txt").read_text() == "x"
    # force replaces a checkpoint, never a folder of the user's
    with pytest.raises(OSError, match="refusing to replace it even with force=True"):
        convert_deepspeed(src, dst, force=True)
    assert (dst / "keep.txt").read_text() == "x"
    old = convert_deepspeed(os.path.join(FIX, "z2_fp32_dp2", "ckpt"), tmp_path / "old")
    convert_deepspeed(src, old, force=True)
    assert jax_ucp.inspect(old).source["path"].startswith(os.path.abspath(src))
    assert "params" in jax_ucp.restore(old)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("name", ["z2_bf16_dp3", "z3_fp32_dp3"])
def test_missing_dp_rank_file(tmp_path, name):
    src = copy_deepspeed_fixture(tmp_path, name)
    victim = glob.glob(
        os.path.join(src, "global_step2", "*zero_pp_rank_1_mp_rank_00_optim_states.pt")
    )[0]
    os.remove(victim)
    dst = str(tmp_path / "out")
    with pytest.raises(
        DeepSpeedImportError,
        match=os.path.basename(victim) + ".*missing optimizer file for DP rank 1",
    ):
        convert_deepspeed(src, dst)
    assert_destination_untouched(dst)


def test_missing_stage3_model_states_file(tmp_path):
    src = copy_deepspeed_fixture(tmp_path, "z3_bf16_dp2")
    os.remove(os.path.join(src, "global_step2", "zero_pp_rank_1_mp_rank_00_model_states.pt"))
    with pytest.raises(
        DeepSpeedImportError, match="zero_pp_rank_1_mp_rank_00_model_states.pt: missing"
    ):
        convert_deepspeed(src, tmp_path / "out")
    assert_destination_untouched(str(tmp_path / "out"))


def test_world_size_metadata_disagrees_with_files(tmp_path):
    src = copy_deepspeed_fixture(tmp_path, "z1_fp32_dp2")
    tag = os.path.join(src, "global_step2")
    shutil.copy(
        os.path.join(tag, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        os.path.join(tag, "zero_pp_rank_2_mp_rank_00_optim_states.pt"),
    )
    with pytest.raises(
        DeepSpeedImportError, match=r"world size metadata says 2 DP ranks.*zero_pp_rank_2"
    ):
        convert_deepspeed(src, tmp_path / "out")
    assert_destination_untouched(str(tmp_path / "out"))


def test_checkpoint_from_another_world_size_mixed_in(tmp_path):
    """A dp3 rank-0 file next to dp2 files: partition counts disagree -> named error."""
    src = copy_deepspeed_fixture(tmp_path, "z2_fp32_dp2")
    shutil.copy(
        os.path.join(
            FIX, "z2_fp32_dp3", "ckpt", "global_step2", "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        ),
        os.path.join(src, "global_step2", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    )
    with pytest.raises(
        DeepSpeedImportError,
        match="mp_rank_00_model_states.pt: dp_world_size is 2 but the optimizer "
        "files say 3|missing optimizer file for DP rank 2",
    ):
        convert_deepspeed(src, tmp_path / "out")
    assert_destination_untouched(str(tmp_path / "out"))


@pytest.mark.parametrize("which", ["optim", "model"])
def test_truncated_file(tmp_path, which):
    src = copy_deepspeed_fixture(tmp_path, "z2_bf16_dp2")
    pat = "bf16_zero_pp_rank_1_*optim*" if which == "optim" else "mp_rank_00_model_states.pt"
    victim = glob.glob(os.path.join(src, "global_step2", pat))[0]
    data = open(victim, "rb").read()
    open(victim, "wb").write(data[: len(data) // 2])
    with pytest.raises(TorchFileError, match=os.path.basename(victim)):
        convert_deepspeed(src, tmp_path / "out")
    assert_destination_untouched(str(tmp_path / "out"))


def test_not_a_checkpoint_and_bad_latest(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DeepSpeedImportError, match="no DeepSpeed checkpoint here"):
        convert_deepspeed(empty, tmp_path / "out")
    src = copy_deepspeed_fixture(tmp_path, "z1_fp32_dp2")
    open(os.path.join(src, "latest"), "w").write("global_step9")
    with pytest.raises(DeepSpeedImportError, match="latest names tag 'global_step9'"):
        convert_deepspeed(src, tmp_path / "out")


def test_groups_disagreeing_on_step_is_an_error():
    checkpoint = open_deepspeed_checkpoint(os.path.join(FIX, "z1_fp32_dp3", "ckpt"))
    assert optimizer_step(checkpoint) == 2
    group_state = checkpoint.optim_states[2]["base_optimizer_state"]["state"][0]
    group_state["step"] = np.float32(3)
    with pytest.raises(
        DeepSpeedImportError, match="disagree on the optimizer step: 2 in .*rank_0.*, 3 in .*rank_2"
    ):
        optimizer_step(checkpoint)
