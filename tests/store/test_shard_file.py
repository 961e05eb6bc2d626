"""store.shard_writer writes exactly the bytes TensorStore writes, and only where it can;
store.shard_reader reads them back."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import re
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ucp
from jax_ucp._src import store
from jax_ucp._src import writer as tensor_writes
from jax_ucp._src.store import shard_file, shard_reader, shard_writer
from jax_ucp.errors import CheckpointError
from tests.ucp_testing import assert_bit_exact, move_out, tree_files

DTYPES = [
    np.bool_,
    np.int8,
    np.uint8,
    np.int16,
    np.uint16,
    np.int32,
    np.uint32,
    np.int64,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    np.complex128,
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
]


def _write(root, value, *, fast, inner_chunk_bytes, checksum, monkeypatch):
    opts = tensor_writes.ArrayOptions(inner_chunk_bytes=inner_chunk_bytes, checksum=checksum)
    p = tensor_writes.prepare_host_tensor(("x",), ("key",), value, opts, primary=True)
    calls = []
    real = shard_writer.write

    def spy(*a, **kw):
        calls.append(a[1])
        return real(*a, **kw)

    with monkeypatch.context() as m:
        m.setattr(shard_writer, "write", spy)
        if not fast:
            m.setattr(shard_writer, "can_write", lambda *a: False)
        asyncio.run(tensor_writes.write_tensor(str(root), p, primary=True))
    return p, calls


def _random(dtype, shape, rng):
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    if np.dtype(dtype) == np.bool_:
        raw = raw & 1
    return raw.view(dtype).reshape(shape)


@settings(max_examples=25, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    inner=st.sampled_from([8, 24, 64, 1 << 20]),
    checksum=st.sampled_from(["crc32c", None]),
    seed=st.integers(0, 2**16),
)
def test_bytes_identical_to_tensorstore(
    tmp_path_factory, monkeypatch, dtype, shape, inner, checksum, seed
):
    value = _random(dtype, tuple(shape), np.random.default_rng(seed))
    a, b = tmp_path_factory.mktemp("ts"), tmp_path_factory.mktemp("ours")
    p, calls_ts = _write(
        a, value, fast=False, inner_chunk_bytes=inner, checksum=checksum, monkeypatch=monkeypatch
    )
    _, calls = _write(
        b, value, fast=True, inner_chunk_bytes=inner, checksum=checksum, monkeypatch=monkeypatch
    )
    assert not calls_ts and calls == [(0,) * len(shape)]  # really two different writers
    assert tree_files(a) == tree_files(b)
    t = store.open_array(store.kvstore_config(str(b), p.entry.dir)).result()
    assert_bit_exact(t.read().result(), value)


def test_whole_checkpoint_of_a_sharded_jax_save_is_identical(tmp_path, monkeypatch):
    """The JAX save path (per-device shards at grid positions) gives TensorStore's files too."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    rng = np.random.default_rng(0)
    tree = {
        "w": jax.device_put(
            rng.standard_normal((64, 48)).astype(np.float32),
            NamedSharding(mesh, P("data", "model")),
        ),
        "b": jax.device_put(jnp.arange(48, dtype=jnp.bfloat16), NamedSharding(mesh, P("model"))),
        "r": jax.device_put(jnp.ones((6, 5), jnp.int8), NamedSharding(mesh, P())),
        "s": jnp.float32(3.0),
        "z": np.zeros((0, 3), np.float32),
        "step": 7,
    }
    jax_ucp.save(tmp_path / "fast", tree)
    positions = []
    real = shard_writer.write
    monkeypatch.setattr(
        shard_writer, "write", lambda *a, **kw: positions.append(a[1]) or real(*a, **kw)
    )
    monkeypatch.setattr(shard_writer, "can_write", lambda *a: False)
    jax_ucp.save(tmp_path / "ts", tree)
    assert not positions
    fast, slow = tree_files(tmp_path / "fast" / "arrays"), tree_files(tmp_path / "ts" / "arrays")
    assert fast == slow
    assert "w/c/1/3" in fast  # 2 x 4 shard files, one per device shard
    back = jax_ucp.restore(tmp_path / "fast")
    assert_bit_exact(back["w"], np.asarray(tree["w"]))


@pytest.mark.parametrize(
    "case",
    [
        "zstd",
        "memory kvstore",
        "tensorstore source",
        "int4",
        "scalar",
        "zero-size",
        "partial shard",
        "non-contiguous chunks",
    ],
)
def test_falls_back_to_tensorstore_where_it_cannot_write(case):
    layout = store.ArrayLayout(
        shape=(4, 6), dtype="float32", chunk_shape=(4, 6), inner_chunk_shape=(2, 6)
    )
    data, kv = np.zeros((4, 6), np.float32), {"driver": "file", "path": "/x/"}
    assert shard_writer.can_write(layout, data, kv)
    if case == "zstd":
        layout = store.ArrayLayout(**{**layout.__dict__, "compression": "zstd"})
    elif case == "memory kvstore":
        kv = {"driver": "memory", "path": "x/"}
    elif case == "tensorstore source":
        data = ts.array(data)
    elif case == "int4":
        data = np.zeros((4, 6), ml_dtypes.int4)
    elif case == "scalar":
        layout = store.ArrayLayout(shape=(), dtype="float32", chunk_shape=(), inner_chunk_shape=())
        data = np.float32(1.0).reshape(())
    elif case == "zero-size":
        data = np.zeros((0, 6), np.float32)
    elif case == "partial shard":
        data = np.zeros((2, 6), np.float32)
    elif case == "non-contiguous chunks":
        layout = store.ArrayLayout(
            shape=(4, 6), dtype="float32", chunk_shape=(4, 6), inner_chunk_shape=(2, 3)
        )
        assert shard_file.chunks_are_contiguous(
            (4, 6), (1, 3)
        ) and shard_file.chunks_are_contiguous((4, 6), (4, 6))
        assert not shard_file.chunks_are_contiguous((4, 6), (4, 3))
    assert not shard_writer.can_write(layout, data, kv)


def test_non_contiguous_source_and_bf16_import_stream(tmp_path):
    """A transposed view (importers yield views) is written in C order like TensorStore would."""
    from jax_ucp._src.writer import HostItem, write_host_checkpoint

    base = np.arange(24 * 10, dtype=np.float32).reshape(24, 10)
    bf = base.astype(ml_dtypes.bfloat16)
    out = write_host_checkpoint(
        tmp_path / "c", iter([HostItem(("t",), base.T), HostItem(("b",), bf[::2])])
    )
    back = jax_ucp.restore(out)
    assert_bit_exact(back["t"], np.ascontiguousarray(base.T))
    assert_bit_exact(back["b"], np.ascontiguousarray(bf[::2]))


def test_short_writes_are_completed(tmp_path, monkeypatch):
    """os.writev may write less than asked (signals, quotas, some file systems): the rest follows."""
    real_writev = os.writev
    monkeypatch.setattr(
        shard_writer.os,
        "writev",
        lambda fd, bufs: real_writev(fd, [memoryview(bufs[0]).cast("B")[:5]]),
    )
    layout = store.ArrayLayout(
        shape=(8, 4), dtype="int16", chunk_shape=(8, 4), inner_chunk_shape=(2, 4)
    )
    value = np.arange(32, dtype=np.int16).reshape(8, 4)
    kv = store.kvstore_config(str(tmp_path), "a")
    store.create(kv, layout).result()
    digest = shard_writer.write(kv["path"], (0, 0), value, layout)
    path = os.path.join(kv["path"], "c", "0", "0")
    assert os.path.getsize(path) == 4 * (16 + 4) + 4 * 16 + 4
    assert digest == shard_reader.file_digest(path, 4)
    assert_bit_exact(store.open_array(kv).result().read().result(), value)


# --- reading ------------------------------------------------------------------------------------


def _ts_array(path, value, chunk_shape, inner_shape, checksum, store_fill=True):
    layout = store.ArrayLayout(
        shape=value.shape,
        dtype=jax_ucp._src.format.dtype_name(value.dtype),
        chunk_shape=tuple(chunk_shape),
        inner_chunk_shape=tuple(inner_shape),
        checksum=checksum,
    )
    spec = store.array_config({"driver": "file", "path": str(path)}, layout)
    spec["store_data_equal_to_fill_value"] = store_fill
    t = ts.open(spec, create=True).result()
    t.write(value).result()
    opened = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}})
    return opened.result(), layout


def _reader(t, layout, path):
    assert shard_file.readable(layout)
    return shard_reader.ShardReader(str(path), layout, t.dtype.numpy_dtype)


@st.composite
def _geometry(draw):
    ndim = draw(st.integers(1, 3))
    inner = [draw(st.integers(1, 3)) for _ in range(ndim)]
    per_shard = [draw(st.integers(1, 3)) for _ in range(ndim)]
    shards = [draw(st.integers(1, 3)) for _ in range(ndim)]
    chunk = [i * p for i, p in zip(inner, per_shard)]
    shape = [c * s for c, s in zip(chunk, shards)]
    region = []
    for n in shape:
        a = draw(st.integers(0, n - 1))
        region.append(slice(a, draw(st.integers(a + 1, n))))
    return tuple(shape), chunk, inner, tuple(region)


# an array of any geometry and dtype, checksummed or not, and its seed
_ARRAYS = dict(
    geo=_geometry(),
    dtype=st.sampled_from(DTYPES),
    checksum=st.sampled_from(["crc32c", None]),
    seed=st.integers(0, 2**16),
)


@settings(max_examples=30, deadline=None)
@given(**_ARRAYS, store_fill=st.booleans())
def test_reads_equal_tensorstore_reads(tmp_path_factory, geo, dtype, checksum, seed, store_fill):
    shape, chunk, inner, region = geo
    value = _random(dtype, shape, np.random.default_rng(seed))
    if not store_fill:  # chunks equal to the fill value are then never written (index says missing)
        value[tuple(slice(0, c) for c in inner)] = 0
    path = tmp_path_factory.mktemp("r") / "a"
    t, layout = _ts_array(path, value, chunk, inner, checksum, store_fill)
    r = _reader(t, layout, path)
    shard_ranges = [range(sl.start // c, (sl.stop - 1) // c + 1) for sl, c in zip(region, chunk)]
    missing = [
        p for p in itertools.product(*shard_ranges) if not (path / shard_file.shard_key(p)).exists()
    ]
    if missing:
        # A whole shard equal to the fill value is never written without store_data_equal_to_fill_value;
        # jax_ucp always stores it, so for us a missing shard is data loss: an error, not zeros.
        with pytest.raises(CheckpointError, match="shard file missing"):
            r[region].read().result()
        return
    if not store_fill:  # an inner chunk missing from a shard the region reads: also an error
        with contextlib.suppress(CheckpointError):
            got = r[region].read().result()
            assert_bit_exact(got, t[region].read().result())  # the region missed those chunks
        return
    assert_bit_exact(r[region].read().result(), t[region].read().result())


@settings(max_examples=30, deadline=None)
@given(**_ARRAYS, data=st.data())
def test_read_into_several_regions_equals_tensorstore_reads(
    tmp_path_factory, geo, dtype, checksum, seed, data
):
    """Regions read together (chunks shared between them read once, some straight into place)
    equal TensorStore's reads of each region, and their arrays are filled completely."""
    shape, chunk, inner, first = geo
    regions = [first]
    for _ in range(data.draw(st.integers(0, 3))):
        region = []
        for n in shape:
            a = data.draw(st.integers(0, n - 1))
            region.append(slice(a, data.draw(st.integers(a + 1, n))))
        regions.append(tuple(region))
    value = _random(dtype, shape, np.random.default_rng(seed))
    path = tmp_path_factory.mktemp("r") / "a"
    t, layout = _ts_array(path, value, chunk, inner, checksum, True)
    r = _reader(t, layout, path)
    dests = []
    for reg in regions:
        out = np.empty(tuple(sl.stop - sl.start for sl in reg), r.dtype)
        out.view(np.uint8)[...] = 0x5A  # anything not written stays visible
        dests.append((tuple((sl.start, sl.stop) for sl in reg), out))
    assert r.read_into(dests).result() is None
    for reg, (_, out) in zip(regions, dests):
        assert_bit_exact(out, t[reg].read().result())


def test_restore_uses_the_fast_reader_and_equals_tensorstore(tmp_path, monkeypatch):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    w = jax.device_put(
        np.random.default_rng(1).standard_normal((64, 48)).astype(np.float32),
        NamedSharding(mesh, P("data", "model")),
    )
    jax_ucp.save(tmp_path / "c", {"w": w, "b": np.arange(6, dtype=np.int8)})
    regions = []
    real = shard_reader.RegionRead.__init__

    def recording(self, reader, dests, out=None):
        regions.append(sorted(region for region, _ in dests))
        real(self, reader, dests, out)

    monkeypatch.setattr(shard_reader.RegionRead, "__init__", recording)
    target = {
        "w": jax.ShapeDtypeStruct(
            (64, 48), jnp.float32, sharding=NamedSharding(mesh, P("model", None))
        ),
        "b": np.zeros(6, np.int8),
    }
    before = shard_reader.bytes_read()
    back = jax_ucp.restore(tmp_path / "c", target=target)
    assert_bit_exact(np.asarray(back["w"]), np.asarray(w))
    # One read per tensor: w's 4 row blocks (each held by 2 devices) together, b whole; every
    # byte of the shard files read once (w: 64*48*4 data bytes; crc32c trailers and indexes).
    rows = [((16 * i, 16 * (i + 1)), (0, 48)) for i in range(4)]
    assert sorted(regions) == [[((0, 6),)], rows]
    stored = sum(p.stat().st_size for p in (tmp_path / "c").rglob("c/*") if p.is_file())
    stored += sum(p.stat().st_size for p in (tmp_path / "c").rglob("c/*/*") if p.is_file())
    assert shard_reader.bytes_read() - before <= stored
    # The read buffers became the device buffers (no copy on CPU): the two devices holding a
    # row block share one buffer, as jax.device_put of one host array onto them does.
    pointers = {s.data.unsafe_buffer_pointer() for s in back["w"].addressable_shards}
    assert len(pointers) == 4
    monkeypatch.setattr(shard_file, "readable", lambda layout: False)
    again = jax_ucp.restore(tmp_path / "c", target=target)
    assert_bit_exact(np.asarray(again["w"]), np.asarray(w))


@pytest.mark.parametrize(
    "damage", ["data byte", "index byte", "truncated", "missing shard", "index past end"]
)
def test_damaged_shards_are_clear_errors(tmp_path, damage):
    value = np.arange(64, dtype=np.float32).reshape(8, 8)
    path = tmp_path / "a"
    t, layout = _ts_array(path, value, (4, 8), (2, 8), "crc32c")
    r = _reader(t, layout, path)
    shard = path / "c" / "1" / "0"
    data = bytearray(shard.read_bytes())
    if damage == "data byte":
        data[3] ^= 0xFF
        expect = "crc32c checksum mismatch in inner chunk 0"
    elif damage == "index byte":
        data[-10] ^= 0xFF
        expect = "crc32c checksum mismatch in the shard index"
    elif damage == "truncated":
        data = data[:20]
        expect = "truncated"
    elif damage == "index past end":
        data = data[:8] + data[-36:]  # index intact (crc ok) but the chunks it points to are gone
        expect = "points past the data"
    if damage == "missing shard":
        shard.unlink()
        expect = "shard file missing"
    else:
        shard.write_bytes(bytes(data))
    assert_bit_exact(r[0:4].read().result(), value[:4])  # the other shard still reads
    with pytest.raises(CheckpointError, match=expect):
        r.read().result()


class _CountedKv:
    """A ``tensorstore.KvStore`` (a file one, read as an object store is) counting its GETs."""

    def __init__(self, kv):
        self.kv, self.gets = kv, 0

    def read(self, key, byte_range=None):
        self.gets += 1
        return self.kv.read(key, byte_range=byte_range)


def _object_reader(path, value, damage=None):
    """``value`` written by TensorStore as 2 shards of 2 inner chunks, then read as objects by
    ``ShardReader`` with each shard's digest as the manifest records it; ``damage`` done to
    shard c/1/0 first."""
    _, layout = _ts_array(path, value, (4, 8), (2, 8), "crc32c")
    keys = ["c/0/0", "c/1/0"]
    digests = {k: shard_reader.file_digest(str(path / k), 2) for k in keys}
    shard = path / "c" / "1" / "0"
    data = bytearray(shard.read_bytes())
    if damage == "data byte":
        data[3] ^= 0xFF
    elif damage == "index byte":
        data[-10] ^= 0xFF
    elif damage == "truncated":
        data = data[:20]
    elif damage == "swapped":
        data = bytearray((path / "c" / "0" / "0").read_bytes())
    shard.write_bytes(bytes(data))
    if damage == "missing":
        shard.unlink()
    kv = _CountedKv(ts.KvStore.open({"driver": "file", "path": str(path) + "/"}).result())
    reader = shard_reader.ShardReader(
        "s3://b/a", layout, value.dtype, digests=digests, tensor="w", objects=(kv, "")
    )
    return reader, kv


def test_object_shards_read_by_ranges_their_digests_from_the_same_reads(tmp_path):
    """From an object store, a whole shard is one ranged GET (chunks, trailers and index), its
    digest checked from the trailers that GET fetched; a shard read in part fetches the rest of
    its trailers and its index after (one GET each, issued together)."""
    value = np.arange(64, dtype=np.float32).reshape(8, 8)
    r, kv = _object_reader(tmp_path / "a", value)
    assert_bit_exact(r.read().result(), value)
    assert kv.gets == 2
    r, kv = _object_reader(tmp_path / "b", value)
    out = np.empty((3, 8), np.float32)
    assert r.read_into([(((1, 4), (0, 8)), out)]).result() is None  # chunk 0 whole, 1 in part
    assert_bit_exact(out, value[1:4])
    assert kv.gets == 1  # both chunks of shard c/0/0 and its index: one GET
    assert_bit_exact(r[0:2].read().result(), value[:2])
    assert kv.gets == 2  # the chunk again, its shard's digest not checked twice
    # chunk 0 of the shard, then chunk 1's trailer with the index; or chunk 1 with the index,
    # then chunk 0's trailer: either way two GETs, and the swapped shard refused by its name
    for rows in ((4, 6), (6, 8)):
        r, kv = _object_reader(tmp_path / f"c{rows[0]}", value, "swapped")
        with pytest.raises(CheckpointError, match=r"s3://b/a/c/1/0 is not the shard file"):
            r[rows[0] : rows[1]].read().result()
        assert kv.gets == 2


@pytest.mark.parametrize("damage", ["data byte", "index byte", "truncated", "missing"])
def test_damaged_shard_objects_are_clear_errors(tmp_path, damage):
    value = np.arange(64, dtype=np.float32).reshape(8, 8)
    r, _ = _object_reader(tmp_path / "a", value, damage)
    assert_bit_exact(r[0:4].read().result(), value[:4])  # the other shard still reads
    expect = {
        "data byte": "s3://b/a/c/1/0: crc32c checksum mismatch in inner chunk 0",
        "index byte": "s3://b/a/c/1/0: crc32c checksum mismatch in the shard index",
        "truncated": "s3://b/a/c/1/0: (truncated|cannot read|shorter than)",
        "missing": "shard object s3://b/a/c/1/0 is missing",
    }[damage]
    with pytest.raises(CheckpointError, match=expect):
        r.read().result()


@pytest.mark.parametrize("case", ["zstd", "edge shards", "0-d", "empty", "int4"])
def test_layouts_it_cannot_read_go_to_tensorstore(case):
    layout = store.ArrayLayout(
        shape=(8, 6), dtype="float32", chunk_shape=(4, 6), inner_chunk_shape=(2, 6)
    )
    assert shard_file.readable(layout)
    other = {
        "zstd": {"compression": "zstd"},
        "edge shards": {"shape": (9, 6)},
        "0-d": {"shape": (), "chunk_shape": (), "inner_chunk_shape": ()},
        "empty": {"shape": (0, 6)},
        "int4": {"dtype": "int4"},
    }[case]
    assert not shard_file.readable(dataclasses.replace(layout, **other))


@pytest.mark.parametrize("fixed_index", [True, False], ids=["index at its offset", "suffix"])
def test_object_digests_of_many_objects_at_once(tmp_path, fixed_index):
    """Digests read together as byte ranges through a kvstore (as from an object store) equal
    each file's own digest; a missing or truncated object is that object's error, the others'
    digests still come back."""
    layout = store.ArrayLayout(
        shape=(16, 4), dtype="int16", chunk_shape=(8, 4), inner_chunk_shape=(2, 4)
    )
    kv = store.kvstore_config(str(tmp_path), "a")
    store.create(kv, layout).result()
    value = np.arange(64, dtype=np.int16).reshape(16, 4)
    want = [
        shard_writer.write(kv["path"], (i, 0), value[8 * i : 8 * i + 8], layout) for i in (0, 1)
    ]
    os.makedirs(os.path.join(kv["path"], "c", "9"))
    with open(os.path.join(kv["path"], "c", "0", "0"), "rb") as f:  # a truncated copy
        open(os.path.join(kv["path"], "c", "9", "0"), "wb").write(f.read()[:-30])
    offset = shard_file.index_offset((2, 4), np.int16, 4, None) if fixed_index else None
    kvstore = ts.KvStore.open({**kv, "path": kv["path"] + "/"}).result()
    keys = ["c/0/0", "c/5/0", "c/1/0", "c/9/0"]
    got = shard_reader.object_digests([(kvstore, k, 4, k, offset) for k in keys])
    assert got[0] == want[0] and got[2] == want[1]
    assert isinstance(got[1], FileNotFoundError)
    assert isinstance(got[3], CheckpointError) and "c/9/0" in str(got[3])
    assert shard_reader.object_digests([(kvstore, "c/1/0", 4, "c/1/0", offset)]) == [want[1]]
    (alone,) = shard_reader.object_digests([(kvstore, "c/5/0", 4, "c/5/0", offset)])
    assert isinstance(alone, FileNotFoundError)


# Nothing outside the checkpoint is read, and no tensor borrows another's bytes.


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "compression, checksum",
    [(None, "crc32c"), (None, None), ("zstd", "crc32c"), ("zstd", None)],
    ids=["plain", "no_checksum", "zstd", "zstd_no_checksum"],
)
def test_own_shard_file_or_array_linked_outside_is_refused(tmp_path, compression, checksum):
    """A shard file of a jax_ucp checkpoint replaced by a symlink to an identical copy outside
    (its digest matches, and without checksums there is none), or a whole array folder linked
    elsewhere: ``restore`` and ``verify`` refuse it naming the file, on jax_ucp's own reader
    (uncompressed) and before TensorStore reads (zstd). Linked inside, it reads exactly."""
    tree = {"w": np.arange(24, dtype=np.float32).reshape(4, 6), "b": np.ones(5, np.float32)}
    ckpt = tmp_path / "ckpt"
    jax_ucp.save(ckpt, tree, compression=compression, checksum=checksum)
    shard = next(p for p in (ckpt / "arrays").rglob("*") if p.is_file() and "/w/c" in str(p))
    moved = ckpt / "kept" / "w-shard"
    moved.parent.mkdir()
    shutil.move(shard, moved)
    shard.symlink_to(moved)
    assert_bit_exact(jax_ucp.restore(ckpt)["w"], tree["w"], "w")  # a link that stays inside
    target = move_out(moved, tmp_path / "elsewhere")
    shard.unlink()
    shard.symlink_to(target)
    outside = r"file name '\S*c/0(/0)?' resolves to \S+/elsewhere/w-shard, outside the checkpoint"
    with pytest.raises(jax_ucp.UCPError, match=outside):
        jax_ucp.restore(ckpt)
    (problem,) = jax_ucp.verify(ckpt)
    assert problem[0] == "w" and re.search(outside, problem[1]), problem
    array = shard.parent
    while array.parent.name != "arrays":
        array = array.parent
    move_out(array, tmp_path / "arrays_elsewhere")
    with pytest.raises(
        jax_ucp.UCPError,
        match=rf"Tensor 'w': ucp\.json: file name 'arrays/{array.name}/zarr\.json' resolves to "
        r"\S+/arrays_elsewhere/",
    ):
        jax_ucp.restore(ckpt)
