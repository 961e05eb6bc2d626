"""The DeepSpeed rank files: DeepSpeed's ``BF16_Optimizer`` (bf16 at ZeRO-1 with
``data_types.grad_accum_dtype`` fp32), whose ``bf16_zero_pp_rank_*`` files hold ZeRO-1's
partitions without a ``zero_stage`` (refused before as "missing 'zero_stage'", weights included).

Fixture ``bf16opt_z1_dp2``: a real DeepSpeed 0.19.8 run (2 gloo ranks on CPU, made by
``tools/fixtures/make_deepspeed_fixtures.py --live``); truth ``live.npz``, the run's live state
right after the save (``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``), and
``ref_universal.npz``, ``ds_to_universal``'s output for the same files. No torch needed here.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.importers.deepspeed import files as deepspeed_files
from jax_ucp.conversion import ImportOptions
from jax_ucp.errors import SourceError
from tests.ucp_testing import REPO, assert_destination_untouched, copy_deepspeed_fixture

FIXTURES = os.path.join(REPO, "tests", "fixtures", "deepspeed")
RUN = "bf16opt_z1_dp2"


def _bits(value) -> tuple:
    value = np.asarray(value)
    if value.dtype == np.dtype("V2"):  # bfloat16 as np.savez stores it
        value = value.view(ml_dtypes.bfloat16)
    return value.dtype, value.shape, value.tobytes()


def _compare_live(tree: dict, *, weights_only: bool = False) -> int:
    """Every live tensor equals the import's bit for bit; returns how many were compared."""
    live = np.load(os.path.join(FIXTURES, RUN, "live.npz"))
    where = {"param": tree["model_params"], "fp32": tree["params"]}
    if not weights_only:
        where.update(exp_avg=tree["opt_state"]["mu"], exp_avg_sq=tree["opt_state"]["nu"])
        assert int(tree["opt_state"]["count"]) == int(live["step"]) == 2
    names = {k.split("/", 1)[1] for k in live.files if k != "step"}
    compared = 0
    for state, subtree in where.items():
        assert set(subtree) == names, state
        for name in names:
            assert _bits(subtree[name]) == _bits(live[f"{state}/{name}"]), (state, name)
            compared += 1
    return compared


@pytest.mark.timeout(120)
def test_bf16_optimizer_imports_exact_against_live_and_ds_to_universal(tmp_path):
    """fp32 masters, Adam moments, step and the bf16 module weights, bit for bit against the
    run's live state and ds_to_universal; recorded as a BF16_Optimizer at ZeRO-1."""
    dest = jax_ucp.convert(os.path.join(FIXTURES, RUN, "ckpt"), str(tmp_path / "u"))
    tree = jax_ucp.restore(dest)
    assert _compare_live(tree) == 4 * 30
    universal = np.load(os.path.join(FIXTURES, RUN, "ref_universal.npz"))
    trees = {"fp32": tree["params"], "exp_avg": tree["opt_state"]["mu"]}
    trees["exp_avg_sq"] = tree["opt_state"]["nu"]
    for key in universal.files:
        name, state = key.rsplit("/", 1)
        if state == "step":
            assert int(universal[key]) == int(tree["opt_state"]["count"])
        else:
            np.testing.assert_array_equal(trees[state][name], universal[key], err_msg=key)
    source = jax_ucp.inspect(dest).source
    assert (source["ds_optimizer"], source["zero_stage"], source["dp_world_size"]) == (
        "BF16_Optimizer",
        1,
        2,
    )


@pytest.mark.timeout(120)
def test_bf16_optimizer_weights_only(tmp_path):
    dest = jax_ucp.convert(
        os.path.join(FIXTURES, RUN, "ckpt"),
        str(tmp_path / "w"),
        importing=ImportOptions(weights_only=True),
    )
    tree = jax_ucp.restore(dest)
    assert sorted(tree) == ["model_params", "params"]
    assert _compare_live(tree, weights_only=True) == 2 * 30


def _altered(monkeypatch, file: str, alter) -> None:
    """``load_deepspeed_file`` as the importer sees it, ``alter(optimizer_state_dict)`` applied
    to rank file ``file``."""
    load = deepspeed_files.load_deepspeed_file

    def altered(folder, path, **kwargs):
        state = load(folder, path, **kwargs)
        if os.path.basename(path) == file:
            alter(state["optimizer_state_dict"])
        return state

    monkeypatch.setattr(deepspeed_files, "load_deepspeed_file", altered)


@pytest.mark.timeout(120)
def test_a_state_without_zero_stage_that_is_no_bf16_optimizers_is_refused(tmp_path, monkeypatch):
    """No ``zero_stage`` and not BF16_Optimizer's entries either: refused naming the file and
    what it holds, nothing written."""
    file = "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    _altered(monkeypatch, file, lambda state: state.pop("param_slice_mappings"))
    with pytest.raises(SourceError, match=rf"{file}: missing 'zero_stage' and not a BF16_Opt"):
        jax_ucp.convert(os.path.join(FIXTURES, RUN, "ckpt"), str(tmp_path / "out"))
    assert_destination_untouched(str(tmp_path / "out"))


@pytest.mark.timeout(120)
def test_bf16_optimizer_and_zero_rank_files_mixed_are_refused(tmp_path):
    """DP rank 1's file from a ZeRO-optimizer run of the same model beside a BF16_Optimizer's
    rank 0 (same file names): two runs mixed, refused naming the file."""
    src = copy_deepspeed_fixture(tmp_path, RUN)
    file = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    other = os.path.join(FIXTURES, "z1_bf16_dp2", "ckpt", "global_step2", file)
    with open(other, "rb") as f, open(os.path.join(src, "global_step2", file), "wb") as g:
        g.write(f.read())
    with pytest.raises(SourceError, match=rf"{file}: not a BF16_Optimizer's state"):
        jax_ucp.convert(src, str(tmp_path / "out"))
    assert_destination_untouched(str(tmp_path / "out"))
