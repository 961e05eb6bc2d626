"""Orbax checkpoints in: a ``StandardCheckpointer`` / ``PyTreeCheckpointer`` directory, a
``CheckpointManager`` step, or a manager root (its latest committed step), OCDBT or not.

The tree and each array's name, shape and dtype come from Orbax's own public metadata
(``PyTreeCheckpointHandler().metadata``); each array is opened with the TensorStore spec Orbax
itself reads it with (``ocp.type_handlers.get_json_tspec_read``), its chunks checked against its
shape before any is decoded, and handed to the writer unread (a ``writer.Deferred``; Orbax's
default zstd chunks are decoded as a stream into the rows written, ``zstd_rows``, other layouts
read by TensorStore reserve the array and the chunks it decodes at once, as many as the memory
budget leaves room for):
the writer reads one array at a time, so memory is bounded by the largest array, never the whole
tree.

Orbax and JAX are imported only when an import is planned: detection (``detect``) reads
file names and one small JSON file.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

from jax_ucp import writer
from jax_ucp.errors import SourceError, is_tensorstore_io_error, tensorstore_message
from jax_ucp.format import MANIFEST_FILE, SavedSharding, UCPError, files, role_of
from jax_ucp.importers.orbax import zstd_rows
from jax_ucp.importers.plan import (
    WHOLE,
    Detection,
    ImportOptions,
    ImportPlan,
    Share,
    refuse_spec,
    skip,
)
from jax_ucp.writer.commit import ORBAX_TMP_MARK

__all__ = ["OrbaxImportError", "OrbaxOptions", "detect", "plan", "plan_orbax"]

CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"  # Orbax's step metadata (item handlers)
_NAME_MAX = 255  # bytes of one file name (Linux, macOS): an item directory's name fits
PYTREE_METADATA = "_METADATA"  # a PyTree item's tree metadata
STRINGS_FILE = "_strings.json"  # Orbax's StringHandler: every str leaf of an item
_MAX_JSON_BYTES = 256 << 20
_STEP = re.compile(r"(?:.*_)?(\d+)")
# Orbax's handlers whose items are PyTrees of arrays (v0 and v1 names).
_PYTREE_HANDLERS = ("StandardCheckpointHandler", "PyTreeCheckpointHandler", "PyTreeHandler")
# the array a TensorStore error names: ``Error reading "params.w/.zarray"``
_ARRAY_IN_MESSAGE = re.compile(r'"([^"]+?)/(?:\.zarray|zarr\.json|\d+(?:[./]\d+)*)"')


OrbaxImportError = SourceError  # an Orbax checkpoint that cannot be imported as it is


def _is_orbax(src) -> bool:
    """An Orbax item (``_METADATA``), step (``_CHECKPOINT_METADATA``) or a manager root whose
    step directories hold one; from file names only."""
    src = os.fspath(src)
    if not os.path.isdir(src):
        return False
    if any(os.path.isfile(os.path.join(src, n)) for n in (PYTREE_METADATA, CHECKPOINT_METADATA)):
        return not os.path.isfile(os.path.join(src, MANIFEST_FILE))
    return bool(_steps(src))


def _steps(root: str) -> dict[int, str]:
    """Committed steps of a manager root: step number -> directory (temporaries excluded)."""
    out: dict[int, str] = {}
    for name in os.listdir(root):
        m = _STEP.fullmatch(name)
        path = os.path.join(root, name)
        if (
            m
            and ORBAX_TMP_MARK not in name
            and os.path.isfile(os.path.join(path, CHECKPOINT_METADATA))
        ):
            out.setdefault(int(m.group(1)), path)
    return out


def _read_json(path: str) -> Any:
    try:
        return json.loads(files.read_regular(path, _MAX_JSON_BYTES))
    except (OSError, ValueError, RecursionError) as e:
        raise OrbaxImportError(f"{path}: not a readable Orbax JSON file ({e})") from None


def _resolve(src, tag: int | str | None = None) -> tuple[str, int | None, dict[str, str], dict]:
    """(step directory, step, {item name: item directory} of its PyTree items, {item name:
    why it is not imported}). A single item has the name ``""``."""
    src = os.path.abspath(os.fspath(src))
    if os.path.isfile(os.path.join(src, PYTREE_METADATA)):
        if tag is not None:
            raise OrbaxImportError(f"{src}: a single Orbax checkpoint has no steps (tag={tag!r})")
        return src, None, {"": src}, {}
    src, step = _step_dir(src, tag)
    handlers = _item_handlers(src)
    items, others = _split_items(src, handlers)
    if not items:
        raise OrbaxImportError(
            f"{src}: no PyTree item (StandardCheckpointHandler / PyTreeCheckpointHandler with "
            f"{PYTREE_METADATA}) among its items {sorted(handlers)}"
        )
    return src, step, items, others


def _step_dir(src: str, tag: int | str | None) -> tuple[str, int | None]:
    """(step directory, step) of ``src``: a manager root's ``tag`` step (default: the latest
    committed one), or ``src`` itself when it is one step (its number when its name is one)."""
    if os.path.isfile(os.path.join(src, CHECKPOINT_METADATA)):
        if tag is not None:
            raise OrbaxImportError(f"{src}: already one step; tag={tag!r} does not apply")
        m = _STEP.fullmatch(os.path.basename(src))
        return src, int(m.group(1)) if m else None
    steps = _steps(src) if os.path.isdir(src) else {}
    if not steps:
        raise OrbaxImportError(
            f"{src}: no Orbax checkpoint here (no {PYTREE_METADATA}, no "
            f"{CHECKPOINT_METADATA}, no committed step directories)"
        )
    try:
        step = max(steps) if tag is None else int(tag)
    except ValueError:
        step = None
    if step not in steps:
        raise OrbaxImportError(f"{src}: no committed step {tag!r}; steps found: {sorted(steps)}")
    _inside(src, os.path.basename(steps[step]), f"{src}: step directory")
    return steps[step], step


def _item_handlers(src: str) -> dict:
    """{item name: handler type name or None} of a step, from its checkpoint metadata (or its
    subdirectories when an older Orbax recorded none)."""
    meta = _read_json(os.path.join(src, CHECKPOINT_METADATA))
    handlers = meta.get("item_handlers") if isinstance(meta, dict) else None
    if isinstance(handlers, str):  # one unnamed item saved into the step directory itself
        handlers = {"": handlers}
    if not isinstance(handlers, dict):  # older Orbax: no record; the subdirectories tell
        handlers = {n: None for n in sorted(os.listdir(src)) if os.path.isdir(os.path.join(src, n))}
    return handlers


def _split_items(src: str, handlers: dict) -> tuple[dict[str, str], dict[str, str]]:
    """({name: directory} of the PyTree items, {name: why not imported} of the others); an item
    name that leaves the step, or an item that is already a jax_ucp checkpoint, is refused."""
    items, others = {}, {}
    for name, typestr in sorted(handlers.items()):
        if not isinstance(name, str) or name in (".", "..") or os.path.basename(name) != name:
            raise OrbaxImportError(
                f"{src}/{CHECKPOINT_METADATA}: item name {str(name)[:100]!r} is not a directory "
                f"name inside the step; refusing to read outside it"
            )
        if len(name.encode("utf-8", "surrogatepass")) > _NAME_MAX:
            raise OrbaxImportError(
                f"{src}/{CHECKPOINT_METADATA}: item name of {len(name)} characters "
                f"({name[:40]!r}...) is longer than a file name can be ({_NAME_MAX} bytes): not "
                f"an item Orbax wrote; the metadata is damaged"
            )
        if name:
            _inside(src, name, f"{src}/{CHECKPOINT_METADATA}: item {name[:100]!r}")
        path = os.path.join(src, name) if name else src
        if os.path.isfile(os.path.join(path, MANIFEST_FILE)) or "jax_ucp" in str(typestr or ""):
            raise OrbaxImportError(
                f"{path}: item {name!r} is already a jax_ucp checkpoint (ucp.json); restore it "
                f"with jax_ucp.restore({path!r}) instead of converting it"
            )
        is_tree = typestr is None or str(typestr).rsplit(".", 1)[-1] in _PYTREE_HANDLERS
        if is_tree and os.path.isfile(os.path.join(path, PYTREE_METADATA)):
            items[name] = path
        elif os.path.exists(path):
            others[name] = (
                f"an Orbax {str(typestr).rsplit('.', 1)[-1]} item, not a PyTree of arrays"
            )
    return items, others


def plan_orbax(
    src,
    *,
    tag: int | str | None = None,
    spec: Any = None,
    weights_only: bool = False,
    share: Share = WHOLE,
) -> ImportPlan:
    """The import of an Orbax checkpoint: every array and scalar of its PyTree items, keyed by
    its tree path (under the item name when a step has several PyTree items).

    Args:
        src: the Orbax checkpoint, step or manager root.
        tag: the step of a manager root (None: the latest committed).
        spec: refused (an Orbax import keeps the saved tree).
        weights_only: only the ``params`` subtree (everything else listed in
            ``source.skipped``).
        share: this process's part of a distributed import (default: the whole).
    """
    refuse_spec(spec, "Orbax imports keep the saved tree", OrbaxImportError)
    import orbax.checkpoint as ocp
    from etils import epath

    step_dir, step, items, others = _resolve(src, tag)
    source: dict[str, Any] = {
        "framework": "orbax",
        "path": step_dir,
        "step": step,
        "items": sorted(items),
        "orbax_version": ocp.__version__,
    }
    found: list[str] = []
    leaves = []  # (output key, key types, source name, item dir, metadata, ocdbt, zarr3)
    for item, path in items.items():
        _check_links(step_dir, path)
        _check_names(path)  # before Orbax's metadata(), which opens every array itself
        md = _tree_metadata(path)
        ocdbt = bool(ocp.type_handlers.is_ocdbt_checkpoint(epath.Path(path)))
        zarr3 = bool(getattr(md, "use_zarr3", False))
        source.setdefault("layout", {})[item] = {"ocdbt": ocdbt, "zarr3": zarr3}
        under = ((item,), ("key",)) if len(items) > 1 else ((), ())
        for key, key_types, leaf in _flatten(md.tree):
            out = (under[0] + key, under[1] + key_types)
            if leaf is None:  # an empty node: a None value, no tensor to account for
                leaves.append((*out, ".".join(key), path, None, ocdbt, zarr3))
                continue
            # the array's directory (or OCDBT key) Orbax's read spec joins from its name
            _inside(path, leaf.name, f"{path}/{PYTREE_METADATA}: array {'.'.join(key)[:100]!r}")
            name = f"{item}/{leaf.name}" if item else leaf.name
            storage = getattr(leaf, "storage", None)  # Orbax's record of the array's chunks
            if (chunk_shape := getattr(storage, "chunk_shape", None)) is not None:
                where = _metadata_file(path, leaf.name, ocdbt, zarr3)
                _check_chunks(where, name, tuple(leaf.shape), [tuple(chunk_shape)])
            found.append(name)
            leaves.append((*out, name, path, leaf, ocdbt, zarr3))
    for item, why in others.items():
        found.append(f"{item}/")
        skip(source, [f"{item}/"], why)
    if weights_only:
        dropped = [lv for lv in leaves if lv[0][:1] != ("params",)]
        tensors = [lv[2] for lv in dropped if lv[4] is not None]  # empty nodes are no tensors
        skip(source, tensors, "weights_only: not under params/")
        leaves = [lv for lv in leaves if lv[0][:1] == ("params",)]
        if not leaves:
            raise OrbaxImportError(f"{step_dir}: weights_only, but no tree has a params/ subtree")
    mine = share.pick(leaves)
    params = sum(1 for lv in mine if lv[0][:1] == ("params",))
    return ImportPlan(_items(mine), source, params, source_tensors=found)


def _tree_metadata(path: str):
    """Orbax's own metadata of an item (its tree, each array's shape, dtype and chunks); a
    missing or damaged file is an error naming the item and the file, not TensorStore's spec."""
    import orbax.checkpoint as ocp
    from etils import epath

    try:
        return ocp.handlers.PyTreeCheckpointHandler().metadata(epath.Path(path))
    except ValueError as e:
        _QuietClosedLoop.install()  # Orbax's loop is closed while TensorStore still completes
        if not is_tensorstore_io_error(e):
            raise
        m = _ARRAY_IN_MESSAGE.search(str(e))
        array = m and m.group(1).removeprefix(os.path.join(path, ""))  # a file's name: relative
        what = f"the metadata of array {array!r}" if m else "Orbax's metadata"
        raise OrbaxImportError(
            f"{path}: cannot read {what} (missing, truncated or corrupt file): "
            f"{tensorstore_message(e)}"
        ) from None


class _QuietClosedLoop:
    """An unraisable-exception hook without one harmless report: when Orbax's metadata read
    fails on a damaged file, Orbax closes its event loop while TensorStore still completes the
    other arrays' futures, whose callbacks then find the loop closed and print a traceback
    after the one clear error. Installed (wrapping the hook before it) only once such a read
    failed; every other report goes to the hook before."""

    def __init__(self, before):
        self.before = before

    @classmethod
    def install(cls) -> None:
        if not isinstance(sys.unraisablehook, cls):
            sys.unraisablehook = cls(sys.unraisablehook)

    def __call__(self, report) -> None:
        e = report.exc_value
        if report.object is None and isinstance(e, RuntimeError):
            if str(e) == "Event loop is closed":
                return
        self.before(report)


def _metadata_file(path: str, name: str, ocdbt: bool, zarr3: bool) -> str:
    """Where an array's zarr metadata lies (inside the OCDBT database, for OCDBT)."""
    meta = f"{name}/{'zarr.json' if zarr3 else '.zarray'}"
    return f"{path} (OCDBT entry {meta})" if ocdbt else os.path.join(path, meta)


def _check_chunks(where: str, name: str, shape: tuple[int, ...], chunks) -> None:
    """Refuses, before anything is read or decoded, an array whose declared chunks (each of
    ``chunks``: the read and the write chunk shape) are larger than the array in any dimension:
    Orbax writes each device's shard as a chunk, never larger than the array, while one chunk of
    2**29 elements declared for 16 floats (a 64 KB zstd file) would decode into 2 GiB."""
    for chunk in chunks:
        if chunk is None:  # TensorStore reports no such chunk (a 0-d array)
            continue
        chunk = tuple(int(c) for c in chunk)
        if len(chunk) != len(shape) or any(c > max(d, 1) for c, d in zip(chunk, shape)):
            raise OrbaxImportError(
                f"{where}: array {name!r} of shape {shape} declares chunks of shape {chunk}, "
                f"larger than the array; an Orbax chunk is at most the array's shape (refused "
                f"before decoding it: the file is damaged or forged)"
            )


def _decoding(shape, itemsize: int, chunk, budget: int) -> tuple[int, int]:
    """(chunks TensorStore may decode at once, the bytes reading the array holds): the array
    itself plus its decoded chunks in flight, as many as fit in ``budget`` beside the array
    (at least one, at most one per CPU)."""
    array = itemsize * math.prod(shape)
    chunk_bytes = itemsize * math.prod(chunk)
    count = math.prod(-(-d // max(c, 1)) for d, c in zip(shape, chunk))
    at_once = max(1, min(count, os.cpu_count() or 1, (budget - array) // max(chunk_bytes, 1)))
    return at_once, array + at_once * chunk_bytes


def _by_rows(shape, itemsize: int, chunk, budget: int) -> bool:
    """Whether an array larger than ``budget`` is read in row slabs (re-chunked by the writer):
    when its saved chunks are small enough for a slab and the chunks decoded beside it to fit
    (one decoded chunk at most a quarter of the budget). An array saved as one chunk larger
    than that (Orbax's default for a single-device array) is read whole: every slab would
    decode the whole chunk again, as costly in memory as the whole read."""
    chunk_bytes = itemsize * math.prod(min(c or d, d) for d, c in zip(shape, chunk))
    return len(shape) >= 1 and 0 < chunk_bytes <= budget // 4


def _inside(root: str, name: Any, what: str) -> str:
    try:
        return files.inside(root, name, what)
    except files.UnsafeFileError as e:
        raise OrbaxImportError(str(e)) from None


def _check_links(root: str, item: str) -> None:
    """Every symlink under the item directory (array folders, zarr chunk files, OCDBT data and
    manifest files, which TensorStore opens itself) resolves inside the checkpoint ``root``."""
    folders = [item]
    while folders:
        with os.scandir(folders.pop()) as entries:
            for entry in entries:  # the entry's type comes with the listing: no stat each
                if entry.is_symlink():
                    _inside(root, os.path.relpath(entry.path, root), f"{item}: file")
                elif entry.is_dir():
                    folders.append(entry.path)


def _check_names(item: str) -> None:
    """Every array name of the item's ``_METADATA`` (its key path joined by ".", as Orbax joins
    it into the array's directory or OCDBT key) stays inside the item: an absolute name, a
    ``..`` part or a NUL is refused before Orbax or TensorStore opens anything."""
    where = os.path.join(item, PYTREE_METADATA)
    meta = _read_json(where)
    tree = meta.get("tree_metadata") if isinstance(meta, dict) else None
    for entry in tree.values() if isinstance(tree, dict) else ():
        keys = entry.get("key_metadata") if isinstance(entry, dict) else None
        if isinstance(keys, list) and all(isinstance(k, dict) and "key" in k for k in keys):
            name = ".".join(str(k["key"]) for k in keys)
            _inside(item, name, f"{where}: array {name[:100]!r}")


def _flatten(tree) -> list[tuple[tuple[str, ...], tuple[str, ...], Any]]:
    """(key, key types, leaf metadata): sequence positions stay "index" components, so a
    restore without a target rebuilds Orbax's lists and tuples as lists (FORMAT.md 5.2)."""
    import jax

    from jax_ucp.format import keypath

    out = []
    # None leaves kept: Orbax's record of an empty node (optax's EmptyState), so a tree exported
    # back to Orbax has the structure an Orbax restore target expects
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]:
        parts = [keypath.component_of(p) for p in path]
        out.append((tuple(n for _, n in parts), tuple(t for t, _ in parts), leaf))
    return out


def _saved_sharding(leaf) -> SavedSharding | None:
    """The NamedSharding Orbax recorded for an array (its mesh axis names and sizes and its
    PartitionSpec), so ``restore(path, mesh=...)`` reuses it as it does a JAX save's; None for
    any other sharding or a record that does not fit the array."""
    meta = getattr(leaf, "sharding", None)
    if meta is None or type(meta).__name__ != "NamedShardingMetadata":
        return None
    try:
        names = tuple(str(n) for n in meta.axis_names)
        sizes = tuple(int(n) for n in meta.shape)
        spec = tuple(
            p if p is None or isinstance(p, str) else tuple(str(n) for n in p)
            for p in meta.partition_spec
        )
    except (TypeError, ValueError):
        return None
    used = [n for p in spec if p is not None for n in ((p,) if isinstance(p, str) else p)]
    if len(names) != len(sizes) or len(spec) > len(leaf.shape) or not set(used) <= set(names):
        return None
    return SavedSharding(mesh_axis_names=names, mesh_shape=sizes, partition_spec=spec)


def _items(leaves) -> Iterator[writer.HostItem]:
    contexts: dict[bool, Any] = {}
    strings: dict[str, dict] = {}
    for key, key_types, name, path, leaf, ocdbt, zarr3 in leaves:
        provenance: dict = {"file": name, "tensors": [name]}
        if leaf is None:
            value, provenance = None, {"values": [f"{name} (an empty node)"]}
        elif type(leaf).__name__ == "StringMetadata":
            if path not in strings:
                strings[path] = _read_json(os.path.join(path, STRINGS_FILE))
            value = strings[path].get(leaf.name) if isinstance(strings[path], dict) else None
            if not isinstance(value, str):
                raise OrbaxImportError(f"{path}/{STRINGS_FILE}: no string for leaf {leaf.name!r}")
        else:
            value = _array(leaf, name, path, ocdbt, zarr3, contexts)
        yield writer.HostItem(
            key,
            value,
            *role_of(key),
            provenance,
            key_types=key_types,
            saved_sharding=_saved_sharding(leaf) if isinstance(value, writer.Deferred) else None,
        )


def _array(leaf, name: str, path: str, ocdbt: bool, zarr3: bool, contexts: dict):
    """An array leaf as a ``writer.Deferred``, read once the writer has room for it (zstd chunks
    decoded as a stream into the rows, else through TensorStore); a scalar leaf as its value."""
    import orbax.checkpoint as ocp
    import tensorstore as ts
    from etils import epath

    kind = type(leaf).__name__
    if kind not in ("ArrayMetadata", "ScalarMetadata"):
        raise OrbaxImportError(
            f"{path}: leaf {leaf.name!r} has Orbax metadata {kind}; jax_ucp imports arrays, "
            f"scalars and strings"
        )
    if ocdbt not in contexts:
        # Orbax's context keeps up to 100 MB of OCDBT data in its cache pool: nothing here
        # is read twice, and the budget leaves no room for it (~50 MiB measured)
        contexts[ocdbt] = ts.Context(
            ts.Context.Spec({"cache_pool#ocdbt": {"total_bytes_limit": 0}}),
            ocp.type_handlers.get_ts_context(use_ocdbt=ocdbt),
        )
    info = ocp.type_handlers.ParamInfo(
        name=leaf.name,
        parent_dir=epath.Path(path),
        is_ocdbt_checkpoint=ocdbt,
        use_zarr3=zarr3,
        ts_context=contexts[ocdbt],
    )
    tspec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=ocdbt)
    where, data = _metadata_file(path, leaf.name, ocdbt, zarr3), _data_files(path, leaf.name, ocdbt)
    array = _open(tspec, contexts[ocdbt], where, name, tuple(leaf.shape))
    if kind == "ScalarMetadata":  # a Python scalar in the saved tree: a manifest value
        return _read(array, data, name).item()
    shape, dtype = tuple(array.shape), array.dtype.numpy_dtype
    streamed = zstd_rows.rows_reader(array, data, name, OrbaxImportError)
    if streamed is not None:  # zstd chunks decoded as a stream, straight into the rows
        return writer.Deferred(
            shape, dtype, functools.partial(streamed, 0, shape[0]), rows=streamed
        )
    chunk = tuple(array.chunk_layout.read_chunk.shape or shape)
    budget = writer.memory_budget()
    at_once, holds = _decoding(shape, dtype.itemsize, chunk, budget)
    if at_once < (os.cpu_count() or 1):  # fewer decoded chunks at once than TensorStore's
        limit = ts.Context.Spec({"data_copy_concurrency": {"limit": at_once}})
        array = _open(tspec, ts.Context(limit, contexts[ocdbt]), where, name, shape)
    read = functools.partial(_read, array, data, name)
    rows = read if _by_rows(shape, dtype.itemsize, chunk, budget) else None
    # read once the writer has room for the array and its decoded chunks
    return writer.Deferred(shape, dtype, read, bound=holds, rows=rows)


def _open(tspec, context, where: str, name: str, shape: tuple[int, ...]):
    """The array opened with Orbax's read spec (its metadata alone is read), its shape and
    chunks checked before any chunk is."""
    import tensorstore as ts

    try:
        array = ts.open(tspec, context=context, open=True, read=True).result()
    except Exception as e:
        raise OrbaxImportError(
            f"{where}: cannot open array {name!r}: {tensorstore_message(e)}"
        ) from None
    if tuple(array.shape) != tuple(shape):
        raise OrbaxImportError(
            f"{where}: array {name!r} has shape {tuple(array.shape)}, its metadata says "
            f"{tuple(shape)}"
        )
    layout = array.chunk_layout
    _check_chunks(where, name, tuple(shape), [layout.read_chunk.shape, layout.write_chunk.shape])
    return array


def _data_files(path: str, name: str, ocdbt: bool) -> str:
    """Where an array's chunks lie: its directory, or the data files of the OCDBT database."""
    if ocdbt:
        return f"{path} (OCDBT data files under d/ and ocdbt.process_*/d/)"
    return os.path.join(path, name)


def _read(array, where: str, name: str, lo: int | None = None, hi: int | None = None):
    """The whole array, or rows ``lo:hi`` of dim 0 alone (decoding only the chunks holding
    them); a missing, truncated or corrupt chunk file is an error naming the array, where its
    chunks lie and the file TensorStore names."""
    import tensorstore as ts

    try:
        if lo is None or hi is None:
            return array.read().result()
        # read into a private mapping unmapped once written (``writer.unpooled_empty``): a slab
        # TensorStore allocates stays resident in glibc's heap after it is freed
        out = writer.unpooled_empty((hi - lo, *array.shape[1:]), array.dtype.numpy_dtype)
        view = array[lo:hi].translate_to[(0,) * array.rank]
        ts.array(out, copy=False, write=True).write(view).result()
        return out
    except ValueError as e:
        rows = "" if lo is None else f"rows {lo}:{hi} of "
        raise OrbaxImportError(
            f"{where}: reading {rows}array {name!r} failed (missing, truncated or corrupt chunk "
            f"data): {tensorstore_message(e)}"
        ) from None


@dataclasses.dataclass(frozen=True)
class OrbaxOptions(ImportOptions):
    """``ImportOptions`` and the step to import.

    Attributes:
        tag: the step of a CheckpointManager directory (None: the latest committed one); a
            string of digits is that step number.
    """

    tag: int | str | None = None

    def __post_init__(self):
        if isinstance(self.tag, str) and self.tag.isdigit():
            object.__setattr__(self, "tag", int(self.tag))


def detect(src: os.PathLike | str) -> Detection:
    """Whether ``src`` is an Orbax checkpoint, step or CheckpointManager directory, from its
    file names."""
    if _is_orbax(src):
        return Detection(True, "Orbax metadata")
    return Detection(False, f"no Orbax `{CHECKPOINT_METADATA}`, `{PYTREE_METADATA}` or steps")


def plan(src: os.PathLike | str, options: OrbaxOptions) -> ImportPlan:
    """:func:`plan_orbax` with its options as one ``OrbaxOptions``."""
    return plan_orbax(src, **vars(options))  # every option is one of its keywords
