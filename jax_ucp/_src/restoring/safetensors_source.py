"""Restore straight from Hugging Face safetensors (a file, or a folder with its index) onto a mesh.

The tensors are seen as a converted checkpoint would hold them (``params/<HF name>``, the stored
dtype), so ``restore(folder, spec="hf_llama", ...)`` gives what convert + restore gives, without
the copy on disk. Each process reads only the byte ranges of the slices its devices hold
(``store.safetensors_file``): a tensor restored as it is (or only renamed) is read region by
region into each device's buffer; one a spec transforms (transpose, merge, concat) is read
through the same lazy TensorStore views as a UCP checkpoint's. ``SafetensorsSource`` is a
``engine.TensorSource``: the read engine of every restore plans, budgets and checks the reads.
JAX-free.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import numpy as np
import tensorstore as ts

from jax_ucp._src.format import safetensors
from jax_ucp._src.restoring import locate
from jax_ucp._src.restoring.engine import OpenedSource, TensorSource
from jax_ucp._src.restoring.model import Available
from jax_ucp._src.store import safetensors_file
from jax_ucp._src.store.storage import Storage

ROOT = "params"  # where the importer puts the weights: a spec's param root


def is_source(storage: Storage) -> bool:
    """A local ``.safetensors`` file, or a folder holding safetensors files and no ``ucp.json``,
    itself or in an item directory (a converted checkpoint or an Orbax step is read as one)."""
    return not locate.is_ucp(storage) and safetensors.is_safetensors(storage.root)


def _available(tensors: dict, spec) -> tuple[dict[tuple[str, ...], Available], dict]:
    """What may be restored (the tensors, or ``spec``'s views of them), and the views read by
    ``safetensors_file.Gathered`` (key → ``(which, rows)``, see ``_gather_map``)."""
    if spec is None:
        return {k: _stored(k, (k,), t.shape, t.dtype) for k, t in tensors.items()}, {}
    from jax_ucp._src import language  # restore-time transforms

    saved = {k: language.TensorInfo(shape=t.shape, dtype=t.dtype) for k, t in tensors.items()}
    out, gathers = {}, {}
    for key, plan in language.compile_restore_plan(spec, saved).items():
        view = Available.view(key, plan, tuple(tuple(s) for s in plan.sources))
        one = tensors[view.sources[0]] if len(view.sources) == 1 else None
        if not plan.ops and one is not None and (view.shape, view.dtype) == (one.shape, one.dtype):
            view = _stored(view.key, view.sources, view.shape, view.dtype, plan.logical_axes)
        elif (gather := _gather_map(plan, view.sources, tensors)) is not None:
            gathers[view.key] = gather
        out[view.key] = view
    return out, gathers


def _stored(key, sources, shape, dtype, logical_axes=None) -> Available:
    """A tensor read as it is (only renamed): region by region like a stored array."""
    return Available(
        key=key,
        key_types=("key",) * len(key),
        shape=tuple(shape),
        dtype=np.dtype(dtype),
        sources=sources,
        build=lambda opened: opened[sources[0]],
        logical_axes=logical_axes,
        stored=True,
    )


GATHER_OPS = {"transpose", "merge_qkv", "concat"}
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
        or not set(ops) <= GATHER_OPS
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


@contextlib.contextmanager
def opened_source(path, spec=None) -> Iterator[OpenedSource]:
    """A safetensors file or folder opened for one restore (``jax_ucp.restore``), its files
    closed after.

    Args:
      path: a ``.safetensors`` file, or a folder of them (with its index when sharded).
      spec: a UCP-language spec whose views of the tensors are restored (None: the tensors).
    """
    path = os.fspath(path)
    parsed, owner = safetensors.open_checkpoint(path)
    opened = {f.path: safetensors_file.OpenFile(f) for f in parsed}
    try:
        tensors = {(ROOT, name): opened[f.path].tensor(name) for name, f in owner.items()}
        every, gathers = _available(tensors, spec)
        yield OpenedSource(SafetensorsSource(path, tensors, gathers), every)
    finally:
        for f in opened.values():
            f.close()


class SafetensorsSource(TensorSource):
    """Safetensors files read in place: a tensor as it is (or only renamed) region by region
    into each device's buffer, a transpose / merge of rank-2 tensors by
    ``safetensors_file.Gathered``, any other view through TensorStore views of its sources."""

    metadata = "safetensors header"

    def __init__(self, path: str, tensors: dict, gathers: dict):
        self.path, self.where = path, f"the safetensors checkpoint {path}"
        self.tensors, self.gathers = tensors, gathers

    def files(self, found: Available) -> str:
        parts = [f"{self.tensors[k].file.path}:{k[-1]}" for k in found.sources[:3]]
        more = len(found.sources) - 3
        return ", ".join(parts) + (f" (+{more} more)" if more > 0 else "")

    def holder(self, found: Available) -> str:
        return self.files(found)

    def reader(self, found: Available):
        sources = [self.tensors[k] for k in found.sources]
        if found.key in self.gathers:
            return safetensors_file.Gathered(sources, *self.gathers[found.key])
        if found.stored and found.shape:
            return sources[0]  # regions preadv'd into each device's buffer
        return found.build({k: t.view() for k, t in zip(found.sources, sources)})
