"""A torchtune 0.6.1 output folder written by torchtune itself
(tools/fixtures/make_torchtune_fixture.py: FullModelHFCheckpointer, torchtune's llama3 model, 3
AdamW steps, an intermediate checkpoint): recognised by auto-detection; the epoch's weights are
imported bit-exact (Hugging Face names and row order); the recipe's optimizer state is refused
naming why, and listed in source.skipped with weights_only."""

from __future__ import annotations

import os
import shutil

import pytest
from safetensors.numpy import load_file

import jax_ucp
from tests.ucp_testing import REPO, assert_bit_exact, assert_destination_untouched

pytestmark = pytest.mark.timeout(120)
SRC = os.path.join(REPO, "tests", "fixtures", "torchtune", "tt_fp32")


def test_torchtune_folder_weights_import_and_optimizer_is_refused_by_name(tmp_path):
    with pytest.raises(
        jax_ucp.UCPError,
        match=r"recipe_state\.pt: torchtune's optimizer state .*not supported yet.*"
        r"weights_only=True to import epoch_0/'s weights",
    ):
        jax_ucp.convert(SRC, tmp_path / "refused")
    assert_destination_untouched(tmp_path / "refused")
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
