"""megatron-core's ``integrity.json`` (0.19+, ``verify_integrity=True``): the SHA-256 of every
file of a torch_dist checkpoint, written by rank 0 after the save. When present it is checked
before anything of the checkpoint is read: a file whose bytes changed, a listed file gone, and a
file the import reads that the record does not list are errors naming the file; a record that
is not megatron-core's (another algorithm, malformed entries, names leaving the folder) is
refused, never ignored."""

from __future__ import annotations

import hashlib
import re

from jax_ucp._src.errors import SourceError
from jax_ucp._src.format import files
from jax_ucp._src.importers.megatron.common import read_file
from jax_ucp._src.store.storage import Storage, ranged

__all__ = ["INTEGRITY_FILE", "verify_integrity"]

INTEGRITY_FILE = "integrity.json"  # megatron.core.dist_checkpointing.validation.INTEGRITY_FNAME
#: the record lists a few files per rank: a larger one is not megatron-core's
MAX_RECORD_BYTES = 16 << 20
_HEX = re.compile(r"[0-9a-f]{64}")
#: what a torch_dist import reads from the folder (each must be listed when the record is there)
_READ = re.compile(r"\.metadata|metadata\.json|common\.pt|__[0-9]+_[0-9]+\.distcp")


def _record(folder: Storage) -> dict[str, str]:
    path = folder.join(INTEGRITY_FILE)
    raw = read_file(folder, INTEGRITY_FILE, MAX_RECORD_BYTES)  # never another run's, linked in
    try:
        data = files.strict_loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError included
        raise SourceError(f"{path}: not megatron-core's integrity record ({e})") from None
    algorithm = data.get("algorithm") if isinstance(data, dict) else None
    listed = data.get("files") if isinstance(data, dict) else None
    if algorithm != "sha256" or not isinstance(listed, dict):
        raise SourceError(
            f"{path}: expected megatron-core's record {{'algorithm': 'sha256', 'files': "
            f"{{name: digest}}}}, found algorithm {algorithm!r} and files of type "
            f"{type(listed).__name__}"
        )
    for name, digest in listed.items():
        if not name or "\0" in name or ".." in name.replace("\\", "/").split("/"):
            raise files.UnsafeFileError(  # as ``files.inside`` refuses it, never looked up
                f"{path}: a listed file: file name {name!r}; a checkpoint may name only files "
                f"inside {folder.root}"
            )
        if "/" in name or not isinstance(digest, str) or not _HEX.fullmatch(digest):
            raise SourceError(
                f"{path}: entry {name!r}: {digest!r}: expected a file of the folder and its "
                f"SHA-256 as 64 lowercase hex digits"
            )
    return listed


def _sha256(folder: Storage, name: str) -> str:
    """The SHA-256 of file ``name`` of ``folder``, read by pieces (remotely: ranged GETs)."""
    h = hashlib.sha256()
    for piece in ranged.pieces(folder, name):
        h.update(piece)
    return h.hexdigest()


def verify_integrity(folder: Storage, names: list[str]) -> int | None:
    """The number of files ``integrity.json`` vouches for, each hashed and equal to its record
    (None: the checkpoint folder, whose entries are ``names``, has no record, as before
    megatron-core 0.19 or without ``verify_integrity``). Costs one more read of every file."""
    if INTEGRITY_FILE not in names:
        return None
    listed = _record(folder)
    unlisted = sorted(n for n in names if _READ.fullmatch(n) and n not in listed)
    if unlisted:
        raise SourceError(
            f"{folder.join(INTEGRITY_FILE)}: does not list {', '.join(unlisted)}, which the "
            f"import reads (megatron-core lists every file it saved: a file added since?)"
        )
    for name, digest in sorted(listed.items()):
        path = folder.join(name)
        try:
            if name not in names:
                raise FileNotFoundError(path)
            found = _sha256(folder, name)
        except FileNotFoundError:
            raise SourceError(
                f"{path}: listed in {INTEGRITY_FILE} but missing from the checkpoint"
            ) from None
        except files.UnsafeFileError as e:
            raise SourceError(str(e)) from None
        if found != digest:
            raise SourceError(
                f"{path}: SHA-256 {found[:16]}…, {INTEGRITY_FILE} records {digest[:16]}… "
                f"(the file changed after megatron-core saved it)"
            )
    return len(listed)
