"""Where an Orbax checkpoint's items lie: a PyTree item, a ``CheckpointManager`` step or a
manager root (its latest committed step), from file names and Orbax's small JSON records; every
name a record gives (item, array, step directory, symlink) checked to stay inside the checkpoint
before Orbax or TensorStore opens anything."""

from __future__ import annotations

import os
import re
from typing import Any

from jax_ucp._src.errors import SourceError
from jax_ucp._src.format import MANIFEST_FILE, files
from jax_ucp._src.importers import runs
from jax_ucp._src.store.storage import Storage
from jax_ucp._src.store.storage.local import ORBAX_TMP_MARK

CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"  # Orbax's step metadata (item handlers)
_NAME_MAX = 255  # bytes of one file name (Linux, macOS): an item directory's name fits
PYTREE_METADATA = "_METADATA"  # a PyTree item's tree metadata
OCDBT_MANIFEST = "manifest.ocdbt"  # an OCDBT item's database manifest
STRINGS_FILE = "_strings.json"  # Orbax's StringHandler: every str leaf of an item
_MAX_JSON_BYTES = 256 << 20
_STEP = re.compile(r"(?:.*_)?([0-9]+)")
# Orbax's handlers whose items are PyTrees of arrays (v0 and v1 names).
_PYTREE_HANDLERS = ("StandardCheckpointHandler", "PyTreeCheckpointHandler", "PyTreeHandler")


def is_orbax(src: Storage) -> bool:
    """An Orbax item (``_METADATA``), step (``_CHECKPOINT_METADATA``) or a manager root whose
    step directories hold one; from file names only."""
    if any(is_file(src, n) for n in (PYTREE_METADATA, CHECKPOINT_METADATA)):
        return not is_file(src, MANIFEST_FILE)
    # a step folder linked out of the root is no evidence (its files are not looked at)
    return any(_committed(src, name, linked=False) for name in _steps(src).values())


def is_file(folder: Storage, name: str) -> bool:
    """Whether ``name`` is listed in ``folder`` and holds nothing (a file, not a folder)."""
    try:
        return name in folder.names() and not is_folder(folder, name)
    except OSError:  # not a folder
        return False


def is_folder(folder: Storage, name: str) -> bool:
    try:
        return bool(folder.folder(name).names())
    except OSError:  # a file, a link leaving it
        return False


def _steps(root: Storage) -> dict[int, str]:
    """Committed steps of a manager root: step number -> folder name (temporaries excluded; 5
    and 0005: refused, not one taken)."""
    try:
        names = sorted({n.split("/", 1)[0] for n in root.names()})
    except OSError:
        return {}
    found = [(int(m[1]), n) for n in names if (m := _STEP.fullmatch(n)) and _committed(root, n)]
    return files.numbered_names(found, root.root, "step")


def _committed(root: Storage, name: str, linked: bool = True) -> bool:
    try:
        return ORBAX_TMP_MARK not in name and is_file(root.folder(name), CHECKPOINT_METADATA)
    except files.UnsafeFileError:  # a link leaving the root: refused where it is read
        return linked


def orbax_run(root: Storage) -> runs.TrainerRun | None:
    """A CheckpointManager root's committed steps (``Importer.run``), None when it has none."""
    steps = _steps(root) if not is_file(root, CHECKPOINT_METADATA) else {}
    return runs.trainer_run(root, "an Orbax CheckpointManager root", steps, lambda _: None)


def read_json(folder: Storage, name: str) -> Any:
    """An Orbax JSON record read within a size bound; unreadable is an error naming it."""
    try:
        raw = folder.read(name, _MAX_JSON_BYTES)
        if raw is None:
            raise FileNotFoundError(f"no such file: {name}")
        return files.strict_loads(raw)
    except (OSError, ValueError, RecursionError) as e:
        raise SourceError(f"{folder.join(name)}: not a readable Orbax JSON file ({e})") from None


def resolve(src: Storage, tag: int | str | None = None) -> tuple[Storage, int | None, dict, dict]:
    """(step directory, step, {item name: item directory} of its PyTree items, {item name:
    why it is not imported}). A single item has the name ``""``."""
    src = src.at(src.absolute())
    if is_file(src, PYTREE_METADATA):
        if tag is not None:
            raise SourceError(f"{src.root}: a single Orbax checkpoint has no steps (tag={tag!r})")
        return src, None, {"": src}, {}
    src, step = _step_dir(src, tag)
    handlers = _item_handlers(src)
    items, others = _split_items(src, handlers)
    if not items:
        raise SourceError(
            f"{src.root}: no PyTree item (StandardCheckpointHandler / PyTreeCheckpointHandler "
            f"with {PYTREE_METADATA}) among its items {sorted(handlers)}"
        )
    return src, step, items, others


def _step_dir(src: Storage, tag: int | str | None) -> tuple[Storage, int | None]:
    """(step directory, step) of ``src``: a manager root's ``tag`` step (default: the latest
    committed one), or ``src`` itself when it is one step (its number when its name is one)."""
    if is_file(src, CHECKPOINT_METADATA):
        if tag is not None:
            raise SourceError(f"{src.root}: already one step; tag={tag!r} does not apply")
        m = _STEP.fullmatch(src.root.rstrip("/").rpartition("/")[2])
        return src, int(m.group(1)) if m else None
    steps = _steps(src)
    if not steps:
        raise SourceError(
            f"{src.root}: no Orbax checkpoint here (no {PYTREE_METADATA}, no "
            f"{CHECKPOINT_METADATA}, no committed step directories)"
        )
    if tag is None:
        step = max(steps)
    else:  # a step number or its ASCII digits (int() would take "١" and " 5")
        step = tag if type(tag) is int else files.name_number(tag) if isinstance(tag, str) else None
    if step not in steps:
        raise SourceError(f"{src.root}: no committed step {tag!r}; steps found: {sorted(steps)}")
    return folder(src, steps[step], f"{src.root}: step directory"), step


def _item_handlers(src: Storage) -> dict:
    """{item name: handler type name or None} of a step, from its checkpoint metadata (or its
    subdirectories when an older Orbax recorded none)."""
    meta = read_json(src, CHECKPOINT_METADATA)
    handlers = meta.get("item_handlers") if isinstance(meta, dict) else None
    if isinstance(handlers, str):  # one unnamed item saved into the step directory itself
        handlers = {"": handlers}
    if not isinstance(handlers, dict):  # older Orbax: no record; the subdirectories tell
        names = sorted({n.split("/", 1)[0] for n in src.names()})
        handlers = {n: None for n in names if is_folder(src, n)}
    return handlers


def _split_items(src: Storage, handlers: dict) -> tuple[dict[str, Storage], dict[str, str]]:
    """({name: directory} of the PyTree items, {name: why not imported} of the others); an item
    name that leaves the step, or an item that is already a jax_ucp checkpoint, is refused."""
    items, others = {}, {}
    where = src.join(CHECKPOINT_METADATA)
    for name, typestr in sorted(handlers.items()):
        if not isinstance(name, str) or name in (".", "..") or os.path.basename(name) != name:
            raise SourceError(
                f"{where}: item name {str(name)[:100]!r} is not a directory "
                f"name inside the step; refusing to read outside it"
            )
        if len(name.encode("utf-8", "surrogatepass")) > _NAME_MAX:
            raise SourceError(
                f"{where}: item name of {len(name)} characters "
                f"({name[:40]!r}...) is longer than a file name can be ({_NAME_MAX} bytes): not "
                f"an item Orbax wrote; the metadata is damaged"
            )
        path = folder(src, name, f"{where}: item {name[:100]!r}") if name else src
        if is_file(path, MANIFEST_FILE) or "jax_ucp" in str(typestr or ""):
            raise SourceError(
                f"{path.root}: item {name!r} is already a jax_ucp checkpoint (ucp.json); restore "
                f"it with jax_ucp.restore({path.root!r}) instead of converting it"
            )
        is_tree = typestr is None or str(typestr).rsplit(".", 1)[-1] in _PYTREE_HANDLERS
        if is_tree and is_file(path, PYTREE_METADATA):
            items[name] = path
        elif not name or is_folder(src, name) or is_file(src, name):
            others[name] = (
                f"an Orbax {str(typestr).rsplit('.', 1)[-1]} item, not a PyTree of arrays"
            )
    return items, others


def folder(root: Storage, name: Any, what: str) -> Storage:
    """Folder ``name`` of ``root`` (:func:`inside` it)."""
    inside(root.root, name, what)
    try:
        return root.folder(name)
    except files.UnsafeFileError as e:
        raise SourceError(str(e)) from None


def inside(root: str, name: Any, what: str) -> str:
    """``root``/``name``, refused unless it stays inside ``root``; a name the file system
    cannot look up (too long) is an error naming ``what``, not a raw OSError.

    Args:
        root: the folder the path must stay in.
        name: the name read from a file (untrusted).
        what: what is looked up, for the error.
    """
    try:
        return files.inside(root, name, what)
    except files.UnsafeFileError as e:
        raise SourceError(str(e)) from None
    except OSError as e:
        raise SourceError(
            f"{what}: not a file name this file system can look up under {root} "
            f"({os.strerror(e.errno) if e.errno else e}; {len(str(name))} characters)"
        ) from None


def check_links(root: Storage, item: Storage) -> None:
    """Every symlink under the item directory (array folders, zarr chunk files, OCDBT data and
    manifest files, which TensorStore opens itself) resolves inside the checkpoint ``root``, and
    nothing there is a FIFO, a socket or a device (TensorStore's read of a FIFO blocks)."""
    try:
        item.inside(".", item.root)
    except NotImplementedError:  # an object store: no links, no FIFOs
        return
    folders = [item.root]
    while folders:
        with os.scandir(folders.pop()) as entries:
            for entry in entries:  # the entry's type comes with the listing: no stat each
                if entry.is_symlink():
                    inside(root.root, os.path.relpath(entry.path, root.root), f"{item.root}: file")
                elif entry.is_dir():
                    folders.append(entry.path)
                    continue
                if not (entry.is_file() or entry.is_dir()) and os.path.exists(entry.path):
                    try:
                        files.check_regular(entry.path)
                    except files.UnsafeFileError as e:
                        raise SourceError(str(e)) from None


def check_names(item: Storage) -> None:
    """Every array name of the item's ``_METADATA`` (its key path joined by ".", as Orbax joins
    it into the array's directory or OCDBT key) stays inside the item: an absolute name, a
    ``..`` part or a NUL is refused before Orbax or TensorStore opens anything."""
    where = item.join(PYTREE_METADATA)
    meta = read_json(item, PYTREE_METADATA)
    tree = meta.get("tree_metadata") if isinstance(meta, dict) else None
    for entry in tree.values() if isinstance(tree, dict) else ():
        keys = entry.get("key_metadata") if isinstance(entry, dict) else None
        if isinstance(keys, list) and all(isinstance(k, dict) and "key" in k for k in keys):
            name = ".".join(str(k["key"]) for k in keys)
            inside(item.root, name, f"{where}: array {name[:100]!r}")
