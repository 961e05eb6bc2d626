"""The order a save's shard files become durable in: each file's write-back started as it is
written (``shard_writer.start_writeback``, no fsync per file), then one syncfs, then the rename
that commits the directory. The write-back hint gives no durability: the syncfs before the
rename does, so these tests fail if it is dropped or moved after the rename."""

from __future__ import annotations

import os
import re
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ucp
from jax_ucp._src import format as fmt
from jax_ucp._src.store import shard_writer
from jax_ucp._src.store.storage import local
from tests.ucp_testing import assert_bit_exact

pytestmark = pytest.mark.timeout(120)


def _tree():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    b = np.arange(16, dtype=np.float32) + 0.5
    return {
        "w": jax.device_put(w, NamedSharding(mesh, P("x", "y"))),
        "b": jax.device_put(b, NamedSharding(mesh, P())),
    }, {"w": w, "b": b}


def _shard_files(path) -> set[str]:
    arrays = os.path.join(path, fmt.ARRAYS_DIR)
    return {
        os.path.relpath(os.path.join(d, f), path)
        for d, _, files in os.walk(arrays)
        for f in files
        if f != "zarr.json"
    }


def test_a_save_syncs_every_shard_file_before_the_rename_that_commits_it(tmp_path, monkeypatch):
    events: list[tuple] = []
    real_start, real_syncfs, real_rename = (
        shard_writer.start_writeback,
        local.sync_filesystem,
        os.rename,
    )

    def start_writeback(fd):
        events.append(("started", os.path.realpath(f"/proc/self/fd/{fd}")))
        real_start(fd)

    def sync_filesystem(path):
        real_syncfs(path)
        events.append(("syncfs", str(path)))

    def rename(src, dst, *args, **kwargs):
        events.append(("rename", str(src), str(dst)))
        return real_rename(src, dst, *args, **kwargs)

    def fsync(fd):
        target = os.path.realpath(f"/proc/self/fd/{fd}")
        assert not re.search(r"/c(/[0-9]+)+$", target), f"a shard file fsynced: {target}"
        os.fdatasync(fd)

    monkeypatch.setattr(shard_writer, "start_writeback", start_writeback)
    monkeypatch.setattr(local, "sync_filesystem", sync_filesystem)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "fsync", fsync)
    tree, expected = _tree()
    dest = tmp_path / "ck"
    jax_ucp.save(dest, tree)
    monkeypatch.undo()

    commit = [i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(dest)]
    assert len(commit) == 1, events
    (committed,) = commit
    tmp = events[committed][1]
    started = {os.path.relpath(e[1], tmp) for e in events[:committed] if e[0] == "started"}
    assert started == _shard_files(dest) and len(started) == 8 + 1, events  # w: 8 shards, b: 1
    last_start = max(i for i, e in enumerate(events) if e[0] == "started")
    assert last_start < committed
    synced = [e for e in events[last_start + 1 : committed] if e[0] == "syncfs"]
    assert synced, f"no syncfs between the last shard write and the commit's rename: {events}"
    restored = jax_ucp.restore(dest)
    for k, v in expected.items():
        assert_bit_exact(restored[k], v)


def test_without_sync_file_range_a_save_still_commits_whole(tmp_path, monkeypatch):
    """Where libc has no ``sync_file_range`` (macOS), the hint is skipped; the commit's syncfs
    (or sync) still makes the files durable and the checkpoint restores bit for bit."""
    looked_up = []
    monkeypatch.setattr(shard_writer, "sync_file_range", lambda: looked_up.append(1))
    tree, expected = _tree()
    jax_ucp.save(tmp_path / "ck", tree)
    assert len(looked_up) == 9  # every shard file asked for it, and went on without
    restored = jax_ucp.restore(tmp_path / "ck")
    for k, v in expected.items():
        assert_bit_exact(restored[k], v)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_the_write_back_hint_is_accepted_by_the_kernel(tmp_path):
    """The ctypes binding and the flag are right: the kernel accepts the call (a wrong argument
    type or flag is EINVAL), so the hint is not silently a no-op on Linux."""
    fn = shard_writer.sync_file_range()
    assert fn is not None
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, b"x" * 65536)
        assert fn(fd, 0, 0, shard_writer.SYNC_FILE_RANGE_WRITE) == 0
        assert fn(fd, 0, 0, 0x100) == -1  # an unknown flag: refused, so 0 above means accepted
    finally:
        os.close(fd)
