"""What jax_ucp reads from TensorStore's errors (``errors.tensorstore_status`` /
``tensorstore_failure``), pinned on failures provoked on real arrays jax_ucp wrote: TensorStore
gives no exception type per failure (every one is a ``ValueError``), so its status code and, for
a digest mismatch, its text are what a read failure is told by. A TensorStore release that
words them otherwise fails here instead of silently mislabelling a corrupt checkpoint."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src import store
from jax_ucp._src.errors import (
    DIGEST_MISMATCH,
    is_tensorstore_io_error,
    tensorstore_failure,
    tensorstore_message,
    tensorstore_status,
)


def _saved(tmp_path, **save_options):
    """A 64x64 float32 array saved by jax_ucp (one shard file), its shard and zarr.json paths."""
    root = tmp_path / "c"
    jax_ucp.save(root, {"w": np.arange(64 * 64, dtype=np.float32).reshape(64, 64)}, **save_options)
    array_dir = root / "arrays" / "w"
    (shard,) = [
        os.path.join(d, f) for d, _, fs in os.walk(array_dir) for f in fs if f != "zarr.json"
    ]
    return root, shard, array_dir / "zarr.json"


def _read_error(root) -> ValueError:
    """The error TensorStore raises opening and reading the array whole."""
    with pytest.raises(ValueError) as info:
        store.open_array(store.kvstore_config(root, "arrays/w")).result().read().result()
    assert type(info.value) is ValueError  # TensorStore's only exception type for these
    return info.value


def _flip(path, offset: int) -> None:
    data = bytearray(open(path, "rb").read())
    data[offset] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _truncate(path, size: int) -> None:
    data = open(path, "rb").read()
    open(path, "wb").write(data[:size])


# failure -> (damage done to the saved array, status, failure kind, text the status comes with)
CASES = {
    "flipped data byte": (lambda s, z: _flip(s, 10), "DATA_LOSS", "corrupt", DIGEST_MISMATCH),
    "flipped index byte": (lambda s, z: _flip(s, -5), "DATA_LOSS", "corrupt", DIGEST_MISMATCH),
    "shard cut in half": (
        lambda s, z: _truncate(s, os.path.getsize(s) // 2),
        "DATA_LOSS",
        "corrupt",  # the index TensorStore finds at the new end fails its digest
        DIGEST_MISMATCH,
    ),
    "shard cut to 10 bytes": (
        lambda s, z: _truncate(s, 10),
        "DATA_LOSS",
        "other",
        "Existing shard has size of 10 bytes",
    ),
    "shard file missing": (lambda s, z: os.remove(s), "NOT_FOUND", "missing", "is missing"),
    "zarr.json missing": (lambda s, z: os.remove(z), "NOT_FOUND", "missing", "does not exist"),
    "zarr.json not JSON": (
        lambda s, z: open(z, "w").write("{not json"),
        "DATA_LOSS",
        "other",
        "Invalid JSON",
    ),
}


ZSTD = {"compression": "zstd"}  # read by TensorStore only (store.shard_reader reads no zstd)
CASES_ZSTD = {
    "zstd data byte flipped": (  # decompressed before the crc32c is checked: not a "Digest"
        lambda s, z: _flip(s, 10),
        "FAILED_PRECONDITION",
        "other",
        "Data corruption detected",
    ),
    "zstd chunk checksum flipped": (
        lambda s, z: _flip(s, os.path.getsize(s) - 21),  # the chunk's crc32c, before the index
        "DATA_LOSS",
        "corrupt",
        DIGEST_MISMATCH,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES) + sorted(CASES_ZSTD))
def test_each_failure_is_told_by_its_status_code(tmp_path, case):
    damage, status, kind, text = CASES[case] if case in CASES else CASES_ZSTD[case]
    root, shard, zarr_json = _saved(tmp_path, **({} if case in CASES else ZSTD))
    damage(shard, zarr_json)
    error = _read_error(root)
    assert tensorstore_status(error) == status, str(error)
    assert text in str(error), str(error)
    assert tensorstore_failure(error) == kind
    assert is_tensorstore_io_error(error)
    assert "tensorstore_spec" not in tensorstore_message(error)


def test_other_exceptions_have_no_status():
    assert tensorstore_status(OSError("DATA_LOSS: not TensorStore's")) is None
    assert tensorstore_status(ValueError("no status here")) is None
    assert tensorstore_failure(KeyError("x")) == "other"


def test_a_corrupt_chunk_read_by_tensorstore_is_named_corrupt_by_restore(tmp_path):
    """A zstd array is read by TensorStore (not ``store.shard_reader``); with the manifest's
    shard digests gone nothing checks the file before, so TensorStore's own crc32c meets the
    flipped checksum and the restore's error says what it means."""
    root, shard, _ = _saved(tmp_path, **ZSTD)
    manifest = json.loads((root / "ucp.json").read_text())
    for entry in manifest["entries"]:
        entry["shard_digests"] = None
    (root / "ucp.json").write_text(json.dumps(manifest))
    _flip(shard, os.path.getsize(shard) - 21)  # the chunk's crc32c (before the 20-byte index)
    with pytest.raises(
        jax_ucp.CheckpointError,
        match=r"Tensor 'w': reading .*arrays/w failed \(crc32c checksum mismatch: the data is "
        r"corrupt\): DATA_LOSS: .*Digest mismatch",
    ):
        jax_ucp.restore(root)
