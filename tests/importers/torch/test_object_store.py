"""torch.save files, a folder of them, torchtune's and torch_checkpointing's folders in an object
store (``s3://`` on the local moto server) restore onto a mesh as the local ones do, their archives
read by ranged GETs through a local view of the prefix (tests/importers/deepspeed/
test_object_store.py has the DeepSpeed folders and the errors)."""

from __future__ import annotations

import os

import pytest

from jax_ucp.conversion import ImportOptions
from tests.importers.deepspeed.test_object_store import restores_as_local, served
from tests.ucp_testing import REPO

pytestmark = pytest.mark.timeout(300)
FIXTURES = os.path.join(REPO, "tests", "fixtures")


@pytest.mark.parametrize(
    "name, options",
    [
        ("torch/plain_state_dict.pt", {}),  # one torch.save file: an object, not a prefix
        ("torch/lightning.ckpt", {}),
        ("torch/hf_bin_sharded", {}),  # pytorch_model-0000N-of-00002.bin + their index
        ("torch/accelerate_full", {}),  # pytorch_model_fsdp.bin + optimizer.bin
        ("torchtune/tt_fp32", {"importing": ImportOptions(weights_only=True)}),
        ("torch_checkpointing/tc_fsdp2_synthetic_layout/step-3", {}),
    ],
)
def test_torch_sources_in_an_object_store_restore_as_the_local_ones(
    s3_server, monkeypatch, name, options
):
    url = served(monkeypatch, s3_server)
    restores_as_local(os.path.join(FIXTURES, name), url, **options)
