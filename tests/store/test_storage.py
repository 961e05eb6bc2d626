"""The storage media: one type chosen once from a path (``store.storage_for``), asked the same
way for a local directory and an object-store prefix."""

from __future__ import annotations

import os

import pytest

from jax_ucp._src.errors import RequestError
from jax_ucp._src.store import storage_for
from jax_ucp._src.store.storage import LocalDirectory, ObjectStorePrefix


def test_the_medium_is_chosen_once_from_the_path(tmp_path):
    local = storage_for(tmp_path / "ck")
    assert isinstance(local, LocalDirectory) and local.local
    assert local.absolute() == os.path.join(os.path.abspath(tmp_path), "ck")
    assert storage_for(local) is local  # handed down, never chosen again
    for url in ("s3://bucket/ck", "gs://bucket/run/ck"):
        prefix = storage_for(url)
        assert isinstance(prefix, ObjectStorePrefix) and not prefix.local
        assert prefix.absolute() == url and prefix.join("arrays", "w") == f"{url}/arrays/w"
    assert isinstance(storage_for("file://x"), LocalDirectory)  # no object-store scheme


def test_a_local_directory_reads_writes_lists_and_deletes_whole_files(tmp_path):
    local = storage_for(tmp_path)
    local.write("ucp.digests.1.json", b"{}")
    local.write("ucp.digests.2.json", b'{"a": {}}')
    local.write("other", b"x")
    assert local.names("ucp.digests.") == ["ucp.digests.1.json", "ucp.digests.2.json"]
    assert local.read("ucp.digests.2.json", 64) == b'{"a": {}}'
    assert local.read("missing", 64) is None
    with pytest.raises(RequestError, match=r"ucp\.digests\.2\.json: more than the 4 bytes"):
        local.read("ucp.digests.2.json", 4)
    local.delete(["ucp.digests.1.json", "missing"])  # a missing name is no error
    assert local.names() == ["other", "ucp.digests.2.json"]
    assert local.kvstore("arrays", "w") == {"driver": "file", "path": f"{tmp_path}/arrays/w"}


def test_a_local_file_is_read_by_ranges_as_an_object_is(tmp_path):
    """``Storage.reader``: the read half every medium offers (pread here, ranged GETs there)."""
    data = bytes(range(200))
    (tmp_path / "f.bin").write_bytes(data)
    f = storage_for(tmp_path).reader("f.bin")
    assert f.shown == str(tmp_path / "f.bin")
    assert f.read(10, 5) == data[10:15] and f.read(195, 10) == data[195:]  # fewer at the end
    assert f.holds(200) and not f.holds(201)
    assert storage_for(tmp_path).reader("missing").read(0, 8) is None


def test_a_malformed_prefix_is_refused_before_anything_is_read():
    class Never:
        def directory(self, path):
            raise AssertionError("asked")

        prefix = failed = directory

    with pytest.raises(RequestError, match="a checkpoint is a prefix, never a bucket root"):
        storage_for("s3://bucket").refuse_early(Never())
