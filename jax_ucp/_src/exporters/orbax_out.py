"""Export to ``orbax``, written by Orbax itself: each tensor a lazy leaf read (digests checked) and
written with Orbax's TensorStore spec as ``np.ndarray``, one tensor in memory at a time."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from orbax.checkpoint import future as ocp_future

from jax_ucp._src import format as fmt
from jax_ucp._src import store, writer
from jax_ucp._src import tree as tree_lib
from jax_ucp._src.errors import RequestError, UCPError, is_tensorstore_io_error, tensorstore_message
from jax_ucp._src.exporters import source
from jax_ucp._src.exporters.options import Exported, OrbaxExport
from jax_ucp._src.restoring import locate, model
from jax_ucp._src.restoring.sources import ucp_source


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One UCP tensor, read only when Orbax's writer gets to it."""

    root: str
    manifest: fmt.Manifest
    key: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    available: Any

    def read(self, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor, or its rows ``lo:hi``."""
        request = model.Request(self.key, rows=rows)
        (value,) = ucp_source.read(self.root, self.manifest, [request], available=self.available)
        return np.asarray(value)


class _TensorHandler(ocp.type_handlers.NumpyHandler):
    """Orbax's ``NumpyHandler`` format, fed lazily: one tensor at a time in the commit future."""

    def __init__(
        self,
        progress: Callable[[str, int, int], None] | None = None,
        total: int = 0,
        destination: str = "",
    ):
        super().__init__()
        self._progress, self._total, self._destination = progress, total, destination
        # read here: Orbax writes from its own thread, outside the export's context
        self._budget = writer.memory_budget()
        self._contexts: dict[bool, ts.Context] = {}

    def _context(self, ocdbt: bool) -> ts.Context:
        """Orbax's TensorStore context without its 100 MB OCDBT cache (nothing is read back)."""
        if ocdbt not in self._contexts:
            self._contexts[ocdbt] = ts.Context(
                ts.Context.Spec({"cache_pool#ocdbt": {"total_bytes_limit": 0}}),
                ocp.type_handlers.get_ts_context(use_ocdbt=ocdbt),
            )
        return self._contexts[ocdbt]

    async def serialize(self, values, infos, args=None):
        args = args or [ocp.SaveArgs()] * len(values)
        coro = self._write_all(list(values), list(infos), list(args))
        return [ocp_future.CommitFutureAwaitingContractedSignals(coro, name="ucp_orbax_export")]

    async def _write_all(self, values, infos, args) -> None:
        for done, (value, info, arg) in enumerate(zip(values, infos, args), 1):
            await info.await_path_creation()
            ocdbt = bool(info.is_ocdbt_checkpoint)
            nbytes = np.dtype(value.dtype).itemsize * math.prod(value.shape)
            if value.shape and nbytes > self._budget // 4 and arg.chunk_byte_size is None:
                # chunks of 1/16 of the budget: one chunk per array held a compressed copy (+416 MiB)
                arg = dataclasses.replace(arg, chunk_byte_size=max(self._budget // 16, 1 << 20))
            tspec = ocp.type_handlers.get_json_tspec_write(
                info,
                use_ocdbt=ocdbt,
                global_shape=value.shape,
                local_shape=value.shape,
                dtype=value.dtype,
                process_index=ocp.multihost.process_index() if ocdbt else None,
                arg=arg,
            )
            if ocp.multihost.process_index() != 0:
                continue  # host data: written once, by the primary (as NumpyHandler does)
            try:
                t = await ts.open(
                    ts.Spec(tspec), create=True, open=True, context=self._context(ocdbt)
                )
                if not value.shape or not nbytes:
                    await t.write(value.read(), can_reference_source_data_indefinitely=True)
                for lo, hi in (
                    _slabs(t, value.shape, nbytes, self._budget // 4) if value.shape else ()
                ):
                    slab = value.read((lo, hi))  # read and written a slab at a time
                    await t[lo:hi].write(slab, can_reference_source_data_indefinitely=True)
                    del slab
            except ValueError as e:  # TensorStore's: a full disk, a write refused
                raise RequestError(
                    f"{self._destination}: writing tensor {fmt.key_to_str(value.key)!r} failed: "
                    f"{tensorstore_message(e)}; nothing was exported"
                ) from None
            if self._progress is not None:
                self._progress(fmt.key_to_str(value.key), done, self._total)


def _slabs(t, shape: tuple[int, ...], nbytes: int, max_bytes: int) -> list[tuple[int, int]]:
    """Row ranges of whole write chunks of ``t``, each within ``max_bytes`` (at least a chunk)."""
    rows = shape[0]
    chunk = int((t.chunk_layout.write_chunk.shape or shape)[0] or rows)
    row_bytes = nbytes // rows
    step = max(chunk, max_bytes // max(row_bytes, 1) // chunk * chunk)
    return [(lo, min(lo + step, rows)) for lo in range(0, rows, step)]


def lazy_tree(root: str, manifest: fmt.Manifest) -> tuple[Any, int]:
    """The checkpoint's tree, each tensor a lazy ``_Tensor``, in its saved containers."""
    available = ucp_source.available_tensors(manifest)
    leaves: dict[tuple, Any] = {}
    key_types: dict[tuple, tuple] = {}
    for key, av in available.items():
        leaves[key] = _Tensor(root, manifest, key, tuple(av.shape), np.dtype(av.dtype), available)
        key_types[key] = av.key_types
    for v in manifest.values:
        leaves[v.key] = v.value
        key_types[v.key] = v.key_types
    if manifest.tree is None:
        return tree_lib.nest((k, key_types[k], x) for k, x in leaves.items()), len(available)
    tree = tree_lib.rebuild_structure(manifest.tree, lambda k: leaves.get(k, tree_lib.missing()))
    return tree, len(available)


def export_orbax(
    ckpt: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    step: int | None = None,
    item: str = "state",
    use_ocdbt: bool = True,
    use_zarr3: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
) -> str:
    """Writes ``ckpt`` as an Orbax checkpoint (``step=N``: of a ``CheckpointManager``); returns its
    path.

    Args:
        ckpt: the UCP checkpoint to export.
        dst: the Orbax directory (or CheckpointManager root with ``step``).
        step: write step ``N`` of a CheckpointManager root (None: a plain checkpoint).
        item: the item name of that step.
        use_ocdbt: Orbax's OCDBT layout (Orbax's default, as is zstd).
        use_zarr3: zarr v3 arrays instead of Orbax's default v2.
        progress: called as ``progress(name, done, total)`` per tensor."""
    checkpoint = locate.find_checkpoint(store.storage_for(ckpt))
    root, manifest = checkpoint.root, checkpoint.read_manifest()
    empty = [e.name for e in manifest.tensors if math.prod(e.shape) == 0]
    if empty:  # Orbax's own save refuses them ("Cannot save arrays with zero size")
        raise RequestError(
            f"{root}: {len(empty)} tensor(s) with no elements cannot be exported to Orbax, which "
            f"stores no zero-size array (its own save refuses them): "
            f"{', '.join(repr(n) for n in empty[:8])}{' …' if len(empty) > 8 else ''}; export "
            f"to safetensors or torch-dcp, which hold them"
        )
    tree, total = lazy_tree(root, manifest)
    dst = os.path.abspath(os.fspath(dst))
    target = dst if step is None else os.path.join(dst, str(step))
    if os.path.isdir(target) and not os.listdir(target):
        os.rmdir(target)  # an empty directory holds nothing to lose
    if os.path.lexists(target):
        raise RequestError(
            f"{target}: already exists; an Orbax export is written to a new directory (remove "
            f"it first, or choose another destination)"
        )
    for name in jax.tree_util.tree_leaves(ocp.tree.get_param_names(tree)):
        # Orbax writes each array to the folder (or OCDBT key) named by its joined key path
        try:
            fmt.files.inside(target, name, f"{root}/{fmt.MANIFEST_FILE}: tensor {name[:100]!r}")
        except fmt.files.UnsafeFileError as e:
            raise RequestError(f"{e} (as an Orbax array name)") from None
    pairs = [
        (t, ocp.type_handlers.get_type_handler(t)) for t in ocp.type_handlers.supported_types()
    ]
    registry = ocp.type_handlers.create_type_handler_registry(
        *pairs, (_Tensor, _TensorHandler(progress, total, target))
    )
    handler = ocp.PyTreeCheckpointHandler(
        use_ocdbt=use_ocdbt, use_zarr3=use_zarr3, type_handler_registry=registry
    )
    if step is None:
        with _one_error(target), ocp.Checkpointer(handler) as checkpointer:
            checkpointer.save(epath.Path(dst), args=ocp.args.PyTreeSave(tree))
        return dst
    handlers = ocp.handlers.DefaultCheckpointHandlerRegistry()
    handlers.add(item, ocp.args.PyTreeSave, handler)
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
    with (
        _one_error(target),
        ocp.CheckpointManager(dst, options=options, handler_registry=handlers) as mngr,
    ):
        mngr.save(step, args=ocp.args.Composite(**{item: ocp.args.PyTreeSave(tree)}))
        mngr.wait_until_finished()
    return os.path.join(target, item)


def export(root: str, dst: str, options: OrbaxExport) -> Exported:
    """The whole tree through Orbax's own writer, inside the export's transaction.

    Args:
        root: the UCP checkpoint directory (a manager step already resolved).
        dst: the directory to create.
        options: this format's options (``engine.export`` checked them)."""
    with writer.one_malloc_arena():
        path = source.write_atomically(
            dst, lambda tmp: export_orbax(root, tmp, progress=options.progress), False, staged=False
        )
    manifest = store.read_manifest(root)
    return Exported(
        path=path,
        files=sorted(os.listdir(path)),
        tensors=len(manifest.tensors),
        bytes=sum(e.nbytes for e in manifest.tensors),
        skipped=[],
    )


class _RaisedAgain(logging.Filter):
    """Drops Orbax's commit-thread tracebacks for an error its save raises to the caller."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and "raised an exception" in record.getMessage())


@contextlib.contextmanager
def _one_error(destination: str):
    """An Orbax save whose failure is one error naming ``destination``."""
    quiet = _RaisedAgain()
    absl = logging.getLogger("absl")
    absl.addFilter(quiet)
    try:
        yield
    except UCPError:
        raise
    except ValueError as e:
        if not is_tensorstore_io_error(e):
            raise
        raise RequestError(
            f"{destination}: writing the Orbax export failed: {tensorstore_message(e)}; "
            f"nothing was exported"
        ) from None
    finally:
        absl.removeFilter(quiet)
