"""A verl FSDP checkpoint (``global_step_N/actor/model_world_size_W_rank_R.pt`` and the optimizer's
rank files) in an object store (``s3://`` on the local moto server) restores onto a mesh as the
local folder does, its rank files read by ranged GETs through a local view of the prefix."""

from __future__ import annotations

import os

import pytest

from tests.importers.deepspeed.test_object_store import restores_as_local, served
from tests.ucp_testing import REPO

pytestmark = pytest.mark.timeout(300)


def test_a_verl_folder_in_an_object_store_restores_as_the_local_folder(s3_server, monkeypatch):
    url = served(monkeypatch, s3_server)
    restores_as_local(os.path.join(REPO, "tests", "fixtures", "verl", "fsdp2"), url)
