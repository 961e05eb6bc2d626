"""Every importer family read in place from a Hugging Face Hub repo (``hf://org/name``, on
tests/object_servers.py's local server with the Hub's layout): torch.save folders, torch DCP,
OLMo-core, torchtune, torch_checkpointing, legacy Megatron, megatron-core's ``torch_dist`` and ``fsdp_dtensor``, verl
(DeepSpeed: tests/importers/deepspeed/test_object_store.py; safetensors: tests/store/test_hub.py).
Each restores onto a 2 x 4 mesh bit for bit as its local folder does; its torch archives are read
by ranged GETs (DCP's only the chunks' ranges), none downloaded whole, and no byte is fetched
twice; the Megatron folders are read in place (no local view of the repo built)."""

from __future__ import annotations

import json
import os
import pickle
import tempfile

import jax
import numpy as np
import pytest
import safetensors.numpy
from jax.sharding import Mesh

import jax_ucp
from jax_ucp.conversion import ImportOptions, TorchOptions
from tests.importers.deepspeed.test_object_store import assert_same, folder_files, served, size_of
from tests.restoring.test_remote_safetensors import _target
from tests.torchfiles.test_pickle_format import D, G, prog, tensor, write_pt
from tests.ucp_testing import REPO

pytestmark = pytest.mark.timeout(300)

FIXTURES = os.path.join(REPO, "tests", "fixtures")
ARCHIVES = (".pt", ".bin", ".ckpt", ".distcp")
RANGED = (*ARCHIVES, ".safetensors")
TRAINER_CONFIG = os.path.join(FIXTURES, "hf_trainer", "trainer_fp32", "checkpoint-3", "config.json")


@pytest.mark.parametrize(
    "name, options",
    [
        # torch DCP, read by the chunks' byte ranges (the default run)
        ("torch/fsdp2_fp32", {}),
        ("torch/dcp_zstd", {}),  # torch 2.15's ZStandard extension
        ("olmo_core/olmo_fp32", {}),  # torch DCP with OLMo-core's storage records
        ("megatron/gpt_tp2", {}),  # megatron-core's torch_dist
        ("megatron_fsdp_dtensor/gpt_dp2", {}),
        # torchtune's LoRA recipe: adapter_model.pt and recipe_state.pt by ranges, in place
        ("torchtune/tt_lora", {}),
        # zip archives by ranges, in place: the slow stage
        *(
            pytest.param(name, options, marks=pytest.mark.slow)
            for name, options in [
                ("torch/hf_bin_sharded", {}),
                ("torchtune/tt_fp32", {"importing": ImportOptions(weights_only=True)}),
                ("torch_checkpointing/tc_fsdp2_synthetic_layout/step-3", {}),
                ("megatron/legacy_gpt_tp2pp2_synthetic", {}),
                ("verl/fsdp2", {}),
            ]
        ),
    ],
)
def test_each_importer_family_restores_from_a_hub_repo_as_its_local_folder(
    hub_server, monkeypatch, name, options
):
    served(monkeypatch)
    src = os.path.join(FIXTURES, name)
    files = {}
    for folder, _, names in os.walk(src):
        for n in names:
            with open(os.path.join(folder, n), "rb") as f:
                files[os.path.relpath(f.name, src)] = f.read()
    repo = "org/" + name.replace("/", "-")
    hub_server.add(repo, files)
    target = _target(
        jax_ucp.restore(src, **options), Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    )
    assert_same(
        jax_ucp.restore(f"hf://{repo}", target=target, **options),
        jax_ucp.restore(src, target=target, **options),
    )
    gets = [r for r in hub_server.log if r["method"] == "GET" and r["path"] in files]
    whole = [r["path"] for r in gets if r["range"] is None and r["path"].endswith(ARCHIVES)]
    assert not whole, f"archives downloaded whole: {whole}"
    nbytes = sum(
        len(files[r["path"]]) if r["range"] is None else r["stop"] - r["start"] for r in gets
    )
    # no byte twice (but the one-byte reads holding an archive's size to the object's)
    assert 0 < nbytes <= size_of(src) + 2 * len(files), (len(gets), nbytes)


def test_one_torch_save_file_of_a_hub_repo_is_read_in_place(hub_server, monkeypatch):
    """``hf://org/name/pytorch_model.bin``, one file of a repo holding others, restores as the
    local file, read through its folder's Storage (no local view), by ranges, no byte twice."""
    served(monkeypatch)
    src = os.path.join(FIXTURES, "torch", "hf_bin", "pytorch_model.bin")
    with open(src, "rb") as f:
        data = f.read()
    hub_server.add("org/one-bin", {"pytorch_model.bin": data, "other.pt": data[:10]})
    assert_same(jax_ucp.restore("hf://org/one-bin/pytorch_model.bin"), jax_ucp.restore(src))
    gets = [r for r in hub_server.log if r["method"] == "GET" and r["path"] == "pytorch_model.bin"]
    assert all(r["range"] is not None for r in gets), gets
    assert 0 < sum(r["stop"] - r["start"] for r in gets) <= len(data) + 2


@pytest.mark.parametrize(
    "name",
    [
        "hf_trainer/trainer_fsdp_synthetic_layout/checkpoint-3",  # pytorch_model_fsdp_0/ + optimizer_0/
        "torch/dcp_hf_ranklocal",  # torch DCP's Hugging Face writer, a file per rank
        "torch/hf_dist_optimizer_tp2",  # the same, and transformers' DCP optimizer/ beside
    ],
)
def test_trainer_fsdp_and_rank_local_dcp_folders_convert_in_place_as_their_local_folder(
    hub_server, monkeypatch, tmp_path, name
):
    """Read through the repo's ``Storage``, no local view: the import equals the local folder's
    (values, and the source record but its path and certificate); the DCP and safetensors files read by ranges
    (a header, the pieces), none whole."""
    served(monkeypatch)
    src = os.path.join(FIXTURES, name)
    files = folder_files(src)
    repo = "org/" + name.replace("/", "-")
    hub_server.add(repo, files)
    local = jax_ucp.convert(src, str(tmp_path / "local"))
    remote = jax_ucp.convert(f"hf://{repo}", str(tmp_path / "remote"))
    assert_same(jax_ucp.restore(remote), jax_ucp.restore(local))
    want, got = (dict(jax_ucp.inspect(p).source) for p in (local, remote))
    assert got.pop("path").startswith(f"hf://{repo}") and want.pop("path") == os.path.abspath(src)
    want.pop("certificate")  # a local import's (docs/HF.md)
    assert got == want
    gets = [r for r in hub_server.log if r["method"] == "GET" and r["path"] in files]
    whole = [r["path"] for r in gets if r["range"] is None and r["path"].endswith(RANGED)]
    assert not whole, f"read whole: {whole}"
    nbytes = sum(
        len(files[r["path"]]) if r["range"] is None else r["stop"] - r["start"] for r in gets
    )
    # each piece once; a safetensors header read by the detection and the plan (a few KiB here)
    assert 0 < nbytes <= 1.5 * size_of(src), (len(gets), nbytes, size_of(src))


def _torch_bin(tensors: dict[str, np.ndarray]) -> bytes:
    """A ``torch.save`` zip of float32 ``tensors`` (an OrderedDict state dict), as torch writes
    it, from tests/torchfiles/test_pickle_format.py's pickle assembler."""
    items, storages = b"", {}
    for i, (name, a) in enumerate(tensors.items()):
        assert a.dtype == np.float32 and a.flags.c_contiguous
        stride = [s // a.itemsize for s in a.strides]
        items += D(name) + tensor("FloatStorage", str(i), a.size, 0, a.shape, stride)
        storages[str(i)] = a.tobytes()
    ordered = G("collections", "OrderedDict") + pickle.EMPTY_TUPLE + pickle.REDUCE
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "w.bin")
        write_pt(path, prog(ordered + pickle.MARK + items + pickle.SETITEMS), storages)
        with open(path, "rb") as f:
            return f.read()


@pytest.mark.torch  # transformers rebuilds the Trainer's parameter order
def test_a_trainer_checkpoint_of_bin_weights_converts_in_place_as_its_local_folder(
    hub_server, monkeypatch, tmp_path
):
    """A Trainer's ``checkpoint-N/`` saved with ``save_safetensors=False`` (``pytorch_model.bin``
    beside ``optimizer.pt``, ``trainer_state.json``, ``config.json``) in a Hub repo is read
    through its ``Storage``, no local view: its parameter order (rebuilt from the repo's
    ``config.json``), Trainer record and values as the local folder's."""
    served(monkeypatch)
    files = folder_files(os.path.join(FIXTURES, "hf_trainer", "trainer_fp32", "checkpoint-3"))
    files["pytorch_model.bin"] = _torch_bin(safetensors.numpy.load(files.pop("model.safetensors")))
    src = tmp_path / "checkpoint-3"
    src.mkdir()
    for name, data in files.items():
        (src / name).write_bytes(data)
    hub_server.add("org/trainer-bin", files)
    local = jax_ucp.convert(str(src), str(tmp_path / "local"))
    remote = jax_ucp.convert("hf://org/trainer-bin", str(tmp_path / "remote"))
    assert_same(jax_ucp.restore(remote), jax_ucp.restore(local))
    want, got = (dict(jax_ucp.inspect(p).source) for p in (local, remote))
    assert got.pop("path").startswith("hf://org/trainer-bin@")
    assert want.pop("path") == str(src)
    want.pop("certificate")  # a local import's (docs/HF.md)
    assert got == want
    assert got["optimizer_keys"].startswith("parameter indices, in the Trainer's groups")
    assert got["trainer"]["global_step"] == 3


@pytest.mark.torch  # transformers rebuilds the Trainer's parameter order
@pytest.mark.parametrize(
    "name, options",
    [
        ("hf_trainer/trainer_fp32/checkpoint-3", {}),  # model.safetensors beside optimizer.pt
        ("hf_trainer/trainer_fp32/checkpoint-3", {"weights_only": True}),  # the safetensors plan
        # a peft adapter's adapter_model.safetensors, its order from the base model's config
        ("hf_trainer/trainer_lora/checkpoint-3", {"model_config": TRAINER_CONFIG}),
        ("accelerate/accelerate_named", {}),  # Accelerate's save_state: optimizer.bin beside
    ],
)
def test_a_trainer_checkpoint_of_safetensors_weights_converts_in_place_as_its_local_folder(
    hub_server, monkeypatch, tmp_path, name, options
):
    """A Trainer's ``checkpoint-N/`` (or Accelerate's ``save_state``) saving its weights as
    safetensors, in a Hub repo, is read through its ``Storage``, no local view: values and source
    record as the local folder's, its safetensors read by ranges (no byte twice) and the
    optimizer's archive by ranges too. Before: read through a view of the repo."""
    served(monkeypatch)
    src = os.path.join(FIXTURES, name)
    files = folder_files(src)
    repo = "org/" + name.replace("/", "-")
    hub_server.add(repo, files)
    importing = TorchOptions(**options)
    local = jax_ucp.convert(src, str(tmp_path / "local"), importing=importing)
    remote = jax_ucp.convert(f"hf://{repo}", str(tmp_path / "remote"), importing=importing)
    assert_same(jax_ucp.restore(remote), jax_ucp.restore(local))
    want, got = (dict(jax_ucp.inspect(p).source) for p in (local, remote))
    assert got.pop("path").startswith(f"hf://{repo}@") and want.pop("path") == src
    want.pop("certificate")  # a local import's (docs/HF.md)
    assert got == want
    gets = [r for r in hub_server.log if r["method"] == "GET" and r["path"] in files]
    whole = [r["path"] for r in gets if r["range"] is None and r["path"].endswith(RANGED)]
    assert not whole, f"read whole: {whole}"
    read = {n: 0 for n in files}
    for r in gets:
        read[r["path"]] += len(files[r["path"]]) if r["range"] is None else r["stop"] - r["start"]
    weights = [n for n in files if n.endswith(".safetensors")]
    assert 0 < sum(read[n] for n in weights) <= sum(len(files[n]) for n in weights) + 64


@pytest.mark.torch  # transformers rebuilds the Trainer's parameter order
def test_sharded_trainer_weights_and_an_adapter_alone_convert_in_place_as_their_local_folders(
    hub_server, monkeypatch, tmp_path
):
    """A Trainer's ``checkpoint-N/`` whose safetensors are sharded (two shards and their
    ``model.safetensors.index.json``), and a peft adapter's folder alone
    (``adapter_model.safetensors`` + ``adapter_config.json``, no torch archive), in a Hub repo:
    read through its ``Storage`` as the local folder is. Before: the first through a view, the
    second refused (nothing a view shows)."""
    served(monkeypatch)
    trainer = folder_files(os.path.join(FIXTURES, "hf_trainer", "trainer_fp32", "checkpoint-3"))
    weights = safetensors.numpy.load(trainer.pop("model.safetensors"))
    names = sorted(weights)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    for shard, held in shards.items():
        trainer[shard] = safetensors.numpy.save({n: weights[n] for n in held})
    index = {"metadata": {}, "weight_map": {n: s for s, held in shards.items() for n in held}}
    trainer["model.safetensors.index.json"] = json.dumps(index).encode()
    lora = folder_files(os.path.join(FIXTURES, "hf_trainer", "trainer_lora", "checkpoint-3"))
    adapter = {n: lora[n] for n in ("adapter_model.safetensors", "adapter_config.json")}
    for name, files in (("sharded", trainer), ("adapter", adapter)):
        src = tmp_path / name
        src.mkdir()
        for file, data in files.items():
            (src / file).write_bytes(data)
        hub_server.add(f"org/{name}", files)
        local = jax_ucp.convert(str(src), str(tmp_path / f"{name}-local"))
        remote = jax_ucp.convert(f"hf://org/{name}", str(tmp_path / f"{name}-remote"))
        assert_same(jax_ucp.restore(remote), jax_ucp.restore(local))
        want, got = (dict(jax_ucp.inspect(p).source) for p in (local, remote))
        assert got.pop("path").startswith(f"hf://org/{name}@") and want.pop("path") == str(src)
        want.pop("certificate")  # a local import's (docs/HF.md)
        assert got == want
    assert got["framework"] == "safetensors" and want["files"] == ["adapter_model.safetensors"]
