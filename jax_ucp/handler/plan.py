"""Planning a restore before anything is read or allocated.

``plan`` answers, for a checkpoint and a mesh, what ``restore`` would do: the PartitionSpec each
tensor gets, the bytes each device will hold, the bytes each process will read, which tensors
end up replicated, and which dimensions cannot be split as the saved spec or the rules ask.

It reads the manifest only (no tensor data) and needs no devices: the mesh may be a
``jax.sharding.AbstractMesh``, and the per-device slices are computed from shapes and
PartitionSpecs. The PartitionSpecs come from the same functions ``restore`` uses
(``sharding.sharding_for`` with ``mesh=``/``rules=``, ``reader.requests_from_target`` with
``target=``/``shardings=``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jax_ucp import format as fmt
from jax_ucp import sharding as sharding_lib
from jax_ucp import store
from jax_ucp.handler import reader


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """Where one tensor goes on restore.

    Attributes:
        name: the tensor's key, ``/``-joined (``"params/dense/kernel"``).
        shape: its global shape.
        dtype: the dtype it is restored as (the saved one unless a target asks for another).
        partition_spec: the PartitionSpec it gets, or ``None`` when it is not a
            ``NamedSharding`` (another kind of sharding, or host numpy: see ``on_host``).
        bytes_per_device: bytes each device holding a shard of it keeps (the largest shard);
            0 on host, ``None`` when ``error`` says restore would refuse it.
        read_bytes: process index → bytes that process reads of it (devices of one process
            holding the same slice share one read).
        replicated: every device holds the whole tensor (a tensor of more than one element).
        on_host: restored as host numpy (no sharding: a ``None`` leaf of ``shardings``, or a
            64-bit tensor with ``mesh=`` while ``jax_enable_x64`` is off).
        not_divisible: one message per dimension the saved PartitionSpec or the rules wanted
            to split over a mesh axis whose size does not divide it (restore replicates it).
        error: why restore would refuse this tensor (explicit sharding that does not divide,
            a shape or dtype the target asks for that the checkpoint cannot give), else None.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    partition_spec: PartitionSpec | None
    bytes_per_device: int | None
    read_bytes: dict[int, int]
    replicated: bool = False
    on_host: bool = False
    not_divisible: tuple[str, ...] = ()
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """``jax_ucp.plan(...)``: every tensor's placement, and the totals.

    Attributes:
        path: the checkpoint directory planned (the one holding ``ucp.json``).
        tensors: one ``TensorPlan`` per tensor restore would produce, in manifest order.
        device_bytes: device → bytes it will hold. Keys are device ids for a concrete mesh
            or concrete shardings, and positions in the mesh (row-major) for an
            ``AbstractMesh``.
        process_read_bytes: process index → bytes it will read from the checkpoint.
        values: how many saved Python values (no tensor data) restore would also return.
    """

    path: str
    tensors: list[TensorPlan]
    device_bytes: dict[int, int]
    process_read_bytes: dict[int, int]
    values: int = 0

    @property
    def replicated(self) -> list[str]:
        """Names of the tensors every device holds whole."""
        return [t.name for t in self.tensors if t.replicated]

    @property
    def not_divisible(self) -> list[str]:
        """Names of the tensors with a dimension that could not be split as asked."""
        return [t.name for t in self.tensors if t.not_divisible]

    @property
    def on_host(self) -> list[str]:
        """Names of the tensors restored as host numpy."""
        return [t.name for t in self.tensors if t.on_host]

    @property
    def errors(self) -> dict[str, str]:
        """Tensor name → why restore would refuse it (empty: restore would succeed)."""
        return {t.name: t.error for t in self.tensors if t.error is not None}

    @property
    def max_device_bytes(self) -> int:
        """The most any one device holds."""
        return max(self.device_bytes.values(), default=0)


def abstract_mesh(axes: Sequence[tuple[str, int]]) -> jax.sharding.AbstractMesh:
    """A device-free mesh from ``[(axis name, size), ...]`` (e.g. for ``plan``)."""
    names = tuple(name for name, _ in axes)
    sizes = tuple(int(size) for _, size in axes)
    try:
        return jax.sharding.AbstractMesh(sizes, names)
    except TypeError:  # JAX < 0.5: AbstractMesh(((name, size), ...))
        return jax.sharding.AbstractMesh(tuple(zip(names, sizes)))


def plan(
    path: str | os.PathLike,
    *,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    rules: Sequence[tuple[str, Any]] | None = None,
    shardings: Any = None,
    target: Any = None,
    spec: Any = None,
    casting: str = "same_kind",
    processes: int | None = None,
) -> RestorePlan:
    """What ``restore(path, ...)`` with the same arguments would place where, without reading
    tensor data or allocating.

    Args:
        path: a checkpoint directory (holding ``ucp.json``) or an Orbax step directory with
            one UCP item.
        mesh: a ``jax.sharding.Mesh``, or a ``jax.sharding.AbstractMesh`` (no devices needed;
            see ``abstract_mesh``). Alone, each tensor keeps its saved PartitionSpec where the
            axes exist and divide; with ``rules``, the logical axes recorded at save time are
            mapped through them.
        rules: flax-style logical-axis rules ``[(logical name, mesh axis or axes), ...]``.
        shardings: a pytree of ``jax.sharding.Sharding`` (``None`` leaves: host numpy), as
            for ``restore(shardings=)``; a ``NamedSharding`` may be on an ``AbstractMesh``.
        target: a pytree like ``restore(target=)``'s; its shapes, dtypes and shardings.
        spec: a UCP-language spec whose restore rules change the structure (see ``restore``).
        casting: as for ``restore``: which dtype conversions a target may ask for.
        processes: with an ``AbstractMesh``, how many processes share its devices (split in
            contiguous blocks of the mesh's row-major order, like ``jax.devices()`` across
            hosts); default 1. A concrete mesh knows each device's process.

    Returns:
        A ``RestorePlan``. Dimensions that do not divide are listed (``not_divisible``), and
        what restore would refuse is reported per tensor (``errors``), never raised.

    Raises:
        CheckpointError: the checkpoint cannot be read, or a target names a tensor it lacks.
        ShardingMismatchError: a rule names a mesh axis the mesh does not have.
        ValueError: neither ``mesh`` nor ``shardings``/``target`` was given, or ``processes``
            does not fit the mesh.
    """
    root = reader.find_checkpoint_dir(path)
    manifest = store.read_manifest(root)
    available = reader.available_tensors(manifest, spec)
    values = {e.key for e in manifest.values}
    explicit = target is not None or shardings is not None
    if not explicit and mesh is None:
        raise ValueError("plan needs a mesh= (with or without rules=), shardings= or target=.")
    if rules is not None and mesh is None:
        raise ValueError("Logical-axis `rules` need a `mesh` to map onto.")
    if rules is not None:
        sharding_lib.check_rules(rules, mesh)
    layouts = _Layouts(mesh, processes)
    placed, n_values = [], 0  # (available tensor, dtype, sharding or None, not_divisible, error)
    if explicit:
        requests, _ = reader.requests_from_target(
            target if target is not None else shardings,
            shardings if target is not None else None,
        )
        for req in requests:
            key = tuple(str(k) for k in req.key)
            if key in available:
                placed.append(_explicit(available[key], req, casting))
            elif key in values:
                n_values += 1
            else:
                near = [fmt.key_to_str(k) for k in list(available)[:5]]
                raise reader.CheckpointError(
                    f"Tensor {fmt.key_to_str(key)!r} is not in the checkpoint {root} "
                    f"({len(available)} tensors, e.g. {near})."
                )
    else:
        n_values = len(values)
        placed = [_on_mesh(av, mesh, rules) for av in available.values()]

    device_bytes = {device: 0 for device in layouts.devices_of(mesh)}
    process_bytes = {p: 0 for p in layouts.processes_of(mesh)}
    tensors, on_host = [], []
    for av, dtype, sharding, not_divisible, error in placed:
        itemsize = np.dtype(dtype).itemsize
        common = dict(name=av.name, shape=av.shape, dtype=str(dtype), not_divisible=not_divisible)
        if error is not None:
            spec = sharding.spec if isinstance(sharding, NamedSharding) else None
            tensors.append(
                TensorPlan(
                    **common, partition_spec=spec, bytes_per_device=None, read_bytes={}, error=error
                )
            )
        elif sharding is None:
            on_host.append(len(tensors))
            tensors.append(
                TensorPlan(
                    **common, partition_spec=None, bytes_per_device=0, read_bytes={}, on_host=True
                )
            )
        else:
            per_device, reads = layouts.place(av.shape, sharding)
            for device, n in per_device.items():
                device_bytes[device] = device_bytes.get(device, 0) + n * itemsize
            read_bytes = {p: n * itemsize for p, n in reads.items()}
            for p, n in read_bytes.items():
                process_bytes[p] = process_bytes.get(p, 0) + n
            tensors.append(
                TensorPlan(
                    **common,
                    partition_spec=sharding.spec if isinstance(sharding, NamedSharding) else None,
                    bytes_per_device=max(per_device.values(), default=0) * itemsize,
                    read_bytes=read_bytes,
                    replicated=math.prod(av.shape) > 1 and _fully_replicated(sharding),
                )
            )
    # Host numpy: every process reads the whole tensor.
    host_processes = sorted(process_bytes) or list(range(jax.process_count()))
    for i in on_host:
        t = tensors[i]
        n = math.prod(t.shape) * np.dtype(t.dtype).itemsize
        tensors[i] = dataclasses.replace(t, read_bytes={p: n for p in host_processes})
        for p in host_processes:
            process_bytes[p] = process_bytes.get(p, 0) + n
    return RestorePlan(root, tensors, device_bytes, process_bytes, n_values)


def _on_mesh(av: reader.Available, mesh, rules):
    """``restore(mesh=, rules=)``'s choice for one tensor (see ``reader._restore_once``)."""
    wide = np.dtype(jax.dtypes.canonicalize_dtype(av.dtype)) != np.dtype(av.dtype)
    if wide:  # 64-bit without jax_enable_x64 stays on host, exact
        return av, av.dtype, None, (), None
    sharding = sharding_lib.sharding_for(
        av.shape, mesh=mesh, saved=av.saved_sharding, logical_axes=av.logical_axes, rules=rules
    )
    return av, av.dtype, sharding, _not_divisible(av, sharding.spec, mesh, rules), None


def _explicit(av: reader.Available, req: reader.Request, casting: str):
    """``restore(target=/shardings=)``'s checks for one tensor, as a message instead of raised."""
    name, error = av.name, None
    dtype = np.dtype(req.dtype) if req.dtype is not None else av.dtype
    if req.shape is not None and tuple(req.shape) != av.shape:
        error = (
            f"Tensor {name!r}: the target asks for shape {tuple(req.shape)}, the checkpoint "
            f"holds shape {av.shape}."
        )
    elif req.python_type is not None and av.shape != ():
        error = (
            f"Leaf {name!r}: the target is a Python {req.python_type.__name__}, but the "
            f"checkpoint holds an array of shape {av.shape}."
        )
    else:
        try:
            reader.check_cast(name, av.dtype, dtype, casting)
            if req.sharding is not None:
                sharding_lib.check_divisible(name, av.shape, req.sharding)
        except (reader.CheckpointError, sharding_lib.ShardingMismatchError) as e:
            error = str(e)
    if error is None and req.sharding is not None:
        narrowed = np.dtype(jax.dtypes.canonicalize_dtype(dtype))
        if narrowed != dtype:
            error = (
                f"Tensor {name!r} is {dtype}, which JAX would silently narrow to {narrowed} on "
                f"device; enable jax_enable_x64, restore it to host (sharding None) or ask for "
                f"a dtype."
            )
    return av, dtype, req.sharding, (), error


def _axes_of(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _not_divisible(av: reader.Available, got: PartitionSpec, mesh, rules) -> tuple[str, ...]:
    """The dimensions the saved PartitionSpec or the rules wanted split over mesh axes whose
    size does not divide them (``sharding_for`` replicates those)."""
    got = tuple(got) + (None,) * (len(av.shape) - len(got))
    wanted: list[list[tuple[str, ...]]] = [[] for _ in av.shape]
    if rules is not None and av.logical_axes is not None:
        for dim, logical in enumerate(av.logical_axes):
            for rule_name, mesh_axes in rules if logical is not None else ():
                if rule_name == logical:
                    if not _axes_of(mesh_axes):
                        break  # explicitly replicated
                    wanted[dim].append(_axes_of(mesh_axes))
    elif av.saved_sharding is not None:
        for dim, entry in enumerate(av.saved_sharding.partition_spec[: len(av.shape)]):
            axes = _axes_of(entry)
            if axes and all(a in mesh.shape for a in axes):
                wanted[dim].append(axes)
    out = []
    for dim, (size, have) in enumerate(zip(av.shape, got)):
        if have is not None:
            continue
        for axes in wanted[dim]:
            k = math.prod(mesh.shape[a] for a in axes)
            if size % k:
                out.append(
                    f"dimension {dim} (size {size}) is not divisible by mesh axis "
                    f"{'×'.join(axes)!r} (size {k}): replicated"
                )
                break
    return tuple(out)


def _fully_replicated(sharding) -> bool:
    if isinstance(sharding, NamedSharding):
        return all(not _axes_of(entry) for entry in sharding.spec)
    return bool(sharding.is_fully_replicated)


class _Layouts:
    """Devices and processes of meshes (concrete or abstract), and the slices a sharding gives
    each device, from shapes and PartitionSpecs alone."""

    def __init__(self, mesh, processes: int | None):
        self._processes = processes
        if isinstance(mesh, jax.sharding.Mesh) and processes is not None:
            raise ValueError(
                "processes= is for an AbstractMesh; a concrete Mesh knows its devices' processes."
            )

    def _positions(self, mesh) -> tuple[list[int], list[int]]:
        """Per mesh position (row-major): device key and process index."""
        if isinstance(mesh, jax.sharding.Mesh):
            devices = list(mesh.devices.flat)
            return [d.id for d in devices], [d.process_index for d in devices]
        n = math.prod(mesh.shape[a] for a in mesh.axis_names)
        p = 1 if self._processes is None else int(self._processes)
        if p < 1 or n % p:
            raise ValueError(
                f"processes={self._processes} does not split the mesh's {n} devices evenly."
            )
        return list(range(n)), [i // (n // p) for i in range(n)]

    def devices_of(self, mesh) -> list[int]:
        return [] if mesh is None else self._positions(mesh)[0]

    def processes_of(self, mesh) -> list[int]:
        return [] if mesh is None else sorted(set(self._positions(mesh)[1]))

    def place(self, shape, sharding) -> tuple[dict[int, int], dict[int, int]]:
        """Elements each device holds, and elements each process reads (its distinct slices)."""
        slices: Iterable[tuple[int, int, tuple]]
        if isinstance(sharding, NamedSharding):
            slices = self._named(shape, sharding.spec, sharding.mesh)
        else:  # any other sharding is concrete: ask it
            slices = (
                (d.id, d.process_index, tuple(s.indices(n)[:2] for s, n in zip(index, shape)))
                for d, index in sharding.devices_indices_map(tuple(shape)).items()
            )
        per_device: dict[int, int] = {}
        distinct: dict[int, set] = {}
        for device, process, box in slices:
            per_device[device] = math.prod(b - a for a, b in box)
            distinct.setdefault(process, set()).add(box)
        reads = {p: sum(math.prod(b - a for a, b in box) for box in s) for p, s in distinct.items()}
        return per_device, reads

    def _named(self, shape, spec, mesh):
        """(device, process, ((start, stop) per dimension)) for each position of ``mesh``, as
        ``NamedSharding.devices_indices_map`` would give (the axes of one entry major first)."""
        names = tuple(mesh.axis_names)
        sizes = tuple(mesh.shape[a] for a in names)
        spec = tuple(spec) + (None,) * (len(shape) - len(spec))
        dims = [[names.index(a) for a in _axes_of(entry)] for entry in spec]
        devices, processes = self._positions(mesh)
        for position, coords in enumerate(np.ndindex(*sizes)):
            box = []
            for size, axes in zip(shape, dims):
                parts, index = 1, 0
                for a in axes:
                    index = index * sizes[a] + coords[a]
                    parts *= sizes[a]
                block = size // parts
                box.append((index * block, (index + 1) * block))
            yield devices[position], processes[position], tuple(box)
