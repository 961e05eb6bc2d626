"""ZeRO-0 in bf16: DeepSpeed's ``FP16_UnfusedOptimizer`` keeps per-parameter fp32 masters and the
torch Adam state inside ``mp_rank_00_model_states.pt``. Before, the optimizer was refused and
``weights_only`` silently gave the bf16 module weights as ``params``.

Fixture ``z0_bf16_dp2``: a real DeepSpeed 0.19.8 run (2 gloo ranks on CPU, made by
``tools/fixtures/make_deepspeed_fixtures.py --live``); truth ``live.npz``, the run's live state
right after the save (module weights, the optimizer's fp32 masters and Adam state, its step).
No torch needed here.
"""

from __future__ import annotations

import os
import warnings

import ml_dtypes
import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.importers.deepspeed import files as deepspeed_files
from jax_ucp.conversion import ImportOptions
from jax_ucp.errors import OptimizerOrderWarning, SourceError
from tests.ucp_testing import REPO, assert_destination_untouched

FIXTURES = os.path.join(REPO, "tests", "fixtures", "deepspeed")
RUN = "z0_bf16_dp2"
SRC = os.path.join(FIXTURES, RUN, "ckpt")
MODEL_FILE = "mp_rank_00_model_states.pt"


def _bits(value) -> tuple:
    value = np.asarray(value)
    if value.dtype == np.dtype("V2"):  # bfloat16 as np.savez stores it
        value = value.view(ml_dtypes.bfloat16)
    return value.dtype, value.shape, value.tobytes()


def _live() -> dict:
    with np.load(os.path.join(FIXTURES, RUN, "live.npz")) as live:
        return {key: live[key] for key in live.files}


def _convert(dest, **kwargs) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizerOrderWarning)
        return jax_ucp.convert(SRC, str(dest), **kwargs)


@pytest.mark.timeout(120)
def test_zero0_bf16_imports_masters_moments_and_step_exact(tmp_path):
    """fp32 masters as ``params``, bf16 module weights as ``model_params``, Adam moments and
    the torch optimizer's step, bit for bit against the live state; the step's offset from
    ``global_steps`` (DeepSpeed's zero-gradient step at build) and the LayerNorm weights that
    only module order tells apart are said and warned."""
    with pytest.warns(OptimizerOrderWarning, match=r"share shape and weights.*h\.0\.ln_1\.weight"):
        dest = jax_ucp.convert(SRC, str(tmp_path / "u"))
    tree = jax_ucp.restore(dest)
    live = _live()
    where = {"param": tree["model_params"], "fp32": tree["params"]}
    where.update(exp_avg=tree["opt_state"]["mu"], exp_avg_sq=tree["opt_state"]["nu"])
    names = {key.split("/", 1)[1] for key in live if key != "step"}
    assert len(names) == 30
    for state, subtree in where.items():
        assert set(subtree) == names, state
        for name in names:
            assert _bits(subtree[name]) == _bits(live[f"{state}/{name}"]), (state, name)
    assert tree["params"]["wte.weight"].dtype == np.float32
    assert int(tree["opt_state"]["count"]) == int(live["step"]) == 3
    source = jax_ucp.inspect(dest).source
    assert (source["ds_optimizer"], source["zero_stage"], source["global_steps"]) == (
        "FP16_UnfusedOptimizer",
        0,
        2,
    )
    assert any("zero-gradient step" in note for note in source["notes"])


@pytest.mark.timeout(120)
def test_zero0_bf16_weights_only_gives_the_fp32_masters(tmp_path):
    """``weights_only`` (before: the bf16 module weights as ``params``, nothing said): the fp32
    masters, and the bf16 weights as ``model_params``, as every other ZeRO import gives."""
    dest = _convert(tmp_path / "w", importing=ImportOptions(weights_only=True))
    tree = jax_ucp.restore(dest)
    assert sorted(tree) == ["model_params", "params"]
    live = _live()
    for name in tree["params"]:
        assert _bits(tree["params"][name]) == _bits(live[f"fp32/{name}"]), name
        assert _bits(tree["model_params"][name]) == _bits(live[f"param/{name}"]), name
    skipped = jax_ucp.inspect(dest).source["skipped"]
    key = f"{MODEL_FILE}:optimizer.optimizer_state_dict.state.4.exp_avg_sq"
    assert skipped[key].startswith("weights_only: ZeRO-0 optimizer state")


def _altered(monkeypatch, alter) -> None:
    """``load_deepspeed_file`` as the importer sees it, ``alter(model_states)`` applied to the
    model states file."""
    load = deepspeed_files.load_deepspeed_file

    def altered(folder, path, **kwargs):
        state = load(folder, path, **kwargs)
        if os.path.basename(path) == MODEL_FILE:
            alter(state)
        return state

    monkeypatch.setattr(deepspeed_files, "load_deepspeed_file", altered)


@pytest.mark.timeout(120)
def test_zero0_bf16_without_masters_says_which_weights_were_taken(tmp_path, monkeypatch):
    """A bf16 ZeRO-0 file without the optimizer's masters: ``weights_only`` takes the bf16
    module weights and says so (``source.notes`` and a warning), never silently."""

    def drop(states):
        states["optimizer"] = None

    _altered(monkeypatch, drop)
    with pytest.warns(UserWarning, match=r"module weights in the run's bfloat16, not fp32 masters"):
        dest = jax_ucp.convert(SRC, str(tmp_path / "w"), importing=ImportOptions(weights_only=True))
    tree = jax_ucp.restore(dest)
    assert tree["params"]["wte.weight"].dtype == ml_dtypes.bfloat16
    notes = jax_ucp.inspect(dest).source["notes"]
    assert any(f"{MODEL_FILE} holds no optimizer state" in note for note in notes)


@pytest.mark.timeout(120)
def test_a_master_of_no_module_weight_is_refused(tmp_path, monkeypatch):
    """A master from another save (it rounds to no module weight): refused naming it."""

    def stale(states):
        group = states["optimizer"]["fp32_groups"][0]
        group[6] = group[6] + np.float32(0.5)

    _altered(monkeypatch, stale)
    with pytest.raises(SourceError, match=rf"{MODEL_FILE}: optimizer\.fp32_groups\.0\.6 \(shape"):
        _convert(tmp_path / "out")
    assert_destination_untouched(str(tmp_path / "out"))


@pytest.mark.timeout(120)
def test_a_master_differing_beyond_the_matched_sample_is_refused(tmp_path, monkeypatch):
    """A master that matches on the elements compared up front but not everywhere: refused as
    it is read, naming the tensor and the parameter; nothing committed."""

    def one_element(states):
        group = states["optimizer"]["fp32_groups"][0]
        master = np.array(group[0])  # wte.weight, 592 elements: 64 compared up front
        flat = master.reshape(-1)
        assert flat.size > 64
        flat[1] += np.float32(1.0)  # between the sampled elements 0 and ~9
        group[0] = master

    _altered(monkeypatch, one_element)
    with pytest.raises(
        SourceError, match=r"fp32_groups\.0\.0: the fp32 master of 'wte\.weight' does not round"
    ):
        _convert(tmp_path / "out")
    assert_destination_untouched(str(tmp_path / "out"))


@pytest.mark.timeout(120)
def test_a_module_weight_the_optimizer_never_had_is_frozen(tmp_path, monkeypatch):
    """A parameter not handed to the optimizer (requires_grad=False): imported as the module
    weight in bf16, marked frozen, without moments; the others keep their masters."""

    def freeze_wpe(states):
        optimizer = states["optimizer"]
        del optimizer["fp32_groups"][0][1]  # wpe.weight, the second parameter
        inner = optimizer["optimizer_state_dict"]
        inner["param_groups"][0]["params"].remove(1)
        del inner["state"][1]

    _altered(monkeypatch, freeze_wpe)
    dest = _convert(tmp_path / "u")
    tree = jax_ucp.restore(dest)
    live = _live()
    assert _bits(tree["params"]["wpe.weight"]) == _bits(live["param/wpe.weight"])
    assert "wpe.weight" not in tree["opt_state"]["mu"]
    assert _bits(tree["params"]["h.0.ln_1.weight"]) == _bits(live["fp32/h.0.ln_1.weight"])
    source = jax_ucp.inspect(dest).source
    assert source["frozen_params"] == ["wpe.weight"]


@pytest.mark.timeout(120)
def test_weight_decay_param_groups_match_by_module_order_within_each_group(tmp_path, monkeypatch):
    """The Trainer's two param groups (matrices with weight decay, the rest without; each in
    module order, renumbered by torch): every master, moment and step lands on its parameter."""

    def two_groups(states):
        optimizer = states["optimizer"]
        masters = optimizer["fp32_groups"][0]
        inner = optimizer["optimizer_state_dict"]
        group, state = inner["param_groups"][0], inner["state"]
        decay = [i for i, m in enumerate(masters) if m.ndim == 2]
        rest = [i for i, m in enumerate(masters) if m.ndim != 2]
        optimizer["fp32_groups"] = [[masters[i] for i in decay], [masters[i] for i in rest]]
        inner["param_groups"] = [
            dict(group, params=list(range(len(decay)))),
            dict(group, params=list(range(len(decay), len(masters))), weight_decay=0.0),
        ]
        inner["state"] = {new: state[old] for new, old in enumerate(decay + rest)}

    _altered(monkeypatch, two_groups)
    tree = jax_ucp.restore(_convert(tmp_path / "u"))
    live = _live()
    for name in tree["params"]:
        assert _bits(tree["params"][name]) == _bits(live[f"fp32/{name}"]), name
        assert _bits(tree["opt_state"]["nu"][name]) == _bits(live[f"exp_avg_sq/{name}"]), name
    assert len(tree["params"]) == 30


@pytest.mark.timeout(120)
def test_a_tied_weight_is_left_out_as_deepspeeds_shared_params(tmp_path, monkeypatch):
    """``lm_head.weight`` the same tensor as ``wte.weight`` (one parameter, one master): not
    imported as a frozen weight but recorded as tied, as DeepSpeed's shared_params are."""

    def tie(states):
        module = states["module"]
        module["lm_head.weight"] = module["wte.weight"]
        optimizer = states["optimizer"]
        del optimizer["fp32_groups"][0][28]  # lm_head.weight
        inner = optimizer["optimizer_state_dict"]
        inner["param_groups"][0]["params"].remove(28)
        del inner["state"][28]

    _altered(monkeypatch, tie)
    dest = _convert(tmp_path / "u")
    tree = jax_ucp.restore(dest)
    assert "lm_head.weight" not in tree["params"] and len(tree["params"]) == 29
    source = jax_ucp.inspect(dest).source
    assert source["shared_params"] == {"lm_head.weight": "wte.weight"}
    assert source["frozen_params"] == []
    assert source["skipped"][f"{MODEL_FILE}:module.lm_head.weight"].startswith("tied to")
