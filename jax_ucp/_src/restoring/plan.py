"""Planning a restore before anything is read or allocated.

``plan`` answers, for a checkpoint and a mesh, what ``restore`` would do: the PartitionSpec each
tensor gets, the bytes each device will hold, the bytes each process will read, which tensors
end up replicated, and which dimensions cannot be split as the saved spec or the rules ask.

It reads the manifest only (no tensor data) and needs no devices: the mesh may be a
``jax.sharding.AbstractMesh``, and the per-device slices are computed from shapes and
PartitionSpecs. Its cost follows the checkpoint (tensors × the few distinct specs), never the
mesh's device count: devices holding equal slices are one run of numbers, not a list (a plan on
10**8 devices takes what one on 8 takes). The PartitionSpecs come from the same functions ``restore`` uses
(``sharding.sharding_for`` with ``mesh=``/``rules=``, ``requests.requests_from_target`` with
``target=``/``shardings=``).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jax_ucp._src import bulk, store
from jax_ucp._src import format as fmt
from jax_ucp._src import sharding as sharding_lib
from jax_ucp._src.errors import CheckpointError, RequestError
from jax_ucp._src.format import display
from jax_ucp._src.format.sizes import format_size
from jax_ucp._src.options import field_namer, keywords_of
from jax_ucp._src.restoring import engine, locate, model, requests, restore_entry, sources
from jax_ucp._src.restoring.options import RestoreOptions
from jax_ucp._src.restoring.sources import ucp_source
from jax_ucp._src.sharding.mesh_layout import axes_of


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
            holding the same slice share one read), an ``IndexedBytes`` mapping.
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
    read_bytes: IndexedBytes
    replicated: bool = False
    on_host: bool = False
    not_divisible: tuple[str, ...] = ()
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class RestorePlan(display.Tabular):
    """``jax_ucp.plan(...)``: every tensor's placement, and the totals.

    Attributes:
        path: the checkpoint directory planned (the one holding ``ucp.json``).
        tensors: one ``TensorPlan`` per tensor restore would produce, in manifest order.
        device_bytes: device → bytes it will hold (an ``IndexedBytes`` mapping: a few numbers
            for a mesh of any size; ``lowest()``/``highest()`` without walking it). Keys are
            device ids for a concrete mesh or concrete shardings, and positions in the mesh
            (row-major) for an ``AbstractMesh``.
        process_read_bytes: process index → bytes it will read from the checkpoint (an
            ``IndexedBytes`` too).
        values: how many saved Python values (no tensor data) restore would also return.
    """

    path: str
    tensors: list[TensorPlan]
    device_bytes: IndexedBytes
    process_read_bytes: IndexedBytes
    values: int = 0
    # the names of ``rules`` no tensor carries (those rules shard nothing)
    unmatched_rules: tuple = ()

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

    def to_rows(self) -> list[dict[str, Any]]:
        """One dict per tensor (pandas-ready without pandas): name, shape, dtype, the new
        PartitionSpec, bytes per device, the most bytes one process reads, replicated, on host,
        the dimensions that do not divide and why restore would refuse it."""
        return [
            {
                "name": t.name,
                "shape": tuple(t.shape),
                "dtype": t.dtype,
                "spec": None if t.partition_spec is None else tuple(t.partition_spec),
                "bytes_per_device": t.bytes_per_device,
                "read_bytes_per_process": t.read_bytes.highest(),
                "replicated": t.replicated,
                "on_host": t.on_host,
                "not_divisible": list(t.not_divisible),
                "error": t.error,
            }
            for t in self.tensors
        ]

    def summary_lines(self) -> list[str]:
        """What a display shows above the table: bytes per device and process, replication."""
        low, high = format_size(self.min_device_bytes), format_size(self.max_device_bytes)
        lines = [
            f"{len(self.tensors)} tensors onto {len(self.device_bytes)} devices: "
            + (f"{high} per device" if low == high else f"{low} to {high} per device")
            + f", at most {format_size(self.process_read_bytes.highest())} read per process"
        ]
        if self.replicated:
            lines.append(
                f"replicated on every device ({len(self.replicated)}): "
                + ", ".join(self.replicated[:5])
                + (" …" if len(self.replicated) > 5 else "")
            )
        if self.errors:
            lines.append(f"restore would refuse {len(self.errors)}: " + ", ".join(self.errors))
        return lines

    def table(self):
        rows = self.to_rows()
        for r in rows:
            r["bytes_per_device"] = format_size(r["bytes_per_device"] or 0)
        columns = ("name", "shape", "dtype", "spec", "bytes_per_device", "replicated")
        return f"restore plan of {self.path}", self.summary_lines(), rows, columns

    def __repr__(self) -> str:
        return (
            f"RestorePlan({self.path!r}, {len(self.tensors)} tensors, "
            f"{len(self.device_bytes)} devices, {format_size(self.max_device_bytes)} per device "
            f"at most)"
        )

    @property
    def max_device_bytes(self) -> int:
        """The most any one device holds."""
        return self.device_bytes.highest()

    @property
    def min_device_bytes(self) -> int:
        """The least any one device holds."""
        return self.device_bytes.lowest()


def abstract_mesh(axes: Sequence[tuple[str, int]]) -> jax.sharding.AbstractMesh:
    """A device-free mesh from ``[(axis name, size), ...]`` (e.g. for ``plan``)."""
    names = tuple(name for name, _ in axes)
    sizes = tuple(int(size) for _, size in axes)
    return jax.sharding.AbstractMesh(sizes, names)


@dataclasses.dataclass
class PlanOptions(RestoreOptions):
    """``plan``'s keywords: ``RestoreOptions`` (the restore to plan) and ``processes``.

    Attributes:
        processes: with an ``AbstractMesh``, how many processes share its devices (split in
            contiguous blocks of the mesh's row-major order, like ``jax.devices()`` across
            hosts); default 1. A concrete mesh knows each device's process.
    """

    _: dataclasses.KW_ONLY
    processes: int | None = None

    def __post_init__(self):
        super().__post_init__()
        field = field_namer(self)
        if not self.has_target and self.mesh is None:
            raise RequestError(
                "plan needs a mesh= (with or without rules=), shardings= or target=."
            )
        if self.rules is not None and self.mesh is None:
            raise RequestError("Logical-axis `rules` need a `mesh` to map onto.")
        for name in ("dtype", "select", "replicated_read"):  # they would change what is read
            if getattr(self, name) is not None:
                raise RequestError(f"{field(name)}: not planned yet; plan without it.")


@keywords_of(PlanOptions)
def plan(path: str | os.PathLike, options: PlanOptions) -> RestorePlan:
    """What ``restore(path, ...)`` with the same keywords would place where, without reading
    tensor data or allocating. The keywords are ``RestoreOptions``' (``dtype``, ``select`` and
    ``replicated_read`` are not planned yet; ``memory_budget`` changes no placement) and
    ``processes``.

    Args:
        path: a checkpoint directory (holding ``ucp.json``) or an Orbax step directory with
            one UCP item; or any source ``restore`` reads in place (safetensors, a source
            ``convert`` reads, with ``importing=``): its import is planned (a Megatron legacy
            merge is built to learn its shape), no tensor is read.
        options: built from the keywords; ``mesh`` (and the ``NamedSharding``s of
            ``shardings``) may be on a ``jax.sharding.AbstractMesh``: no devices needed.

    Returns:
        A ``RestorePlan``. Dimensions that do not divide are listed (``not_divisible``), and
        what restore would refuse is reported per tensor (``errors``), never raised.

    Raises:
        CheckpointError: the checkpoint cannot be read, or a target names a tensor it lacks.
        RequestError: a rule names a mesh axis the mesh does not have; with
            ``strict``, a rule names a logical name no tensor carries or a mesh axis is used
            by no rule and no saved PartitionSpec (each names the closest known names).
        RequestError: an argument of the wrong kind (as for ``restore``), neither ``mesh`` nor
            ``shardings``/``target`` given, or ``processes`` does not fit the mesh (a
            ``ValueError`` too).
    """
    with bulk.cyclic_gc_paused():  # objects by the tensor, none dropped: a third faster
        return _plan(path, options)


def _plan(path: str | os.PathLike, options: PlanOptions) -> RestorePlan:
    found = sources.opening(store.storage_for(path), options.importing, options.format)
    if found.importer is not None:  # a source read in place: what its import holds
        with restore_entry.imported(found, options) as source:
            return _planned(source, options)
    root = locate.find_checkpoint(found.storage, found.manifest)  # the UCP checkpoint's manifest
    return _planned(ucp_source.open_checkpoint(root, options.spec), options)


def _planned(opened: engine.OpenedSource, options: PlanOptions) -> RestorePlan:
    """The plan of a restore from ``opened``: its tensors (key -> ``model.Available``) and its
    saved Python values."""
    root, available, values = opened.source.path, opened.available, opened.values
    mesh, rules, explicit = options.mesh, options.rules, options.has_target
    layouts = Layouts(mesh, options.processes)
    if mesh is not None:
        layouts.every_process(mesh, 0)  # processes= fits the mesh
    if explicit and rules is not None:
        assert mesh is not None  # PlanOptions refuses rules without a mesh
        sharding_lib.check_rules(rules, mesh)
    elif not explicit:
        requests.check_mesh_names(
            root, available.values(), mesh, rules, options.strict, options.spec
        )
    if explicit:
        placed, n_values = _placed_by_target(
            root, values, available, options.target, options.shardings, options.casting
        )
    else:
        chosen: dict = {}  # tensors share a few (shape, dtype, saved sharding, axes): once each
        placed = [_on_mesh(av, mesh, rules, chosen) for av in available.values()]
        n_values = len(values)
    device_bytes, process_bytes = IndexedBytes(), IndexedBytes()
    if mesh is not None:  # every device and process of the mesh is listed, 0 if it holds none
        layouts.add_devices(mesh, 0, device_bytes)
        process_bytes.merge(layouts.every_process(mesh, 0))
    laid: dict = {}  # (shape, dtype, NamedSharding) -> [its placement, tensors placed alike]
    read_by: dict[int, list] = {}  # id -> [read bytes, tensors reading as much]: merged once
    tensors = [_tensor_plan(p, layouts, device_bytes, read_by, laid) for p in placed]
    for (_, _, sharding), ((per_device, _, _), again) in laid.items():
        if again:  # the first of each was added by Layouts.place
            layouts.add_devices(sharding.mesh, per_device * again, device_bytes)
    for reads, count in read_by.values():
        process_bytes.merge(reads, times=count)
    _read_on_host(tensors, layouts, mesh, process_bytes)
    unmatched = ()
    if not explicit and rules is not None:
        names = {n for av in available.values() for n in av.logical_axes or () if n is not None}
        unmatched = tuple(sharding_lib.unmatched_rules(rules, names))
    return RestorePlan(root, tensors, device_bytes, process_bytes, n_values, unmatched)


def _placed_by_target(root, saved_values, available, target, shardings, casting):
    """``restore(target=/shardings=)``'s placement of each tensor the target names (see
    ``_explicit``), and how many saved values it names. A name the checkpoint lacks is an
    error, as in restore."""
    values = {e.key for e in saved_values}
    placed, n_values = [], 0
    reqs, _ = requests.requests_from_target(target, shardings)
    for req in reqs:
        key = tuple(str(k) for k in req.key)
        if key in available:
            placed.append(_explicit(available[key], req, casting))
        elif key in values:
            n_values += 1
        else:
            raise model.not_found(fmt.key_to_str(key), f"the checkpoint {root}", available)
    return placed, n_values


def _tensor_plan(placed, layouts, device_bytes, read_by: dict, laid: dict) -> TensorPlan:
    """One tensor's plan from its placement (available tensor, dtype, sharding or None,
    not_divisible, error); its device bytes added to the totals, its read bytes counted in
    ``read_by`` (id -> [read bytes, how many tensors read them]). A tensor on host
    gets its read bytes from ``_read_on_host`` once every process is known. ``laid`` keeps
    each ``NamedSharding``'s placement of a shape and dtype (tensors share their read bytes,
    which nothing changes) and how many more tensors share it (their device bytes are added
    by the caller, once per placement)."""
    av, dtype, sharding, not_divisible, error = placed
    per_device, reads, replicated = None, None, False
    if error is None and sharding is None:
        per_device = 0
    elif error is None:
        key = (av.shape, dtype, sharding) if isinstance(sharding, NamedSharding) else None
        seen = laid.get(key) if key is not None else None
        if seen is not None:
            (per_device, reads, replicated), _ = seen
            seen[1] += 1
        else:
            itemsize = np.dtype(dtype).itemsize
            per_device, reads = layouts.place(av.shape, sharding, itemsize, device_bytes)
            replicated = math.prod(av.shape) > 1 and _fully_replicated(sharding)
            if key is not None:
                laid[key] = [(per_device, reads, replicated), 0]
        read_by.setdefault(id(reads), [reads, 0])[1] += 1
    # TensorPlan's own __init__ sets each field through object.__setattr__ (it is frozen):
    # filling its __dict__ at once makes the same object in a third of the time (100k tensors)
    out = _new(TensorPlan)
    out.__dict__.update(
        name=av.name,
        shape=av.shape,
        dtype=_dtype_text(dtype),
        partition_spec=sharding.spec if isinstance(sharding, NamedSharding) else None,
        bytes_per_device=per_device,
        read_bytes=IndexedBytes() if reads is None else reads,
        replicated=replicated,
        on_host=error is None and sharding is None,
        not_divisible=not_divisible,
        error=error,
    )
    return out


_new = object.__new__


@functools.lru_cache(maxsize=64)
def _dtype_text(dtype) -> str:
    """``str(dtype)``, which numpy builds in Python: once per dtype, not once per tensor."""
    return str(dtype)


def _read_on_host(tensors: list[TensorPlan], layouts, mesh, process_bytes) -> None:
    """Host numpy: every process reads the whole tensor (its plan and the totals updated)."""
    on_host = [i for i, t in enumerate(tensors) if t.on_host]
    if not on_host:
        return
    readers = layouts.every_process(mesh, 0) if mesh is not None else process_bytes
    if not len(readers):
        readers = IndexedBytes.run(jax.process_count(), 0)
    for i in on_host:
        t = tensors[i]
        reads = readers.filled(math.prod(t.shape) * np.dtype(t.dtype).itemsize)
        tensors[i] = dataclasses.replace(t, read_bytes=reads)
        process_bytes.merge(reads)


def _on_mesh(av: model.Available, mesh, rules, chosen: dict):
    """``restore(mesh=, rules=)``'s choice for one tensor (see ``requests.placed_requests``),
    kept in ``chosen`` for the next tensor of the same shape, dtype, saved sharding and axes."""
    key = (av.shape, av.dtype, av.saved_sharding, av.logical_axes)
    if key not in chosen:
        wide = np.dtype(jax.dtypes.canonicalize_dtype(av.dtype)) != np.dtype(av.dtype)
        if wide:  # 64-bit without jax_enable_x64 stays on host, exact
            chosen[key] = None, ()
        else:
            sharding = sharding_lib.sharding_for(
                av.shape,
                mesh=mesh,
                saved=av.saved_sharding,
                logical_axes=av.logical_axes,
                rules=rules,
            )
            chosen[key] = sharding, _not_divisible(av, sharding.spec, mesh, rules)
    sharding, not_divisible = chosen[key]
    return av, av.dtype, sharding, not_divisible, None


def _explicit(av: model.Available, req: model.Request, casting: str):
    """``restore(target=/shardings=)``'s checks for one tensor, as a message instead of raised."""
    dtype, error = np.dtype(req.dtype) if req.dtype is not None else av.dtype, None
    try:
        model.check_tensor_request(av.name, req, av, lambda: "the checkpoint", casting)
    except (CheckpointError, RequestError) as e:
        error = str(e)
    return av, dtype, req.sharding, (), error


def _not_divisible(av: model.Available, got: PartitionSpec, mesh, rules) -> tuple[str, ...]:
    """The dimensions the saved PartitionSpec or the rules wanted split over mesh axes whose
    size does not divide them (``sharding_for`` replicates those)."""
    padded = tuple(got) + (None,) * (len(av.shape) - len(got))
    wanted: list[list[tuple[str, ...]]] = [[] for _ in av.shape]
    if rules is not None and av.logical_axes is not None:
        for dim, logical in enumerate(av.logical_axes):
            for rule_name, mesh_axes in rules if logical is not None else ():
                if rule_name == logical:
                    if not axes_of(mesh_axes):
                        break  # explicitly replicated
                    wanted[dim].append(axes_of(mesh_axes))
    elif av.saved_sharding is not None:
        for dim, entry in enumerate(av.saved_sharding.partition_spec[: len(av.shape)]):
            axes = axes_of(entry)
            if axes and all(a in mesh.shape for a in axes):
                wanted[dim].append(axes)
    out = []
    for dim, (size, have) in enumerate(zip(av.shape, padded)):
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
        return all(not axes_of(entry) for entry in sharding.spec)
    return bool(sharding.is_fully_replicated)


class IndexedBytes(Mapping[int, int]):
    """Device or process index → bytes, kept as a few numbers however many indices there are.

    A mesh of 10**8 devices holds every tensor of a ``NamedSharding`` evenly, so its devices
    are one span ``0..n-1`` with the same bytes: bytes are added to spans ``[start, stop)``
    (a concrete mesh's device ids are a few spans, an index alone is one). Lookups, ``len``,
    ``lowest`` and ``highest`` come from the few segments where the sum changes (a sweep
    over the spans' ends, kept until the next ``add``); iterating lists every index.
    """

    def __init__(self, spans: Mapping[tuple[int, int], int] | None = None):
        self._spans: dict[tuple[int, int], int] = {}  # [start, stop) → bytes added to each
        self._cut: list[list[int]] | None = None  # ``_segments``, until the next ``add``
        for (start, stop), value in (spans or {}).items():
            self.add(start, value, stop)

    @classmethod
    def run(cls, n: int, value: int) -> IndexedBytes:
        """Indices ``0..n-1``, each ``value``."""
        return cls({(0, n): value})

    @classmethod
    def points(cls, values: Mapping[int, int]) -> IndexedBytes:
        return cls({(k, k + 1): v for k, v in values.items()})

    def add(self, index: int, value: int, stop: int | None = None) -> None:
        """``value`` more on ``index`` (with ``stop``: on each index of ``[index, stop)``)."""
        span = (int(index), int(index) + 1 if stop is None else int(stop))
        self._spans[span] = self._spans.get(span, 0) + int(value)
        self._cut = None

    def merge(self, other: IndexedBytes, times: int = 1) -> None:
        """``other``'s bytes added ``times`` over (tensors sharing one placement: once)."""
        for (start, stop), value in other._spans.items():
            self.add(start, value * times, stop)

    def spans(self) -> list[tuple[int, int]]:
        """The indices as ``[start, stop)`` runs, in order."""
        return [(start, stop) for start, stop, _ in self._segments()]

    def filled(self, value: int) -> IndexedBytes:
        """The same indices, each ``value``."""
        return IndexedBytes(dict.fromkeys(self.spans(), value))

    def _segments(self) -> list[list[int]]:
        """[start, stop, sum] of each run of indices holding one sum, in order."""
        if self._cut is None:
            change: dict[int, list[int]] = {}  # index → [sum's change, spans' count's change]
            for (start, stop), value in self._spans.items():
                for at, sign in ((start, 1), (stop, -1)) if start < stop else ():
                    step = change.setdefault(at, [0, 0])
                    step[0] += sign * value
                    step[1] += sign
            cut: list[list[int]] = []
            total = depth = 0
            for lo, hi in itertools.pairwise(sorted(change)):
                total, depth = total + change[lo][0], depth + change[lo][1]
                if depth and cut and cut[-1][1:] == [lo, total]:
                    cut[-1][1] = hi  # the run before goes on
                elif depth:  # indices some span covers
                    cut.append([lo, hi, total])
            self._cut = cut
        return self._cut

    def __getitem__(self, index) -> int:
        cut = self._segments()
        if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
            i = bisect.bisect_right(cut, index, key=lambda segment: segment[0]) - 1
            if i >= 0 and index < cut[i][1]:
                return cut[i][2]
        raise KeyError(index)

    def __len__(self) -> int:
        return sum(stop - start for start, stop, _ in self._segments())

    def __iter__(self):
        for start, stop in self.spans():
            yield from range(start, stop)

    def lowest(self) -> int:
        return min((value for *_, value in self._segments()), default=0)

    def highest(self) -> int:
        return max((value for *_, value in self._segments()), default=0)

    def highest_index(self) -> int | None:
        """An index holding the most (the first such), None when empty."""
        cut = self._segments()
        return max(cut, key=lambda segment: segment[2])[0] if cut else None

    def __repr__(self) -> str:
        if len(self) <= 16:
            return repr(dict(self.items()))
        return f"IndexedBytes({len(self)} indices, {self.lowest()} to {self.highest()} bytes)"


class Layouts:
    """Devices and processes of meshes (concrete or abstract), and the slices a sharding gives
    each device, from shapes and PartitionSpecs alone."""

    def __init__(self, mesh, processes: int | None):
        self._processes = processes
        self._cache: dict = {}
        if isinstance(mesh, jax.sharding.Mesh) and processes is not None:
            raise RequestError(
                "processes= is for an AbstractMesh; a concrete Mesh knows its devices' processes."
            )

    def _split(self, mesh) -> tuple[int, int]:
        """An AbstractMesh's device count and how many processes share it (contiguous blocks)."""
        n = math.prod(mesh.shape[a] for a in mesh.axis_names)
        p = 1 if self._processes is None else int(self._processes)
        if p < 1 or n % p:
            raise RequestError(
                f"processes={self._processes} does not split the mesh's {n} devices evenly."
            )
        return n, p

    def add_devices(self, mesh, value: int, device_bytes: IndexedBytes) -> None:
        """``value`` more bytes on every device of ``mesh``."""
        if mesh not in self._cache:  # its devices as a few spans of ids (of positions)
            if isinstance(mesh, jax.sharding.Mesh):
                ids = IndexedBytes.points(dict.fromkeys((d.id for d in mesh.devices.flat), 0))
                self._cache[mesh] = ids.spans()
            else:
                self._cache[mesh] = [(0, self._split(mesh)[0])]
        for start, stop in self._cache[mesh]:
            device_bytes.add(start, value, stop)

    def every_process(self, mesh, value: int) -> IndexedBytes:
        """``value`` for every process holding devices of ``mesh``."""
        if isinstance(mesh, jax.sharding.Mesh):
            return IndexedBytes.points({d.process_index: value for d in mesh.devices.flat})
        return IndexedBytes.run(self._split(mesh)[1], value)

    def place(
        self, shape, sharding, itemsize: int, device_bytes: IndexedBytes
    ) -> tuple[int, IndexedBytes]:
        """Adds what each device holds to ``device_bytes``; returns the most one device holds
        and the bytes each process reads (its distinct slices), both in bytes.

        A ``NamedSharding`` is computed from shapes and the mesh's axis sizes: every device
        holds one equal slice (restore requires that the axes divide), and a process reads
        as many distinct slices as its devices have distinct coordinates on the axes the spec
        uses, so the cost follows the tensors, not the devices."""
        if isinstance(sharding, NamedSharding):
            mesh = sharding.mesh
            names = tuple(mesh.axis_names)
            spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
            used = frozenset(names.index(a) for entry in spec for a in axes_of(entry))
            elements = math.prod(
                size // math.prod(mesh.shape[a] for a in axes_of(entry))
                for size, entry in zip(shape, spec)
            )
            slice_bytes = elements * itemsize
            self.add_devices(mesh, slice_bytes, device_bytes)
            if (mesh, used) not in self._cache:  # tensors share a few: counted once each
                self._cache[mesh, used] = self._count_slices(mesh, used)
            reads = IndexedBytes()
            reads.merge(self._cache[mesh, used], times=slice_bytes)
            return slice_bytes, reads
        # any other sharding is concrete (its devices exist): ask it
        largest, distinct = 0, {}
        for d, index in sharding.devices_indices_map(tuple(shape)).items():
            box = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
            n_bytes = math.prod(b - a for a, b in box) * itemsize
            device_bytes.add(d.id, n_bytes)
            largest = max(largest, n_bytes)
            distinct.setdefault(d.process_index, {})[box] = n_bytes
        return largest, IndexedBytes.points({p: sum(b.values()) for p, b in distinct.items()})

    def _count_slices(self, mesh, used: frozenset) -> IndexedBytes:
        """Process → how many distinct slices its devices hold of a tensor whose spec uses the
        mesh axes ``used``."""
        sizes = tuple(mesh.shape[a] for a in mesh.axis_names)
        if isinstance(mesh, jax.sharding.Mesh):  # real devices: look at each
            seen: dict[int, set] = {}
            for coords in np.ndindex(*sizes):
                device: Any = mesh.devices[coords]
                process = device.process_index
                seen.setdefault(process, set()).add(tuple(coords[a] for a in sorted(used)))
            return IndexedBytes.points({p: len(s) for p, s in seen.items()})
        n, p = self._split(mesh)
        block = n // p  # process q holds positions q*block .. (q+1)*block-1 (row-major)
        in_spec = tuple(a in used for a in range(len(sizes)))
        for axis in range(len(sizes)):  # blocks that are boxes: the same count everywhere
            inner = math.prod(sizes[axis + 1 :])
            if block % inner == 0 and sizes[axis] % (block // inner) == 0:
                count = block // inner if in_spec[axis] else 1
                count *= math.prod(s for s, u in zip(sizes[axis + 1 :], in_spec[axis + 1 :]) if u)
                return IndexedBytes.run(p, count)
        row = n // sizes[0] if sizes else 1
        memo: dict[int, int] = {}
        counts = {}
        for q in range(p):  # an uneven split: the count depends on where the block starts
            start = q * block % row
            if start not in memo:
                memo[start] = _distinct_projections([(start, start + block)], sizes, in_spec)
            counts[q] = memo[start]
        return IndexedBytes.points(counts)


def _distinct_projections(intervals, sizes: tuple[int, ...], in_spec: tuple[bool, ...]) -> int:
    """How many distinct coordinate tuples on the axes marked ``in_spec`` the mesh positions in
    ``intervals`` (disjoint [start, stop) ranges of row-major positions of a mesh of ``sizes``)
    have: the distinct slices a process holding those devices reads. Recurses over the axes,
    never over positions."""
    if not intervals:
        return 0
    if not sizes:
        return 1
    total = math.prod(sizes)
    everything = math.prod(s for s, u in zip(sizes, in_spec) if u)
    if intervals == [(0, total)]:
        return everything
    row = total // sizes[0]
    rest = everything // (sizes[0] if in_spec[0] else 1)
    full, partial = 0, {}
    for lo, hi in intervals:
        first, last = lo // row, (hi - 1) // row
        if first == last:
            pieces = [(first, lo - first * row, hi - first * row)]
        else:
            pieces = [(first, lo - first * row, row), (last, 0, hi - last * row)]
            full += last - first - 1
        for r, a, b in pieces:
            if (a, b) == (0, row):
                full += 1
            else:
                partial.setdefault(r, []).append((a, b))
    if in_spec[0]:  # rows have distinct coordinates: their slices never coincide
        return full * rest + sum(
            _distinct_projections(_merged(p), sizes[1:], in_spec[1:]) for p in partial.values()
        )
    if full:
        return rest
    merged = _merged([piece for p in partial.values() for piece in p])
    return _distinct_projections(merged, sizes[1:], in_spec[1:])


def _merged(intervals) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(a, b) for a, b in out]
