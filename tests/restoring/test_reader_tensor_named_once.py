"""A restore error names its tensor once: a store error that names it already (a shard's digest
check) is not prefixed with the name again."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ucp


def test_swapped_shard_names_the_tensor_once(tmp_path):
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    w = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(mesh, P("x")))
    path = tmp_path / "c"
    jax_ucp.save(path, {"w": w})
    a, b = path / "arrays/w/c/0/0", path / "arrays/w/c/1/0"
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    with pytest.raises(jax_ucp.UCPError) as info:
        jax_ucp.restore(path)
    message = str(info.value)
    assert "is not the shard file this checkpoint saved there" in message, message
    assert message.count("Tensor 'w'") == 1, message
    ((name, problem),) = jax_ucp.verify(path)
    assert name == "w" and problem.count("Tensor 'w'") == 1, problem
