"""The read engine (``engine.read_from``) behind its ``TensorSource`` protocol: a source that
only says where a tensor's bytes are gets the engine's checks, budget, sharded assembly, overflow
and failure messages. The source here is synthetic (numpy arrays in memory)."""

from __future__ import annotations

import concurrent.futures

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ucp._src import sharding
from jax_ucp._src.restoring import engine, model
from jax_ucp.errors import CheckpointError


class _Regions:
    """A ``sharding.RegionReader`` over one numpy array; counts what was read."""

    def __init__(self, array: np.ndarray, fail: Exception | None = None):
        self.array, self.fail = array, fail
        self.shape, self.dtype = array.shape, array.dtype
        self.regions: list = []

    def read_into(self, dests):
        future: concurrent.futures.Future = concurrent.futures.Future()
        for region, out in dests:
            self.regions.append(region)
            out[...] = self.array[tuple(slice(a, b) for a, b in region)]
        if self.fail is not None:
            future.set_exception(self.fail)
        else:
            future.set_result(None)
        return future


class SyntheticArraysSource(engine.TensorSource):
    metadata = "synthetic header"

    def __init__(self, arrays: dict, fail: Exception | None = None):
        self.path, self.where = "memory", "the synthetic arrays"
        self.readers = {k: _Regions(a, fail) for k, a in arrays.items()}
        self.prepared: list = []

    def files(self, found):
        return f"memory:{found.name}"

    def prepare(self, tensors):
        self.prepared = [found.name for found in tensors]

    def reader(self, found):
        return self.readers[found.sources[0]]


def _available(arrays: dict) -> dict:
    return {
        k: model.Available(
            key=k,
            key_types=("key",) * len(k),
            shape=a.shape,
            dtype=a.dtype,
            sources=(k,),
            build=lambda opened, k=k: opened[k],
            stored=True,
        )
        for k, a in arrays.items()
    }


def test_a_source_gives_exact_slices_on_a_mesh_and_to_host():
    w = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    b = np.linspace(-1, 1, 5).astype(np.float32)
    arrays = {("w",): w, ("b",): b}
    source = SyntheticArraysSource(arrays)
    assert isinstance(source.readers[("w",)], sharding.RegionReader)
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    requests = [
        model.Request(key=("w",), sharding=NamedSharding(mesh, P("x"))),
        model.Request(key=("b",), dtype=np.dtype(np.float64)),
    ]
    got_w, got_b = engine.read_from(source, requests, _available(arrays), memory_budget=64)
    assert source.prepared == ["w", "b"]  # every tensor announced once, before any read
    np.testing.assert_array_equal(np.asarray(got_w), w)
    for shard in got_w.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), w[shard.index])
    assert sorted(source.readers[("w",)].regions) == [
        ((8 * i, 8 * i + 8), (0, 8)) for i in range(8)
    ]
    assert got_b.dtype == np.float64
    np.testing.assert_array_equal(got_b, b.astype(np.float64))


def test_the_engine_names_the_source_in_its_errors():
    arrays = {("w",): np.array([1.0, 1e10], np.float32)}
    source = SyntheticArraysSource(arrays)
    available = _available(arrays)
    with pytest.raises(CheckpointError, match=r"'v'.*synthetic arrays \("):
        engine.read_from(source, [model.Request(key=("v",))], available)
    with pytest.raises(
        CheckpointError,
        match=r"Tensor 'w' \(memory:w\): 1 of its values \(of 2\) overflow float16",
    ):
        engine.read_from(source, [model.Request(key=("w",), dtype=np.dtype(np.float16))], available)
    failing = SyntheticArraysSource(arrays, fail=OSError("the device went away"))
    with pytest.raises(
        CheckpointError,
        match=r"Tensor 'w': reading memory:w failed \(corrupt or truncated data\?\): the device",
    ):
        engine.read_from(failing, [model.Request(key=("w",))], available)
