"""A ``torch_checkpointing`` checkpoint (the package torchtitan 0.3 saves with): one folder per
checkpoint, one ``torch.save`` file per item per rank (``<item>_<rank>.pt`` by default: each
rank's state dict, DTensors as that rank's shards) and ``metadata.pkl``, the pickled global
metadata a resharding-capable save writes (per item, per nested path: the global shape, dtype,
mesh and placements, and which ranks hold it).

``metadata.pkl`` is plain data (dicts, lists, tuples, strings, numbers) and is read through the
allow-listed unpickler with no class allowed; the rank files with
:data:`allow_list.SHARDED_TENSOR_CLASSES` (a DTensor becomes an inert ``WrapperTensor``
holding its local shard).
Each tensor is assembled from the ranks' shards at the offsets the placements give (DTensor's
own rule: ``Shard(d)`` splits dim ``d`` in ``ceil(n / mesh size)`` chunks, mesh dimension after
mesh dimension); each shard's shape is checked against that rule. The ``model`` item gives the
parameters, the ``optimizer`` item (``get_optimizer_state_dict``: keyed by name) the moments and
step; the other items (``train_state``, ``lr_scheduler``, ``dataloader``) are recorded or
listed in ``source.skipped``.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from jax_ucp._src.errors import RequestError, SourceError
from jax_ucp._src.format.files import numbered_names, strict_loads
from jax_ucp._src.importers.plan import (
    Detection,
    ImportPlan,
    refuse_spec,
    tensor_names,
)
from jax_ucp._src.importers.torch.options import TorchOptions
from jax_ucp._src.importers.torch_state import TensorRef, TorchState, plan_state, scalar_ref
from jax_ucp._src.store.storage import Storage
from jax_ucp._src.torchfiles import allow_list, dtypes, pickle_format, sharded, torch_zip

__all__ = ["METADATA_FILE", "detect", "is_torch_checkpointing", "plan_torch_checkpointing"]

METADATA_FILE = "metadata.pkl"  # torch_checkpointing.metadata_serialization.METADATA_FILE_NAME
#: the metadata versions read here (torch_checkpointing 0.1.x writes "2.0")
VERSIONS = ("2.0",)
MAX_METADATA_BYTES = 256 << 20  # plain data: shapes, placements, ranks per tensor
MODEL_ITEMS = ("model",)
OPTIMIZER_ITEMS = ("optimizer", "optim")
_RANK_FILE = re.compile(r"(.+)_([0-9]+)\.pt")  # ASCII digits: rank_١.pt is no rank file


def is_torch_checkpointing(storage: Storage) -> bool:
    """``metadata.pkl`` beside ``<item>_<rank>.pt`` files (a remote prefix by its listing)."""
    try:
        names = storage.names()
    except OSError:  # a file, or nothing
        return False
    return METADATA_FILE in names and any(_RANK_FILE.fullmatch(n) for n in names)


def _metadata(storage: Storage) -> tuple[dict, int]:
    """({item: {nested path tuple: [(sharding data, ranks)]}}, world size) from metadata.pkl."""
    path = storage.join(METADATA_FILE)
    # a bounded read of a regular file of this folder (never a link out, a FIFO, a huge file)
    data = storage.read(METADATA_FILE, MAX_METADATA_BYTES)  # a larger one refused unread
    if data is None:
        raise SourceError(f"{path}: listed, but no file there (a link to nothing?)")
    raw = pickle_format.restricted_loads(data, where=path)
    if not isinstance(raw, dict) or not isinstance(raw.get("metadata"), dict):
        raise SourceError(
            f"{path}: expected a dict with 'metadata', found {allow_list.short_repr(raw, 120)}"
        )
    if raw.get("version") not in VERSIONS:
        raise SourceError(
            f"{path}: metadata version {raw.get('version')!r}, expected one of {list(VERSIONS)} "
            f"(torch_checkpointing 0.1.x)"
        )
    world = raw.get("world_size")
    if not isinstance(world, int) or world < 1:
        raise SourceError(f"{path}: world_size {world!r}, expected a positive int")
    items: dict[str, dict[tuple, list]] = {}
    for item, meta in raw["metadata"].items():
        paths = meta.get("nested_path_to_metadata") if isinstance(meta, dict) else None
        if not isinstance(paths, dict):
            raise SourceError(f"{path}: item {item!r} has no nested_path_to_metadata")
        layouts = meta.get("rank_to_layout_info") or {}
        if any(v is not None for v in layouts.values()):
            raise SourceError(
                f"{path}: item {item!r} was saved with a custom layout "
                f"({allow_list.short_repr(layouts, 120)}); "
                f"only the default <item>_<rank>.pt layout is read"
            )
        table: dict[tuple, list] = {}
        for key, groups in paths.items():
            nested = tuple(_json_path(key, path))
            try:
                table[nested] = [(g["sharding_metadata"], tuple(g["ranks"])) for g in groups]
            except (KeyError, TypeError) as e:
                raise SourceError(
                    f"{path}: item {item!r} entry {allow_list.short_repr(key, 80)}: malformed "
                    f"({type(e).__name__}: {str(e)[:80]})"
                ) from None
        items[str(item)] = table
    return items, world


def _json_path(key: Any, where: str) -> list:
    try:
        value = strict_loads(key)
    except (TypeError, ValueError):
        value = None
    if not isinstance(value, list):
        raise SourceError(
            f"{where}: nested path {allow_list.short_repr(key, 80)} is not a JSON list"
        )
    return value


def _shard_box(
    meta: dict, rank: int, where: str
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(global shape, offset, local shape) of ``rank``'s shard by DTensor's placement rule."""
    if not isinstance(meta, dict) or meta.get("type") != "DTensorShardingMetadata":
        raise SourceError(
            f"{where}: sharding metadata of type "
            f"{allow_list.short_repr(meta.get('type') if isinstance(meta, dict) else meta, 60)}, expected "
            f"DTensorShardingMetadata"
        )
    try:  # untrusted plain data: a missing key or a non-number is an error naming it
        data = meta["data"]
        shape = tuple(int(n) for n in data["global_shape"])
        mesh = data["mesh_spec"]
        mesh_shape = tuple(int(n) for n in mesh["mesh_shape"])
        ranks = [int(r) for r in np.asarray(mesh["mesh_data"]).reshape(-1)]
        placements = [(p.get("type"), p.get("dim")) for p in data["placements"]]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise SourceError(
            f"{where}: malformed sharding metadata ({type(e).__name__}: {str(e)[:120]})"
        ) from None
    if rank not in ranks or len(ranks) != math.prod(mesh_shape):
        raise SourceError(f"{where}: rank {rank} is not in the mesh {ranks}")
    if len(placements) != len(mesh_shape) or any(n < 0 for n in shape):
        raise SourceError(
            f"{where}: {len(placements)} placements for a {len(mesh_shape)}-D mesh, shape "
            f"{list(shape)}"
        )
    coords = np.unravel_index(ranks.index(rank), mesh_shape)
    dims: list[int | None] = []
    for kind, dim in placements:
        if kind not in ("Shard", "Replicate"):
            raise SourceError(f"{where}: placement {kind!r}; only Shard and Replicate are read")
        if kind == "Shard" and type(dim) is not int:
            raise SourceError(f"{where}: Shard dim {allow_list.short_repr(dim, 40)} is not an int")
        dims.append(dim if kind == "Shard" else None)
    try:
        offset, local = sharded.dtensor_box(shape, mesh_shape, [int(c) for c in coords], dims)
    except sharded.ShardLayoutError as e:  # Shard(1) of a 1-D tensor: no IndexError
        raise SourceError(f"{where}: {e}") from None
    return shape, offset, local


def _metadata_dtype(meta: dict, where: str) -> np.dtype:
    """The dtype ``metadata.pkl`` records for a tensor (``"torch.float32"``)."""
    data = meta.get("data") if isinstance(meta, dict) else None
    name = data.get("dtype") if isinstance(data, dict) else None
    torch_name = name.partition("torch.")[2] if isinstance(name, str) else ""
    dtype = dtypes.BY_NAME.get(torch_name) if name == f"torch.{torch_name}" else None
    if dtype is None:
        raise SourceError(
            f"{where}: metadata dtype {allow_list.short_repr(name, 60)} is not a torch dtype"
        )
    return dtype


def _local(value: Any) -> tuple[Any, tuple[int, ...] | None]:
    """A DTensor's local shard and its global shape; anything else as is, with no shape."""
    if not (isinstance(value, allow_list.WrapperTensor) and value.qualname == sharded.DTENSOR):
        return value, None
    state = value.state
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        state = {**(state[0] or {}), **state[1]}  # (dict, slots): DTensor keeps slots
    local = state.get("_local_tensor") if isinstance(state, dict) else None
    return local, value.shape


def _assembled(
    name: str, groups: list, shards: dict[int, Any], dtype: np.dtype, where: str
) -> np.ndarray:
    """The global tensor of ``name`` from every rank's shard (a replicated one: the first),
    each shard's shape checked against its placement, the boxes tiling the whole (their dtypes
    were checked by ``_refs``)."""
    shape: tuple[int, ...] = ()
    pieces: dict[tuple, sharded.Piece] = {}
    for meta, ranks in groups:
        for rank in ranks:
            shape, offset, local = _shard_box(meta, rank, f"{where}: {name!r}")
            value = shards.get(rank)
            array, global_shape = _local(value)
            if not isinstance(array, np.ndarray) or array.shape != local:
                found = list(array.shape) if isinstance(array, np.ndarray) else type(value).__name__
                raise SourceError(
                    f"{where}: {name!r} on rank {rank} is {found}, its placement says {list(local)}"
                )
            if global_shape is not None and global_shape != shape:
                raise SourceError(
                    f"{where}: {name!r} on rank {rank} is a shard of {list(global_shape)}, "
                    f"the metadata says {list(shape)}"
                )
            pieces.setdefault((offset, local), sharded.Piece(offset, array))  # replicas: once
    problem = sharded.covers(shape, list(pieces.values())) if pieces else "no shard"
    if problem:
        raise SourceError(f"{where}: the ranks' shards of {name!r} do not tile it ({problem})")
    return sharded.assemble(shape, dtype, list(pieces.values()))


def _same_dtype(
    name: str, rank: int, value: Any, array: np.ndarray, dtype: np.dtype, where: str
) -> None:
    """The dtype ``metadata.pkl`` records, the DTensor's own and its shard's storage type agree:
    a renamed storage class (``FloatStorage`` -> ``IntStorage``) would read other values.

    Args:
        name: the entry, for the error.
        rank: whose file it is.
        value: what the rank's file holds (a DTensor, or a plain tensor).
        array: its local tensor.
        dtype: the metadata's dtype.
        where: the checkpoint folder.
    """
    found = {"its storage": np.dtype(array.dtype).name}
    if isinstance(value, allow_list.WrapperTensor):
        found["the DTensor"] = np.dtype(value.dtype).name
    wrong = {k: v for k, v in found.items() if v != dtype.name}
    if wrong:
        said = ", ".join(f"{k} says {v}" for k, v in wrong.items())
        raise SourceError(
            f"{where}: {name!r} in rank {rank}'s file ({name.split(':')[0]}_{rank}.pt): "
            f"{METADATA_FILE} records {dtype.name}, {said}"
        )


def _leaf(state: Any, nested: tuple) -> Any:
    for part in nested:
        if (isinstance(state, dict) and part in state) or (
            isinstance(state, (list, tuple)) and isinstance(part, int) and part < len(state)
        ):
            state = state[part]
        else:
            return None
    return state


def detect(storage: Storage) -> Detection:
    """Whether ``src`` is a torch_checkpointing folder, from its file names."""
    if is_torch_checkpointing(storage):
        return Detection(True, "a torch_checkpointing checkpoint (metadata.pkl, <item>_<rank>.pt)")
    return Detection(False, "no torch_checkpointing `metadata.pkl` + `<item>_<rank>.pt`")


def plan_torch_checkpointing(storage: Storage, options: TorchOptions) -> ImportPlan:
    """The import of a torch_checkpointing folder: the ``model`` item's parameters and the
    ``optimizer`` item's state, assembled from every rank's shards, bit for bit.

    Args:
        storage: the checkpoint folder (``metadata.pkl``, ``<item>_<rank>.pt``).
        options: ``spec`` refused (torch's parameter names are kept), ``weights_only``: the
            model weights alone, the optimizer state in ``source.skipped``; an optimizer keyed
            by name takes no ``parameter_order`` / ``model_config``.
    """
    src = storage.root
    if options.parameter_order is not None or options.model_config is not None:
        raise RequestError(
            f"{src}: a torch_checkpointing checkpoint keys its optimizer by name; "
            f"parameter_order= / model_config= do not apply"
        )
    refuse_spec(
        options.spec, "torch_checkpointing imports keep torch's parameter names", SourceError
    )
    items, world = _metadata(storage)
    model_item = next((i for i in MODEL_ITEMS if i in items), None)
    if model_item is None:
        raise SourceError(
            f"{storage.join(METADATA_FILE)}: no {' or '.join(MODEL_ITEMS)!r} item among "
            f"{sorted(items)}"
        )
    optimizer_item = next((i for i in OPTIMIZER_ITEMS if i in items), None)
    files = _rank_files(storage)
    loaded = _load_ranks(storage, items, world, files)
    params, states, found, optimizer_sources, skipped = _refs(
        src, items, world, loaded, model_item, optimizer_item
    )
    # the optimizer's param_groups (rank 0's: every rank saves them whole), a Python-number
    # step, and any tensor the metadata did not list (skipped)
    saved = loaded[optimizer_item][0] if optimizer_item is not None else None
    if not isinstance(saved, dict):
        saved = {}
    for name in tensor_names(saved):
        if (entry := f"{optimizer_item}:{name}") not in found:
            found.append(entry)
            skipped[entry] = "optimizer entry outside the global metadata"
    for param, per in (saved.get("state") or {}).items():
        step = per.get("step") if isinstance(per, dict) else None
        if isinstance(step, (int, float)) and not isinstance(step, bool):
            where = {"format": "torch_checkpointing", "files": [f"{optimizer_item}_0.pt"]}
            entry = f"{optimizer_item}:state.{param}.step"
            states.setdefault(str(param), {})["step"] = scalar_ref(entry, step, where)
    groups_out = list(saved.get("param_groups") or [])
    recorded = _unmapped_items(storage, items, files, found, skipped)
    torch_state = TorchState(params, states, groups_out, skipped, src, found, optimizer_sources)
    source = {
        "framework": "torch_checkpointing",
        "path": storage.absolute(),
        "world_size": world,
        "items": sorted(set(items) | {f.rsplit("_", 1)[0] for f in files}),
        "files": files + [METADATA_FILE],
    }
    if recorded:
        source["recorded"] = recorded
    return plan_state(torch_state, source, options)


def _rank_files(storage: Storage) -> list[str]:
    """The ``<item>_<rank>.pt`` files of ``src``, refusing two names for one item's rank
    (``model_1.pt``, ``model_01.pt``): the import reads one by its name, the other would be
    left out unsaid."""
    found = [
        ((m.group(1), int(m.group(2))), n)
        for n in storage.names()
        if (m := _RANK_FILE.fullmatch(n))
    ]
    return sorted(numbered_names(found, storage.root, "(item, rank)").values())


def _load_ranks(storage: Storage, items: dict, world: int, files: list[str]) -> dict:
    """{item: {rank: its state}}: every item's file of every rank, or refused naming the one
    missing (a tensor could not be assembled without it)."""
    loaded: dict[str, dict[int, Any]] = {}
    for item in items:
        for rank in range(world):
            name = f"{item}_{rank}.pt"
            if name not in files:
                where = storage.root
                raise SourceError(f"{where}: {name} is missing (world size {world}, item {item!r})")
            loaded.setdefault(item, {})[rank] = _load(storage, name)
    return loaded


def _refs(
    src: str,
    items: dict,
    world: int,
    loaded: dict[str, dict[int, Any]],
    model_item: str,
    optimizer_item: str | None,
) -> tuple[dict[str, TensorRef], dict[str, dict[str, TensorRef]], list[str], list[str], dict]:
    """(parameters, optimizer states, every entry found, the optimizer's, skipped): one lazy
    reference per metadata entry, assembled from the ranks' shards when read."""
    found: list[str] = []
    skipped: dict[str, str] = {}
    params: dict[str, TensorRef] = {}
    states: dict[str, dict[str, TensorRef]] = {}
    optimizer_sources: list[str] = []
    for item, table in items.items():
        for nested, groups in table.items():
            entry = f"{item}:{'.'.join(map(str, nested))}"
            found.append(entry)
            shards = {r: _leaf(loaded[item][r], nested) for r in range(world)}
            first = next(iter(shards.values()))
            local = _local(first)[0]
            if not isinstance(local, np.ndarray):
                raise SourceError(f"{src}: {entry} is not a tensor in {item}_0.pt")
            shape = _shard_box(groups[0][0], groups[0][1][0], f"{src}: {entry}")[0]
            dtype = _metadata_dtype(groups[0][0], f"{src}: {entry}")
            for rank, value in shards.items():  # checked before anything is written
                if isinstance(array := _local(value)[0], np.ndarray):  # else: _assembled says
                    _same_dtype(entry, rank, value, array, dtype, src)
            ref = TensorRef(
                entry,
                shape,
                dtype,
                lambda n=entry, g=groups, s=shards, d=dtype: _assembled(n, g, s, d, src),
                {
                    "format": "torch_checkpointing",
                    "files": [f"{item}_{r}.pt" for r in range(world)],
                },
            )
            if item == model_item:
                params[".".join(map(str, nested))] = ref
            elif item == optimizer_item and len(nested) == 3 and nested[0] == "state":
                states.setdefault(str(nested[1]), {})[str(nested[2])] = ref
                optimizer_sources.append(entry)
            else:
                skipped[entry] = f"item {item!r}: not a model weight or optimizer state"
    return params, states, found, optimizer_sources, skipped


def _load(storage: Storage, name: str) -> Any:
    """Rank file ``name`` of ``storage`` (a link out of the folder refused)."""
    try:
        return torch_zip.load_torch_file((storage, name), allow_list.SHARDED_TENSOR_CLASSES)
    except allow_list.TorchFileError:
        storage.exists(name)  # a link out of the folder: refused as such (UnsafeFileError)
        raise


def _unmapped_items(
    storage: Storage, items: dict, files: list[str], found: list[str], skipped: dict[str, str]
) -> dict[str, Any]:
    """The items saved without global metadata (``train_state``, ...): their numbers recorded,
    their tensors skipped."""
    recorded: dict[str, Any] = {}
    for item in sorted({f.rsplit("_", 1)[0] for f in files} - set(items)):
        state = _load(storage, f"{item}_0.pt")
        for name in tensor_names(state):
            entry = f"{item}:{name}"
            found.append(entry)
            skipped[entry] = f"item {item!r} (no global metadata): training state, not imported"
        if isinstance(state, dict):
            recorded[item] = {k: v for k, v in state.items() if isinstance(v, (int, float, str))}
    return recorded
