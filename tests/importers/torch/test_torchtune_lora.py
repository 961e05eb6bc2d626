"""A torchtune LoRA run (issue 60): its recipe's optimizer state is over the adapter's
``lora_a`` / ``lora_b`` (which the merged ``epoch_N/`` weights do not hold), refused in one
message saying LoRA optimizer state, never the generic "give its order"; with weights_only the
adapter files beside the merged weights are listed in ``source.skipped``, not ignored.

The LoRA runs here are SYNTHETIC (torchtune is not installed): tests/fixtures/torchtune/tt_fp32
(written by torchtune) with what torchtune 0.6.1's LoRA recipes add, written torch-free in the
layout of ``FullModelHFCheckpointer.save_checkpoint``: ``epoch_0/adapter_model.pt`` (torchtune's
names), ``adapter_model.safetensors`` and ``adapter_config.json`` (peft's), and a
``recipe_state.pt`` whose optimizer holds state for the LoRA parameters only (keyed by index over
``model.parameters()``, frozen weights without state: the single-device recipe; or by
torchtune's names: the distributed one)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jax_ucp
from jax_ucp._src.importers.torch import torchtune_order
from jax_ucp._src.torchfiles import torch_zip
from jax_ucp.conversion import ImportOptions
from tests.ucp_testing import REPO, assert_bit_exact, assert_destination_untouched

SRC = os.path.join(REPO, "tests", "fixtures", "torchtune", "tt_fp32")
RANK = 4
#: torchtune's default lora_attn_modules (q_proj, v_proj) of the fixture's 2 layers (dim 32)
LORA = {
    f"layers.{i}.attn.{m}.{part}.weight": shape
    for i in range(2)
    for m, out in (("q_proj", 32), ("v_proj", 16))
    for part, shape in (("lora_a", (RANK, 32)), ("lora_b", (out, RANK)))
}


def _synthetic_lora_run(tmp_path, keyed_by: str = "index", adapter: bool = True) -> str:
    src = str(shutil.copytree(SRC, tmp_path / "tt_lora_synthetic"))
    epoch = os.path.join(src, "epoch_0")
    rng = np.random.default_rng(0)
    weights = {n: rng.standard_normal(s).astype(np.float32) for n, s in LORA.items()}
    if adapter:
        torch_zip.save_file(
            os.path.join(epoch, "adapter_model.pt"),
            {
                n: torch_zip.TensorSlot(i, v.shape, v.dtype)
                for i, (n, v) in enumerate(weights.items())
            },
            list(weights.values()),
        )
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


@pytest.mark.parametrize("keyed_by", ["index", "name"])
def test_a_lora_recipes_optimizer_state_is_refused_saying_lora(tmp_path, monkeypatch, keyed_by):
    monkeypatch.setattr(torchtune_order, "torchtune_builder", lambda: None)  # not installed
    src = _synthetic_lora_run(tmp_path, keyed_by)
    with pytest.raises(jax_ucp.UCPError) as e:
        jax_ucp.convert(src, tmp_path / "refused")
    said = str(e.value)
    assert "recipe_state.pt: LoRA optimizer state (torchtune's LoRA recipe: epoch_0/adapter" in said
    assert "lora_a / lora_b" in said and "weights_only=True" in said
    assert "Give its order" not in said and "parameter_order" not in said
    assert_destination_untouched(tmp_path / "refused")


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
