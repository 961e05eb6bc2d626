"""Broken checkpoints and mismatched targets: clear errors, nothing on disk damaged."""

import hashlib
import json
import os
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ucp
from jax_ucp import format as fmt
from tests.ucp_testing import mesh


def _digest(path):
    h = hashlib.sha256()
    for d, _, fs in sorted(os.walk(path)):
        for f in sorted(fs):
            h.update(os.path.relpath(os.path.join(d, f), path).encode())
            with open(os.path.join(d, f), "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "c"
    jax_ucp.save(
        path,
        {
            "params": {
                "w": np.arange(64, dtype=np.float32).reshape(8, 8),
                "b": np.ones(8, np.float32),
            },
            "step": 1,
        },
    )
    return path


def test_missing_manifest(ckpt):
    os.remove(ckpt / "ucp.json")
    with pytest.raises(jax_ucp.CheckpointError, match=r"no ucp\.json"):
        jax_ucp.restore(ckpt)


def test_corrupt_manifest(ckpt):
    (ckpt / "ucp.json").write_text('{"format": "jax_ucp", "version": 1, "entries": [')
    with pytest.raises(fmt.ManifestError, match=r"ucp\.json: corrupt manifest"):
        jax_ucp.restore(ckpt)


def test_newer_format_version(ckpt):
    d = json.loads((ckpt / "ucp.json").read_text())
    d["version"] = 99
    (ckpt / "ucp.json").write_text(json.dumps(d))
    with pytest.raises(fmt.ManifestError, match="version 99 is newer"):
        jax_ucp.inspect(ckpt)


def test_target_shape_mismatch(ckpt):
    before = _digest(ckpt)
    t = {"params": {"w": jax.ShapeDtypeStruct((8, 4), np.float32)}}
    with pytest.raises(
        jax_ucp.CheckpointError, match=r"params/w.*shape \(8, 4\).*holds shape \(8, 8\)"
    ):
        jax_ucp.restore(ckpt, target=t)
    assert _digest(ckpt) == before


def test_missing_tensor_in_checkpoint(ckpt):
    t = {"params": {"gamma": jax.ShapeDtypeStruct((8,), np.float32)}}
    with pytest.raises(jax_ucp.CheckpointError, match=r"params/gamma.*not in the checkpoint"):
        jax_ucp.restore(ckpt, target=t)


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


def test_existing_destination_is_refused_and_untouched(ckpt):
    before = _digest(ckpt)
    with pytest.raises(FileExistsError, match="already exists"):
        jax_ucp.save(ckpt, {"x": np.zeros(2)})
    assert _digest(ckpt) == before


def test_failed_save_leaves_previous_checkpoint(ckpt):
    before = _digest(ckpt)
    with pytest.raises(TypeError, match=r"'bad'.*cannot save"):
        jax_ucp.save(ckpt, {"bad": object()}, force=True)
    assert _digest(ckpt) == before
    assert sorted(os.listdir(ckpt.parent)) == ["c"]


def test_unsupported_leaf_and_bare_leaf(tmp_path):
    with pytest.raises(ValueError, match="bare leaf"):
        jax_ucp.save(tmp_path / "x", np.zeros(3))
    with pytest.raises(TypeError, match=r"'a/b'.*set"):
        jax_ucp.save(tmp_path / "y", {"a": {"b": {1, 2}}})
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "y")


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(jax_ucp.CheckpointError, match="not a jax_ucp checkpoint"):
        jax_ucp.restore(tmp_path / "empty")
    with pytest.raises(jax_ucp.CheckpointError, match="no such checkpoint"):
        jax_ucp.restore(tmp_path / "nope")


def test_64bit_onto_devices_without_x64_is_refused(tmp_path):
    jax_ucp.save(tmp_path / "c", {"d": np.arange(8, dtype=np.float64)})
    m = mesh((2,), ("x",))
    with pytest.raises(jax_ucp.CheckpointError, match=r"'d' is float64.*narrow"):
        jax_ucp.restore(tmp_path / "c", shardings={"d": NamedSharding(m, P("x"))})
    # mesh-only restore keeps it exact on host
    out = jax_ucp.restore(tmp_path / "c", mesh=m, strict=False)
    assert isinstance(out["d"], np.ndarray) and out["d"].dtype == np.float64
