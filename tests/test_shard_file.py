"""store.shard_file writes exactly the bytes TensorStore writes, and only where it can."""

import asyncio
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from hypothesis import given, settings, strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_ucp
from jax_ucp import store
from jax_ucp.handler import tensor_writes
from jax_ucp.store import shard_file
from ucp_testing import assert_bit_exact

DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
          np.float16, np.float32, np.float64, np.complex64, np.complex128, ml_dtypes.bfloat16,
          ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]


def _files(root):
  out = {}
  for d, _, fs in os.walk(root):
    for f in fs:
      p = os.path.join(d, f)
      out[os.path.relpath(p, root)] = open(p, "rb").read()
  return out


def _write(root, value, *, fast, inner_chunk_bytes, checksum, monkeypatch):
  opts = tensor_writes.SaveOptions(inner_chunk_bytes=inner_chunk_bytes, checksum=checksum)
  p = tensor_writes.prepare_host_tensor(("x",), ("key",), value, opts, primary=True)
  calls = []
  real = shard_file.write

  def spy(*a, **kw):
    calls.append(a[1])
    return real(*a, **kw)

  with monkeypatch.context() as m:
    m.setattr(shard_file, "write", spy)
    if not fast:
      m.setattr(shard_file, "can_write", lambda *a: False)
    asyncio.run(tensor_writes.write_tensor(str(root), p, primary=True))
  return p, calls


def _random(dtype, shape, rng):
  raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
  if np.dtype(dtype) == np.bool_:
    raw = raw & 1
  return raw.view(dtype).reshape(shape)


@settings(max_examples=25, deadline=None)
@given(dtype=st.sampled_from(DTYPES),
       shape=st.lists(st.integers(1, 12), min_size=1, max_size=3),
       inner=st.sampled_from([8, 24, 64, 1 << 20]),
       checksum=st.sampled_from(["crc32c", None]),
       seed=st.integers(0, 2**16))
def test_bytes_identical_to_tensorstore(tmp_path_factory, monkeypatch, dtype, shape, inner, checksum, seed):
  value = _random(dtype, tuple(shape), np.random.default_rng(seed))
  a, b = tmp_path_factory.mktemp("ts"), tmp_path_factory.mktemp("ours")
  p, calls_ts = _write(a, value, fast=False, inner_chunk_bytes=inner, checksum=checksum, monkeypatch=monkeypatch)
  _, calls = _write(b, value, fast=True, inner_chunk_bytes=inner, checksum=checksum, monkeypatch=monkeypatch)
  assert not calls_ts and calls == [(0,) * len(shape)]  # really two different writers
  assert _files(a) == _files(b)
  t = store.open_array(store.kvstore_spec(str(b), p.entry.dir)).result()
  assert_bit_exact(t.read().result(), value)


def test_whole_checkpoint_of_a_sharded_jax_save_is_identical(tmp_path, monkeypatch):
  """The JAX save path (per-device shards at grid positions) gives TensorStore's files too."""
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
  rng = np.random.default_rng(0)
  tree = {"w": jax.device_put(rng.standard_normal((64, 48)).astype(np.float32), NamedSharding(mesh, P("data", "model"))),
          "b": jax.device_put(jnp.arange(48, dtype=jnp.bfloat16), NamedSharding(mesh, P("model"))),
          "r": jax.device_put(jnp.ones((6, 5), jnp.int8), NamedSharding(mesh, P())),
          "s": jnp.float32(3.0), "z": np.zeros((0, 3), np.float32), "step": 7}
  jax_ucp.save(tmp_path / "fast", tree)
  positions = []
  real = shard_file.write
  monkeypatch.setattr(shard_file, "write", lambda *a, **kw: positions.append(a[1]) or real(*a, **kw))
  monkeypatch.setattr(shard_file, "can_write", lambda *a: False)
  jax_ucp.save(tmp_path / "ts", tree)
  assert not positions
  fast, slow = _files(tmp_path / "fast" / "arrays"), _files(tmp_path / "ts" / "arrays")
  assert fast == slow
  assert "w/c/1/3" in fast  # 2 x 4 shard files, one per device shard
  back = jax_ucp.restore(tmp_path / "fast")
  assert_bit_exact(back["w"], np.asarray(tree["w"]))


@pytest.mark.parametrize("case", ["zstd", "memory kvstore", "tensorstore source", "int4", "scalar", "zero-size",
                                  "partial shard", "non-contiguous chunks"])
def test_falls_back_to_tensorstore_where_it_cannot_write(case):
  layout = store.ArrayLayout(shape=(4, 6), dtype="float32", chunk_shape=(4, 6), inner_chunk_shape=(2, 6))
  data, kv = np.zeros((4, 6), np.float32), {"driver": "file", "path": "/x/"}
  assert shard_file.can_write(layout, data, kv)
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
    layout = store.ArrayLayout(shape=(4, 6), dtype="float32", chunk_shape=(4, 6), inner_chunk_shape=(2, 3))
    assert shard_file.chunks_are_contiguous((4, 6), (1, 3)) and shard_file.chunks_are_contiguous((4, 6), (4, 6))
    assert not shard_file.chunks_are_contiguous((4, 6), (4, 3))
  assert not shard_file.can_write(layout, data, kv)


def test_non_contiguous_source_and_bf16_import_stream(tmp_path):
  """A transposed view (importers yield views) is written in C order like TensorStore would."""
  from jax_ucp.handler.host_writer import HostItem, write_host_checkpoint
  base = np.arange(24 * 10, dtype=np.float32).reshape(24, 10)
  bf = base.astype(ml_dtypes.bfloat16)
  out = write_host_checkpoint(tmp_path / "c", iter([HostItem(("t",), base.T), HostItem(("b",), bf[::2])]))
  back = jax_ucp.restore(out)
  assert_bit_exact(back["t"], np.ascontiguousarray(base.T))
  assert_bit_exact(back["b"], np.ascontiguousarray(bf[::2]))


def test_short_writes_are_completed(tmp_path, monkeypatch):
  """os.writev may write less than asked (signals, quotas, some file systems): the rest follows."""
  real_writev = os.writev
  monkeypatch.setattr(shard_file.os, "writev", lambda fd, bufs: real_writev(fd, [memoryview(bufs[0]).cast("B")[:5]]))
  layout = store.ArrayLayout(shape=(8, 4), dtype="int16", chunk_shape=(8, 4), inner_chunk_shape=(2, 4))
  value = np.arange(32, dtype=np.int16).reshape(8, 4)
  kv = store.kvstore_spec(str(tmp_path), "a")
  store.create(kv, layout).result()
  nbytes = shard_file.write(kv["path"], (0, 0), value, layout)
  assert os.path.getsize(os.path.join(kv["path"], "c", "0", "0")) == nbytes == 4 * (16 + 4) + 4 * 16 + 4
  assert_bit_exact(store.open_array(kv).result().read().result(), value)
