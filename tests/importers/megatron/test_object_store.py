"""Megatron checkpoints in an object store (``s3://`` on the local moto server) restore onto a
mesh as the local folders do: the legacy per-rank folders (``iter_N/mp_rank_XX[_YYY]/
model_optim_rng.pt``, the distributed optimizer's ``distrib_optim.pt``), their archives read by
ranged GETs; megatron-core's ``torch_dist`` and ``fsdp_dtensor`` folders, read at their URL by
the torch DCP reader: each ``.distcp`` object only by the byte ranges of the chunks a restore
reads (every GET recorded), never whole. Each prefix is read in place, through its ``Storage``
(no local view of it built)."""

from __future__ import annotations

import os
import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_ucp
from jax_ucp._src.importers.megatron import dcp
from jax_ucp._src.store.storage import LocalDirectory, object_store, ranged, sparse
from tests.importers.deepspeed.test_object_store import (
    assert_same,
    restores_as_local,
    served,
    size_of,
    upload,
)
from tests.restoring.test_remote_safetensors import _target
from tests.ucp_testing import REPO, run_workers

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
    """megatron-core's own fsdp_dtensor save (torch DCP with uneven DP row chunks) from s3://,
    a save root (its tracker naming ``iter_0000002/``) read in place: no archive in it, so
    nothing is fetched into a sparse copy, its objects only by ranges."""
    src = os.path.join(REPO, "tests", "fixtures", "megatron_fsdp_dtensor", "gpt_dp2")
    url = upload(src, served(monkeypatch, s3_server))
    local = jax_ucp.restore(src)
    target = _target(local, Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b")))
    before = sparse.fetched()
    assert_same(jax_ucp.restore(url, target=target), jax_ucp.restore(src, target=target))
    assert_same(jax_ucp.restore(url), local)
    assert sparse.fetched() == before


def _gets(monkeypatch) -> list[tuple[str, int | None, int | None]]:
    """Every read of the object store from now on: (object name, start, stop) of a ranged one
    (a range of ``ranged.fetch_ranges``, a piece of ``RangedObject.read_into`` or a size
    probe), (name, None, None) of a whole GET."""
    gets: list[tuple[str, int | None, int | None]] = []
    fetch, size, whole = ranged.fetch_ranges, ranged.RangedObject.size, object_store.read

    def pieces(kv, key, ranges, put, url=""):
        gets.extend((key.rpartition("/")[2], a, b) for a, b in ranges)
        return fetch(kv, key, ranges, put, url)

    monkeypatch.setattr(ranged, "fetch_ranges", pieces)
    read_into = ranged.RangedObject.read_into

    def into(self, asked, done):
        gets.extend((self.key.rpartition("/")[2], a, a + n) for a, n, _ in asked)
        return read_into(self, asked, done)

    monkeypatch.setattr(ranged.RangedObject, "read_into", into)
    monkeypatch.setattr(
        ranged.RangedObject,
        "size",
        lambda self, end: (
            gets.append((self.key.rpartition("/")[2], end - 1, end)) or size(self, end)
        ),
    )
    monkeypatch.setattr(
        object_store,
        "read",
        lambda root, name, limit: gets.append((name, None, None)) or whole(root, name, limit),
    )
    return gets


@pytest.mark.parametrize(
    "src, inside, select",
    [
        ("megatron/gpt_tp2", "", r".*word_embeddings.*"),
        ("megatron_fsdp_dtensor/gpt_dp2", "iter_0000002", r".*linear_fc1.*"),
    ],
)
def test_megatron_dcp_objects_are_read_by_the_byte_ranges_of_the_chunks_read(
    s3_server, monkeypatch, src, inside, select
):
    """The ``.distcp`` objects are read only by ranged GETs, each inside one chunk's (or pickled
    object's) byte range from ``.metadata`` or a one-byte probe of an object's size, never
    whole; a restore of a few tensors reads only their chunks' bytes, fewer than the files'.
    The pieces of a chunk are fetched at once (4 KiB here, as 8 MiB ones of a larger chunk)."""
    root = os.path.join(REPO, "tests", "fixtures", src)
    url = upload(root, served(monkeypatch, s3_server))
    monkeypatch.setattr(ranged, "PIECE", 4096)
    folder = os.path.join(root, inside)
    ck = dcp.open_dcp(LocalDirectory(folder))
    sizes = {f: os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)}
    entries = [*(c for t in ck.tensors.values() for c in t.chunks), *ck.objects.values()]
    extents = set(map(_extent, entries))
    probes = {(f, sizes[f] - 1, sizes[f]) for f, *_ in extents}
    local = jax_ucp.restore(root)
    target = _target(local, Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b")))
    gets = _gets(monkeypatch)
    view = sparse.fetched()[1]
    assert_same(jax_ucp.restore(url, target=target), jax_ucp.restore(root, target=target))
    dcp_gets = [g for g in gets if g[0].endswith(".distcp")]
    outside = [g for g in dcp_gets if g not in probes and not _within(g, extents)]
    assert dcp_gets and not outside, outside
    assert all(b - a < sizes[name] for name, a, b in dcp_gets)  # never an object whole
    dcp_files = sum(n for f, n in sizes.items() if f == ".metadata" or f.endswith(".distcp"))
    assert sparse.fetched()[1] - view <= size_of(root) - dcp_files  # the view: none of them

    gets.clear()
    part = jax_ucp.restore(url, select=select)
    assert_same(part, jax_ucp.restore(root, select=select))
    chosen = [t for k, t in ck.tensors.items() if re.fullmatch(select, k)]
    steps = [t for t in ck.tensors.values() if not t.shape]  # each parameter's, held equal
    mine = {_extent(c) for t in chosen + steps for c in t.chunks}
    objects = set(map(_extent, ck.objects.values()))
    read = {g for g in gets if g[0].endswith(".distcp")} - probes
    outside = [g for g in read if not _within(g, mine | objects)]
    assert chosen and not outside, outside
    total = sum(n for f, n in sizes.items() if f.endswith(".distcp"))
    assert sum(b - a for _, a, b in read) < total  # the pickled objects, its tensors' chunks
    tensors = sum(c.byte_length for t in ck.tensors.values() for c in t.chunks)
    mine_read = [g for g in read if not _within(g, objects)]
    assert 0 < sum(b - a for _, a, b in mine_read) < tensors / 2, (read, tensors)


def _within(get, extents) -> bool:
    """Whether ranged read ``get`` lies inside one of ``extents`` (each (file, start, stop))."""
    return any(f == get[0] and a <= get[1] and get[2] <= b for f, a, b in extents)


def _extent(entry) -> tuple[str, int, int]:
    """(file, start, stop) of a chunk's or pickled object's bytes, as ``.metadata`` gives them."""
    return entry.file, entry.byte_offset, entry.byte_offset + entry.byte_length


def test_integrity_json_is_checked_on_the_objects_themselves(s3_server, monkeypatch):
    """megatron-core 0.19's ``integrity.json`` from s3://: each listed object hashed by ranged
    GETs (not the view's empty stand-ins), the restore equal to the local folder's; an object
    whose bytes changed is refused by its SHA-256, naming its URL."""
    src = os.path.join(REPO, "tests", "fixtures", "megatron", "mcore_versions", "0.19.2")
    src = os.path.join(src, "gpt_tp2_integrity")
    url = upload(src, served(monkeypatch, s3_server))
    assert_same(jax_ucp.restore(url), jax_ucp.restore(src))
    with open(os.path.join(src, "__1_0.distcp"), "rb") as f:
        data = bytearray(f.read())
    data[-1] ^= 1
    object_store.write(url, "__1_0.distcp", bytes(data))
    with pytest.raises(jax_ucp.UCPError, match=rf"{url}/__1_0\.distcp: SHA-256 .*integrity"):
        jax_ucp.restore(url)


WORKER = r"""
import sys, threading
pid, port, url, src = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
import jax
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid, initialization_timeout=120)
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax_ucp
from jax_ucp._src.store.storage import ranged
read, lock, read_into = [0], threading.Lock(), ranged.RangedObject.read_into
def counting(self, pieces, done):
    with lock:
        read[0] += sum(n for _, n, _ in pieces) if self.key.endswith(".distcp") else 0
    return read_into(self, pieces, done)
ranged.RangedObject.read_into = counting
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
assert {d.process_index for d in mesh.devices[pid]} == {pid}
whole = jax_ucp.restore(src)  # the local folder, to host: the single-process answer
rows = lambda x: P("data" if np.ndim(x) and np.shape(x)[0] % 2 == 0 else None)
out = jax_ucp.restore(url, shardings=jax.tree.map(lambda x: NamedSharding(mesh, rows(x)), whole))
for a, w in zip(jax.tree.leaves(out), jax.tree.leaves(whole)):
    for s in a.addressable_shards:
        assert np.asarray(s.data).tobytes() == np.asarray(w)[s.index].tobytes()
print("READ", read[0])
"""


@pytest.mark.slow
def test_each_process_of_a_two_process_restore_fetches_only_its_chunks(
    s3_server, monkeypatch, tmp_path
):
    """A 2-process job (4 CPU devices each, rows split over the processes) restores the TP=2
    torch_dist fixture from s3://: every shard equals the local folder's, and each process
    fetches the chunks of its rows, not both ranks' (counted at ``RangedObject.read_into``)."""
    src = os.path.join(REPO, "tests", "fixtures", "megatron", "gpt_tp2")
    url = upload(src, served(monkeypatch, s3_server))
    results = run_workers(tmp_path, WORKER, url, src, devices=4, timeout=240)
    total = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src) if "distcp" in f)
    for code, out, err in results:
        assert code == 0, err[-3000:]
        read = int(out.split("READ ", 1)[1].split()[0])
        assert 0 < read < 0.75 * total, (read, total)
