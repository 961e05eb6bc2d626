"""A verl FSDP checkpoint (``global_step_N/actor/model_world_size_W_rank_R.pt`` and the optimizer's
rank files) in an object store (``s3://`` on the local moto server) restores onto a mesh as the
local folder does, its rank files read by ranged GETs through the prefix's Storage (its Megatron
backend too)."""

from __future__ import annotations

import os

import pytest

import jax_ucp
from tests.importers.deepspeed.test_object_store import restores_as_local, served
from tests.ucp_testing import REPO

pytestmark = pytest.mark.timeout(300)


def test_a_verl_folder_in_an_object_store_restores_as_the_local_folder(s3_server, monkeypatch):
    url = served(monkeypatch, s3_server)
    restores_as_local(os.path.join(REPO, "tests", "fixtures", "verl", "fsdp2"), url)


def test_a_verl_megatron_run_in_an_object_store_restores_as_the_local_run(
    s3_server, monkeypatch, tmp_path
):
    """verl's Megatron backend (global_step_N/actor/dist_ckpt/, megatron-core's own files):
    its ``.distcp`` objects read by ranges only, never one whole."""
    from tests.importers.megatron.test_object_store import _gets
    from tests.importers.verl.test_megatron_backend import ACTOR, _verl_run

    url, run = served(monkeypatch, s3_server), _verl_run(tmp_path)
    gets = _gets(monkeypatch)
    restores_as_local(run, url)
    dist_ckpt = os.path.join(run, ACTOR, "dist_ckpt")
    sizes = {f: os.path.getsize(os.path.join(dist_ckpt, f)) for f in os.listdir(dist_ckpt)}
    read = [(name, a, b) for name, a, b in gets if name.endswith(".distcp")]
    assert read and all(a is not None and b - a < sizes[name] for name, a, b in read), read


def test_a_damaged_dist_ckpt_object_is_named_by_its_url_when_its_rows_are_read(
    s3_server, monkeypatch, tmp_path
):
    """The tensors are read after the plan (a direct restore's regions): the view's files are
    still there, and the error names the object's URL, never the local view."""
    from jax_ucp._src.store.storage import object_store
    from tests.importers.deepspeed.test_object_store import upload
    from tests.importers.verl.test_megatron_backend import ACTOR, _verl_run

    run = _verl_run(tmp_path)
    url = upload(run, served(monkeypatch, s3_server))
    name = f"{ACTOR}/dist_ckpt/__0_0.distcp"
    with open(os.path.join(run, name), "rb") as f:
        data = bytearray(f.read())
    data[177095] ^= 0x4A  # in a tensor's bytes (the harness's flip): its CRC-32 fails when read
    object_store.write(url, name, bytes(data))
    with pytest.raises(jax_ucp.UCPError, match=f"{url}/{name}") as e:
        jax_ucp.restore(url)
    assert "ucp-view-" not in str(e.value)
