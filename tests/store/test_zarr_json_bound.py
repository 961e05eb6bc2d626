"""An array's ``zarr.json`` is bound to the manifest (docs/FORMAT.md): one word changed in it (the
inner ``bytes`` codec made big-endian, a ``transpose`` codec added) restored the tensor
byte-swapped or transposed with no error and ``jax-ucp verify`` exited 0, since the shard digests
cover the shard files and only zarr.json's shape and dtype were compared. Each case is a hostile
copy of a real checkpoint; restore, verify, diff and the CLI refuse it naming the tensor, the file
and the field. TensorStore's own equivalent spellings are still accepted."""

from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import pytest
from typer.testing import CliRunner

import jax_ucp
from jax_ucp._src.store.storage import object_store
from jax_ucp.cli import app
from jax_ucp.errors import CheckpointError

pytestmark = pytest.mark.timeout(120)
runner = CliRunner()

W = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)


def _inner(z: dict) -> list:
    return z["codecs"][0]["configuration"]["codecs"]


def _set(path: list, value):
    def edit(z: dict) -> None:
        node = z
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value

    return edit


# hostile edit -> the field the error names
HOSTILE = {
    "bytes codec made big-endian": (
        lambda z: _inner(z)[0]["configuration"].update(endian="big"),
        "codecs[0].configuration.codecs[0].configuration.endian",
    ),
    "transpose codec added": (
        lambda z: _inner(z).insert(0, {"name": "transpose", "configuration": {"order": [1, 0]}}),
        "codecs[0].configuration.codecs[0].name",
    ),
    "index codecs made big-endian": (
        lambda z: z["codecs"][0]["configuration"]["index_codecs"][0]["configuration"].update(
            endian="big"
        ),
        "codecs[0].configuration.index_codecs[0].configuration.endian",
    ),
    "crc32c dropped": (
        lambda z: _inner(z).pop(),
        "codecs[0].configuration.codecs[1]",
    ),
    "chunk keys with '.'": (
        _set(["chunk_key_encoding"], {"name": "default", "configuration": {"separator": "."}}),
        "chunk_key_encoding.configuration",
    ),
    "v2 chunk keys": (_set(["chunk_key_encoding"], {"name": "v2"}), "chunk_key_encoding.name"),
    "fill value 7": (_set(["fill_value"], 7.0), "fill_value"),
    "data type int32": (_set(["data_type"], "int32"), "data_type"),
    "index at the start": (
        lambda z: z["codecs"][0]["configuration"].update(index_location="start"),
        "codecs[0].configuration.index_location",
    ),
    "an unknown member": (_set(["must_understand"], False), "must_understand"),
    "dimension names of another rank": (_set(["dimension_names"], ["a"]), "dimension_names"),
    "a storage transformer": (
        _set(["storage_transformers"], [{"name": "x"}]),
        "storage_transformers",
    ),
}


def _saved(tmp_path, **options) -> str:
    path = str(tmp_path / "good")
    jax_ucp.save(path, {"w": W, "b": np.arange(4, dtype=np.int8)}, **options)
    return path


def _hostile(good: str, dest: str, edit) -> str:
    shutil.copytree(good, dest)
    meta = os.path.join(dest, "arrays", "w", "zarr.json")
    z = json.loads(open(meta).read())
    edit(z)
    with open(meta, "w") as f:
        json.dump(z, f)
    return meta


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_zarr_json_that_is_not_what_the_manifest_implies_is_refused(tmp_path, case):
    edit, field = HOSTILE[case]
    good = _saved(tmp_path)
    bad = str(tmp_path / "bad")
    meta = _hostile(good, bad, edit)
    with pytest.raises(CheckpointError) as info:
        jax_ucp.restore(bad)
    message = str(info.value)
    assert message.startswith(f"Tensor 'w': {meta}: {field} is "), message
    assert "ucp.json implies" in message, message
    assert [name for name, _ in jax_ucp.verify(bad)] == ["w"]
    with pytest.raises(CheckpointError, match=r"ucp\.json implies"):
        jax_ucp.diff(good, bad)
    r = runner.invoke(app, ["verify", bad], env={"COLUMNS": "400"})
    assert r.exit_code == 1 and field in r.output and meta in r.output, r.output
    np.testing.assert_array_equal(jax_ucp.restore(good)["w"], W)  # the good copy is fine


def test_the_old_silent_misreads_are_refused_with_compression(tmp_path):
    """zstd between bytes and crc32c: swapping their order, or dropping zstd, is refused."""
    good = _saved(tmp_path, compression="zstd")
    for i, (edit, field) in enumerate(
        [
            (lambda z: _inner(z).reverse(), "codecs[0].configuration.codecs[0].name"),
            (lambda z: _inner(z).pop(1), "codecs[0].configuration.codecs[1].name"),
            (
                lambda z: _inner(z)[1]["configuration"].update(checksum=True),
                "codecs[0].configuration.codecs[1].configuration.checksum",
            ),
        ]
    ):
        bad = str(tmp_path / f"bad{i}")
        meta = _hostile(good, bad, edit)
        with pytest.raises(CheckpointError) as info:
            jax_ucp.restore(bad)
        assert f"{meta}: {field} is " in str(info.value)


def test_a_zarr_json_naming_a_key_twice_is_refused(tmp_path):
    good = _saved(tmp_path)
    bad = str(tmp_path / "bad")
    shutil.copytree(good, bad)
    meta = os.path.join(bad, "arrays", "w", "zarr.json")
    text = open(meta).read()
    open(meta, "w").write(text.replace('"zarr_format":3', '"zarr_format":3,"data_type":"int32"'))
    with pytest.raises(CheckpointError, match=r"names 'data_type' twice"):
        jax_ucp.restore(bad)


def test_tensorstores_equivalent_spellings_are_accepted(tmp_path):
    """What TensorStore writes for the same array in another form: the index location and the
    key separator said explicitly, another zstd level (not recorded: decoding does not use it),
    zstd's checksum member left out, a single-byte type's endianness said; and the members
    FORMAT.md 4.1 has readers ignore (attributes, dimension names)."""
    good = _saved(tmp_path, compression="zstd")
    same = str(tmp_path / "same")

    def spelled(z: dict) -> None:
        z["codecs"][0]["configuration"]["index_location"] = "end"
        z["chunk_key_encoding"] = {"name": "default", "configuration": {"separator": "/"}}
        _inner(z)[1]["configuration"] = {"level": 19}
        z["fill_value"] = 0  # an integer zero for a float array
        z["attributes"] = {"note": "names change nothing a read gives"}
        z["dimension_names"] = ["rows", None]

    _hostile(good, same, spelled)
    b_meta = os.path.join(same, "arrays", "b", "zarr.json")
    z = json.loads(open(b_meta).read())
    _inner(z)[0] = {"name": "bytes", "configuration": {"endian": "little"}}
    open(b_meta, "w").write(json.dumps(z))
    out = jax_ucp.restore(same)
    np.testing.assert_array_equal(out["w"], W)
    np.testing.assert_array_equal(out["b"], np.arange(4, dtype=np.int8))
    assert not jax_ucp.verify(same)


def test_an_object_store_zarr_json_is_bound_too(bucket):
    _, root = bucket
    url = f"{root}/bound-{time.time_ns()}"
    jax_ucp.save(url, {"w": W})
    name = "arrays/w/zarr.json"
    z = json.loads(object_store.read(url, name, 1 << 20) or b"")
    _inner(z)[0]["configuration"]["endian"] = "big"
    object_store.write(url, name, json.dumps(z).encode())
    with pytest.raises(CheckpointError, match=r"configuration\.endian is \"big\", but ucp.json"):
        jax_ucp.restore(url)
    object_store.write(url, name, b" " * (64 << 10))
    with pytest.raises(CheckpointError, match=r"more than the 16384 bytes"):
        jax_ucp.restore(url)
    object_store.delete(url, name)
    with pytest.raises(CheckpointError, match=r"zarr.json is missing"):
        jax_ucp.restore(url)
