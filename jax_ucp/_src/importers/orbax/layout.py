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
from jax_ucp._src.store.storage.local import ORBAX_TMP_MARK

CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"  # Orbax's step metadata (item handlers)
_NAME_MAX = 255  # bytes of one file name (Linux, macOS): an item directory's name fits
PYTREE_METADATA = "_METADATA"  # a PyTree item's tree metadata
STRINGS_FILE = "_strings.json"  # Orbax's StringHandler: every str leaf of an item
_MAX_JSON_BYTES = 256 << 20
_STEP = re.compile(r"(?:.*_)?([0-9]+)")
# Orbax's handlers whose items are PyTrees of arrays (v0 and v1 names).
_PYTREE_HANDLERS = ("StandardCheckpointHandler", "PyTreeCheckpointHandler", "PyTreeHandler")


def is_orbax(src) -> bool:
    """An Orbax item (``_METADATA``), step (``_CHECKPOINT_METADATA``) or a manager root whose
    step directories hold one; from file names only."""
    src = os.fspath(src)
    if not os.path.isdir(src):
        return False
    if any(os.path.isfile(os.path.join(src, n)) for n in (PYTREE_METADATA, CHECKPOINT_METADATA)):
        return not os.path.isfile(os.path.join(src, MANIFEST_FILE))
    return bool(_steps(src))


def _steps(root: str) -> dict[int, str]:
    """Committed steps of a manager root: step number -> directory (temporaries excluded; 5
    and 0005: refused, not one taken)."""
    named = runs.numbered_steps(root, _STEP.pattern, _committed)
    return {step: os.path.join(root, name) for step, name in named.items()}


def _committed(path: str) -> bool:
    return ORBAX_TMP_MARK not in os.path.basename(path) and os.path.isfile(
        os.path.join(path, CHECKPOINT_METADATA)
    )


def read_json(path: str) -> Any:
    """An Orbax JSON record read within a size bound; unreadable is an error naming it."""
    try:
        return files.strict_loads(files.read_regular(files.in_own_folder(path), _MAX_JSON_BYTES))
    except (OSError, ValueError, RecursionError) as e:
        raise SourceError(f"{path}: not a readable Orbax JSON file ({e})") from None


def resolve(src, tag: int | str | None = None) -> tuple[str, int | None, dict[str, str], dict]:
    """(step directory, step, {item name: item directory} of its PyTree items, {item name:
    why it is not imported}). A single item has the name ``""``."""
    src = os.path.abspath(os.fspath(src))
    if os.path.isfile(os.path.join(src, PYTREE_METADATA)):
        if tag is not None:
            raise SourceError(f"{src}: a single Orbax checkpoint has no steps (tag={tag!r})")
        return src, None, {"": src}, {}
    src, step = _step_dir(src, tag)
    handlers = _item_handlers(src)
    items, others = _split_items(src, handlers)
    if not items:
        raise SourceError(
            f"{src}: no PyTree item (StandardCheckpointHandler / PyTreeCheckpointHandler with "
            f"{PYTREE_METADATA}) among its items {sorted(handlers)}"
        )
    return src, step, items, others


def _step_dir(src: str, tag: int | str | None) -> tuple[str, int | None]:
    """(step directory, step) of ``src``: a manager root's ``tag`` step (default: the latest
    committed one), or ``src`` itself when it is one step (its number when its name is one)."""
    if os.path.isfile(os.path.join(src, CHECKPOINT_METADATA)):
        if tag is not None:
            raise SourceError(f"{src}: already one step; tag={tag!r} does not apply")
        m = _STEP.fullmatch(os.path.basename(src))
        return src, int(m.group(1)) if m else None
    steps = _steps(src) if os.path.isdir(src) else {}
    if not steps:
        raise SourceError(
            f"{src}: no Orbax checkpoint here (no {PYTREE_METADATA}, no "
            f"{CHECKPOINT_METADATA}, no committed step directories)"
        )
    if tag is None:
        step = max(steps)
    else:  # a step number or its ASCII digits (int() would take "١" and " 5")
        step = tag if type(tag) is int else files.name_number(tag) if isinstance(tag, str) else None
    if step not in steps:
        raise SourceError(f"{src}: no committed step {tag!r}; steps found: {sorted(steps)}")
    inside(src, os.path.basename(steps[step]), f"{src}: step directory")
    return steps[step], step


def _item_handlers(src: str) -> dict:
    """{item name: handler type name or None} of a step, from its checkpoint metadata (or its
    subdirectories when an older Orbax recorded none)."""
    meta = read_json(os.path.join(src, CHECKPOINT_METADATA))
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
            raise SourceError(
                f"{src}/{CHECKPOINT_METADATA}: item name {str(name)[:100]!r} is not a directory "
                f"name inside the step; refusing to read outside it"
            )
        if len(name.encode("utf-8", "surrogatepass")) > _NAME_MAX:
            raise SourceError(
                f"{src}/{CHECKPOINT_METADATA}: item name of {len(name)} characters "
                f"({name[:40]!r}...) is longer than a file name can be ({_NAME_MAX} bytes): not "
                f"an item Orbax wrote; the metadata is damaged"
            )
        if name:
            inside(src, name, f"{src}/{CHECKPOINT_METADATA}: item {name[:100]!r}")
        path = os.path.join(src, name) if name else src
        if os.path.isfile(os.path.join(path, MANIFEST_FILE)) or "jax_ucp" in str(typestr or ""):
            raise SourceError(
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


def check_links(root: str, item: str) -> None:
    """Every symlink under the item directory (array folders, zarr chunk files, OCDBT data and
    manifest files, which TensorStore opens itself) resolves inside the checkpoint ``root``, and
    nothing there is a FIFO, a socket or a device (TensorStore's read of a FIFO blocks)."""
    folders = [item]
    while folders:
        with os.scandir(folders.pop()) as entries:
            for entry in entries:  # the entry's type comes with the listing: no stat each
                if entry.is_symlink():
                    inside(root, os.path.relpath(entry.path, root), f"{item}: file")
                elif entry.is_dir():
                    folders.append(entry.path)
                    continue
                if not (entry.is_file() or entry.is_dir()) and os.path.exists(entry.path):
                    try:
                        files.check_regular(entry.path)
                    except files.UnsafeFileError as e:
                        raise SourceError(str(e)) from None


def check_names(item: str) -> None:
    """Every array name of the item's ``_METADATA`` (its key path joined by ".", as Orbax joins
    it into the array's directory or OCDBT key) stays inside the item: an absolute name, a
    ``..`` part or a NUL is refused before Orbax or TensorStore opens anything."""
    where = os.path.join(item, PYTREE_METADATA)
    meta = read_json(where)
    tree = meta.get("tree_metadata") if isinstance(meta, dict) else None
    for entry in tree.values() if isinstance(tree, dict) else ():
        keys = entry.get("key_metadata") if isinstance(entry, dict) else None
        if isinstance(keys, list) and all(isinstance(k, dict) and "key" in k for k in keys):
            name = ".".join(str(k["key"]) for k in keys)
            inside(item, name, f"{where}: array {name[:100]!r}")
