"""Restore: match what the caller asks for to what is saved, read only the needed slices."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, cast

import jax
import ml_dtypes
import numpy as np
import tensorstore as ts

from jax_ucp import format as fmt
from jax_ucp import sharding as sharding_lib
from jax_ucp import store
from jax_ucp import tree as tree_lib
from jax_ucp.errors import (
    CheckpointError,
    CheckpointReplacedError,
    tensorstore_failure,
    tensorstore_message,
)
from jax_ucp.format.dtypes import CASTINGS
from jax_ucp.format.sizes import DEFAULT_MEMORY_BUDGET, format_size
from jax_ucp.options import user_stacklevel
from jax_ucp.restoring import replicated
from jax_ucp.restoring.options import ArgsError, RestoreOptions
from jax_ucp.store import shard_file, shard_reader
from jax_ucp.writer import commit


@dataclasses.dataclass(frozen=True)
class Available:
    """A tensor restore can produce: stored as is, or a lazy view the UCP language built over
    stored tensors (``sources``: their manifest entries, or the keys a ``TensorSource`` knows
    them by)."""

    key: tuple[str, ...]
    key_types: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    sources: tuple[Any, ...]
    build: Callable[[Mapping[tuple[str, ...], ts.TensorStore]], ts.TensorStore]
    saved_sharding: fmt.SavedSharding | None = None
    logical_axes: tuple | None = None
    stored: bool = False  # the stored tensor itself (no view): may be read region by region

    @property
    def name(self) -> str:
        return fmt.key_to_str(self.key)

    @classmethod
    def view(cls, key, plan, sources: tuple, **fields) -> Available:
        """The view ``plan`` (``language.compile_restore_plan``) builds over ``sources``."""
        key = tuple(key)
        fields.setdefault("logical_axes", plan.logical_axes)
        shape, dtype = tuple(plan.shape), np.dtype(plan.dtype)
        return cls(key, ("key",) * len(key), shape, dtype, sources, plan.build, **fields)


def find_checkpoint_dir(path) -> str:
    """``path`` itself when it holds ucp.json, else its single UCP item (an Orbax step dir).

    A forced save killed between its two renames leaves ``path`` missing with both whole
    checkpoints beside it: the newer one (``<path>.ucp-replacing``, committed before the swap
    began) is read, else the older one (``<path>.ucp-replaced``). Reading never renames; the
    next save to ``path`` completes the interrupted swap.
    """
    path = os.fspath(path).rstrip("/") or "/"
    if store.is_url(path):
        return _find_in_object_store(path)
    if os.path.isdir(path) and os.path.exists(os.path.join(path, fmt.MANIFEST_FILE)):
        return path
    if not os.path.lexists(path):
        for survivor in (path + commit.REPLACING, path + commit.REPLACED):
            if os.path.isdir(survivor):
                return find_checkpoint_dir(survivor)
        raise CheckpointError(f"{path}: no such checkpoint directory.")
    if not os.path.isdir(path):
        raise CheckpointError(
            f"{path}: is a file, not a checkpoint directory (expected a directory holding "
            f"{fmt.MANIFEST_FILE}, or an Orbax step directory with one UCP item)."
        )
    items = _ucp_items(path)
    if len(items) == 1 and is_step_dir(path):
        try:  # the step's item, never a link to another checkpoint
            fmt.files.inside(path, items[0], path)
        except fmt.files.UnsafeFileError as e:
            raise CheckpointError(str(e)) from None
        return os.path.join(path, items[0])
    if len(items) == 1:  # any folder holding one checkpoint is not read as that checkpoint
        raise CheckpointError(
            f"{path}: no {fmt.MANIFEST_FILE} here; it is not a checkpoint nor an Orbax step "
            f"directory, but holds one checkpoint: {os.path.join(path, items[0])} (pass that)."
        )
    if not items:
        steps = manager_steps(path)
        if steps:
            shown = ", ".join(name for name, _ in steps[-10:])
            name, item = steps[-1]
            raise CheckpointError(
                f"{path}: a CheckpointManager directory, not a checkpoint: "
                f"{len(steps)} step(s) with a UCP item ({'…, ' if len(steps) > 10 else ''}"
                f"{shown}); pass a step's item, e.g. {os.path.join(path, name, item)} "
                f"(or mngr.restore(step) in Orbax)."
            )
        raise CheckpointError(
            f"{path}: no {fmt.MANIFEST_FILE} here nor in any item directory below "
            f"it; not a jax_ucp checkpoint (or the manifest was removed)."
        )
    raise CheckpointError(f"{path}: holds several UCP items {items}; pass one of them.")


def is_step_dir(path: str) -> bool:
    """An Orbax step directory: Orbax's step metadata or commit marker in it, or a step number
    as its name (CheckpointManager's default step names)."""
    return (
        os.path.basename(path).isdigit()
        or os.path.exists(os.path.join(path, "_CHECKPOINT_METADATA"))
        or os.path.exists(os.path.join(path, "commit_success.txt"))
    )


def manager_steps(path: str) -> list[tuple[str, str]]:
    """(step directory, its first UCP item) of each step of a CheckpointManager root, in step
    order (numeric names first)."""
    steps = []
    for name in os.listdir(path):
        step = os.path.join(path, name)
        if not os.path.isdir(step) or not is_step_dir(step):
            continue
        items = _ucp_items(step)
        if items:
            steps.append((name, items[0]))
    return sorted(
        steps, key=lambda s: (not s[0].isdigit(), int(s[0]) if s[0].isdigit() else 0, s[0])
    )


def committed_steps(root: str) -> list[tuple[int, str]]:
    """(step, its UCP item directory) of each committed step of a CheckpointManager root,
    newest first. A step still being written (Orbax's ``<step>.orbax-checkpoint-tmp...``, or a
    step directory whose commit Orbax has not recorded: no ``commit_success.txt`` and no
    ``commit_timestamp_nsecs`` in its ``_CHECKPOINT_METADATA``) is never listed."""
    if not os.path.isdir(root):
        raise CheckpointError(f"{root}: no such CheckpointManager directory.")
    steps = []
    for name, item in manager_steps(root):
        step_dir = os.path.join(root, name)
        if name.isdigit() and commit.ORBAX_TMP_MARK not in name and _committed(step_dir):
            steps.append((int(name), os.path.join(step_dir, item)))
    return sorted(steps, reverse=True)


def _committed(step_dir: str) -> bool:
    if os.path.exists(os.path.join(step_dir, "commit_success.txt")):
        return True
    try:
        meta = fmt.files.read_regular(os.path.join(step_dir, "_CHECKPOINT_METADATA"), 1 << 20)
        return json.loads(meta).get("commit_timestamp_nsecs") is not None
    except (OSError, ValueError, AttributeError, fmt.UCPError):
        return False


def check_readable(path: str) -> None:
    """Whether the checkpoint at ``path`` can be read before reading it: its manifest parses
    and every shard file it lists is there (the digests are checked as the restore reads)."""
    manifest = store.read_manifest(path)
    for entry in manifest.tensors:
        for key in entry.shard_digests or {}:
            if not os.path.isfile(os.path.join(path, entry.dir, key)):
                raise CheckpointError(
                    f"{path}: tensor {entry.name!r}: shard file {entry.dir}/{key} is missing."
                )


def _ucp_items(path: str) -> list[str]:
    """The item directories of ``path`` holding a ucp.json, sorted."""
    return sorted(
        d for d in os.listdir(path) if os.path.exists(os.path.join(path, d, fmt.MANIFEST_FILE))
    )


def _find_in_object_store(url: str) -> str:
    """``url`` when it holds ucp.json, else its single UCP item (an Orbax-style step prefix).
    A prefix without ucp.json is no checkpoint: a save that never completed."""
    location = store.location
    if location.exists(url, fmt.MANIFEST_FILE):
        return url
    items = sorted(
        {
            name.split("/")[0]
            for name in location.list_names(url)
            if name.count("/") == 1 and name.endswith("/" + fmt.MANIFEST_FILE)
        }
    )
    if len(items) == 1:
        return location.join(url, items[0])
    if not items:
        raise CheckpointError(
            f"{url}: no {fmt.MANIFEST_FILE} here nor in any item below it; not a jax_ucp "
            f"checkpoint (or its save did not complete: an object-store checkpoint exists once "
            f"its {fmt.MANIFEST_FILE} is written)."
        )
    raise CheckpointError(f"{url}: holds several UCP items {items}; pass one of them.")


def available_tensors(manifest: fmt.Manifest, spec=None) -> dict[tuple[str, ...], Available]:
    """What a restore may ask for: the saved tensors, or the views ``spec`` makes of them."""
    by_key = {e.key: e for e in manifest.tensors}
    if spec is None:
        return {
            e.key: Available(
                key=e.key,
                key_types=e.key_types,
                shape=e.shape,
                dtype=store.zarr3.numpy_dtype(e.dtype),
                sources=(e,),
                build=lambda opened, k=e.key: opened[k],
                saved_sharding=e.saved_sharding,
                logical_axes=e.logical_axes,
                stored=True,
            )
            for e in manifest.tensors
        }
    from jax_ucp import language  # restore-time transforms (stack/unstack/split/merge/transpose)

    saved = {
        k: language.TensorInfo(shape=e.shape, dtype=store.zarr3.numpy_dtype(e.dtype))
        for k, e in by_key.items()
    }
    out = {}
    for key, plan in language.compile_restore_plan(spec, saved).items():
        srcs = tuple(by_key[s] for s in plan.sources)
        view = Available.view(key, plan, srcs)
        if len(srcs) == 1 and srcs[0].key == view.key and view.shape == srcs[0].shape:
            axes = srcs[0].logical_axes if view.logical_axes is None else view.logical_axes
            view = dataclasses.replace(  # the stored tensor under its own name
                view,
                key_types=srcs[0].key_types,
                saved_sharding=srcs[0].saved_sharding,
                logical_axes=axes,
            )
        out[view.key] = view
    return out


@dataclasses.dataclass
class Request:
    """What the caller wants for one leaf: a tensor (sharding None → host numpy) or a value."""

    key: tuple[str, ...]
    dtype: np.dtype | None = None
    shape: tuple[int, ...] | None = None
    sharding: jax.sharding.Sharding | None = None
    python_type: type | None = None  # target leaf was a Python scalar
    wants_array: bool = False  # target leaf was an array (a saved Python value does not fit)
    rows: tuple[int, int] | None = None  # only rows lo:hi of the first axis (a host read)


_KIND_RANK = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}


def _kind_rank(dtype: np.dtype) -> int:
    """bool < integers < floats (bfloat16 and float8 included) < complex."""
    # ml_dtypes (kind "V"): bfloat16/float8_* are floats, int4 an integer
    return _KIND_RANK.get(dtype.kind, 2 if "float" in dtype.name else 1)


def check_cast(name: str, saved: np.dtype, wanted: np.dtype, casting: str) -> None:
    """Refuses a dtype conversion ``casting`` does not allow (numpy's vocabulary).

    The default ``same_kind`` lets float32 become bfloat16 (a precision change users ask for)
    but not int8 (300 would wrap to 44, NaN to 0): that needs ``casting="unsafe"``. Values are
    checked as they are converted (``sharding.convert``): under ``same_kind`` a narrowing float
    cast in which a finite value overflows the target (1e10 into float16 or float8) or an inf
    meets a dtype without inf (float8_e4m3fn) is an error after the read; under ``unsafe`` it is
    a RuntimeWarning naming the tensor and the count.

    Args:
        name: the tensor, for the error.
        saved: its dtype in the checkpoint.
        wanted: the dtype asked for.
        casting: numpy's casting rule.
    """
    if casting not in CASTINGS:
        raise ArgsError(f"casting must be one of {CASTINGS}, got {casting!r}.")
    if saved == wanted or casting == "unsafe":
        return
    if casting == "same_kind":
        ok = _kind_rank(wanted) >= _kind_rank(saved)
    else:
        try:
            ok = np.can_cast(saved, wanted, casting)
        except TypeError:
            ok = False
    if not ok:
        raise CheckpointError(
            f"Tensor {name!r} was saved as {saved}; converting it to {wanted} is not a "
            f"{casting!r} cast (values would change). Pass casting='unsafe' to convert anyway."
        )


class TensorSource(Protocol):
    """What the read engine (``read_from``) reads tensors from: a UCP checkpoint's arrays
    (``CheckpointSource``), a safetensors file read in place (``safetensors_source``); the idea
    of torch DCP's ``StorageReader``. The engine plans, budgets, checks memory, reads and
    finishes; a source only says where a tensor's bytes are and what to check first."""

    path: str  # the checkpoint (a directory, URL or file)
    where: str  # names it in errors: "the checkpoint <dir>"
    metadata: str  # what declares a tensor's shape there, for errors ("ucp.json")

    def files(self, found: Available) -> str: ...  # the files ``found`` is read from, for errors

    def reader(self, found: Available) -> sharding_lib.RegionReader | ts.TensorStore: ...

    def holder(self, found: Available) -> str:
        """What holds ``found``, in errors about a request that does not fit it."""
        return self.where

    def prepare(self, tensors: Sequence[Available]) -> None:
        """Called once with every tensor to read, before any read (opens them together)."""

    def check_fits(self, found: Available, limit: int, what: str) -> None:
        """Refuses, before allocating, a tensor whose reader alone needs more than ``limit``
        bytes of host memory (``what`` limits them)."""

    def verify(self, found: Available, reader: Any) -> None:
        """Checks ``found``'s files before its reads start."""

    def unit_rows(self, found: Available) -> int:
        """Rows of ``found`` read together (split no finer across processes)."""
        return 1


def read(
    root: str,
    manifest: fmt.Manifest,
    requests: Sequence[Request],
    *,
    spec=None,
    available: Mapping | None = None,
    casting: str = "same_kind",
    memory_budget: int | None = None,
    replicated_read: str | None = None,
) -> list:
    """``read_from`` the checkpoint at ``root``: jax.Array (a request with a sharding),
    np.ndarray, or the saved Python value, in request order.

    Args:
      root: the checkpoint directory (holding ucp.json).
      manifest: its manifest.
      requests: what to read, one result per request.
      spec: a UCP-language spec whose views the requests name (when ``available`` is None).
      available: what may be read (``available_tensors``); None: computed from the manifest.
      casting: numpy's casting rule for the requests' dtypes.
      memory_budget: host bytes of read buffers in flight (None: 256 MiB).
      replicated_read: "each" (None) or "once" (``restoring.replicated``).
    """
    return read_from(
        CheckpointSource(root),
        requests,
        available if available is not None else available_tensors(manifest, spec),
        {e.key: e for e in manifest.values},
        casting=casting,
        memory_budget=memory_budget,
        replicated_read=replicated_read,
    )


def read_from(
    source: TensorSource,
    requests: Sequence[Request],
    available: Mapping,
    values: Mapping | None = None,
    *,
    casting: str = "same_kind",
    memory_budget: int | None = None,
    replicated_read: str | None = None,
) -> list:
    """The one read loop of every restore, whatever the source: each request checked before
    any data is read, every tensor opened at once, then each read with at most
    ``memory_budget`` of host buffers in flight (a tensor's reads start once the budget has
    room, one tensor at least; the oldest is turned into its result, its host buffers freed,
    to make room) and the bytes results keep in host memory checked against the host's.

    Args:
      source: where the tensors are read from.
      requests: what to read, one result per request, in order.
      available: key → ``Available``, what may be read.
      values: key → ``fmt.ValueEntry``, the saved Python values.
      casting: numpy's casting rule for the requests' dtypes.
      memory_budget: host bytes of read buffers in flight (None: 256 MiB).
      replicated_read: "each" (None) or "once" (``restoring.replicated``).
    """
    plan = [_plan_item(source, req, available, values or {}, casting) for req in requests]
    tensors = [(i, item[1], item[2]) for i, item in enumerate(plan) if item[0] == "tensor"]
    source.prepare([found for _, _, found in tensors])
    reads = _Reads(source, casting, memory_budget, len(plan))
    # Tensors every process of a multi-process job needs whole: each reads a share, all-gather.
    once = replicated.select(tensors, replicated_read)
    shared = replicated.read_once(
        once,
        reads.source_of,
        budget=reads.window.max_bytes,
        check=reads.check,
        unit_rows=source.unit_rows,
    )
    for done in shared:
        reads.finish(done)
    read_once = {position for position, _, _ in once}
    for position, item in enumerate(plan):
        if position in read_once:
            continue
        if item[0] == "value":
            reads.out[position] = item[1]
        else:
            reads.start(position, item[1], item[2])
    for done in reads.window.drain():
        reads.finish(done)
    return reads.out


class _Reads:
    """The reads of one ``read_from`` call: the window of buffers in flight, the results, the
    bytes they keep in host memory."""

    def __init__(self, source: TensorSource, casting: str, memory_budget, n: int):
        self.source, self.casting = source, casting
        self.out: list = [None] * n
        self.window = store.InFlightBytes(
            DEFAULT_MEMORY_BUDGET if memory_budget is None else int(memory_budget)
        )
        self.kept = 0  # bytes of the results so far that stay in host memory (numpy, CPU)
        self.limit = sharding_lib.host_memory_limit()

    def source_of(self, found: Available):
        """``found``'s checked reader (for ``replicated.read_once``)."""
        reader = self.source.reader(found)
        self.source.verify(found, reader)
        return reader

    def check(self, found: Available, pending) -> None:
        """Refuses, before allocating, a tensor whose buffers cannot fit this host (a manifest
        may declare 2**40 elements), or whose result would take the host-resident results
        past it; counts the bytes its result keeps in host memory."""
        keeps = pending.result_bytes if pending.on_host else 0
        if self.limit is not None:
            bytes_, what = self.limit
            self.source.check_fits(found, bytes_, what)
            if pending.host_bytes > bytes_:
                raise self._memory_error(found, pending, f"exceeds {what} ({format_size(bytes_)})")
            if self.kept + keeps > bytes_:
                raise self._memory_error(
                    found,
                    pending,
                    f"would take the {format_size(self.kept)} this restore already holds in host "
                    f"memory past {what} ({format_size(bytes_)})",
                )
        self.kept += keeps

    def _memory_error(self, found: Available, pending, why: str) -> CheckpointError:
        return CheckpointError(
            f"Tensor {found.name!r} ({self.source.files(found)}): restoring it needs "
            f"{format_size(pending.host_bytes)} of host memory (shape {found.shape}, {pending.dtype}, "
            f"the slices this process reads), which {why}. Restore it sharded over more "
            f"processes, select= other tensors, or check the checkpoint's "
            f"{self.source.metadata} (it declares this shape)."
        )

    def start(self, position: int, req: Request, found: Available) -> None:
        """Starts one tensor's reads once the budget has room for them."""
        reader = self.source_of(found)
        dtype = np.dtype(req.dtype) if req.dtype is not None else found.dtype
        shape = found.shape
        if req.rows is not None:  # a slab: its rows' bytes alone are read and held
            lo, hi = req.rows
            shape = (hi - lo, *shape[1:])
            if isinstance(reader, shard_reader.ShardReader):
                reader = _Rows(reader, lo, hi)
            elif isinstance(reader, ts.TensorStore):
                reader = reader[lo:hi].translate_to[0]
            else:  # e.g. a safetensors tensor: exports read UCP checkpoints only
                raise TypeError(f"rows= cannot slice a {type(reader).__name__}")
        pending = sharding_lib.PendingArray(reader, shape, dtype, req.sharding)
        self.check(found, pending)
        for done in self.window.make_room(pending.read_bytes):
            self.finish(done)
        try:
            pending.start()
        except MemoryError:
            raise self._memory_error(found, pending, "could not be allocated") from None
        self.window.add((position, req, found, pending), pending.read_bytes)

    def finish(self, done) -> None:
        """Waits for one tensor's reads, stores its result (its read buffers are then freed)."""
        position, req, found, pending = done
        try:
            result = pending.result()
        except fmt.UCPError as e:  # names the file already
            raise _tensor_error(found.name, e) from e
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(
                f"Tensor {found.name!r}: reading {self.source.files(found)} failed "
                f"({_READ_FAILURES[tensorstore_failure(e)]}): {tensorstore_message(e)}"
            ) from e
        if pending.overflowed:
            self._overflow(found, pending)
        if req.python_type is not None and getattr(result, "shape", None) == ():
            result = req.python_type(np.asarray(result).item())
        self.out[position] = result

    def _overflow(self, found: Available, pending) -> None:
        """A narrowing float cast that overflowed: an error under ``same_kind`` (values would
        change, as float → int does), a warning naming the tensor under ``unsafe``."""
        target = pending.dtype
        largest = np.finfo(target).max if target.kind == "c" else ml_dtypes.finfo(target).max
        message = (
            f"Tensor {found.name!r} ({self.source.files(found)}): {pending.overflowed} of its "
            f"values (of {math.prod(found.shape)}) overflow {target} (largest finite {largest}) "
            f"converting from {found.dtype}: they became inf or NaN."
        )
        if self.casting != "unsafe":
            raise CheckpointError(
                f"{message} A {self.casting!r} cast keeps every value's magnitude; pass "
                f"casting='unsafe' to convert anyway, or restore as {found.dtype}."
            )
        warnings.warn(message, RuntimeWarning, stacklevel=user_stacklevel())


class _Rows:
    """A shard reader seen from row ``lo`` on: regions of a slab read as the tensor's."""

    def __init__(self, source: shard_reader.ShardReader, lo: int, hi: int):
        self._source, self._lo, self.dtype = source, lo, source.dtype
        self.shape = (hi - lo, *source.shape[1:])  # a ``sharding.RegionReader``

    def read_into(self, dests) -> shard_reader.RegionRead:
        lo = self._lo
        return self._source.read_into(
            [(((a + lo, b + lo), *rest), out) for ((a, b), *rest), out in dests]
        )


def read_rows(
    root: str,
    manifest: fmt.Manifest,
    key: tuple[str, ...],
    *,
    available: Mapping,
    dtype: np.dtype | None = None,
    casting: str = "same_kind",
    max_bytes: int,
) -> Iterator[np.ndarray]:
    """Tensor ``key`` as consecutive slabs of rows (the first axis), each read as ``read`` reads
    (digests, crc32c, casting) and holding at most ``max_bytes`` of read and converted data
    (one row at least; whole inner chunks where the stored layout allows): a writer streams a
    tensor of any size in bounded memory. A 0-d or empty tensor is one slab."""
    found = available[key]
    out_dtype = found.dtype if dtype is None else np.dtype(dtype)
    for rows in row_ranges(found, out_dtype, max_bytes):
        request = Request(key, dtype=out_dtype, rows=rows)
        (slab,) = read(
            root,
            manifest,
            [request],
            available=available,
            casting=casting,
            memory_budget=max_bytes,
        )
        yield slab
        del slab


def row_ranges(found: Available, dtype: np.dtype, max_bytes: int) -> list:
    """The ``rows`` of each slab ``read_rows`` reads (``[None]``: the whole tensor at once)."""
    shape = found.shape
    if not shape or not math.prod(shape):
        return [None]
    row = math.prod(shape[1:]) * (found.dtype.itemsize + (dtype != found.dtype) * dtype.itemsize)
    step = max(1, max_bytes // max(row, 1))
    inner = found.sources[0].inner_chunk_shape[0] if found.stored and found.sources else 1
    if step > inner:  # whole inner chunks: none decoded twice
        step -= step % inner
    return [(lo, min(lo + step, shape[0])) for lo in range(0, shape[0], step)]


def _tensor_error(name: str, e: BaseException) -> CheckpointError:
    """``e`` as a ``CheckpointError`` naming tensor ``name`` once (a store error, e.g. a shard
    digest's, may name it already)."""
    prefix, message = f"Tensor {name!r}: ", str(e)
    return CheckpointError(message if message.startswith(prefix) else prefix + message)


_READ_FAILURES = {  # ``errors.tensorstore_failure`` → what a failed read tells the user
    "corrupt": "crc32c checksum mismatch: the data is corrupt",
    "missing": "missing data: the checkpoint is incomplete",
    "denied": "permission denied: the file is there but this user may not read it",
    "other": "corrupt or truncated data?",
}


def _plan_item(source: TensorSource, req: Request, available: Mapping, values: Mapping, casting):
    """``("value", the saved value)`` or ``("tensor", req, the Available)`` for one request,
    after every check that needs no data (the name exists, ``check_tensor_request``)."""
    key = tuple(map(str, req.key))  # int vs str components (lists vs dicts of indices)
    found = available.get(key, values.get(key))
    name = fmt.key_to_str(req.key)
    if found is None:
        raise not_found(name, source.where, available)
    if isinstance(found, fmt.ValueEntry):
        value = found.value
        if req.wants_array:
            value = value_as_array(name, source.where, value, req, casting)
        return ("value", value)
    check_tensor_request(name, req, found, source.holder(found), casting)
    return ("tensor", req, found)


def not_found(name: str, where: str, available: Mapping) -> CheckpointError:
    """A requested tensor ``where`` lacks, naming a few it holds."""
    near = [fmt.key_to_str(k) for k in list(available)[:5]]
    return CheckpointError(
        f"Tensor {name!r} is not in {where} ({len(available)} tensors, e.g. {near})."
    )


def check_tensor_request(name: str, req: Request, found, holder: str, casting: str) -> np.dtype:
    """The checks of a request for a tensor that need no data, whatever the source: shape,
    dtype cast, a Python scalar target (a 0-d tensor only), divisibility by the sharding, a
    64-bit dtype JAX would narrow on device. Returns the dtype it is restored as.

    Args:
      name: the tensor's name.
      req: the request.
      found: what the source holds (``shape``, ``dtype``).
      holder: names the source in errors ("the checkpoint <dir>", "<file>:<tensor>").
      casting: numpy's casting rule.
    """
    if req.shape is not None and tuple(req.shape) != found.shape:
        raise CheckpointError(
            f"Tensor {name!r}: the target asks for shape {tuple(req.shape)}, "
            f"{holder} holds shape {found.shape}."
        )
    want_dtype = np.dtype(req.dtype) if req.dtype is not None else found.dtype
    check_cast(name, found.dtype, want_dtype, casting)
    if req.python_type is not None and found.shape != ():
        raise CheckpointError(
            f"Leaf {name!r}: the target is a Python {req.python_type.__name__}, but "
            f"{holder} holds an array of shape {found.shape}."
        )
    if req.sharding is not None:
        sharding_lib.check_divisible(name, found.shape, req.sharding)
        narrowed = np.dtype(jax.dtypes.canonicalize_dtype(want_dtype))
        if narrowed != want_dtype:
            raise CheckpointError(
                f"Tensor {name!r} is {want_dtype}, which JAX would silently narrow to "
                f"{narrowed} on device; enable jax_enable_x64, restore it to host (sharding "
                f"None) or ask for a dtype."
            )
    return want_dtype


class CheckpointSource(TensorSource):
    """A UCP checkpoint's arrays: each opened once, concurrently, with errors that name tensor
    and file; read by ``store.shard_reader`` where the layout allows (hardware crc32c, shard
    digests), by TensorStore elsewhere (after checking every shard file it will open)."""

    metadata = fmt.MANIFEST_FILE

    def __init__(self, root: str):
        self.root = self.path = root
        self.where = f"the checkpoint {root}"
        self.url = store.location.is_url(root)
        self._context = store.zarr3.read_context()
        self._futures: dict[tuple, tuple[fmt.TensorEntry, ts.Future]] = {}

    def files(self, found: Available) -> str:
        return ", ".join(os.path.join(self.root, s.dir) for s in found.sources)

    def prepare(self, tensors: Sequence[Available]) -> None:
        """Every array opened at once; in an object store every shard object's digest checked
        at once, before any read."""
        sources = {s.key: s for found in tensors for s in found.sources}
        for src in sources.values():
            self._open(src)
        if self.url:
            verify_shard_objects(self.root, sources.values())

    def _open(self, entry: fmt.TensorEntry) -> None:
        if entry.key not in self._futures:
            kv = store.kvstore_config(self.root, entry.dir)
            if kv.get("driver") == "file":  # never hand TensorStore a FIFO or a device
                try:  # an array folder linked out of the checkpoint is never read
                    fmt.files.inside(self.root, f"{entry.dir}/zarr.json", fmt.MANIFEST_FILE)
                    fmt.files.check_regular(os.path.join(kv["path"], "zarr.json"))
                except FileNotFoundError:
                    pass  # reported with the tensor's name by _get()
                except fmt.files.UnsafeFileError as e:
                    raise _tensor_error(entry.name, e) from None
            self._futures[entry.key] = (entry, store.open_array(kv, context=self._context))

    def _get(self, key) -> ts.TensorStore:
        entry, fut = self._futures[key]
        where = os.path.join(self.root, entry.dir)
        try:
            t = fut.result()
        except Exception as e:  # noqa: BLE001
            if not os.path.exists(os.path.join(where, "zarr.json")) and "://" not in where:
                raise CheckpointError(
                    f"Tensor {entry.name!r} is listed in {fmt.MANIFEST_FILE} but its "
                    f"array {where}/zarr.json is missing."
                ) from e
            raise CheckpointError(
                f"Tensor {entry.name!r}: cannot open {where}: {tensorstore_message(e)}"
            ) from e
        found_dtype = t.dtype.numpy_dtype
        if tuple(t.shape) != entry.shape or found_dtype != store.zarr3.numpy_dtype(entry.dtype):
            raise CheckpointError(
                f"Tensor {entry.name!r}: {where}/zarr.json has shape {tuple(t.shape)} dtype "
                f"{found_dtype}, but {fmt.MANIFEST_FILE} says shape {entry.shape} dtype {entry.dtype}."
            )
        layout = t.chunk_layout
        found_chunks = (
            tuple(layout.write_chunk.shape or ()),  # None for a 0-d array
            tuple(layout.read_chunk.shape or ()),
        )
        if entry.shape and found_chunks != (entry.chunk_shape, entry.inner_chunk_shape):
            raise CheckpointError(  # the manifest's chunks are the ones checked for size
                f"Tensor {entry.name!r}: {where}/zarr.json has chunk shape {found_chunks[0]} "
                f"and inner chunk shape {found_chunks[1]}, but {fmt.MANIFEST_FILE} says "
                f"{entry.chunk_shape} and {entry.inner_chunk_shape}."
            )
        return t

    def reader(self, found: Available):
        """``store.shard_reader`` where the stored array's zarr.json allows it, else the view."""
        view = found.build({s.key: self._get(s.key) for s in found.sources})
        entry = found.sources[0]
        kv = store.kvstore_config(self.root, entry.dir)
        if not found.stored or kv.get("driver") != "file":
            return view
        layout = shard_file.layout_from_metadata(
            view.spec().to_json().get("metadata", {}), view.dtype.numpy_dtype
        )
        if layout is None:
            return view
        return shard_reader.ShardReader(
            kv["path"],
            layout,
            view.dtype.numpy_dtype,
            digests=entry.shard_digests,
            tensor=entry.name,
            root=self.root,
        )

    def check_fits(self, found: Available, limit: int, what: str) -> None:
        for src in found.sources:  # a reader decodes whole inner chunks
            chunk = math.prod(src.inner_chunk_shape) * store.zarr3.numpy_dtype(src.dtype).itemsize
            if src.shape and chunk > limit:
                raise CheckpointError(
                    f"Tensor {found.name!r} ({os.path.join(self.root, src.dir)}): its inner "
                    f"chunks of shape {src.inner_chunk_shape} take {format_size(chunk)} each, more "
                    f"than {what} ({format_size(limit)}); a reader decodes whole chunks. Check the "
                    f"checkpoint's {fmt.MANIFEST_FILE} and zarr.json (they declare this chunking)."
                )

    def verify(self, found: Available, reader) -> None:
        """Read by TensorStore: every shard file it may open checked first (object stores
        were checked at once, by ``prepare``)."""
        if not self.url and not isinstance(reader, shard_reader.ShardReader):
            for src in found.sources:
                verify_shard_files(self.root, src)

    def unit_rows(self, found: Available) -> int:
        """The stored array is split on its inner chunks."""
        return max(1, int(found.sources[0].inner_chunk_shape[0])) if found.stored else 1


def verify_shard_files(root: str, entry: fmt.TensorEntry) -> None:
    """Before TensorStore reads ``entry``: each shard file exists, is a regular file, and (with
    checksums) is the one the manifest lists (its digest), so a swapped, stale or missing shard
    is an error naming the file, and a FIFO never blocks the read."""
    kv = store.kvstore_config(root, entry.dir)
    if kv.get("driver") != "file":
        verify_shard_objects(root, [entry])
        return
    n_chunks = _chunks_per_shard(entry)
    for key in shard_file.grid_keys(entry.shape, entry.chunk_shape):
        path = os.path.join(kv["path"], *key.split("/"))
        with _shard_checked(entry, "file", path):
            fmt.files.inside(root, f"{entry.dir}/{key}", "shard file")
            if entry.checksum == "crc32c" and entry.shard_digests is not None:
                found = shard_reader.file_digest(path, n_chunks)
                shard_file.check_digest(path, found, entry.shard_digests.get(key), entry.name)
            else:
                fmt.files.check_regular(path)


def _chunks_per_shard(entry: fmt.TensorEntry) -> int:
    return math.prod(c // i for c, i in zip(entry.chunk_shape, entry.inner_chunk_shape))


@contextlib.contextmanager
def _shard_checked(entry: fmt.TensorEntry, kind: str, where: str):
    """A missing shard (``kind``: file or object) or a failed check as an error naming the
    tensor."""
    try:
        yield
    except FileNotFoundError:
        raise CheckpointError(
            f"Tensor {entry.name!r}: shard {kind} {where} is missing (the checkpoint is "
            f"incomplete)."
        ) from None
    except fmt.UCPError as e:
        raise _tensor_error(entry.name, e) from None


def verify_shard_objects(root: str, entries) -> None:
    """``verify_shard_files`` for many tensors in an object store at once: each shard object's
    digest from its index and chunk trailers, read as byte ranges, all objects' requests issued
    together (two round trips for a whole restore, where one object after another took two
    each)."""
    entries = [e for e in entries if e.checksum == "crc32c" and e.shard_digests is not None]
    if not entries:
        return
    kvstore = ts.KvStore.open(store.kvstore_config(root)).result()
    shards, owners = [], []
    for entry in entries:
        n_chunks = _chunks_per_shard(entry)
        data_bytes = shard_file.index_offset(
            entry.inner_chunk_shape,
            store.zarr3.numpy_dtype(entry.dtype),
            n_chunks,
            entry.compression,
        )
        for key in shard_file.grid_keys(entry.shape, entry.chunk_shape):
            where = store.location.join(root, entry.dir, key)
            shards.append((kvstore, f"{entry.dir.strip('/')}/{key}", n_chunks, where, data_bytes))
            owners.append((entry, key, where))
    for start in range(0, len(shards), _OBJECTS_PER_SWEEP):
        found = shard_reader.object_digests(shards[start : start + _OBJECTS_PER_SWEEP])
        for (entry, key, where), digest in zip(owners[start:], found):
            with _shard_checked(entry, "object", where):
                if isinstance(digest, BaseException):
                    raise digest
                shard_file.check_digest(where, digest, entry.shard_digests.get(key), entry.name)


# Shard objects whose digests are read together (each holds its index in memory meanwhile).
_OBJECTS_PER_SWEEP = 4096


def value_as_array(name: str, where: str, value: Any, req: Request, casting: str):
    """A saved Python bool/int/float as the array a target leaf asks for (a ``jax.Array`` on
    its sharding, as Orbax gives ``step=5`` restored into a ``jax.eval_shape`` target), when the
    conversion keeps the value: the cast is one ``casting`` allows from the value's own type
    (bool, int64, float64) and the value survives it (no int wraps, no float overflows).
    Anything else (a str, None, a lossy cast) needs ``casting="unsafe"``.

    Args:
        name: the leaf, for errors.
        where: the checkpoint, for errors ("the checkpoint <dir>").
        value: the saved scalar.
        req: what the target leaf asks for.
        casting: numpy's casting rule.
    """
    want = np.dtype(req.dtype) if req.dtype is not None else None
    shape = tuple(req.shape) if req.shape is not None else ()
    kind = type(value)
    if shape != ():
        raise CheckpointError(
            f"Leaf {name!r}: the target asks for an array of shape {shape}, but "
            f"{where} holds the Python {kind.__name__} {_short(value)} (a scalar)."
        )
    if casting != "unsafe":
        why = None
        if kind not in (bool, int, float):
            why = f"holds the Python {kind.__name__} {_short(value)}"
        elif want is not None:
            natural = np.dtype(bool if kind is bool else np.int64 if kind is int else np.float64)
            try:
                check_cast(name, natural, want, casting)
                with np.errstate(over="ignore", invalid="ignore"):
                    converted = np.asarray(value).astype(want)
                back = converted.item()
                if kind is int and back != value:
                    why = f"holds the Python int {value}, which {want} cannot hold"
                elif kind is float and np.isfinite(value) and not np.isfinite(float(back)):
                    why = f"holds the Python float {value}, which overflows {want}"
            except (CheckpointError, OverflowError):
                why = (
                    f"holds the Python {kind.__name__} {_short(value)}, and {natural} → {want} "
                    f"is not a {casting!r} cast"
                )
        if why is not None:
            raise CheckpointError(
                f"Leaf {name!r}: the target asks for a {want if want is not None else ''} "
                f"array, but {where} {why}. Pass "
                f"casting='unsafe' to turn it into an array anyway."
            )
    try:
        array = np.asarray(value, dtype=want)
    except (OverflowError, ValueError, TypeError):
        with np.errstate(over="ignore", invalid="ignore"):
            array = np.asarray(value).astype(want)
    if req.sharding is not None:
        return jax.device_put(array, req.sharding)
    return array


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value) if not isinstance(value, str) else repr(value[:limit])
    return text[:limit] + ("…" if len(text) > limit else "")


def _concrete(key, sharding, mesh):
    """A target's ``NamedSharding`` on an ``AbstractMesh`` (what ``nnx.eval_shape`` under
    ``jax.set_mesh`` gives) on the concrete mesh: ``mesh=`` or the one set by
    ``jax.set_mesh``, when its axis names and sizes are the abstract mesh's."""
    if not (
        isinstance(sharding, jax.sharding.NamedSharding)
        and isinstance(sharding.mesh, jax.sharding.AbstractMesh)
    ):
        return sharding
    wanted = dict(sharding.mesh.shape)
    candidates = [mesh] if mesh is not None else []
    current = getattr(jax.sharding, "get_mesh", lambda: None)()
    if current is not None and not getattr(current, "empty", True):
        candidates.append(current)
    for candidate in candidates:
        if isinstance(candidate, jax.sharding.Mesh) and dict(candidate.shape) == wanted:
            return jax.sharding.NamedSharding(candidate, sharding.spec)
    found = f"; mesh= has axes {dict(mesh.shape)}" if mesh is not None else ""
    raise CheckpointError(
        f"Leaf {fmt.key_to_str(key)!r}: the target's sharding is on an AbstractMesh {wanted} "
        f"(nnx.eval_shape under jax.set_mesh gives these), which has no devices{found}. Pass "
        f"the concrete mesh as mesh=, or restore inside `with jax.set_mesh(mesh):`."
    )


def requests_from_target(target, shardings=None, mesh=None) -> tuple[list[Request], Any]:
    """One request per target leaf; shardings (same structure) override the target's own.

    Args:
        target: the pytree to restore into (None: ``shardings`` are the target).
        shardings: shardings in the target's structure (override its own).
        mesh: the concrete mesh for shardings on an ``AbstractMesh``.
    """
    if target is None:
        target, shardings = shardings, None
    leaves, treedef = tree_lib.flatten(target)
    shard_by_key = {
        key: _concrete(key, tree_lib.unbox(s)[0], mesh)
        for key, _, s in (tree_lib.flatten(shardings)[0] if shardings is not None else ())
    }
    reqs = []
    for key, _, leaf in leaves:
        leaf, _ = tree_lib.unbox(leaf)
        if isinstance(leaf, jax.sharding.Sharding):  # a pytree of shardings used as the target
            reqs.append(Request(key=key, sharding=_concrete(key, leaf, mesh)))
            continue
        sharding = shard_by_key.get(key, _concrete(key, getattr(leaf, "sharding", None), mesh))
        if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)):
            dtype, shape = np.dtype(leaf.dtype), tuple(leaf.shape)
            reqs.append(Request(key, dtype, shape, sharding, wants_array=True))
        elif isinstance(leaf, (bool, int, float)):
            reqs.append(Request(key=key, python_type=type(leaf), sharding=sharding))
        else:  # None, str, or anything else: take what was saved
            reqs.append(Request(key=key, sharding=shard_by_key.get(key)))
    return reqs, treedef


def restore_tree(path, options: RestoreOptions):
    """Restores the checkpoint at ``path`` (see ``jax_ucp.restore``), whole or not at all.

    A concurrent forced save swaps directories: the restore starts over on the new one
    (``read_consistently``), so the result is never a mix of two saves nor a false "corrupt".

    Args:
      path: the checkpoint directory, or an Orbax step directory holding one UCP item.
      options: what to restore and how (checked when constructed).
    """
    return read_consistently(path, lambda root: _restore_once(root, options))


def read_consistently(path, read: Callable[[str], Any], *, redo: bool = True):
    """``read(root)`` of the checkpoint at ``path`` (``find_checkpoint_dir``), or of the one a
    concurrent forced save swapped in while it ran.

    A forced save commits a new directory beside ``path`` and swaps it in by two renames
    (``writer.commit``); a reader may meanwhile see ``path`` missing, read a manifest from one
    directory and shards from the next (``ShardReadError``: not the shard the manifest lists),
    or its directory vanish. Each of those is told from damage by what changed around the read:
    the directory read (device, inode and ctime: ext4 gives a freed inode to the next directory
    at once, the ctime tells them apart) or the swap's names beside ``path`` (``.ucp-replacing``,
    ``.ucp-replaced``). An error with nothing changed is the checkpoint's own; one with a change
    is retried, and after ``_SWAP_RETRIES`` such retries ``CheckpointReplacedError`` ("being
    replaced, retry") is raised, never a corrupt-checkpoint error.

    Args:
      path: the checkpoint directory, or an Orbax step directory holding one UCP item.
      read: reads the checkpoint directory it is given.
      redo: a successful ``read`` during which the directory changed is run again (False for a
        read with effects, as an export: a success is whole, every shard checked against the
        manifest's digest).
    """
    path = os.fspath(path).rstrip("/") or "/"
    error: BaseException | None = None
    for _ in range(_SWAP_RETRIES + 1):
        around = _swap_state(path)
        root, stamp = None, None
        try:
            root = find_checkpoint_dir(path)
            stamp = _identity(root)
            result = read(root)
        except fmt.UCPError as e:  # the checkpoint's own, unless path or root changed meanwhile
            moved = root is not None and (stamp is None or _identity(root) != stamp)
            if _swap_state(path) == around and not moved:
                raise
            error = e
            continue
        if not redo or root is None or stamp is None or _identity(root) == stamp:
            return result
    raise CheckpointReplacedError(
        f"{path}: the checkpoint was being replaced by a concurrent save while it was read "
        f"({_SWAP_RETRIES + 1} attempts); nothing is wrong with it: read it again once the save "
        f"finishes."
    ) from error  # what the read met while the directory changed under it


_SWAP_RETRIES = 3


def _identity(root: str):
    """What tells one directory at ``root`` from the next: a freed inode is given to the next
    directory made on ext4 at once, the ctime (set when made or renamed) differs."""
    if store.is_url(root):
        return "url"  # an object-store checkpoint is never replaced (no rename there)
    try:
        st = os.stat(root)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


def _swap_state(path: str) -> tuple:
    """``path`` and the names a forced replacement of it uses beside it."""
    return tuple(_identity(p) for p in (path, path + commit.REPLACING, path + commit.REPLACED))


def _restore_once(root: str, options: RestoreOptions):
    manifest = store.read_manifest(root)
    return restore_from(
        CheckpointSource(root),
        available_tensors(manifest, options.spec),
        manifest.values,
        options,
        tree=manifest.tree if options.spec is None else None,
    )


def restore_from(
    source: TensorSource,
    every: Mapping,
    values: Sequence[fmt.ValueEntry],
    options: RestoreOptions,
    *,
    tree=None,
):
    """A restore from ``source``, whatever it is: into ``options.target`` / ``.shardings``, or
    every tensor (or those ``select`` matches) on ``mesh=`` (saved PartitionSpecs and logical
    axes through ``rules``) or to host.

    Args:
      source: what the tensors are read from.
      every: key → ``Available``, what the source holds (a spec's views of it).
      values: the saved Python values.
      options: a restore's options.
      tree: the saved containers (``manifest.tree``), or None to nest by key.
    """
    saved_values = {v.key: v for v in values}

    def read_requests(reqs, available=every):
        return read_from(
            source,
            reqs,
            available,
            saved_values,
            casting=options.casting,
            memory_budget=options.read_budget,
            replicated_read=options.replicated_read,
        )

    if options.has_target:  # one request per leaf, the results in the target's structure
        if options.rules is not None and options.mesh is not None:
            sharding_lib.check_rules(options.rules, options.mesh)
        target = options.target
        reqs, treedef = requests_from_target(target, options.shardings, mesh=options.mesh)
        for r in reqs if options.dtype is not None else ():
            r.dtype = np.dtype(options.dtype)
        results = read_requests(reqs)
        if target is not None:  # flax boxes (nn.LogicallyPartitioned, ...) keep their metadata
            boxes = [leaf for _, _, leaf in tree_lib.flatten(target)[0]]
            results = [tree_lib.rebox(box, x) for box, x in zip(boxes, results)]
        return jax.tree_util.tree_unflatten(treedef, results)
    where = source.path
    if options.mesh is not None:
        check_mesh_names(where, every.values(), options.mesh, options.rules, options.strict)
    available, chosen_values = _selected(where, every, values, options.select)
    reqs, key_types = placed_requests(where, available.values(), options)
    for v in chosen_values:
        reqs.append(Request(key=v.key))
        key_types.append(v.key_types)
    results = read_requests(reqs, available)
    partial = options.select is not None
    if tree is not None:  # the saved containers, NamedTuples included
        by_key = {r.key: x for r, x in zip(reqs, results)}
        rebuilt = tree_lib.rebuild_structure(
            tree, lambda key: by_key.get(key, tree_lib.missing()), partial=partial
        )
        return {} if rebuilt is tree_lib.missing() else rebuilt
    return tree_lib.nest(
        ((r.key, k, x) for r, k, x in zip(reqs, key_types, results)), partial=partial
    )


def _selected(where: str, every: Mapping, values: Sequence[fmt.ValueEntry], select):
    """The tensors and values ``select`` (a regex matched in full against "a/b/c" names, or a
    predicate on the name) matches (all without it); matching none is an error."""
    if select is None:
        return dict(every), list(values)
    if isinstance(select, str):
        selected = re.compile(select).fullmatch
    elif callable(select):
        selected = cast(Callable[[str], Any], select)
    else:
        raise TypeError(
            f"select must be a regex string or a predicate, got {type(select).__name__}."
        )
    available = {k: av for k, av in every.items() if selected(fmt.key_to_str(k))}
    chosen_values = [v for v in values if selected(v.name)]
    if not available and not chosen_values:
        tops = sorted({k[0] for k in every if k} | {v.key[0] for v in values if v.key})
        shown = ", ".join(map(repr, tops[:20])) + (
            f", … ({len(tops)} in all)" if len(tops) > 20 else ""
        )
        example = next(map(fmt.key_to_str, every), values[0].name if values else "params/w")
        raise CheckpointError(
            f"select={_short(select)} matches no tensor or value of the checkpoint {where}; its "
            f"top-level names: {shown or 'none'} (a regex is matched in full "
            f"against '/'-joined names such as {example!r})."
        )
    return available, chosen_values


def placed_requests(where: str, available, options: RestoreOptions):
    """One request per tensor of ``available``, placed as ``restore(mesh=, rules=)`` places it
    (host numpy without a mesh; a 64-bit tensor without jax_enable_x64 stays on host, exact).
    A tensor saved sharded that comes back replicated without a rule asking for it is named in
    one ``ReplicationWarning``.

    Args:
      where: the checkpoint, for the warning.
      available: ``Available``-like tensors (key, key_types, shape, dtype, saved_sharding,
        logical_axes).
      options: the restore's options (mesh, rules, dtype).

    Returns:
      (requests, key types), one each per tensor.
    """
    dtype, mesh, rules = options.dtype, options.mesh, options.rules
    reqs, key_types, replicated = [], [], []
    for av in available:
        want = np.dtype(dtype or av.dtype)
        sharding = None
        if mesh is not None and np.dtype(jax.dtypes.canonicalize_dtype(want)) == want:
            placement: dict[str, Any] = dict(
                mesh=mesh, saved=av.saved_sharding, logical_axes=av.logical_axes, rules=rules
            )
            sharding = sharding_lib.sharding_for(av.shape, **placement)
            if sharding_lib.replicated_unasked(av.shape, sharding.spec, **placement):
                replicated.append((av.name, math.prod(av.shape) * want.itemsize))
        reqs.append(Request(key=av.key, sharding=sharding, dtype=None if dtype is None else want))
        key_types.append(av.key_types)
    if replicated:
        warnings.warn(
            sharding_lib.replication_warning(where, replicated),
            sharding_lib.ReplicationWarning,
            stacklevel=user_stacklevel(),
        )
    return reqs, key_types


def check_mesh_names(root: str, available, mesh, rules, strict: bool) -> None:
    """``sharding.check_names`` for the tensors a restore (or plan) with ``mesh=`` would
    place: the logical names they carry and the mesh axes they were saved with.

    Args:
        root: the checkpoint, for errors.
        available: the tensors to place.
        mesh: the mesh restored onto.
        rules: the logical-axis rules (or None).
        strict: also refuse unused rules and mesh axes.
    """
    names, axes = set(), set()
    for av in available:
        names.update(n for n in av.logical_axes or () if n is not None)
        saved = av.saved_sharding
        if saved is not None:
            axes.update(saved.mesh_axis_names)
            for entry in saved.partition_spec:
                axes.update(entry if isinstance(entry, (tuple, list)) else (entry,))
    axes.discard(None)
    sharding_lib.check_names(
        mesh, rules, logical_names=names, saved_axes=axes, where=root, strict=strict
    )
    unmatched = sharding_lib.unmatched_rules(rules, names)
    if unmatched:
        warnings.warn(
            sharding_lib.unmatched_rules_message(root, unmatched, names),
            sharding_lib.ReplicationWarning,
            stacklevel=user_stacklevel(),
        )
