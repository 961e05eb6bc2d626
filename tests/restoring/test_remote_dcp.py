"""A torch DCP folder in an object store restored straight onto a mesh (``s3://`` and ``gs://`` on
the local servers tests/store/test_object_store.py starts): the tree equals the local folder's direct
restore bit for bit, its chunks fetched by ranges, the folder read through its ``Storage`` (no
local view built); a corrupt or missing ``.distcp`` object is an error naming it."""

from __future__ import annotations

import os
import time

import jax
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import Mesh

import jax_ucp
from jax_ucp._src import store
from jax_ucp._src.store import storage
from jax_ucp._src.store.storage import object_store, sparse
from jax_ucp._src.torchfiles import dcp
from tests.restoring.test_remote_safetensors import _target

pytestmark = pytest.mark.timeout(300)
FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "torch")


def _upload(name: str, url: str) -> tuple[str, str]:
    folder = os.path.join(FIXTURES, name)
    prefix = f"{url}/dcp-{os.getpid()}-{np.random.default_rng().integers(1 << 30)}"
    for entry in os.listdir(folder):
        with open(os.path.join(folder, entry), "rb") as f:
            object_store.write(prefix, entry, f.read())
    return folder, prefix


def _bytes(x) -> np.ndarray:
    """The array's bytes (bit-exact, also for NaNs and bf16)."""
    return np.atleast_1d(np.asarray(x)).view(np.uint8)


@pytest.mark.parametrize("name", ["fsdp2_fp32", "fsdp2_bf16"])
def test_dcp_in_an_object_store_restores_as_the_local_folder(bucket_url, monkeypatch, name):
    folder, url = _upload(name, bucket_url)

    listed, list_names = [], object_store.list_names
    monkeypatch.setattr(object_store, "list_names", lambda *a: listed.append(a) or list_names(*a))
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    local = jax_ucp.restore(folder)
    target = _target(local, mesh)
    before, viewed = store.bytes_read(), sparse.fetched()
    remote = jax_ucp.restore(url, target=target)
    assert store.bytes_read() >= before  # nothing written: only read
    assert sparse.fetched() == viewed  # listed, no object fetched into the view: by ranges
    assert listed == [(url, "")] * 2  # once to detect (every detector), once to plan
    on_mesh = jax_ucp.restore(folder, target=target)
    assert jax.tree.structure(remote) == jax.tree.structure(local)
    for a, b, c in zip(*(jax.tree.leaves(t) for t in (remote, on_mesh, local))):
        assert a.sharding == b.sharding and a.dtype == b.dtype == np.asarray(c).dtype
        np.testing.assert_array_equal(_bytes(a), _bytes(b))
        np.testing.assert_array_equal(_bytes(a), _bytes(c))
    host = jax_ucp.restore(url + "/")  # no target: to host
    for a, c in zip(*(jax.tree.leaves(t) for t in (host, local))):
        np.testing.assert_array_equal(_bytes(a), _bytes(c))


def test_a_flipped_byte_in_a_distcp_object_is_an_error_naming_it(bucket_url):
    folder, url = _upload("fsdp2_fp32", bucket_url)
    data = bytearray(open(os.path.join(folder, "__1_0.distcp"), "rb").read())
    ck = dcp.open_dcp(folder)
    t = ck.tensors["model.layers.0.attention.wq.weight"]
    (c,) = (c for c in t.chunks if c.file == "__1_0.distcp")
    at = data.find(ck.read_chunk(t, c).tobytes(), c.byte_offset)  # the tensor's own bytes
    assert c.byte_offset < at < c.byte_offset + c.byte_length
    data[at + 5] ^= 0xFF  # its CRC-32 now disagrees
    object_store.write(url, "__1_0.distcp", bytes(data))
    with pytest.raises(jax_ucp.UCPError, match=r"__1_0\.distcp"):
        jax_ucp.restore(url)


def test_a_missing_rank_object_is_an_error_naming_it(bucket_url):
    _, url = _upload("fsdp2_fp32", bucket_url)
    object_store.delete(url, "__1_0.distcp")
    with pytest.raises(jax_ucp.UCPError, match=r"__1_0\.distcp"):
        jax_ucp.restore(url)


def test_a_dcp_prefix_without_its_metadata_is_named_incomplete(bucket_url):
    """Rank objects but no ``.metadata`` (torch writes it last): a DCP save still running or
    killed, named as that as for a local folder, not "no ucp.json here" (found by tests/hostile)."""
    _, url = _upload("fsdp2_fp32", bucket_url)
    object_store.delete(url, ".metadata")
    with pytest.raises(
        jax_ucp.CheckpointError, match=r"an incomplete torch DCP checkpoint: 2 rank"
    ):
        jax_ucp.restore(url)


def test_accelerates_two_dcp_folders_in_an_object_store_restore_as_the_local_folder(
    s3_server, monkeypatch
):
    """Accelerate's FSDP ``save_state`` (``pytorch_model_fsdp_0/`` and ``optimizer_0/``, a DCP
    folder each) from s3://: read in place, each folder at its URL."""
    from tests.importers.deepspeed.test_object_store import assert_same, served, upload

    folder = os.path.join(FIXTURES, "accelerate_fsdp")
    url = upload(folder, served(monkeypatch, s3_server))
    local = jax_ucp.restore(folder)
    target = _target(local, Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b")))
    viewed = sparse.fetched()
    assert_same(jax_ucp.restore(url, target=target), jax_ucp.restore(folder, target=target))
    assert sparse.fetched() == viewed


def _counted(what: str) -> float:
    """``what`` (``bytes_read``, ``read``: the requests) of TensorStore's object-store drivers in
    this process so far."""
    names = (f"/tensorstore/kvstore/s3/{what}", f"/tensorstore/kvstore/gcs/{what}")
    return sum(
        v.get("value", 0)
        for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/")
        if m["name"] in names
        for v in m.get("values", [])
    )


def _uploaded(bucket_url: str, tmp_path, values: dict, name: str) -> dcp.DcpCheckpoint:
    """``values`` written as a torch DCP folder, uploaded under a fresh prefix, opened there."""
    items = [dcp.DcpItem(k, (k,), v.shape, v.dtype) for k, v in values.items()]
    dcp.write_dcp(str(tmp_path), items, values.values(), save_id=name)
    prefix = f"{bucket_url}/{name}-{os.getpid()}-{time.time_ns()}"
    for entry in os.listdir(tmp_path):
        object_store.write(prefix, entry, (tmp_path / entry).read_bytes())
    return dcp.open_dcp(storage.storage_for(prefix))


def test_a_remote_chunk_needed_whole_is_read_in_one_request(bucket_url, tmp_path):
    """A tensor read whole (a full restore's share): one ranged GET per chunk, not its archive's
    two ends first (issue 71 item 1: a direct restore's requests do not grow)."""
    values = {"w": np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)}
    ck = _uploaded(bucket_url, tmp_path, values, "whole")
    ck.check_files(list(ck.tensors.values()))  # its size probes aside
    before = _counted("read")
    np.testing.assert_array_equal(ck.read("w"), values["w"])
    assert _counted("read") - before == len(ck.tensors["w"].chunks)


def test_a_share_of_a_remote_chunk_fetches_its_rows_alone(bucket_url, tmp_path):
    """Each half of every tensor's rows read apart, as one process of two reads its share
    onto its devices (two destinations of columns each): the bytes fetched are those rows
    (within 5 %: each archive's first and last bytes, the size probe), never the chunk whole
    (issue 69 item 4: it was 2x); the values are the tensor's."""
    rng = np.random.default_rng(0)
    values = {f"w{i}": rng.standard_normal((512, 1024), np.float32) for i in range(2)}
    ck = _uploaded(bucket_url, tmp_path, values, "share")
    for rows in ((0, 256), (256, 512)):
        before = _counted("bytes_read")
        for name, v in values.items():
            halves = [np.empty((256, 512), np.float32) for _ in range(2)]
            dests = [((rows, (0, 512)), halves[0]), ((rows, (512, 1024)), halves[1])]
            for job in ck.region_jobs(name, dests):
                job()
            np.testing.assert_array_equal(np.concatenate(halves, axis=1), v[slice(*rows)])
        needed = sum(v[slice(*rows)].nbytes for v in values.values())
        assert needed <= _counted("bytes_read") - before <= 1.05 * needed
