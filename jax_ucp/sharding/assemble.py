"""Reading exactly the slices a process's devices need, and assembling a global ``jax.Array``.

Works on any TensorStore object, including the lazy views the UCP language builds, so a
transformed tensor is read slice by slice like a stored one.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
import tensorstore as ts


def _index_key(index: tuple, shape: Sequence[int]) -> tuple:
    return tuple(s.indices(n) for s, n in zip(index, shape))


class PendingArray:
    """Reads issued for one tensor; ``result()`` waits for them and builds the array."""

    def __init__(
        self,
        source: ts.TensorStore,
        shape: tuple[int, ...],
        dtype: np.dtype,
        sharding: jax.sharding.Sharding | None,
    ):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.sharding = sharding
        self._reads: dict[tuple, ts.Future] = {}
        self._device_index: list[tuple[jax.Device, tuple]] = []
        if sharding is None:
            self._reads[()] = source.read() if self.shape else source[()].read()
            return
        for device, index in sharding.addressable_devices_indices_map(self.shape).items():
            key = _index_key(index, self.shape)
            if key not in self._reads:  # devices holding the same slice share one read
                self._reads[key] = source[index].read() if index else source[()].read()
            self._device_index.append((device, key))

    def _host(self, key) -> np.ndarray:
        data = np.asarray(self._reads[key].result())
        return data if data.dtype == self.dtype else data.astype(self.dtype)

    def result(self):
        if self.sharding is None:
            return self._host(())
        host = {key: self._host(key) for key in self._reads}
        singles = [jax.device_put(host[key], device) for device, key in self._device_index]
        return jax.make_array_from_single_device_arrays(self.shape, self.sharding, singles)
