"""What a commit may replace, and the one way anything is committed (``transaction``).

``transaction`` commits a save, convert, export or manager step through the medium of its
destination (``store.storage``: a rename locally, ``ucp.json`` last in ``s3://`` / ``gs://``);
this module is the policy: ``force`` replaces only what jax_ucp wrote (a checkpoint, an Orbax step
of them, an earlier export by its ``EXPORT_RECORD``, a killed save's objects), and the old
checkpoint is never deleted first. An Orbax export lets Orbax write and rename (its
``<name>.orbax-checkpoint-tmp-*``) inside the same transaction (``staged=False``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import stat

from jax_ucp._src import format as fmt
from jax_ucp._src import store
from jax_ucp._src.errors import RequestError, SaveConflictError
from jax_ucp._src.store.storage.local import ORBAX_STEP_METADATA
from jax_ucp._src.writer import durable, file_digest

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Replace:
    """The replace policy of one transaction, as the medium asks it (``store.storage.Claim``).

    Args:
        force: replace what is there if jax_ucp wrote it.
        export: the destination is an export (``force`` replaces only an earlier export).
        what: how ``FileExistsError`` names the destination ("step 7").
    """

    force: bool
    export: bool = False
    what: str = "it"

    def directory(self, path: str) -> bool:
        """``check_replaceable``, then an empty directory at ``path`` removed so the new one can
        take its place (``rmdir``: it removes nothing that appeared meanwhile). True when a
        committed directory is to be replaced (swapped out at the commit)."""
        replacing = check_replaceable(path, force=self.force, export=self.export, what=self.what)
        if not replacing and os.path.isdir(path):
            try:
                os.rmdir(path)
                log.info("removed the empty directory %s to save there", path)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise SaveConflictError(
                    f"{path}: was an empty directory and is not anymore ({e.strerror}); nothing "
                    f"was changed."
                ) from None
        return replacing

    def prefix(self, prefix: store.storage.Storage) -> None:
        """Before a save to ``prefix`` (lock held): refuses a committed checkpoint
        there (an object store cannot replace one) and anything a killed jax_ucp save of this
        prefix cannot have left, naming it; deletes such a save's leftovers (its arrays'
        objects and digest reports, nothing else)."""
        # a local save never loads it
        from jax_ucp._src.store.storage.object_store import LOCK_OBJECT

        url = prefix.root
        names = [n for n in prefix.names() if n != LOCK_OBJECT]
        if fmt.MANIFEST_FILE in names:
            if self.force:
                raise RequestError(
                    f"{url}: replacing a committed checkpoint in an object store is not supported "
                    f"(no atomic rename: the old one would be deleted before the new one is "
                    f"whole). Save to a new prefix, e.g. the next step, and delete the old one "
                    f"after."
                )
            raise FileExistsError(
                f"{url} already exists (a committed checkpoint): an object store cannot replace "
                f"one in place. Save to a new prefix (e.g. the next step)."
            )
        foreign = [n for n in names if not _LEFTOVER.fullmatch(n)]
        if foreign:
            raise SaveConflictError(
                f"{url}: holds objects that no jax_ucp save of this prefix wrote "
                f"({_listed(foreign)}); refusing to save here even with force=True (nothing was "
                f"deleted). Choose a new prefix."
            )
        if names:
            log.info("deleting %d objects a killed save of %s left there", len(names), url)
        prefix.delete(names)

    def failed(self, prefix: store.storage.Storage) -> None:
        remove_object_store_leftovers(prefix)


def transaction(
    dest,
    *,
    force: bool,
    kind: str = "save",
    export: bool = False,
    what: str = "it",
    staged: bool = True,
    inner: str | None = None,
):
    """Lock, recover, check ``force``, write, commit: ``with transaction(dest, force=f) as tx:``
    write under ``tx.path``; the block's end commits (or ``tx.commit()`` inside it).

    Args:
        dest: the directory (or ``s3://`` / ``gs://`` prefix) to create or replace.
        force: replace what is there if jax_ucp wrote it (``check_replaceable``); the old one
            stays whole until the new one is committed.
        kind: what is written ("save", "import", "export"), for the log of a failure.
        export: ``dest`` is an export (``force`` replaces only an earlier export).
        what: how ``FileExistsError`` names ``dest`` ("step 7").
        staged: write into a new ``temporary_path`` directory that the transaction makes durable
            and renames (or swaps) into place; False for a writer that commits atomically
            itself (Orbax), which writes ``dest`` or ``dest + REPLACING``.
        inner: staged only: the writer puts the checkpoint in ``tx.path/inner``.

    Returns:
        The ``Transaction``'s context. On any error in the block (or in the commit) what the writer wrote
        is removed (logged on the ``jax_ucp`` logger) and ``dest`` is as it was. Errors on
        entry (``SaveConflictError``, ``FileExistsError``) change nothing.
    """
    storage = store.storage_for(os.fspath(dest).rstrip("/"))
    return storage.transaction(Replace(force, export, what), kind=kind, staged=staged, inner=inner)


# Orbax's own files in what it commits (``orbax.checkpoint``: the v1 API's empty marker)
ORBAX_STEP_FILES = (ORBAX_STEP_METADATA, "commit_success.txt", "orbax.checkpoint")
EXPORT_RECORD = ".jax_ucp_export.json"  # the files an export wrote: force replaces only those
_EXPORT_FORMAT = "jax_ucp export"
_SHOWN = 5  # unexpected entries named in an error


def check_replaceable(
    path: str, *, force: bool = True, export: bool = False, what: str = "it", content: bool = True
) -> bool:
    """Whether writing ``path`` replaces something (True) or creates it (False: ``path`` is
    absent, or an empty directory, which holds nothing to lose; ``Replace.directory`` removes it).

    ``force`` replaces only what jax_ucp wrote: a checkpoint directory (``ucp.json`` and only
    what the format and Orbax put beside it) or an Orbax step directory of such items; with
    ``export``, only an earlier export (every file listed in its ``EXPORT_RECORD``). Anything
    else is refused untouched whatever ``force`` says, the error naming what was found, so the
    advice to pass ``force=True`` is only given where it would work; ``force=False`` refuses
    a replaceable ``path`` too, with that advice. Pure: changes nothing.

    Args:
        path: the destination.
        force: whether replacing is allowed (False: a replaceable ``path`` is refused too).
        export: ``path`` is an export's destination (only an earlier export is replaceable).
        what: how the ``FileExistsError`` names ``path`` ("step 7").
        content: with ``export``, compare each file's content with its recorded digest (one
            read of the export); False: names and sizes only (a quick check before the
            transaction, which checks content under the lock).

    Returns:
        True when something is there to replace, False when ``path`` is new or empty.
    """
    if not os.path.lexists(path):
        return False
    if os.path.islink(path) or not os.path.isdir(path):
        kind = "an export" if export else "a checkpoint"
        raise SaveConflictError(
            f"{path}: already exists and is not {kind} directory (a file or link); refusing to "
            f"replace it even with force=True. Remove it yourself or choose another path."
        )
    names = sorted(os.listdir(path))
    if not names:
        return False
    why = ""
    if export:
        kind, found = "an export written by jax_ucp", export_problems(path, content=content)
    else:
        kind, found = "a jax_ucp checkpoint or an Orbax step of one", checkpoint_problems(path)
        if found and not _regular_file(os.path.join(path, fmt.MANIFEST_FILE)):
            why = _folder_of_checkpoints(path)
    if found:
        raise SaveConflictError(
            f"{path}: already exists and is not {kind} (found {_listed(found)}); refusing to replace it "
            f"even with force=True (nothing was changed).{why} Remove it yourself or choose "
            f"another path."
        )
    if not force:
        raise FileExistsError(
            f"{path} already exists; pass force=True to replace {what} (the old one is kept "
            f"until the new one is committed)."
        )
    return True


def checkpoint_problems(path: str) -> list[str]:
    """What in the directory ``path`` is not part of a checkpoint (docs/FORMAT.md 1.1, 1.2):
    ``ucp.json``, ``arrays/`` of array directories, Orbax's files; or, for an Orbax step (known
    by Orbax's own step metadata, ``orbax_step_items``, never by the shape of its folders), item
    directories that are such checkpoints and that the metadata names. Empty when ``path`` is
    one; directories end in "/"."""
    names = sorted(os.listdir(path))
    if _regular_file(os.path.join(path, fmt.MANIFEST_FILE)):
        found = []
        for n in names:
            full = os.path.join(path, n)
            if n == fmt.MANIFEST_FILE or (n in ORBAX_STEP_FILES and _regular_file(full)):
                continue
            if n == fmt.ARRAYS_DIR and _real_dir(full):
                found += [f"{n}/{a}" for a in _not_arrays(full)]
                continue
            found.append(_shown(path, n))
        return found
    step_items = orbax_step_items(path)
    if step_items is None:  # not an Orbax step: nothing in it is jax_ucp's to replace
        return [_shown(path, n) for n in names] or [f"no {fmt.MANIFEST_FILE}"]
    found, items = [], 0
    for n in names:
        full = os.path.join(path, n)
        if n in ORBAX_STEP_FILES and _regular_file(full):
            continue
        if (
            n in step_items
            and _real_dir(full)
            and _regular_file(os.path.join(full, fmt.MANIFEST_FILE))
        ):
            inner = checkpoint_problems(full)
            found += [f"{n}/{p}" for p in inner]
            items += not inner
            continue
        found.append(_shown(path, n))
    if not items and not found:
        found.append(f"no {fmt.MANIFEST_FILE}")
    return found


def orbax_step_items(path: str) -> frozenset[str] | None:
    """The item names of the Orbax step directory ``path``, from the step metadata Orbax writes
    in every step it commits (``_CHECKPOINT_METADATA``, a JSON object whose ``item_handlers``
    maps each item to its handler: orbax.checkpoint 0.12 ``metadata/checkpoint.py``); None when
    ``path`` holds none (a folder of checkpoints or of steps is no step, whatever its
    sub-folders look like)."""
    meta = os.path.join(path, ORBAX_STEP_METADATA)
    if not _regular_file(meta):
        return None
    try:
        metadata = fmt.files.strict_loads(fmt.files.read_regular(meta, _STEP_METADATA_LIMIT))
    except (OSError, ValueError, RecursionError):
        return None
    handlers = metadata.get("item_handlers") if isinstance(metadata, dict) else None
    if not isinstance(handlers, dict) or not all(isinstance(k, str) for k in handlers):
        return None
    return frozenset(handlers)


_STEP_METADATA_LIMIT = 16 << 20  # Orbax's step metadata: item handlers, metrics, timestamps


def _folder_of_checkpoints(path: str) -> str:
    """Why a directory holding checkpoints (no ``ucp.json`` of its own) is no Orbax step of
    them, for the refusal; "" when it holds none."""
    inside = checkpoints_inside(path)
    step_items = orbax_step_items(path)
    if step_items is not None:
        inside = [d for d in inside if d[:-1] not in step_items]
    if not inside:
        return ""
    held = _listed(inside)
    if step_items is None:
        metadata = (
            f"a {ORBAX_STEP_METADATA} that is not Orbax's step metadata (a JSON object whose "
            f"item_handlers names the items)"
            if _regular_file(os.path.join(path, ORBAX_STEP_METADATA))
            else f"no Orbax step metadata ({ORBAX_STEP_METADATA})"
        )
        return (
            f" It holds {len(inside)} checkpoint{'s' if len(inside) > 1 else ''} ({held}) and "
            f"{metadata}: a folder of checkpoints, not an Orbax step; force replaces one "
            f"checkpoint or one step, never a folder of them."
        )
    return (
        f" Its Orbax step metadata ({ORBAX_STEP_METADATA}) does not name {held} as items of "
        f"the step."
    )


def checkpoints_inside(path: str) -> list[str]:
    """The sub-directories of ``path`` that hold a ``ucp.json`` (for an error to name)."""
    return [
        n + "/"
        for n in sorted(os.listdir(path))
        if _real_dir(os.path.join(path, n))
        and _regular_file(os.path.join(path, n, fmt.MANIFEST_FILE))
    ]


def _not_arrays(arrays: str) -> list[str]:
    """Entries of ``arrays/`` that are not array directories (each holds its ``zarr.json``)."""
    return [
        _shown(arrays, a)
        for a in sorted(os.listdir(arrays))
        if not (
            _real_dir(os.path.join(arrays, a))
            and _regular_file(os.path.join(arrays, a, "zarr.json"))
        )
    ]


@contextlib.contextmanager
def export_record(directory: str):
    """Records what an export writes into its temporary ``directory``: the block's writes (through
    ``durable.durable_file``) are digested as they are written (``file_digest``), then
    ``EXPORT_RECORD`` lists every file with its size and digest, so a later forced export
    replaces the directory only while it holds exactly those files with that content. A file
    written some other way is digested by reading it (logged)."""
    with file_digest.recording(directory) as digests:
        yield
    files = {}
    for rel in _walk(directory):
        digest = digests.get(rel)
        if digest is None:
            log.info("digesting %s by reading it (not written through durable_file)", rel)
            digest = file_digest.digest_file(os.path.join(directory, rel))
        files[rel] = {"size": digest.size, "crc32c": digest.crc32c}
    record = {
        "format": _EXPORT_FORMAT,
        "version": _EXPORT_RECORD_VERSION,
        "digest": file_digest.KIND,
        "files": files,
    }
    durable.write_file(
        os.path.join(directory, EXPORT_RECORD), json.dumps(record, indent=1, sort_keys=True) + "\n"
    )


_EXPORT_RECORD_VERSION = 2  # 1: names and sizes only (no longer enough to replace an export)


def export_problems(path: str, *, content: bool = True) -> list[str]:
    """What in ``path`` is not a file its ``EXPORT_RECORD`` lists with that size and content (a
    file the user added or edited, a link, a device); everything when there is no record, or
    one without content digests (written before they were recorded, or forged from names and
    sizes). ``content=False`` compares names and sizes only (a quick first check, no reads)."""
    try:
        raw = fmt.files.read_regular(os.path.join(path, EXPORT_RECORD), 16 << 20)
        record = fmt.files.strict_loads(raw)
        recorded = record["files"]
        if record.get("format") != _EXPORT_FORMAT or not isinstance(recorded, dict):
            raise ValueError("not an export record")
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        if str(e).startswith("names "):  # format.files.unique_keys: a key named twice
            return [f"{EXPORT_RECORD}, which {e}"]
        names = sorted(os.listdir(path))
        return [f"no {EXPORT_RECORD}: {', '.join(_shown(path, n) for n in names[:_SHOWN])}"]
    if record.get("version") != _EXPORT_RECORD_VERSION or record.get("digest") != file_digest.KIND:
        return [
            f"{EXPORT_RECORD} without content digests (version {record.get('version')!r}; "
            f"written by an older jax_ucp, or not by jax_ucp): its files cannot be told unchanged"
        ]
    found = []
    for rel in _walk(path, problems=found):
        if rel == EXPORT_RECORD:
            continue
        entry = recorded.get(rel)
        if not isinstance(entry, dict) or not isinstance(entry.get("crc32c"), str):
            found.append(rel)
            continue
        full = os.path.join(path, rel)
        if entry.get("size") != os.lstat(full).st_size:
            found.append(f"{rel} (changed since the export: size)")
            continue
        if not content:
            continue
        try:
            now = file_digest.digest_file(full)
        except OSError as e:
            found.append(f"{rel} (unreadable: {e})")
            continue
        if (now.size, now.crc32c) != (entry["size"], entry["crc32c"]):
            found.append(f"{rel} (changed since the export: content)")
    return found


def _walk(top: str, problems: list[str] | None = None):
    """Relative paths of the regular files under ``top``; anything else (links, devices, FIFOs)
    goes to ``problems`` (or is an error when there is no list), never followed."""
    for root, dirs, files in os.walk(top):
        for n in sorted(dirs + files):
            full = os.path.join(root, n)
            rel = os.path.relpath(full, top)
            if _real_dir(full):
                continue
            if _regular_file(full):
                yield rel
            elif problems is not None:
                problems.append(_shown(root, n) if root == top else rel)
            else:
                raise SaveConflictError(f"{full}: not a regular file or directory")
        dirs[:] = [d for d in dirs if _real_dir(os.path.join(root, d))]


def _regular_file(path: str) -> bool:
    return stat.S_ISREG(_lstat_mode(path))


def _real_dir(path: str) -> bool:
    return stat.S_ISDIR(_lstat_mode(path))


def _lstat_mode(path: str) -> int:
    try:
        return os.lstat(path).st_mode
    except OSError:
        return 0


def _listed(names: list[str]) -> str:
    """The first ``_SHOWN`` names, and how many more there are."""
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def _shown(parent: str, name: str) -> str:
    """An entry as an error names it: directories with a trailing "/"."""
    return name + "/" if _real_dir(os.path.join(parent, name)) else name


# What a killed jax_ucp save of a prefix can have left there (docs/FORMAT.md 1.1, 6.1, 6.4): the
# objects of its arrays (``zarr.json`` and shard objects ``c/i/j``, ``c`` when 0-d) and the
# other processes' digest reports. Nothing else is ever deleted.
_LEFTOVER = re.compile(
    r"arrays/(?!\.\.?/)[A-Za-z0-9_%~.\-]+/(zarr\.json|c(/[0-9]+)*)|ucp\.digests\.[0-9]+\.json"
)


def remove_object_store_leftovers(prefix: store.storage.Storage) -> None:
    """After a failed save to ``prefix`` (lock held): its own objects, if it did not commit."""
    names = prefix.names()
    if fmt.MANIFEST_FILE not in names:
        own = [n for n in names if _LEFTOVER.fullmatch(n)]
        if own:
            log.info("deleting %d objects of the failed save of %s", len(own), prefix.root)
        prefix.delete(own)
