"""Hugging Face safetensors in an object store restored straight onto a mesh (``s3://`` and
``gs://`` on the local moto and GCS emulator servers tests/store/test_object_store.py starts): the tree equals the local files'
restore and convert + restore, each region fetched as byte ranges; a truncated object is an
error naming it."""

from __future__ import annotations

import json
import os
import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

import jax_ucp
from jax_ucp._src import store
from jax_ucp._src.store.storage import object_store

pytestmark = pytest.mark.timeout(300)


def _folder(tmp_path):
    rng = np.random.default_rng(0)
    a = {
        "w": rng.standard_normal((16, 24)).astype(np.float32),
        "b": rng.standard_normal(24).astype(np.float16),
        "s": np.asarray(3.5, np.float32),
    }
    b = {"layers.0.proj": rng.standard_normal((8, 12)).astype(np.float32)}
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file(a, str(folder / "model-00001-of-00002.safetensors"))
    save_file(b, str(folder / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in a}
    weight_map |= {n: "model-00002-of-00002.safetensors" for n in b}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def _upload(folder, url: str) -> str:
    prefix = f"{url}/hf-{os.getpid()}-{np.random.default_rng().integers(1 << 30)}"
    for name in os.listdir(folder):
        object_store.write(prefix, name, (folder / name).read_bytes())
    return prefix


def _target(tree, mesh):
    def one(x):
        spec = [None] * x.ndim
        if x.ndim and x.shape[0] % 2 == 0:
            spec[0] = "a"
        if x.ndim > 1 and x.shape[-1] % 4 == 0:
            spec[-1] = "b"
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P(*spec)))

    return jax.tree.map(one, tree)


def test_safetensors_in_an_object_store_restore_onto_a_mesh(bucket_url, tmp_path):
    folder = _folder(tmp_path)
    url = _upload(folder, bucket_url)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    local = jax_ucp.restore(folder)
    target = _target(local, mesh)
    before = store.bytes_read()
    remote = jax_ucp.restore(url, target=target)
    assert store.bytes_read() - before >= sum(x.nbytes for x in jax.tree.leaves(local))
    converted = jax_ucp.restore(jax_ucp.convert(folder, tmp_path / "ucp"), target=target)
    for a, b, c in zip(*(jax.tree.leaves(t) for t in (remote, converted, local))):
        assert a.sharding == b.sharding and a.dtype == b.dtype == c.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), c)
    host = jax_ucp.restore(url)  # no target: every tensor to host, nested by key
    assert set(host["params"]) == set(local["params"])
    one = jax_ucp.restore(f"{url}/model-00002-of-00002.safetensors")
    np.testing.assert_array_equal(one["params"]["layers.0.proj"], local["params"]["layers.0.proj"])


def test_a_truncated_object_is_an_error_naming_it(bucket_url, tmp_path):
    folder = _folder(tmp_path)
    url = _upload(folder, bucket_url)
    name = "model-00002-of-00002.safetensors"
    object_store.write(url, name, (folder / name).read_bytes()[:-8])
    with pytest.raises(jax_ucp.UCPError, match=name):
        jax_ucp.restore(url)


@pytest.mark.parametrize(
    ("entry", "shard"),
    [
        ("layers.0.proj", "model-00001-of-00002.safetensors"),
        ("ghost", "model-00002-of-00002.safetensors"),
    ],
    ids=["in-another-shard", "in-no-shard"],
)
@pytest.mark.parametrize("medium", ["local", "s3"])
def test_an_index_naming_the_wrong_shard_is_refused_on_every_medium(
    bucket_url, tmp_path, medium, entry, shard
):
    """A tensor the index puts in a shard that does not hold it (it is in the other one, or in
    none): refused naming the index, the tensor and the shard, locally and in an object store
    alike (before: an object store's index was read for its file names only)."""
    folder = _folder(tmp_path)
    index = folder / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] | {entry: shard}
    index.write_text(json.dumps({"weight_map": weight_map}))
    src = str(folder) if medium == "local" else _upload(folder, bucket_url)
    pattern = rf"model\.safetensors\.index\.json: .*{re.escape(repr(entry))}.* {shard}"
    with pytest.raises(jax_ucp.SourceError, match=pattern):
        jax_ucp.convert(src, tmp_path / "out")
    with pytest.raises(jax_ucp.SourceError, match=pattern):
        jax_ucp.restore(src)
