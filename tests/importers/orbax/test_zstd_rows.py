"""Rows of an Orbax array decoded from its zstd chunks as a stream (``importers.orbax.zstd_rows``,
issue 33): exact rows in any order, damaged chunks refused naming the array, and an array saved
as one chunk (Orbax's default) imported within the memory budget instead of decoded whole."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numcodecs
import numpy as np
import pytest
import tensorstore as ts
import zstandard

import jax_ucp
from jax_ucp._src.importers.orbax import zstd_rows
from jax_ucp.errors import SourceError
from tests.ucp_testing import peak_over_baseline, run_child

MiB = 1 << 20


def _zarr(path, value: np.ndarray, chunk_rows: int):
    """A zarr v2 array written by TensorStore (zstd, as Orbax writes it) in chunks of rows."""
    spec = {
        "driver": "zarr",
        "kvstore": {"driver": "file", "path": str(path)},
        "metadata": {
            "shape": list(value.shape),
            "chunks": [chunk_rows, *value.shape[1:]],
            "dtype": "bfloat16" if value.dtype == ml_dtypes.bfloat16 else value.dtype.str,
            "compressor": {"id": "zstd", "level": 1},
        },
        "create": True,
    }
    ts.open(spec).result().write(value).result()
    return ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(path)}}).result()


def _rows(array):
    rows = zstd_rows.rows_reader(array, "where", "w")
    assert rows is not None
    return rows


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int8])
def test_rows_in_any_order_equal_the_array(tmp_path, monkeypatch, dtype):
    """Small pieces (the value's end reached by zstd's hints), slabs across chunk borders, the
    same rows twice and rows before ones already decoded (a restart)."""
    monkeypatch.setattr(zstd_rows, "PIECE_BYTES", 97)
    value = (np.random.default_rng(0).standard_normal((101, 33)) * 50).astype(dtype)
    rows = _rows(_zarr(tmp_path / "a", value, 40))
    for lo, hi in [(0, 7), (7, 45), (45, 101), (3, 5), (3, 5), (0, 101), (80, 81), (60, 100)]:
        np.testing.assert_array_equal(rows(lo, hi), value[lo:hi])


def test_other_layouts_are_left_to_tensorstore(tmp_path):
    """Chunks that split a row, or no compressor: None (read through TensorStore)."""
    value = np.arange(64, dtype=np.float32).reshape(8, 8)
    spec = {
        "driver": "zarr",
        "kvstore": {"driver": "file", "path": str(tmp_path / "split")},
        "metadata": {"shape": [8, 8], "chunks": [8, 4], "dtype": "<f4", "compressor": None},
        "create": True,
    }
    split = ts.open(spec).result()
    split.write(value).result()
    assert zstd_rows.rows_reader(split, "w", "x") is None
    spec["kvstore"]["path"] = str(tmp_path / "raw")
    spec["metadata"]["chunks"] = [4, 8]
    assert zstd_rows.rows_reader(ts.open(spec).result(), "w", "x") is None


def _damage(tmp_path, how: str):
    value = np.random.default_rng(1).standard_normal((64, 16)).astype(np.float32)
    array = _zarr(tmp_path / "a", value, 32)
    chunk = tmp_path / "a" / "1.0"
    raw = chunk.read_bytes()
    if how == "truncated":
        chunk.write_bytes(raw[: len(raw) // 2])
    elif how == "trailing":
        chunk.write_bytes(raw + b"\0")
    elif how == "longer":
        chunk.write_bytes(numcodecs.Zstd().encode(np.zeros((33, 16), np.float32).tobytes()))
    elif how == "shorter":
        chunk.write_bytes(numcodecs.Zstd().encode(np.zeros((31, 16), np.float32).tobytes()))
    elif how == "garbage":
        chunk.write_bytes(b"not a zstd frame at all")
    elif how == "empty":
        chunk.write_bytes(b"")
    return _rows(array), value


@pytest.mark.parametrize("how", ["truncated", "trailing", "longer", "shorter", "garbage", "empty"])
def test_a_damaged_chunk_is_an_error_naming_the_array(tmp_path, how):
    """Every way a chunk can disagree with its declared bytes is refused (the rows of the
    intact chunk before it still read exactly)."""
    rows, value = _damage(tmp_path, how)
    np.testing.assert_array_equal(rows(0, 32), value[:32])
    with pytest.raises(SourceError, match=r"where: reading array .w. failed \(rows 32:64; "):
        rows(32, 64)


_SAVE = """
import sys, numpy as np, orbax.checkpoint as ocp
embed = np.random.default_rng(5).standard_normal((40960, 1024)).astype(np.float32)
with ocp.StandardCheckpointer() as c:  # defaults: OCDBT, zstd, one chunk per array
    c.save(sys.argv[1], {"embed": embed, "b": np.ones(3, np.float32)})
"""

_CHECK = """
import sys, numpy as np, jax_ucp
embed = np.random.default_rng(5).standard_normal((40960, 1024)).astype(np.float32)
assert np.array_equal(np.asarray(jax_ucp.restore(sys.argv[1])["embed"]), embed)
"""


@pytest.mark.slow  # ~10 s; the default run keeps writer/test_stream_memory_budget's twin
@pytest.mark.timeout(900)
def test_a_one_chunk_orbax_array_over_the_budget_stays_within_it(tmpfs_path):
    """A 160 MiB array saved by Orbax's defaults (one zstd chunk of 147 MiB compressed),
    imported at a 32 MiB budget: the process's RssAnon stays within budget + 64 MiB over its
    baseline (Orbax and JAX imported), where TensorStore's whole-chunk decode held the
    compressed chunk, the decoded chunk and the array (~+430 MiB)."""
    run_child(_SAVE, tmpfs_path / "orbax")
    over = peak_over_baseline(
        tmpfs_path / "orbax", tmpfs_path / "ucp", "32MiB", orbax_in_baseline=True
    )
    assert over < 32 * MiB + 64 * MiB, over / MiB
    run_child(_CHECK, tmpfs_path / "ucp")


def _checksummed_orbax(path, value: np.ndarray, chunk_rows: int) -> list[bytes]:
    """An Orbax checkpoint (zarr v2, no OCDBT) holding ``value`` as array ``w`` re-chunked by
    rows, every chunk a zstd frame with the content-checksum flag set (the edge chunk padded to
    the full chunk shape, as zarr v2 stores it); returns the frames."""
    import orbax.checkpoint as ocp

    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False)
    with ocp.Checkpointer(handler) as c:
        c.save(os.fspath(path), args=ocp.args.PyTreeSave({"w": value}))
    folder = path / "w"
    zarray = json.loads((folder / ".zarray").read_text())
    zarray["chunks"] = [chunk_rows, *value.shape[1:]]
    (folder / ".zarray").write_text(json.dumps(zarray))
    for old in folder.iterdir():
        if old.name != ".zarray" and not old.name.startswith("."):
            old.unlink()
    frames = []
    compressor = zstandard.ZstdCompressor(write_checksum=True, write_content_size=True)
    for index in range(-(-value.shape[0] // chunk_rows)):
        chunk = np.zeros((chunk_rows, *value.shape[1:]), value.dtype)
        rows = value[index * chunk_rows : (index + 1) * chunk_rows]
        chunk[: len(rows)] = rows
        frames.append(compressor.compress(chunk.tobytes()))
        (folder / ".".join([str(index)] + ["0"] * (value.ndim - 1))).write_bytes(frames[-1])
    return frames


def test_a_flipped_byte_in_an_edge_chunk_fails_its_checksum(tmp_path):
    """Issue 38: a (10, 4) array in chunks of 4 rows, each a checksummed zstd frame; one byte
    of row 9 changed inside the edge chunk (rows 8..11, rows 10 and 11 past the array's end).
    The frame is decoded to its end and its checksum checked before any of its rows is
    handed out: ``convert`` refuses naming the array, where it once gave a wrong row 9."""
    value = np.random.default_rng(7).standard_normal((10, 4)).astype(np.float32)
    src = tmp_path / "orbax"
    frames = _checksummed_orbax(src, value, 4)
    assert zstandard.get_frame_parameters(frames[2]).has_checksum
    np.testing.assert_array_equal(jax_ucp.restore(_converted(src, tmp_path / "ok"))["w"], value)

    at = frames[2].find(value[9].tobytes())  # the row is stored as is (random floats)
    assert at > 0
    bad = bytearray(frames[2])
    bad[at + 1] ^= 0x40
    (src / "w" / "2.0").write_bytes(bytes(bad))
    with pytest.raises(zstandard.ZstdError, match="checksum"):
        zstandard.ZstdDecompressor().decompress(bytes(bad))  # what the one-shot decoder says
    with pytest.raises(SourceError, match=r"'w'.*(rows 8:10|rows 0:10)") as e:
        jax_ucp.convert(src, tmp_path / "out")
    assert os.fspath(src / "w") in str(e.value) and "checksum" in str(e.value)
    assert not (tmp_path / "out").exists()
    # the rows alone, the edge rows asked for last or by themselves
    array = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(src / "w")}})
    rows = _rows(array.result())
    np.testing.assert_array_equal(rows(0, 8), value[:8])
    for lo, hi in [(8, 10), (9, 10), (8, 9)]:
        with pytest.raises(SourceError, match="checksum"):
            rows(lo, hi)
    # the frame cut inside its checksum: every row decodes, the frame does not end
    (src / "w" / "2.0").write_bytes(frames[2][:-2])
    with pytest.raises(SourceError, match=r"'w'.*truncated"):
        _rows(array.result())(0, 10)


def _converted(src, dst) -> str:
    jax_ucp.convert(src, dst)
    return os.fspath(dst)


def test_a_damaged_edge_chunk_is_refused_although_its_padding_is_never_asked_for(tmp_path):
    """(10, 4) float32 in chunks of 4 rows: the edge chunk covers rows 8..11, rows 10 and 11 lie
    outside the array. One byte of row 9 changed inside its zstd frame (content checksum set):
    the frame's XXH64 no longer matches, which zstd only checks at the frame's end — past the
    last row anyone asks for. The rows are refused, never returned with row 9 wrong."""
    value = np.random.default_rng(2).standard_normal((10, 4)).astype(np.float32)
    array = _zarr(tmp_path / "a", value, 4)
    chunk = tmp_path / "a" / "2.0"
    content = np.zeros((4, 4), np.float32)
    content[:2] = value[8:]
    level0 = zstandard.ZstdCompressor(level=1, write_checksum=True)
    frame = bytearray(level0.compress(content.tobytes()))
    at = bytes(frame).find(value[9].tobytes())
    assert at > 0, "row 9 is stored as literal bytes in the frame"
    frame[at + 1] ^= 0x40
    chunk.write_bytes(bytes(frame))
    with pytest.raises(zstandard.ZstdError, match="checksum"):  # libzstd's own one-shot verdict
        zstandard.ZstdDecompressor().decompress(bytes(frame))
    rows = _rows(array)
    np.testing.assert_array_equal(rows(0, 8), value[:8])
    with pytest.raises(SourceError, match=r"rows 8:10.*checksum"):
        rows(8, 10)
    with pytest.raises(SourceError, match=r"rows 0:10.*checksum"):
        _rows(array)(0, 10)
