"""An OLMo-core ``save_model_and_optim_state`` checkpoint written by OLMo-core 3.0.0 itself
(tools/fixtures/make_olmo_core_fixture.py): torch DCP whose ``.metadata`` pickles OLMo-core's
own ``_StorageInfo``, read through an inert allow-listed stand-in, imported by auto-detection
with weights, moments and step bit-exact to the run's live state."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import jax_ucp
from tests.importers.torch.test_hf_trainer import assert_matches_run, truth
from tests.ucp_testing import REPO, assert_destination_untouched

pytestmark = pytest.mark.timeout(120)
FIX = os.path.join(REPO, "tests", "fixtures", "olmo_core")


def test_olmo_core_checkpoint_imports_bit_exact(tmp_path):
    src = os.path.join(FIX, "olmo_fp32")
    out = jax_ucp.convert(src, tmp_path / "ucp")
    assert_matches_run(jax_ucp.restore(out), truth(os.path.join(FIX, "olmo_fp32.truth.npz")))
    source = jax_ucp.inspect(out).source
    assert source["framework"] == "torch_dcp"
    assert source["optimizer"]["param_groups"][0]["weight_decay"] == 0.1


def test_another_olmo_core_class_in_the_metadata_is_refused(tmp_path):
    """Only OLMo-core's _StorageInfo is allowed: the same pickle naming another class of that
    module (built here by renaming it, same length) is refused by name; nothing is written."""
    src = shutil.copytree(os.path.join(FIX, "olmo_fp32"), tmp_path / "evil")
    meta = os.path.join(src, ".metadata")
    with open(meta, "rb") as f:
        data = f.read()
    assert data.count(b"_StorageInfo") == 1  # the class is named once, then memoized
    with open(meta, "wb") as f:
        f.write(data.replace(b"_StorageInfo", b"_StorageInfX"))
    with pytest.raises(
        jax_ucp.UCPError, match=r"olmo_core\.distributed\.checkpoint\.filesystem\._StorageInfX"
    ):
        jax_ucp.convert(src, tmp_path / "u")
    assert_destination_untouched(tmp_path / "u")
    assert np.load(os.path.join(FIX, "olmo_fp32.truth.npz"))["step"] == 3
