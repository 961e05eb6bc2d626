"""The ``parameter_order=`` hint of a Trainer checkpoint whose order cannot be rebuilt says the
order is the optimizer's groups concatenated as it was built (the Trainer's weight-decayed
parameters, then the others), not ``model.named_parameters()`` order, which interleaves them
(issue 60). Torch-free: the refusal comes before any model is built."""

from __future__ import annotations

import os
import shutil

import pytest

import jax_ucp
from jax_ucp._src.torchfiles import torch_zip
from tests.ucp_testing import REPO, assert_destination_untouched

TRAINER = os.path.join(REPO, "tests", "fixtures", "hf_trainer", "trainer_fp32", "checkpoint-3")


def test_a_trainer_checkpoint_without_config_json_hints_the_groups_concatenated(tmp_path):
    src = tmp_path / "checkpoint-3"
    shutil.copytree(TRAINER, src)
    os.remove(src / "config.json")
    groups = torch_zip.load_torch_file(str(src / "optimizer.pt"))["param_groups"]
    assert len(groups) == 2  # the Trainer's decay / no-decay groups
    with pytest.raises(jax_ucp.UCPError) as e:
        jax_ucp.convert(src, tmp_path / "refused")
    said = str(e.value)
    assert "no config.json" in said
    assert "group after group as the optimizer was built" in said
    assert "decay_names + no_decay_names, not model.named_parameters() order" in said
    assert_destination_untouched(tmp_path / "refused")
