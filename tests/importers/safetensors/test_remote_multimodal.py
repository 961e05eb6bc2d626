"""A multimodal Hugging Face checkpoint (each of ``TEXT_MODELS``: Llama 4, Gemma 4, Qwen3.5 dense
and MoE) imported from an object store (``s3://``, the local moto server) and from a Hub repo
(``hf://``, tests/object_servers.py's local Hub) exactly as from its local folder: its text model
under the text model's names, the same values, and the same ``source`` record (``config.json``
read through the remote storage: the text model's config, the outer one, the towers skipped; the
files' ``__metadata__``) but for ``path`` (and the local files' certificate). Before, the remote import read no ``config.json``:
every tower imported under the multimodal names, no config recorded."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

import jax_ucp
from jax_ucp._src.importers.safetensors_weights import TEXT_MODELS
from tests.importers.deepspeed.test_object_store import assert_same, served, upload
from tests.ucp_testing import FIXTURES

pytestmark = pytest.mark.timeout(300)


def _folder(model_type: str, folder) -> str:
    """transformers' names, shapes and config.json of the tiny multimodal model (names.json),
    random values, in two files with the index and a ``__metadata__`` as ``save_pretrained``'s."""
    with open(os.path.join(FIXTURES, "hf_families", "names.json")) as f:
        entry = json.load(f)[model_type]
    rng = np.random.default_rng(0)
    names = sorted(entry["tensors"])
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    os.makedirs(folder)
    weight_map = {}
    for i, half in enumerate(halves):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        tensors = {n: rng.standard_normal(entry["tensors"][n]).astype(np.float32) for n in half}
        save_file(tensors, os.path.join(folder, file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(half, file)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(entry["config"], f)
    return str(folder)


@pytest.mark.parametrize("model_type", sorted(TEXT_MODELS))
def test_a_multimodal_checkpoint_imports_from_s3_and_the_hub_as_from_its_folder(
    model_type, s3_server, hub_server, monkeypatch, tmp_path
):
    folder = _folder(model_type, tmp_path / "src")
    bucket = served(monkeypatch, s3_server)
    with open(os.path.join(folder, "config.json")) as f:
        text_model = f"{json.load(f)['model_type']}_text"
    files = {n: open(os.path.join(folder, n), "rb").read() for n in os.listdir(folder)}
    hub_server.add(f"org/{model_type}", files)
    local = jax_ucp.inspect(jax_ucp.convert(folder, tmp_path / "local"))
    assert local.source["config"]["model_type"] == text_model and local.source["skipped"]
    want = jax_ucp.restore(tmp_path / "local")
    for i, url in enumerate((upload(folder, bucket), f"hf://org/{model_type}")):
        found = jax_ucp.inspect(jax_ucp.convert(url, tmp_path / str(i)))
        assert found.source["path"].startswith(url.split("@")[0])
        # but the certificate: the hashes of local files (verify --against reads local ones)
        held = {k: v for k, v in local.source.items() if k != "certificate"}
        assert {**found.source, "path": None} == {**held, "path": None}, url
        assert [(t.name, t.shape, t.dtype) for t in found.tensors] == [
            (t.name, t.shape, t.dtype) for t in local.tensors
        ]
        assert_same(jax_ucp.restore(tmp_path / str(i)), want)
        assert_same(jax_ucp.restore(url), jax_ucp.restore(folder))  # read in place, unconverted
