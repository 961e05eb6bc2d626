"""A torchtune 0.6.1 output folder written by torchtune itself
(tools/fixtures/make_torchtune_fixture.py: FullModelHFCheckpointer, torchtune's llama3 model, 3
AdamW steps, an intermediate checkpoint): recognised by auto-detection; the epoch's weights are
imported bit-exact (Hugging Face names and row order); the recipe's optimizer state is refused
naming why, and listed in source.skipped with weights_only."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

import jax_ucp
from jax_ucp.exporters import torch_out
from jax_ucp.torchfiles import unpickler
from tests.ucp_testing import (
    REPO,
    assert_bit_exact,
    assert_convert_refused,
    assert_destination_untouched,
)

pytestmark = pytest.mark.timeout(120)
SRC = os.path.join(REPO, "tests", "fixtures", "torchtune", "tt_fp32")


def test_torchtune_folder_weights_import_and_optimizer_is_refused_by_name(tmp_path):
    assert_convert_refused(
        SRC,
        tmp_path / "refused",
        r"recipe_state\.pt: torchtune's optimizer state, keyed by index \(\d+ parameters "
        r"in 1 param group, indices 0, 1, 2, \.\.\., without their names\), is over "
        r"torchtune's own model .*not supported yet.*"
        r"weights_only=True to import epoch_0/'s weights",
    )
    out = jax_ucp.convert(SRC, tmp_path / "ucp", weights_only=True)
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
    out = jax_ucp.convert(src, tmp_path / "ucp", weights_only=True)
    source = jax_ucp.inspect(out).source
    assert source["epoch"] == "epoch_1"
    assert source["skipped"]["epoch_0/"] == "an earlier epoch's weights (epoch_1/ imported)"


def _rekeyed_recipe(tmp_path, per_parameter: bool = False) -> str:
    """The fixture with its recipe state keyed by torchtune's parameter names, as the
    distributed recipes save it (``get_full_optimizer_state_dict``), or one optimizer per
    parameter (optimizer in backward); written torch-free."""
    src = shutil.copytree(SRC, tmp_path / "tt")
    path = os.path.join(src, "recipe_state", "recipe_state.pt")
    recipe = unpickler.load_torch_file(path)
    optimizer = recipe["optimizer"]
    arrays: list[np.ndarray] = []

    def slot(value):
        arrays.append(np.array(value))
        return torch_out.TensorSlot(len(arrays) - 1, value.shape, value.dtype)

    names = {i: f"layers.{i}.attn.q_proj.weight" for i in optimizer["state"]}
    names[0] = "tok_embeddings.weight"
    state = {
        names[i]: {k: slot(v) if isinstance(v, np.ndarray) else v for k, v in per.items()}
        for i, per in optimizer["state"].items()
    }
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in optimizer["param_groups"]]
    if per_parameter:
        saved = {n: {"state": {n: s}, "param_groups": groups} for n, s in state.items()}
    else:
        saved = {"state": state, "param_groups": groups}
    torch_out.save_file(path, {**recipe, "optimizer": saved}, arrays)
    return str(src)


def test_distributed_recipe_state_refusal_says_it_is_keyed_by_names(tmp_path):
    """The distributed recipes key the optimizer by torchtune's names: the refusal says so (and
    names some), never "by index"."""
    src = _rekeyed_recipe(tmp_path)
    with pytest.raises(jax_ucp.UCPError) as refused:
        jax_ucp.convert(src, tmp_path / "refused")
    message = str(refused.value)
    assert "keyed by torchtune's parameter names (" in message
    assert "'tok_embeddings.weight', 'layers.1.attn.q_proj.weight'" in message
    assert "by index" not in message
    assert_destination_untouched(tmp_path / "refused")


def test_optimizer_in_backward_recipe_state_refusal_says_one_per_parameter(tmp_path):
    src = _rekeyed_recipe(tmp_path, per_parameter=True)
    with pytest.raises(jax_ucp.UCPError, match=r"one optimizer per parameter \(optimizer in "):
        jax_ucp.convert(src, tmp_path / "refused")
