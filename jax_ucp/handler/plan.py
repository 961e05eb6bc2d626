"""Planning a restore before anyone allocates: which PartitionSpec each tensor gets on a mesh,
what each device will hold and each process will read, and what cannot be sharded as asked.

Computed from the manifest and the mesh alone (no tensor data is read), with the same choices
``restore(mesh=, rules=)`` makes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jax_ucp import format as fmt
from jax_ucp import sharding as sharding_lib
from jax_ucp.handler import reader


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """One tensor on the target mesh."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    partition_spec: PartitionSpec
    bytes_per_device: int
    replicated: bool  # every device holds the whole tensor
    dropped: tuple[str, ...]  # wanted axes (saved spec / logical rules) that do not divide


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """``jax_ucp.plan(path, mesh=...)``: per tensor and per device / process totals."""

    tensors: list[TensorPlan]
    device_bytes: dict[str, int]  # str(device) -> bytes it will hold
    process_read_bytes: dict[int, int]  # process index -> bytes it will read

    @property
    def replicated(self) -> list[str]:
        return [t.name for t in self.tensors if t.replicated and math.prod(t.shape) > 1]

    @property
    def not_divisible(self) -> list[str]:
        return [t.name for t in self.tensors if t.dropped]


def plan(path, *, mesh: jax.sharding.Mesh, rules=None, spec=None) -> RestorePlan:
    """What ``restore(path, mesh=mesh, rules=rules, spec=spec)`` would place where."""
    root = reader.find_checkpoint_dir(path)
    manifest = fmt.read_manifest(root)
    if rules is not None:
        sharding_lib.check_rules(rules, mesh)
    tensors, device_bytes, process_bytes = [], {}, {}
    for av in reader.available_tensors(manifest, spec).values():
        sharding = sharding_lib.sharding_for(
            av.shape, mesh=mesh, saved=av.saved_sharding, logical_axes=av.logical_axes, rules=rules
        )
        itemsize = np.dtype(av.dtype).itemsize
        per_device = math.prod(sharding.shard_shape(av.shape)) * itemsize
        for device in mesh.devices.flat:
            device_bytes[str(device)] = device_bytes.get(str(device), 0) + per_device
        for process, slices in _slices_by_process(sharding, av.shape).items():
            read = sum(math.prod(len(range(*k)) for k in key) for key in slices)
            process_bytes[process] = process_bytes.get(process, 0) + read * itemsize
        tensors.append(
            TensorPlan(
                name=av.name,
                shape=av.shape,
                dtype=str(av.dtype),
                partition_spec=sharding.spec,
                bytes_per_device=per_device,
                replicated=all(p is None for p in sharding.spec),
                dropped=_dropped(av, sharding, rules, mesh),
            )
        )
    return RestorePlan(tensors, device_bytes, process_bytes)


def _slices_by_process(sharding: NamedSharding, shape) -> dict[int, set]:
    """The distinct slices ((start, stop, step) per dimension) each process's devices hold:
    devices with the same slice share one read."""
    out: dict[int, set] = {}
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        key = tuple(s.indices(n) for s, n in zip(index, shape))
        out.setdefault(device.process_index, set()).add(key)
    return out


def _dropped(av, sharding, rules, mesh) -> tuple[str, ...]:
    """Mesh axes the saved spec or the rules asked for that this tensor could not take."""
    wanted: list = []
    if rules is not None and av.logical_axes is not None:
        rule_map = {}
        for name, axes in rules:
            rule_map.setdefault(name, axes)
        wanted = [rule_map.get(n) if n is not None else None for n in av.logical_axes]
    elif av.saved_sharding is not None:
        wanted = list(av.saved_sharding.partition_spec)
    got = list(sharding.spec) + [None] * (len(av.shape) - len(sharding.spec))
    dropped = []
    for want, have in zip(wanted, got):
        axes = (want,) if isinstance(want, str) else tuple(want or ())
        if axes and have is None and all(a in mesh.shape for a in axes):
            dropped.extend(axes)
    return tuple(dropped)
