"""Restore straight from Hugging Face safetensors (a file, or a folder with its index) onto a mesh.

The tensors are seen as a converted checkpoint would hold them (``params/<HF name>``, the stored
dtype), so ``restore(folder, spec="hf_llama", ...)`` gives what convert + restore gives, without
the copy on disk. Each process reads only the byte ranges of the slices its devices hold
(``store.safetensors_file``): a tensor restored as it is (or only renamed) is read region by
region into each device's buffer; one a spec transforms (transpose, merge, concat) is read
through the same lazy TensorStore views as a UCP checkpoint's. Host memory for reads in flight is
bounded by ``memory_budget`` as for any restore.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import tensorstore as ts

from jax_ucp import format as fmt
from jax_ucp import sharding as sharding_lib
from jax_ucp import store
from jax_ucp.format import safetensors
from jax_ucp.restoring import reader
from jax_ucp.restoring.options import RestoreOptions
from jax_ucp.store import safetensors_file

ROOT = "params"  # where the importer puts the weights: a spec's param root


def is_source(path) -> bool:
    """A local ``.safetensors`` file, or a folder holding safetensors files and no ``ucp.json``,
    itself or in an item directory (a converted checkpoint or an Orbax step is read as one)."""
    path = os.fspath(path)
    if "://" in path or os.path.exists(os.path.join(path, fmt.MANIFEST_FILE)):
        return False
    if os.path.isdir(path) and any(  # an Orbax step directory holding a UCP item
        os.path.exists(os.path.join(path, d, fmt.MANIFEST_FILE)) for d in os.listdir(path)
    ):
        return False
    return safetensors.is_safetensors(path)


@dataclasses.dataclass(frozen=True)
class _Available:
    key: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    sources: tuple[tuple[str, ...], ...]
    build: Callable | None  # a spec's view over the sources' views; None: the source as it is
    gather: Any = None  # (which, rows): read by ``safetensors_file.Gathered`` (see _gather_map)
    saved_sharding: Any = None
    logical_axes: Any = None

    @property
    def name(self) -> str:
        return fmt.key_to_str(self.key)

    @property
    def key_types(self) -> tuple[str, ...]:
        return ("key",) * len(self.key)


def _available(tensors: dict, spec) -> dict[tuple[str, ...], _Available]:
    if spec is None:
        return {k: _Available(k, t.shape, t.dtype, (k,), None) for k, t in tensors.items()}
    from jax_ucp import language  # restore-time transforms

    saved = {k: language.TensorInfo(shape=t.shape, dtype=t.dtype) for k, t in tensors.items()}
    out = {}
    for key, plan in language.compile_restore_plan(spec, saved).items():
        key = tuple(key)
        sources = tuple(tuple(s) for s in plan.sources)
        as_is = (  # only renamed: read region by region like a stored array
            not plan.ops
            and len(sources) == 1
            and tuple(plan.shape) == tensors[sources[0]].shape
            and np.dtype(plan.dtype) == tensors[sources[0]].dtype
        )
        gather = None if as_is else _gather_map(plan, sources, tensors)
        out[key] = _Available(
            key,
            tuple(plan.shape),
            np.dtype(plan.dtype),
            sources,
            None if as_is or gather is not None else plan.build,
            gather=gather,
            logical_axes=plan.logical_axes,
        )
    return out


_GATHER_OPS = {"transpose", "merge_qkv", "concat"}
_BITS = 24  # row and column fields of a probe's codes


def _gather_map(plan, sources, tensors):
    """``(which, rows)`` when ``plan``'s view is columns each taken whole from a row of a rank-2
    source (``transpose`` first, then ``merge_qkv`` / ``concat`` of such columns): column ``j``
    is row ``rows[j]`` of ``sources[which[j]]``, read by ``safetensors_file.Gathered``. Found
    on probes whose values encode (source, row, column), checked on three rows of the view
    (each must hold column ``i`` of the same source rows); None for any other view."""
    ops = tuple(plan.ops)
    shapes = [tensors[k].shape for k in sources]
    if (
        not ops
        or ops[0] != "transpose"
        or not set(ops) <= _GATHER_OPS
        or any(len(sh) != 2 or max(sh) >= 1 << _BITS for sh in shapes)
        or len({sh[1] for sh in shapes}) != 1
        or any(tensors[k].dtype != np.dtype(plan.dtype) for k in sources)
        or len(plan.shape) != 2
        or plan.shape[0] != shapes[0][1]
    ):
        return None

    def probe(sid, shape):
        def fill(domain, array, params):
            del params
            rows, cols = np.indices(array.shape)
            rows += domain[0].inclusive_min
            cols += domain[1].inclusive_min
            array[...] = (sid << (2 * _BITS)) | (rows << _BITS) | cols

        return ts.virtual_chunked(
            fill,
            dtype=ts.int64,
            domain=ts.IndexDomain(shape=list(shape)),
            chunk_layout=ts.ChunkLayout(read_chunk_shape=[shape[0], 1]),
        )

    view = plan.build({k: probe(i, sh) for i, (k, sh) in enumerate(zip(sources, shapes))})
    if tuple(view.shape) != tuple(plan.shape):
        return None
    first = np.asarray(view[0, :].read().result())
    if np.any(first & ((1 << _BITS) - 1)):
        return None
    n_in = plan.shape[0]
    for i in sorted({1, n_in - 1} - {0} if n_in > 1 else set()):
        if not np.array_equal(np.asarray(view[i, :].read().result()), first + i):
            return None
    which = first >> (2 * _BITS)
    rows = (first >> _BITS) & ((1 << _BITS) - 1)
    return which, rows


def restore(path, options: RestoreOptions):
    """``jax_ucp.restore`` of a safetensors file or folder (see there for the arguments).

    Args:
      path: a ``.safetensors`` file, or a folder of them (with its index when sharded).
      options: what to restore and how (checked when constructed).
    """
    path = os.fspath(path)
    parsed, owner = safetensors.open_checkpoint(path)
    opened = {f.path: safetensors_file.OpenFile(f) for f in parsed}
    try:
        tensors = {(ROOT, name): opened[f.path].tensor(name) for name, f in owner.items()}
        every = _available(tensors, options.spec)

        def read_requests(reqs, available=every):
            return _read(path, tensors, available, reqs, options.casting, options.read_budget)

        if options.has_target:
            return reader.restore_into_target(options, read_requests)
        return reader.restore_without_target(path, every, (), options, read_requests)
    finally:
        for f in opened.values():
            f.close()


def _read(path, tensors, available, requests, casting, max_read_bytes: int) -> list:
    """Reads the requests in order with at most ``max_read_bytes`` of read buffers in flight
    (one tensor at least): a tensor's reads start once the budget has room, the oldest is
    turned into its result to make room."""
    checked = []
    for req in requests:
        key = tuple(str(k) for k in req.key)
        name = fmt.key_to_str(key)
        av = available.get(key)
        if av is None:
            near = [fmt.key_to_str(k) for k in list(available)[:5]]
            raise reader.CheckpointError(
                f"Tensor {name!r} is not in the safetensors checkpoint {path} "
                f"({len(available)} tensors, e.g. {near})."
            )
        want = reader.check_tensor_request(name, req, av, _where(path, tensors, av), casting)
        checked.append((req, av, want))
    window = store.InFlightBytes(max_read_bytes)
    limit = sharding_lib.host_memory_limit()
    out: list = [None] * len(checked)
    for position, (req, av, want) in enumerate(checked):
        if av.gather is not None:
            source = safetensors_file.Gathered([tensors[k] for k in av.sources], *av.gather)
        elif av.build is None and av.shape:
            source = tensors[av.sources[0]]  # regions preadv'd into each device's buffer
        else:
            source = (av.build or (lambda opened, k=av.sources[0]: opened[k]))(
                {k: tensors[k].view() for k in av.sources}
            )
        pending = sharding_lib.PendingArray(source, av.shape, want, req.sharding)
        if limit is not None and pending.host_bytes > limit[0]:
            raise reader.CheckpointError(
                f"Tensor {av.name!r} ({_where(path, tensors, av)}): restoring it needs "
                f"{pending.host_bytes} bytes of host memory (shape {av.shape}, {want}), more "
                f"than {limit[1]} ({limit[0]} bytes). Restore it sharded over more processes or "
                f"select= other tensors."
            )
        for done in window.make_room(pending.read_bytes):
            _finish(path, tensors, done, out, casting)
        pending.start()
        window.add((position, req, av, pending), pending.read_bytes)
    for done in window.drain():
        _finish(path, tensors, done, out, casting)
    return out


def _where(path, tensors, av: _Available) -> str:
    """The files and tensors ``av`` is read from."""
    parts = [f"{tensors[k].file.path}:{k[-1]}" for k in av.sources[:3]]
    return ", ".join(parts) + (f" (+{len(av.sources) - 3} more)" if len(av.sources) > 3 else "")


def _finish(path, tensors, entry, out: list, casting: str) -> None:
    position, req, av, pending = entry
    try:
        out[position] = pending.result()
    except Exception as e:  # noqa: BLE001
        raise reader.CheckpointError(
            f"Tensor {av.name!r}: reading {_where(path, tensors, av)} failed: {e}"
        ) from e
    if pending.overflowed:
        target = pending.dtype
        largest = np.finfo(target).max if target.kind == "c" else ml_dtypes.finfo(target).max
        message = (
            f"Tensor {av.name!r} ({_where(path, tensors, av)}): {pending.overflowed} of its "
            f"values (of {math.prod(av.shape)}) overflow {target} (largest finite {largest}) "
            f"converting from {av.dtype}: they became inf or NaN."
        )
        if casting != "unsafe":
            raise reader.CheckpointError(
                f"{message} A {casting!r} cast keeps every value's magnitude; pass "
                f"casting='unsafe' to convert anyway, or restore as {av.dtype}."
            )
        warnings.warn(message, RuntimeWarning, stacklevel=4)
    if req.python_type is not None:  # a 0-d tensor into a Python scalar leaf
        out[position] = req.python_type(np.asarray(out[position]).item())
