"""A torchtune LoRA run (issue 70): its recipe's optimizer state is over the adapter's
``lora_a`` / ``lora_b``, which import (in peft's names and q/k rows, as torchtune's own
``adapter_model.safetensors``) with their moments, and ``optax_from_torch`` takes torchtune's next
step; the merged ``epoch_N/`` weights are not the base and are listed in ``source.skipped``.

tests/fixtures/torchtune/tt_lora was written by torchtune 0.6.1 itself
(tools/fixtures/make_torchtune_lora_fixture.py: ``lora_llama3`` r=4 on q/k/v, the single-device
recipe's optimizer over ``model.parameters()``, keyed by index), tt_dora the same with
``use_dora=True`` (``--dora``: its magnitudes checked there against peft's DoRA forward). The other
runs here are
SYNTHETIC (``_synthetic``): tests/fixtures/torchtune/tt_fp32 with a LoRA recipe's files written
torch-free, for the layouts the real run does not show (keyed by name, no adapter file)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jax_ucp
from jax_ucp._src.importers.torch import torchtune, torchtune_order
from jax_ucp._src.torchfiles import torch_zip
from jax_ucp.conversion import ImportOptions
from tests.ucp_testing import REPO, assert_bit_exact

SRC = os.path.join(REPO, "tests", "fixtures", "torchtune", "tt_fp32")
RANK = 4
#: torchtune's default lora_attn_modules (q_proj, v_proj) of the fixture's 2 layers (dim 32)
LORA = {
    f"layers.{i}.attn.{m}.{part}.weight": shape
    for i in range(2)
    for m, out in (("q_proj", 32), ("v_proj", 16))
    for part, shape in (("lora_a", (RANK, 32)), ("lora_b", (out, RANK)))
}


def _save_adapter(path: str, adapter: dict) -> None:
    """``adapter`` ({name: array}) written at ``path`` as torch.save writes a state dict (copied
    first: the arrays may map the file being replaced)."""
    slots = {
        n: torch_zip.TensorSlot(i, v.shape, v.dtype) for i, (n, v) in enumerate(adapter.items())
    }
    torch_zip.save_file(path, slots, [np.array(v) for v in adapter.values()])


def _synthetic_lora_run(tmp_path, keyed_by: str = "index", adapter: bool = True) -> str:
    src = str(shutil.copytree(SRC, tmp_path / "tt_lora_synthetic"))
    epoch = os.path.join(src, "epoch_0")
    rng = np.random.default_rng(0)
    weights = {n: rng.standard_normal(s).astype(np.float32) for n, s in LORA.items()}
    if adapter:
        _save_adapter(os.path.join(epoch, "adapter_model.pt"), weights)
        peft = {
            "base_model.model."
            + n.replace("layers.", "model.layers.")
            .replace("attn.", "self_attn.")
            .replace("lora_a", "lora_A")
            .replace("lora_b", "lora_B"): v
            for n, v in weights.items()
        }
        save_file(peft, os.path.join(epoch, "adapter_model.safetensors"))
        with open(os.path.join(epoch, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": RANK, "target_modules": ["q_proj", "v_proj"]}, f)
    path = os.path.join(src, "recipe_state", "recipe_state.pt")
    recipe = torch_zip.load_torch_file(path)
    arrays: list[np.ndarray] = []

    def slot(value: np.ndarray):
        arrays.append(value)
        return torch_zip.TensorSlot(len(arrays) - 1, value.shape, value.dtype)

    state = {}
    for i, (name, value) in enumerate(weights.items()):
        key = name if keyed_by == "name" else 100 + i  # frozen weights' indices have no state
        per = {"step": 3.0, "exp_avg": slot(value * 0.1), "exp_avg_sq": slot(value * value)}
        state[key] = per
    group = {**recipe["optimizer"]["param_groups"][0], "params": list(state)}
    if keyed_by == "index":
        group["params"] = list(range(100 + len(state)))  # model.parameters(): frozen ones too
    torch_zip.save_file(
        path, {**recipe, "optimizer": {"state": state, "param_groups": [group]}}, arrays
    )
    return src


TT_LORA = os.path.join(REPO, "tests", "fixtures", "torchtune", "tt_lora")
TT_DORA = os.path.join(REPO, "tests", "fixtures", "torchtune", "tt_dora")


def _tt_truth(run: str = TT_LORA) -> dict[str, np.ndarray]:
    with np.load(run + ".truth.npz") as z:
        return {k: z[k] for k in z.files}


def _as_peft(name: str, value: np.ndarray) -> tuple[str, np.ndarray]:
    """torchtune's adapter tensor as its adapter_model.safetensors holds it (4 q heads, 2 kv
    heads of 8: lora_b rows permuted as tune_to_peft_adapter_weights does), DoRA's magnitude
    permuted as those rows (which that function leaves undone)."""
    peft = torchtune.peft_name(name)
    assert peft is not None
    heads = 4 if "q_proj" in name else 2 if "k_proj" in name else None
    if (".lora_b." in name or name.endswith(".magnitude")) and heads is not None:
        value = torchtune.permute_rows(value, heads, 8)
    return peft, value


def test_torchtunes_lora_run_imports_its_adapter_and_moments(tmp_path):
    """The adapter equals torchtune's adapter_model.safetensors bit for bit, each moment the
    run's (its rows as the adapter's), the step 3; the merged weights are skipped, said."""
    out = jax_ucp.convert(TT_LORA, tmp_path / "ucp")
    got = jax_ucp.restore(out)
    written = load_file(os.path.join(TT_LORA, "epoch_0", "adapter_model.safetensors"))
    assert sorted(got["params"]) == sorted(written)
    for name, value in written.items():
        assert_bit_exact(got["params"][name], value, name)
    truth = _tt_truth()
    for key, tree in (("exp_avg", "mu"), ("exp_avg_sq", "nu"), ("param", None)):
        for k, v in truth.items():
            if k.startswith(key + "/"):
                name, value = _as_peft(k.split("/", 1)[1], v)
                assert_bit_exact(
                    got["opt_state"][tree][name] if tree else got["params"][name], value, k
                )
    assert int(got["opt_state"]["count"]) == int(truth["step"]) == 3
    source = jax_ucp.inspect(out).source
    merged = "epoch_0/model-00001-of-00001.safetensors"
    assert "not the base the adapter trains over" in source["skipped"][merged]
    assert any("base model it trains over is not in this folder" in n for n in source["notes"])
    assert source["optimizer_keyed_by"] == "index"


def test_an_adapter_file_not_the_optimizers_is_refused(tmp_path):
    """adapter_model.pt with one module (two tensors) fewer than the optimizer has states:
    refused naming both counts (its order numbers the states)."""
    src = str(shutil.copytree(TT_LORA, tmp_path / "tt_lora"))
    path = os.path.join(src, "epoch_0", "adapter_model.pt")
    adapter = dict(list(torch_zip.load_torch_file(path).items())[:-2])
    _save_adapter(path, adapter)
    with pytest.raises(
        jax_ucp.UCPError,
        match=r"12 parameters have optimizer state, "
        r"epoch_0/adapter_model\.pt holds 10 adapter tensors",
    ):
        jax_ucp.convert(src, tmp_path / "refused")


@pytest.mark.torch
@pytest.mark.parametrize("run_dir", [TT_LORA, TT_DORA], ids=["lora", "dora"])
def test_optax_from_torch_takes_torchtunes_next_lora_step(run_dir):
    """optax_from_torch on the output folder (read in place), fed torch's gradients of the step
    after the save, gives torchtune's adapter (DoRA's magnitudes too) after that step."""
    import optax

    with pytest.warns(UserWarning, match="gradient clipping"):
        run = jax_ucp.optax_from_torch(run_dir)
    assert (run.optimizer, run.step) == ("adamw", 3)
    truth = _tt_truth(run_dir)
    grads = dict(
        _as_peft(k.split("/", 1)[1], v) for k, v in truth.items() if k.startswith("next_grad/")
    )
    want = dict(
        _as_peft(k.split("/", 1)[1], v) for k, v in truth.items() if k.startswith("next_param/")
    )
    updates, _ = run.tx.update(grads, run.opt_state, run.params)
    params = optax.apply_updates(run.params, updates)
    assert sorted(params) == sorted(want)
    for name, value in want.items():
        np.testing.assert_allclose(np.asarray(params[name]), value, rtol=0, atol=1e-6, err_msg=name)


def _dora_merged(params: dict, base: dict, module: str) -> np.ndarray:
    """DoRA's merged weight of ``module`` (peft's names) from the imported adapter over the
    transformers base, as torchtune's get_merged_lora_ckpt merges it (alpha/r = 2)."""
    a, b, m = (
        np.asarray(params[f"base_model.model.{module}.{p}"], np.float64)
        for p in ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector")
    )
    weight = base[f"base/{module}.weight"] + 2.0 * b @ a
    return weight * (m / np.linalg.norm(weight, axis=1))[:, None]


def test_torchtunes_dora_run_imports_magnitudes_in_the_rows_they_scale(tmp_path):
    """Each imported magnitude, with lora_A / lora_B over the transformers base, remakes the
    merged weight torchtune wrote into epoch_0/ (its rows as Hugging Face's); torchtune's own
    adapter_model.safetensors, its q/k magnitudes unpermuted, does not; moments as the run's."""
    out = jax_ucp.convert(TT_DORA, tmp_path / "ucp")
    got = jax_ucp.restore(out)
    truth = _tt_truth(TT_DORA)
    merged = load_file(os.path.join(TT_DORA, "epoch_0", "model-00001-of-00001.safetensors"))
    theirs = load_file(os.path.join(TT_DORA, "epoch_0", "adapter_model.safetensors"))
    assert sorted(got["params"]) == sorted(theirs)
    modules = [k[len("base/") : -len(".weight")] for k in truth if k.startswith("base/")]
    assert len(modules) == 6
    for module in modules:
        want = merged[f"{module}.weight"]
        np.testing.assert_allclose(_dora_merged(got["params"], truth, module), want, atol=1e-6)
        off = np.abs(_dora_merged(theirs, truth, module) - want).max()
        assert (off > 1e-3) == ("v_proj" not in module), (module, off)
    for key, tree in (("exp_avg", "mu"), ("exp_avg_sq", "nu"), ("param", None)):
        for k, v in truth.items():
            if k.startswith(key + "/"):
                name, value = _as_peft(k.split("/", 1)[1], v)
                assert_bit_exact(
                    got["opt_state"][tree][name] if tree else got["params"][name], value, k
                )
    source = jax_ucp.inspect(out).source
    assert source["lora"]["use_dora"] is True
    assert any("the q/k ones permuted as the rows they scale" in n for n in source["notes"])


def test_a_magnitude_not_doras_is_refused(tmp_path):
    """A magnitude of another shape than its lora_b's rows is refused naming the module."""
    src = str(shutil.copytree(TT_DORA, tmp_path / "tt_dora"))
    path = os.path.join(src, "epoch_0", "adapter_model.pt")
    adapter = torch_zip.load_torch_file(path)
    adapter["layers.1.attn.k_proj.magnitude"] = adapter["layers.1.attn.k_proj.magnitude"][:8]
    _save_adapter(path, adapter)
    with pytest.raises(
        jax_ucp.UCPError,
        match=r"adapter_model\.pt: layers\.1\.attn\.k_proj's adapter tensors are magnitude \[8\], "
        r"lora_a \[4, 32\], lora_b \[16, 4\]: expected",
    ):
        jax_ucp.convert(src, tmp_path / "refused")


@pytest.mark.parametrize("keyed_by", ["index", "name"])
def test_a_synthetic_lora_recipe_imports_keyed_by_index_or_name(tmp_path, monkeypatch, keyed_by):
    monkeypatch.setattr(torchtune_order, "torchtune_builder", lambda: None)  # not installed
    src = _synthetic_lora_run(tmp_path, keyed_by)
    got = jax_ucp.restore(jax_ucp.convert(src, tmp_path / "ucp"))
    written = load_file(os.path.join(src, "epoch_0", "adapter_model.safetensors"))
    assert sorted(got["params"]) == sorted(written) == sorted(got["opt_state"]["mu"])


def test_lora_names_in_the_optimizer_alone_say_lora(tmp_path):
    """No adapter file beside the weights: the optimizer's own names (lora_a) say LoRA."""
    src = _synthetic_lora_run(tmp_path, "name", adapter=False)
    with pytest.raises(
        jax_ucp.UCPError,
        match=r"recipe_state\.pt: LoRA optimizer state \(torchtune's LoRA recipe: "
        r"'layers\.0\.attn\.q_proj\.lora_a\.weight'",
    ):
        jax_ucp.convert(src, tmp_path / "refused")


def test_weights_only_lists_the_adapter_files_beside_the_merged_weights(tmp_path):
    src = _synthetic_lora_run(tmp_path)
    out = jax_ucp.convert(src, tmp_path / "ucp", importing=ImportOptions(weights_only=True))
    want = load_file(os.path.join(src, "epoch_0", "model-00001-of-00001.safetensors"))
    got = jax_ucp.restore(out)
    assert sorted(got["params"]) == sorted(want)
    for name, value in want.items():
        assert_bit_exact(got["params"][name], value, name)
    skipped = jax_ucp.inspect(out).source["skipped"]
    why = (
        "a LoRA adapter (torchtune's LoRA recipe): its lora_a / lora_b are merged into the "
        "epoch_0/ weights imported"
    )
    for name in ("adapter_model.pt", "adapter_model.safetensors", "adapter_config.json"):
        assert skipped[f"epoch_0/{name}"] == why
    assert "recipe_state/recipe_state.pt" in skipped
