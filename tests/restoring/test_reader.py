"""The checked read path of restore: missing, damaged, swapped and stale files are errors naming\nthe file and the tensor; a read never exceeds its memory budget."""

from __future__ import annotations

import os
import shutil

import pytest

import jax_ucp


def test_missing_manifest(ckpt):
    os.remove(ckpt / "ucp.json")
    with pytest.raises(jax_ucp.CheckpointError, match=r"no ucp\.json"):
        jax_ucp.restore(ckpt)


def test_missing_array_directory(ckpt):
    shutil.rmtree(ckpt / "arrays" / "params.b")
    with pytest.raises(
        jax_ucp.CheckpointError, match=r"params/b.*listed in ucp\.json.*zarr\.json is missing"
    ):
        jax_ucp.restore(ckpt)


def test_corrupt_chunk_is_detected_by_checksum(ckpt):
    shard = ckpt / "arrays" / "params.w" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(jax_ucp.CheckpointError, match=r"params/w.*params\.w.*(checksum|crc)"):
        jax_ucp.restore(ckpt)


def test_truncated_shard_is_detected(ckpt):
    shard = ckpt / "arrays" / "params.w" / "c" / "0" / "0"
    shard.write_bytes(shard.read_bytes()[:40])
    with pytest.raises(jax_ucp.CheckpointError, match=r"params/w"):
        jax_ucp.restore(ckpt)


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(jax_ucp.CheckpointError, match="not a jax_ucp checkpoint"):
        jax_ucp.restore(tmp_path / "empty")
    with pytest.raises(jax_ucp.CheckpointError, match="no such checkpoint"):
        jax_ucp.restore(tmp_path / "nope")
