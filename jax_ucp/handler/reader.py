"""Restore: match what the caller asks for to what is saved, read only the needed slices."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from jax_ucp import format as fmt
from jax_ucp import sharding as sharding_lib
from jax_ucp import store
from jax_ucp.handler import tree as tree_lib
from jax_ucp.store import shard_file


class CheckpointError(ValueError):
    """A checkpoint cannot be restored as asked: names the tensor, the file, expected vs found."""


@dataclasses.dataclass(frozen=True)
class Available:
    """A tensor restore can produce: stored as is, or a lazy view the UCP language built."""

    key: tuple[str, ...]
    key_types: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    sources: tuple[fmt.TensorEntry, ...]
    build: Callable[[Mapping[tuple[str, ...], ts.TensorStore]], ts.TensorStore]
    saved_sharding: fmt.SavedSharding | None = None
    logical_axes: tuple | None = None
    stored: bool = False  # the stored array itself (no view): may be read by store.shard_file

    @property
    def name(self) -> str:
        return fmt.key_to_str(self.key)


def find_checkpoint_dir(path) -> str:
    """``path`` itself when it holds ucp.json, else its single UCP item (an Orbax step dir)."""
    path = os.fspath(path)
    if os.path.exists(os.path.join(path, fmt.MANIFEST_FILE)):
        return path
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory.")
    items = sorted(
        d for d in os.listdir(path) if os.path.exists(os.path.join(path, d, fmt.MANIFEST_FILE))
    )
    if len(items) == 1:
        return os.path.join(path, items[0])
    if not items:
        raise CheckpointError(
            f"{path}: no {fmt.MANIFEST_FILE} here nor in any item directory below "
            f"it; not a jax_ucp checkpoint (or the manifest was removed)."
        )
    raise CheckpointError(f"{path}: holds several UCP items {items}; pass one of them.")


def available_tensors(manifest: fmt.Manifest, spec=None) -> dict[tuple[str, ...], Available]:
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
    plans = language.compile_restore_plan(spec, saved)
    out = {}
    for key, plan in plans.items():
        srcs = tuple(by_key[s] for s in plan.sources)
        identity = len(srcs) == 1 and srcs[0].key == key and tuple(plan.shape) == srcs[0].shape
        out[tuple(key)] = Available(
            key=tuple(key),
            key_types=srcs[0].key_types if identity else ("key",) * len(key),
            shape=tuple(plan.shape),
            dtype=np.dtype(plan.dtype),
            sources=srcs,
            build=plan.build,
            saved_sharding=srcs[0].saved_sharding if identity else None,
            logical_axes=srcs[0].logical_axes if identity else None,
        )
    return out


class _Opener:
    """Opens each stored array once, concurrently, with errors that name tensor and file."""

    def __init__(self, root: str):
        self.root = root
        self._context = store.zarr3.read_context()
        self._futures: dict[tuple, tuple[fmt.TensorEntry, ts.Future]] = {}

    def request(self, entry: fmt.TensorEntry):
        if entry.key not in self._futures:
            kv = store.kvstore_config(self.root, entry.dir)
            self._futures[entry.key] = (entry, store.open_array(kv, context=self._context))

    def get(self, key) -> ts.TensorStore:
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
            raise CheckpointError(f"Tensor {entry.name!r}: cannot open {where}: {e}") from e
        found_dtype = t.dtype.numpy_dtype
        if tuple(t.shape) != entry.shape or found_dtype != store.zarr3.numpy_dtype(entry.dtype):
            raise CheckpointError(
                f"Tensor {entry.name!r}: {where}/zarr.json has shape {tuple(t.shape)} dtype "
                f"{found_dtype}, but {fmt.MANIFEST_FILE} says shape {entry.shape} dtype {entry.dtype}."
            )
        return t


@dataclasses.dataclass
class Request:
    """What the caller wants for one leaf: a tensor (sharding None → host numpy) or a value."""

    key: tuple[str, ...]
    dtype: np.dtype | None = None
    shape: tuple[int, ...] | None = None
    sharding: jax.sharding.Sharding | None = None
    python_type: type | None = None  # target leaf was a Python scalar


def _match(key, available: Mapping, values: Mapping):
    """Look a target key up; tolerant of int vs str components (lists vs dicts of indices)."""
    key = tuple(str(k) for k in key)
    if key in available:
        return available[key]
    if key in values:
        return values[key]
    return None


def read(
    root: str,
    manifest: fmt.Manifest,
    requests: Sequence[Request],
    *,
    spec=None,
    available: Mapping | None = None,
) -> list:
    """Results in request order: jax.Array / np.ndarray / saved Python values."""
    if available is None:
        available = available_tensors(manifest, spec)
    values = {e.key: e for e in manifest.values}
    opener = _Opener(root)
    plan = []
    for req in requests:
        found = _match(req.key, available, values)
        name = fmt.key_to_str(req.key)
        if found is None:
            near = [fmt.key_to_str(k) for k in list(available)[:5]]
            raise CheckpointError(
                f"Tensor {name!r} is not in the checkpoint {root} "
                f"({len(available)} tensors, e.g. {near})."
            )
        if isinstance(found, fmt.ValueEntry):
            plan.append(("value", found.value))
            continue
        if req.shape is not None and tuple(req.shape) != found.shape:
            raise CheckpointError(
                f"Tensor {name!r}: the target asks for shape {tuple(req.shape)}, "
                f"the checkpoint {root} holds shape {found.shape}."
            )
        want_dtype = np.dtype(req.dtype) if req.dtype is not None else found.dtype
        if req.sharding is not None:
            sharding_lib.check_divisible(name, found.shape, req.sharding)
            if np.dtype(jax.dtypes.canonicalize_dtype(want_dtype)) != want_dtype:
                raise CheckpointError(
                    f"Tensor {name!r} is {want_dtype}, which JAX would silently narrow to "
                    f"{np.dtype(jax.dtypes.canonicalize_dtype(want_dtype))} on device; enable "
                    f"jax_enable_x64, restore it to host (sharding None) or ask for a dtype."
                )
        for src in found.sources:
            opener.request(src)
        plan.append(("tensor", req, found))
    # All opens were issued above; now build views and issue every read before waiting on any.
    pending = []
    for item in plan:
        if item[0] == "value":
            pending.append(item)
            continue
        _, req, found = item
        view = found.build({s.key: opener.get(s.key) for s in found.sources})
        if found.stored:
            view = _fast_reader(root, found.sources[0], view)
        dtype = np.dtype(req.dtype) if req.dtype is not None else found.dtype
        pending.append(
            (
                "tensor",
                req,
                found,
                sharding_lib.PendingArray(view, found.shape, dtype, req.sharding),
            )
        )
    out = []
    for item in pending:
        if item[0] == "value":
            out.append(item[1])
            continue
        _, req, found, pa = item
        try:
            result = pa.result()
        except Exception as e:  # noqa: BLE001
            files = ", ".join(os.path.join(root, s.dir) for s in found.sources)
            what = (
                "crc32c checksum mismatch: the data is corrupt"
                if ("Digest mismatch" in str(e) or "crc32c checksum mismatch" in str(e))
                else "corrupt or truncated data?"
            )
            raise CheckpointError(
                f"Tensor {found.name!r}: reading {files} failed ({what}): {e}"
            ) from e
        if req.python_type is not None and getattr(result, "shape", None) == ():
            result = req.python_type(np.asarray(result).item())
        out.append(result)
    return out


def _fast_reader(root: str, entry: fmt.TensorEntry, opened: ts.TensorStore):
    """``store.shard_file``'s reader (hardware crc32c) where the array's zarr.json allows it."""
    kv = store.kvstore_config(root, entry.dir)
    if kv.get("driver") != "file":
        return opened
    layout = shard_file.layout_from_metadata(
        opened.spec().to_json().get("metadata", {}), opened.dtype.numpy_dtype
    )
    if layout is None:
        return opened
    return shard_file.ShardReader(kv["path"], layout, opened.dtype.numpy_dtype)


def requests_from_target(target, shardings=None) -> tuple[list[Request], Any]:
    """One request per target leaf; shardings (same structure) override the target's own."""
    leaves, treedef = tree_lib.flatten(target)
    shard_by_key = {}
    if shardings is not None:
        for key, _, s in tree_lib.flatten(shardings)[0]:
            shard_by_key[key] = s
    reqs = []
    for key, _, leaf in leaves:
        leaf, _ = tree_lib.unbox(leaf)
        if isinstance(leaf, jax.sharding.Sharding):  # a pytree of shardings used as the target
            reqs.append(Request(key=key, sharding=leaf))
            continue
        sharding = shard_by_key.get(key, getattr(leaf, "sharding", None))
        if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
            reqs.append(
                Request(
                    key=key, dtype=np.dtype(leaf.dtype), shape=tuple(leaf.shape), sharding=sharding
                )
            )
        elif isinstance(leaf, (np.ndarray, np.generic)):
            reqs.append(
                Request(
                    key=key,
                    dtype=leaf.dtype,
                    shape=tuple(np.shape(leaf)),
                    sharding=shard_by_key.get(key),
                )
            )
        elif isinstance(leaf, (bool, int, float)):
            reqs.append(Request(key=key, python_type=type(leaf), sharding=shard_by_key.get(key)))
        else:  # None, str, or anything else: take what was saved
            reqs.append(Request(key=key, sharding=shard_by_key.get(key)))
    return reqs, treedef


def restore_tree(
    path, *, target=None, shardings=None, mesh=None, rules=None, spec=None, dtype=None
):
    root = find_checkpoint_dir(path)
    manifest = fmt.read_manifest(root)
    if target is not None or shardings is not None:
        reqs, treedef = requests_from_target(
            target if target is not None else shardings, shardings if target is not None else None
        )
        if dtype is not None:
            for r in reqs:
                r.dtype = np.dtype(dtype)
        return jax.tree_util.tree_unflatten(treedef, read(root, manifest, reqs, spec=spec))
    if rules is not None and mesh is None:
        raise ValueError("Logical-axis `rules` need a `mesh` to map onto.")
    available = available_tensors(manifest, spec)
    reqs, key_types = [], []
    for key, av in available.items():
        sharding = None
        wide = np.dtype(jax.dtypes.canonicalize_dtype(dtype or av.dtype)) != np.dtype(
            dtype or av.dtype
        )
        if mesh is not None and not wide:  # 64-bit without jax_enable_x64 stays on host, exact
            sharding = sharding_lib.sharding_for(
                av.shape,
                mesh=mesh,
                saved=av.saved_sharding,
                logical_axes=av.logical_axes,
                rules=rules,
            )
        reqs.append(
            Request(key=key, sharding=sharding, dtype=None if dtype is None else np.dtype(dtype))
        )
        key_types.append(av.key_types)
    for v in manifest.values:
        reqs.append(Request(key=v.key))
        key_types.append(v.key_types)
    results = read(root, manifest, reqs, available=available)
    return tree_lib.nest((r.key, k, x) for r, k, x in zip(reqs, key_types, results))
