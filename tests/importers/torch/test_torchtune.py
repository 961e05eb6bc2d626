"""A torchtune 0.6.1 output folder written by torchtune itself
(tools/fixtures/make_torchtune_fixture.py: FullModelHFCheckpointer, torchtune's llama3 model, 3
AdamW steps, an intermediate checkpoint): recognised by auto-detection; the epoch's weights are
imported bit-exact (Hugging Face names and row order); the recipe's optimizer state (keyed by
index, as the single-device recipes save it) imports with parameter_order, keyed by torchtune's
names (the distributed recipes) without: moments renamed and their q/k rows permuted as the
checkpointer permuted the weights, bit-exact against the run's live state."""

from __future__ import annotations

import os
import re
import shutil
import warnings

import numpy as np
import pytest
from safetensors.numpy import load_file

import jax_ucp
from jax_ucp._src.importers.torch import torchtune_order
from jax_ucp._src.torchfiles import torch_zip
from jax_ucp.conversion import ImportOptions, TorchOptions
from tests.ucp_testing import (
    REPO,
    assert_bit_exact,
    assert_destination_untouched,
    assert_source_refused,
    rewrite_zip_member,
)

pytestmark = pytest.mark.timeout(120)
FIXTURES = os.path.join(REPO, "tests", "fixtures", "torchtune")
SRC = os.path.join(FIXTURES, "tt_fp32")
TRUTH = np.load(SRC + ".truth.npz")
#: tools/fixtures/make_torchtune_dist_fixtures.py: the distributed recipe's saves (2 ranks)
DIST = os.path.join(FIXTURES, "tt_dist_fp32")
ASYNC = os.path.join(FIXTURES, "tt_dist_async")
DIST_TRUTH = np.load(os.path.join(FIXTURES, "tt_dist.truth.npz"))
#: torchtune's names in model.named_parameters() order (the generator saved the truth so)
ORDER = [k[len("param/") :] for k in TRUTH.files if k.startswith("param/")]
HEADS = {"q_proj": 4, "k_proj": 2}  # the fixture's config.json: 4 heads, 2 kv heads, head_dim 8


def _hf_rows(value: np.ndarray, name: str) -> np.ndarray:
    """torchtune's q/k rows in Hugging Face's order, written out row by row: HF row
    ``h*8 + j*4 + i`` is torchtune's row ``h*8 + 2*i + j`` (the interleaved RoPE pairs split
    into halves); other tensors unchanged."""
    heads = next((n for proj, n in HEADS.items() if f"attn.{proj}" in name), None)
    if heads is None:
        return value
    rows = [h * 8 + 2 * i + j for h in range(heads) for j in range(2) for i in range(4)]
    return value[rows]


def _hf_name(name: str) -> str:
    table = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.scale": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if name in table:
        return table[name]
    layer, rest = name.split(".")[1], ".".join(name.split(".")[2:])
    parts = {
        "attn.q_proj.weight": "self_attn.q_proj.weight",
        "attn.k_proj.weight": "self_attn.k_proj.weight",
        "attn.v_proj.weight": "self_attn.v_proj.weight",
        "attn.output_proj.weight": "self_attn.o_proj.weight",
        "mlp.w1.weight": "mlp.gate_proj.weight",
        "mlp.w2.weight": "mlp.down_proj.weight",
        "mlp.w3.weight": "mlp.up_proj.weight",
        "sa_norm.scale": "input_layernorm.weight",
        "mlp_norm.scale": "post_attention_layernorm.weight",
    }
    return f"model.layers.{layer}.{parts[rest]}"


def _assert_the_live_run(out, truth=TRUTH) -> None:
    """Weights, moments and step of the import equal the run's live state under Hugging Face's
    names and row order, bit for bit."""
    got = jax_ucp.restore(out)
    assert [k[len("param/") :] for k in truth.files if k.startswith("param/")] == ORDER
    assert sorted(got["params"]) == sorted(map(_hf_name, ORDER))
    for name in ORDER:
        hf = _hf_name(name)
        assert_bit_exact(got["params"][hf], _hf_rows(truth[f"param/{name}"], name), hf)
        mu, nu = got["opt_state"]["mu"][hf], got["opt_state"]["nu"][hf]
        assert_bit_exact(mu, _hf_rows(truth[f"exp_avg/{name}"], name), f"mu {hf}")
        assert_bit_exact(nu, _hf_rows(truth[f"exp_avg_sq/{name}"], name), f"nu {hf}")
    assert int(got["opt_state"]["count"]) == int(truth["step"]) == 3


def test_index_keyed_optimizer_imports_with_parameter_order_bit_exact(tmp_path):
    out = jax_ucp.convert(SRC, tmp_path / "ucp", importing=TorchOptions(parameter_order=ORDER))
    _assert_the_live_run(out)
    source = jax_ucp.inspect(out).source
    assert source["optimizer_keyed_by"] == "index"
    assert source["qk_permuted"] == {"heads": 4, "kv_heads": 2, "head_dim": 8}
    assert source["recipe"] == {
        "seed": 0,
        "epochs_run": 1,
        "total_epochs": 2,
        "max_steps_per_epoch": 3,
    }
    (group,) = source["optimizer"]["param_groups"]
    assert (group["lr"], group["weight_decay"]) == (0.01, 0.1)
    assert group["params"] == [_hf_name(n) for n in ORDER]


def test_parameter_order_of_another_length_is_refused(tmp_path):
    with pytest.raises(jax_ucp.UCPError, match=r"recipe_state\.pt: parameter_order names 20 .*21"):
        jax_ucp.convert(
            SRC, tmp_path / "refused", importing=TorchOptions(parameter_order=ORDER[:-1])
        )
    assert_destination_untouched(tmp_path / "refused")


def test_torchtune_folder_weights_import_and_index_keyed_optimizer_asks_for_the_order(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(torchtune_order, "torchtune_builder", lambda: None)  # not installed
    with pytest.raises(
        jax_ucp.UCPError,
        match=r"recipe_state\.pt: torchtune's optimizer state, keyed by index \(\d+ parameters "
        r"in 1 param group, indices 0, 1, 2, \.\.\., without their names\)\. Give its order: "
        r"parameter_order=\[n for n, _ in model\.named_parameters\(\)\].*weights_only=True",
    ):
        jax_ucp.convert(SRC, tmp_path / "refused")
    assert_destination_untouched(tmp_path / "refused")
    out = jax_ucp.convert(SRC, tmp_path / "ucp", importing=ImportOptions(weights_only=True))
    got = jax_ucp.restore(out)
    want = load_file(os.path.join(SRC, "epoch_0", "model-00001-of-00001.safetensors"))
    assert sorted(got) == ["params"]
    assert sorted(got["params"]) == sorted(want)
    assert "model.layers.0.self_attn.q_proj.weight" in want  # Hugging Face's names
    for name, value in want.items():
        assert_bit_exact(got["params"][name], value, name)
    source = jax_ucp.inspect(out).source
    assert (source["framework"], source["epoch"]) == ("torchtune", "epoch_0")
    assert source["skipped"] == {
        "recipe_state/recipe_state.pt": "weights_only: torchtune's recipe state (optimizer, seed)"
    }


def test_only_the_latest_epoch_is_imported_and_the_others_are_listed(tmp_path):
    src = shutil.copytree(SRC, tmp_path / "run")
    shutil.copytree(os.path.join(src, "epoch_0"), os.path.join(src, "epoch_1"))
    out = jax_ucp.convert(src, tmp_path / "ucp", importing=ImportOptions(weights_only=True))
    source = jax_ucp.inspect(out).source
    assert source["epoch"] == "epoch_1"
    assert source["skipped"]["epoch_0/"] == "an earlier epoch's checkpoint (epoch_1/ imported)"


def _rekeyed_recipe(tmp_path, per_parameter: bool = False) -> str:
    """The fixture with its recipe state keyed by torchtune's parameter names, as the
    distributed recipes save it (``get_full_optimizer_state_dict``), or one optimizer per
    parameter (optimizer in backward); written torch-free."""
    src = shutil.copytree(SRC, tmp_path / "tt")
    path = os.path.join(src, "recipe_state", "recipe_state.pt")
    recipe = torch_zip.load_torch_file(path)
    optimizer = recipe["optimizer"]
    arrays: list[np.ndarray] = []

    def slot(value):
        arrays.append(np.array(value))
        return torch_zip.TensorSlot(len(arrays) - 1, value.shape, value.dtype)

    names = dict(enumerate(ORDER))
    state = {
        names[i]: {k: slot(v) if isinstance(v, np.ndarray) else v for k, v in per.items()}
        for i, per in optimizer["state"].items()
    }
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in optimizer["param_groups"]]
    if per_parameter:
        saved = {n: {"state": {n: s}, "param_groups": groups} for n, s in state.items()}
    else:
        saved = {"state": state, "param_groups": groups}
    torch_zip.save_file(path, {**recipe, "optimizer": saved}, arrays)
    return str(src)


def test_distributed_recipe_state_keyed_by_names_imports_bit_exact(tmp_path):
    """The distributed recipe (2 ranks, FSDP2) keys the optimizer by torchtune's names
    (get_full_optimizer_state_dict): mapped by torchtune's table, by auto-detection, no order
    needed (and parameter_order refused as not applying)."""
    out = jax_ucp.convert(DIST, tmp_path / "ucp")
    _assert_the_live_run(out, DIST_TRUTH)
    source = jax_ucp.inspect(out).source
    assert (source["framework"], source["optimizer_keyed_by"]) == ("torchtune", "name")
    with pytest.raises(jax_ucp.UCPError, match=r"keyed by torchtune's parameter names; param"):
        jax_ucp.convert(DIST, tmp_path / "refused", importing=TorchOptions(parameter_order=ORDER))
    assert_destination_untouched(tmp_path / "refused")


def test_moments_whose_storage_type_was_rewritten_to_integers_are_refused(tmp_path):
    """``FloatStorage`` renamed ``IntStorage`` in recipe_state.pt's data.pkl (CRCs made to
    agree, the same 4 bytes per element): the Adam moments were imported as int32 bit patterns,
    by convert and by a direct restore alike (harness ``torchtune`` seed 11 #25). A torch
    optimizer's state is floating point: refused naming the state, the parameter and the file."""
    src = shutil.copytree(DIST, tmp_path / "tt")
    rewrite_zip_member(
        src / "recipe_state" / "recipe_state.pt",
        "/data.pkl",
        lambda b: b.replace(b"FloatStorage", b"IntStorage"),
    )
    said = r"optimizer state 'exp_avg(_sq)?' of '[a-z_.0-9]+' is int32; .*floating point"
    assert_source_refused(src, tmp_path / "refused", said)


def test_a_recipe_state_folder_without_its_file_is_refused_not_weights_only(tmp_path):
    """recipe_state/ left empty (recipe_state.pt deleted): the weights were imported alone
    without a word (harness ``torchtune`` seed 13 #13). torchtune makes the folder only to
    write the file into it: refused, by convert and a direct restore; weights_only=True takes
    the weights."""
    src = shutil.copytree(DIST, tmp_path / "tt")
    os.remove(src / "recipe_state" / "recipe_state.pt")
    said = r"recipe_state/ is here without recipe_state\.pt .* weights_only=True"
    assert_source_refused(src, tmp_path / "refused", said)
    out = jax_ucp.convert(src, tmp_path / "weights", importing=ImportOptions(weights_only=True))
    assert list(jax_ucp.restore(out)) == ["params"]


def test_an_earlier_epochs_recipe_state_is_never_merged_with_the_latest_weights(tmp_path):
    """A finished two-epoch run: epoch_0/ and recipe_state/ (saved after 1 epoch) from the
    intermediate save, epoch_1/ from the final one, which writes no recipe state. Before:
    epoch_1's weights imported with epoch_0's Adam moments and step, without a word. Now the
    weights alone, the recipe state listed in ``source.skipped`` as epoch_0's, a note and a
    warning; by convert and a direct restore."""
    src = shutil.copytree(DIST, tmp_path / "tt")
    shutil.copytree(src / "epoch_0", src / "epoch_1")
    says = (
        r"recipe_state\.pt is the recipe state saved after 1 epoch\(s\) \(epoch_0/'s\), not epoch_1"
    )
    with pytest.warns(UserWarning, match=says):
        out = jax_ucp.convert(src, tmp_path / "out")
    source = jax_ucp.inspect(out).source
    assert re.search(says, source["skipped"]["recipe_state/recipe_state.pt"])
    assert re.search(says, source["notes"][-1]) and source["epoch"] == "epoch_1"
    with pytest.warns(UserWarning, match=says):
        assert list(jax_ucp.restore(src)) == list(jax_ucp.restore(out)) == ["params"]


@pytest.mark.parametrize("change", ["recipe_state.bak", "two epochs", "one epoch"])
def test_a_recipe_state_renamed_or_gone_beside_an_earlier_epoch_is_said(tmp_path, change):
    """recipe_state/ renamed (``recipe_state.bak``), or removed while an earlier epoch's
    folder shows a recipe wrote one: the weights alone, a warning and a note saying so
    (before: no word). Removed beside one epoch: a final epoch's save, no word."""
    src = shutil.copytree(DIST, tmp_path / "tt")
    if change == "recipe_state.bak":
        os.rename(src / "recipe_state", src / change)
    else:
        shutil.rmtree(src / "recipe_state")
    if change == "two epochs":
        shutil.copytree(src / "epoch_0", src / "epoch_1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = jax_ucp.convert(src, tmp_path / "out")
    said = [str(w.message) for w in caught if "imported alone" in str(w.message)]
    notes = jax_ucp.inspect(out).source.get("notes", [])
    if change == "one epoch":
        assert said == [] and not [n for n in notes if "imported alone" in n]
    else:
        assert len(said) == 1 and "no recipe_state/recipe_state.pt beside" in said[0]
        assert ("recipe_state.bak" if change != "two epochs" else "epoch_0") in said[0]
        assert said[0].endswith(notes[-1])
    assert list(jax_ucp.restore(out)) == ["params"]


def test_a_model_type_tune_to_hf_does_not_convert_is_refused(tmp_path):
    src = shutil.copytree(DIST, tmp_path / "tt")
    config = os.path.join(src, "epoch_0", "config.json")
    with open(config) as f:
        text = f.read()
    with open(config, "w") as f:
        f.write(text.replace('"model_type": "llama"', '"model_type": "qwen2"'))
    with pytest.raises(jax_ucp.UCPError, match=r"config\.json: model_type 'qwen2'.*weights_only"):
        jax_ucp.convert(src, tmp_path / "refused")


@pytest.mark.parametrize(
    "change, says",
    [
        ('"num_attention_heads": 4', r"num_attention_heads 0, .*positive integer"),
        ('"num_key_value_heads": 2', r"num_key_value_heads -2, .*positive integer"),
        ("link", r"config\.json: not read .*q/k heads"),
    ],
    ids=["zero heads", "negative kv heads", "linked out"],
)
def test_a_hostile_config_of_the_heads_is_refused(tmp_path, change, says):
    """The q/k moments are permuted by config.json's heads: heads that are not positive, or a
    config.json linked out of the checkpoint, are refused naming the file, nothing written."""
    src = shutil.copytree(DIST, tmp_path / "tt")
    config = os.path.join(src, "epoch_0", "config.json")
    if change == "link":
        outside = tmp_path / "elsewhere.json"
        shutil.move(config, outside)
        os.symlink(outside, config)
    else:
        with open(config) as f:
            text = f.read()
        assert change in text
        bad = change.replace(": 4", ": 0") if "attention" in change else change.replace("2", "-2")
        with open(config, "w") as f:
            f.write(text.replace(change, bad))
    with pytest.raises(jax_ucp.UCPError, match=says):
        jax_ucp.convert(src, tmp_path / "refused")
    assert_destination_untouched(tmp_path / "refused")


def test_optimizer_in_backward_recipe_state_refusal_says_one_per_parameter(tmp_path):
    src = _rekeyed_recipe(tmp_path, per_parameter=True)
    with pytest.raises(jax_ucp.UCPError, match=r"one optimizer per parameter \(optimizer in "):
        jax_ucp.convert(src, tmp_path / "refused")


def test_optax_from_torch_continues_the_torchtune_run_saying_what_the_files_lack(tmp_path):
    """The recipe state records AdamW's groups and step, not the recipe's schedule or
    clipping (those are in its YAML config): the translation says so."""
    out = jax_ucp.convert(SRC, tmp_path / "ucp", importing=TorchOptions(parameter_order=ORDER))
    with pytest.warns(UserWarning, match="gradient clipping"):
        run = jax_ucp.optax_from_torch(out)
    assert (run.optimizer, run.step) == ("adamw", 3)
    assert any("schedule" in u for u in run.unrecovered)
    assert any("clipping" in u for u in run.unrecovered)


def _assert_the_live_dist_run(out, *, moments: bool = True) -> None:
    """dist_epoch_N/ as saved: torchtune's names and row order, bit for bit."""
    got = jax_ucp.restore(out)
    assert sorted(got["params"]) == sorted(ORDER)
    for name in ORDER:
        assert_bit_exact(got["params"][name], DIST_TRUTH[f"param/{name}"], name)
        if moments:
            assert_bit_exact(got["opt_state"]["mu"][name], DIST_TRUTH[f"exp_avg/{name}"], name)
            assert_bit_exact(got["opt_state"]["nu"][name], DIST_TRUTH[f"exp_avg_sq/{name}"], name)
    if moments:
        assert int(got["opt_state"]["count"]) == int(DIST_TRUTH["step"]) == 3
    else:
        assert "opt_state" not in got


def test_async_dist_epoch_is_detected_and_imports_with_parameter_order_bit_exact(tmp_path):
    """torchtune's asynchronous save (DistributedCheckpointer, 2 ranks): dist_epoch_0/ torch DCP,
    the optimizer keyed by index; the output folder and dist_epoch_0/ itself both import."""
    out = jax_ucp.convert(ASYNC, tmp_path / "ucp", importing=TorchOptions(parameter_order=ORDER))
    _assert_the_live_dist_run(out)
    source = jax_ucp.inspect(out).source
    assert (source["framework"], source["epoch"]) == ("torchtune", "dist_epoch_0")
    assert source["optimizer_keyed_by"] == "index"
    assert source["optimizer"]["param_groups"][0]["params"] == ORDER
    inner = os.path.join(ASYNC, "dist_epoch_0")
    out = jax_ucp.convert(inner, tmp_path / "inner", importing=TorchOptions(parameter_order=ORDER))
    _assert_the_live_dist_run(out)
    assert jax_ucp.inspect(out).source["framework"] == "torch_dcp"


def test_async_dist_epoch_without_order_asks_for_it_and_imports_weights_only(tmp_path, monkeypatch):
    monkeypatch.setattr(torchtune_order, "torchtune_builder", lambda: None)  # not installed
    with pytest.raises(
        jax_ucp.UCPError,
        match=r"dist_epoch_0: the optimizer state is keyed by index \(21 parameters, indices 0, "
        r"1, 2, \.\.\..*parameter_order=\[n for n, _ in model\.named_parameters\(\)\].*"
        r"weights_only=True",
    ):
        jax_ucp.convert(ASYNC, tmp_path / "refused")
    assert_destination_untouched(tmp_path / "refused")
    out = jax_ucp.convert(ASYNC, tmp_path / "ucp", importing=ImportOptions(weights_only=True))
    _assert_the_live_dist_run(out, moments=False)
    skipped = jax_ucp.inspect(out).source["skipped"]
    assert skipped["optimizer.state.0.exp_avg"] == "weights_only: optimizer state not imported"
    with pytest.raises(jax_ucp.UCPError, match=r"parameter_order names 20 .*number 21"):
        jax_ucp.convert(
            ASYNC, tmp_path / "short", importing=TorchOptions(parameter_order=ORDER[:-1])
        )


def test_the_latest_epoch_of_either_save_is_imported(tmp_path):
    """dist_epoch_1/ after epoch_0/: the DCP one, epoch_0/ and recipe_state.pt skipped; epoch_1/
    after dist_epoch_0/ (the final, synchronous save): the safetensors one."""
    run = shutil.copytree(DIST, tmp_path / "run")
    shutil.copytree(os.path.join(ASYNC, "dist_epoch_0"), run / "dist_epoch_1")
    out = jax_ucp.convert(run, tmp_path / "a", importing=TorchOptions(parameter_order=ORDER))
    source = jax_ucp.inspect(out).source
    assert source["epoch"] == "dist_epoch_1"
    assert source["skipped"]["epoch_0/"] == "an earlier epoch's checkpoint (dist_epoch_1/ imported)"
    assert "recipe_state/recipe_state.pt" in source["skipped"]
    _assert_the_live_dist_run(out)
    os.rename(run / "dist_epoch_1", run / "dist_epoch_0")
    shutil.copytree(run / "epoch_0", run / "epoch_1")
    with pytest.warns(UserWarning, match=r"after 1 epoch\(s\) \(epoch_0/'s\), not epoch_1/'s"):
        out = jax_ucp.convert(run, tmp_path / "b")  # recipe_state.pt is epoch_0's: not merged
    source = jax_ucp.inspect(out).source
    assert source["epoch"] == "epoch_1"
    assert source["skipped"]["dist_epoch_0/"] == "an earlier epoch's checkpoint (epoch_1/ imported)"
    weights = jax_ucp.restore(
        jax_ucp.convert(DIST, tmp_path / "w", importing=ImportOptions(weights_only=True))
    )
    got = jax_ucp.restore(out)
    assert (
        list(got) == list(weights) == ["params"]
        and got["params"].keys() == weights["params"].keys()
    )
    for name, value in weights["params"].items():
        assert_bit_exact(got["params"][name], value, name)


@pytest.mark.torch
def test_verify_against_the_source_compares_the_permuted_moments_equal(tmp_path):
    """verify(against=) reads recipe_state.pt with torch.load and moves the q/k moments' rows
    as the import did (the provenance says so): every weight and moment equal; the DCP save is
    read from its dist_epoch_0/ folder."""
    out = jax_ucp.convert(DIST, tmp_path / "ucp")
    q = "opt_state/mu/model.layers.0.self_attn.q_proj.weight"
    raw = DIST_TRUTH["exp_avg/layers.0.attn.q_proj.weight"]  # torchtune's rows, as saved
    assert not np.array_equal(np.asarray(jax_ucp.restore(out)["opt_state"]["mu"][q[13:]]), raw)
    result = jax_ucp.verify(out, against=DIST)
    assert list(result) == []
    assert result.notices == []  # the step, built from 21 steps: with the import planned again
    assert result.against is not None and result.against.rebuilt == ["opt_state/count"]
    out = jax_ucp.convert(ASYNC, tmp_path / "async", importing=TorchOptions(parameter_order=ORDER))
    result = jax_ucp.verify(out, against=ASYNC)
    assert list(result) == [] and result.notices == []


def test_an_epoch_folder_named_in_other_digits_is_no_epoch(tmp_path):
    """``epoch_٥`` (Arabic-Indic five) beside ``epoch_0``: ``\\d`` and ``int()`` read it as epoch
    5 and imported it over epoch_0; only ASCII digits number an epoch."""
    src = shutil.copytree(SRC, tmp_path / "run")
    shutil.copytree(os.path.join(src, "epoch_0"), os.path.join(src, "epoch_\u0665"))
    out = jax_ucp.convert(src, tmp_path / "ucp", importing=ImportOptions(weights_only=True))
    assert jax_ucp.inspect(out).source["epoch"] == "epoch_0"


def test_two_names_for_one_epoch_are_refused_naming_both(tmp_path):
    """``epoch_5`` and ``epoch_05`` are both epoch 5: which one is "the latest" is no choice to
    make silently."""
    src = shutil.copytree(SRC, tmp_path / "run")
    for name in ("epoch_5", "epoch_05"):
        shutil.copytree(os.path.join(src, "epoch_0"), os.path.join(src, name))
    with pytest.raises(jax_ucp.UCPError, match=r"'epoch_05' and 'epoch_5' both name epoch 5"):
        jax_ucp.convert(src, tmp_path / "refused", importing=ImportOptions(weights_only=True))
    assert_destination_untouched(tmp_path / "refused")


@pytest.mark.parametrize("what", ["recipe_state", "recipe_state/recipe_state.pt"])
def test_a_recipe_state_linked_out_of_the_output_folder_is_refused(tmp_path, what):
    """``recipe_state/`` (or its file) a link to a copy elsewhere: refused naming it, not read;
    before: its optimizer state read through the link (found by tests/hostile)."""
    src = shutil.copytree(DIST, tmp_path / "tt")
    shutil.move(src / what, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", src / what)
    with pytest.raises(jax_ucp.UnsafeFileError, match=r"recipe_state.*outside the checkpoint"):
        jax_ucp.convert(src, tmp_path / "refused")
    assert_destination_untouched(tmp_path / "refused")
