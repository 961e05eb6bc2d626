"""Megatron checkpoints in an object store (``s3://`` on the local moto server) restore onto a
mesh as the local folders do: the legacy per-rank folders (``iter_N/mp_rank_XX[_YYY]/
model_optim_rng.pt``, the distributed optimizer's ``distrib_optim.pt``), their archives read by
ranged GETs through a local view of the prefix; megatron-core's ``torch_dist`` and
``fsdp_dtensor`` folders, their DCP files fetched whole into that view."""

from __future__ import annotations

import os

import pytest

from tests.importers.deepspeed.test_object_store import restores_as_local, served
from tests.ucp_testing import REPO

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(
    "name",
    [
        "legacy_gpt_tp2pp2_synthetic",
        "legacy_gpt_distopt_pp2dp2_synthetic",
        "gpt_tp2",  # megatron-core's torch_dist: common.pt, metadata.json, its DCP files
        "gpt_distopt_dp2",
    ],
)
def test_legacy_megatron_in_an_object_store_restores_as_the_local_folder(
    s3_server, monkeypatch, name
):
    url = served(monkeypatch, s3_server)
    restores_as_local(os.path.join(REPO, "tests", "fixtures", "megatron", name), url)


def test_megatron_fsdp_dtensor_in_an_object_store_restores_as_the_local_folder(
    s3_server, monkeypatch
):
    """megatron-core's own fsdp_dtensor save (torch DCP with uneven DP row chunks) from s3://."""
    url = served(monkeypatch, s3_server)
    restores_as_local(
        os.path.join(REPO, "tests", "fixtures", "megatron_fsdp_dtensor", "gpt_dp2"), url
    )
