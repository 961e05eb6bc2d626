"""torch.save files, a folder of them, Accelerate's safetensors beside ``optimizer.bin``,
torchtune's and torch_checkpointing's folders in an object store (``s3://`` on the local moto
server) restore onto a mesh as the local ones do, read in place through the prefix's Storage,
their archives by ranged GETs (tests/importers/deepspeed/test_object_store.py has the DeepSpeed
folders and the errors)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct

import pytest

import jax_ucp
from jax_ucp._src.store.storage import object_store
from jax_ucp.conversion import ImportOptions, TorchOptions
from tests.importers.deepspeed.test_object_store import (
    assert_same,
    restores_as_local,
    served,
    size_of,
    upload,
)
from tests.importers.torch.test_torchtune import ORDER
from tests.restoring.test_remote_dcp import _counted
from tests.torchfiles.test_pickle_format import write_pt
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
        ("accelerate/accelerate_named", {}),  # model.safetensors + optimizer.bin (by name)
    ],
)
def test_torch_sources_in_an_object_store_restore_as_the_local_ones(
    s3_server, monkeypatch, name, options
):
    """torch.save files and folders of them, and safetensors weights beside a torch optimizer,
    are read through their Storage."""
    url = served(monkeypatch, s3_server)
    restores_as_local(os.path.join(FIXTURES, name), url, **options)


def test_torch_checkpointing_and_olmo_core_folders_are_read_in_place(
    s3_server, monkeypatch, tmp_path
):
    """A torch_checkpointing folder and an OLMo-core step folder (``model_and_optim/`` torch
    DCP, ``train/rank0.pt``, ``.metadata.json``) in an object store restore as the local ones,
    read through their prefix's Storage (no local view); the OLMo-core trainer's step and
    version are recorded as from the local folder."""
    url = served(monkeypatch, s3_server)
    restores_as_local(
        os.path.join(FIXTURES, "torch_checkpointing/tc_fsdp2_synthetic_layout/step-3"), url
    )
    step = tmp_path / "step3"
    shutil.copytree(os.path.join(FIXTURES, "olmo_core", "olmo_fp32"), step / "model_and_optim")
    (step / "train").mkdir()
    write_pt(str(step / "train" / "rank0.pt"), pickle.dumps({"global_step": 3}, protocol=2))
    (step / ".metadata.json").write_text(json.dumps({"version": "3.0.0"}))
    restores_as_local(str(step), url)
    remote = jax_ucp.convert(upload(str(step), url), tmp_path / "remote")
    record = jax_ucp.inspect(remote).source
    local = jax_ucp.inspect(jax_ucp.convert(str(step), tmp_path / "local")).source
    assert record["trainer"] == local["trainer"]
    assert record["trainer"]["global_step"] == 3
    assert record["skipped"] == local["skipped"]


@pytest.mark.parametrize(
    "name, options",
    [
        ("tt_fp32", ImportOptions(weights_only=True)),  # epoch_0/'s safetensors, by ranges
        ("tt_dist_fp32", ImportOptions()),  # and recipe_state.pt's moments, keyed by names
        ("tt_lora", ImportOptions()),  # a LoRA recipe's adapter_model.pt and its moments
        ("tt_dist_async", TorchOptions(parameter_order=ORDER)),  # dist_epoch_0/: torch DCP
    ],
)
def test_torchtune_output_folders_are_read_in_place(
    s3_server, monkeypatch, tmp_path, name, options
):
    """A torchtune output folder in an object store converts as the local one (its values and
    source record but the path and certificate), read through its prefix's Storage: no local view, no object
    read twice (but config.json, by the q/k heads' check and the weights' plan). Before: read
    through a local view of the prefix, its safetensors fetched whole."""
    src = os.path.join(FIXTURES, "torchtune", name)
    url = upload(src, served(monkeypatch, s3_server))
    before = _counted("bytes_read")
    remote = jax_ucp.convert(url, tmp_path / "remote", importing=options)
    nbytes = _counted("bytes_read") - before
    local = jax_ucp.convert(src, tmp_path / "local", importing=options)
    assert_same(jax_ucp.restore(remote), jax_ucp.restore(local))
    got, want = (jax_ucp.inspect(out).source for out in (remote, local))
    assert (got.pop("path"), want.pop("path")) == (url, os.path.abspath(src))
    assert want.pop("certificate") and got == want  # (a local source's files' digests)
    files = sum(1 for _, _, names in os.walk(src) for _ in names)
    config = os.path.join(src, "epoch_0", "config.json")
    twice = os.path.getsize(config) if os.path.exists(config) else 0
    assert 0 < nbytes <= size_of(src) + 2 * files + twice, nbytes


HF_BIN_SHARDED = os.path.join(FIXTURES, "torch", "hf_bin_sharded")


def files_of(folder: str) -> dict[str, bytes]:
    """{name relative to ``folder``: bytes} of every file under it."""
    out = {}
    for where, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(where, name), "rb") as f:
                out[os.path.relpath(f.name, folder)] = f.read()
    return out


def test_folder_markers_are_no_files_and_a_lying_zip_directory_is_named(s3_server, monkeypatch):
    """A prefix holding zero-byte folder markers (``sub/``, as the S3 console and other tools
    make) restores as the local folder; one whose archive's zip64 locator places its end
    record later, or declares a 2**62-byte archive, is a ``SourceError`` naming that object
    and its zip directory. Before: each "no ucp.json here ... not a jax_ucp checkpoint" (the
    view's refusal taken for "no importer claims it"), the markers refused too."""
    url = served(monkeypatch, s3_server)
    marked = upload(HF_BIN_SHARDED, url)
    for marker in ("sub/", "sub/deeper/"):
        object_store.write(marked, marker, b"")
    assert_same(jax_ucp.restore(marked), jax_ucp.restore(HF_BIN_SHARDED))
    name = "pytorch_model-00001-of-00002.bin"
    data = files_of(HF_BIN_SHARDED)[name]
    at = data.rfind(b"PK\x06\x07") + 8  # the zip64 locator's offset of the end record
    (record,) = struct.unpack_from("<Q", data, at)
    for lie in (record + 1000, 2**62):
        lying = upload(HF_BIN_SHARDED, url)
        object_store.write(lying, name, data[:at] + struct.pack("<Q", lie) + data[at + 8 :])
        with pytest.raises(jax_ucp.SourceError, match=rf"{lying}/{name}: its zip directory"):
            jax_ucp.restore(lying)
