"""The storage media: one type chosen once from a path (``store.storage_for``), asked the same
way for a local directory and an object-store prefix."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os

import pytest

from jax_ucp._src.errors import RequestError, UnsafeFileError
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
    with pytest.raises(UnsafeFileError, match=r"ucp\.digests\.2\.json: 9 bytes, more than the 4"):
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


def _reads(local: LocalDirectory, name: str) -> list:
    """Every read ``local`` offers of ``name``: whole, by ranges, its existence, its listing."""
    return [local.read(name, 64), local.reader(name).read(0, 64), local.exists(name), local.names()]


def _leaving(tmp_path):
    """A checkpoint ``ck`` and, beside it, another user's file."""
    ck, other = tmp_path / "ck", tmp_path / "other"
    ck.mkdir(), other.mkdir()
    (other / "secret").write_bytes(b"another user's bytes")
    return storage_for(str(ck)), ck, other


def _refused(local: LocalDirectory, name: str, match: str) -> None:
    """Every read of ``name`` raises ``UnsafeFileError`` matching ``match``."""
    for read in (
        lambda: local.read(name, 64),
        lambda: local.reader(name).read(0, 8),
        lambda: local.exists(name),
        lambda: local.ranged(name),
    ):
        with pytest.raises(UnsafeFileError, match=match):
            read()


def test_a_link_leaving_a_local_directory_is_refused(tmp_path):
    """Named: the name, where it resolves, the checkpoint (issue 71)."""
    local, ck, other = _leaving(tmp_path)
    (ck / "out").symlink_to(other / "secret")
    _refused(local, "out", rf"'out' resolves to {other}/secret, outside the checkpoint {ck}")


def test_a_dotdot_name_is_refused(tmp_path):
    local, ck, _ = _leaving(tmp_path)
    _refused(local, "../other/secret", rf"'\.\./other/secret' has a '\.\.' part.* {ck}")


def test_a_checkpoint_through_symlinks_reads_as_its_real_folder(tmp_path):
    """A symlinked parent folder (a mounted disk) or a link to the checkpoint reads the same
    bytes as the folder itself, and a link leaving it is refused there too (issue 68 (1))."""
    real = tmp_path / "disk" / "ck"
    real.mkdir(parents=True)
    (real / "w.bin").write_bytes(bytes(range(50)))
    (real / "inner").symlink_to("w.bin")  # a link that stays inside is followed
    (tmp_path / "secret").write_bytes(b"x")
    (real / "out").symlink_to(tmp_path / "secret")
    (tmp_path / "mnt").symlink_to(tmp_path / "disk")
    (tmp_path / "ck-link").symlink_to(real)
    expected = _reads(storage_for(str(real)), "w.bin")
    assert expected[0] == bytes(range(50)) == expected[1]
    for root in (tmp_path / "mnt" / "ck", tmp_path / "ck-link"):
        local = storage_for(str(root))
        assert _reads(local, "w.bin") == expected == _reads(local, "inner")
        with pytest.raises(UnsafeFileError, match=rf"resolves to {tmp_path}/secret, outside"):
            local.read("out", 64)


def test_a_fifo_is_refused_at_once(tmp_path):
    """A FIFO named as a checkpoint's file is refused without waiting for a writer (an
    ``open`` would block forever), by the whole read and the ranged one."""
    os.mkfifo(tmp_path / "fifo")
    local = storage_for(str(tmp_path))
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        for read in (
            lambda: local.read("fifo", 64),
            lambda: local.reader("fifo").read(0, 8),
            lambda: local.ranged("fifo"),
        ):
            with pytest.raises(UnsafeFileError, match=r"fifo: not a regular file \(a FIFO\)"):
                pool.submit(read).result(timeout=5)
    finally:  # a reader blocked in open() (the old code) is let go by a writer opening it
        with contextlib.suppress(OSError):
            os.close(os.open(tmp_path / "fifo", os.O_WRONLY | os.O_NONBLOCK))
        pool.shutdown(wait=False)
