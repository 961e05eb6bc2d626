"""megatron-core's ``integrity.json`` (0.19+, ``verify_integrity=True``): the SHA-256 of every
file of a torch_dist checkpoint, written by rank 0 after the save. When present it is checked
before anything of the checkpoint is read: a file whose bytes changed, a listed file gone, and a
file the import reads that the record does not list are errors naming the file; a record that
is not megatron-core's (another algorithm, malformed entries, names leaving the folder) is
refused, never ignored."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from jax_ucp._src.errors import SourceError
from jax_ucp._src.format import files
from jax_ucp._src.store.storage import ranged, sparse

__all__ = ["INTEGRITY_FILE", "verify_integrity"]

INTEGRITY_FILE = "integrity.json"  # megatron.core.dist_checkpointing.validation.INTEGRITY_FNAME
#: the record lists a few files per rank: a larger one is not megatron-core's
MAX_RECORD_BYTES = 16 << 20
_HEX = re.compile(r"[0-9a-f]{64}")
#: what a torch_dist import reads from the folder (each must be listed when the record is there)
_READ = re.compile(r"\.metadata|metadata\.json|common\.pt|__[0-9]+_[0-9]+\.distcp")


def _record(ckpt_dir: Path) -> dict[str, str]:
    path = ckpt_dir / INTEGRITY_FILE
    try:
        files.in_own_folder(path)  # never another run's record linked in
        raw = files.read_regular(str(path), MAX_RECORD_BYTES)
        data = files.strict_loads(raw)
    except files.UnsafeFileError as e:
        raise SourceError(str(e)) from None
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
        files.inside(ckpt_dir, name, f"{path}: a listed file")  # a plain name in the folder
        if "/" in name or not isinstance(digest, str) or not _HEX.fullmatch(digest):
            raise SourceError(
                f"{path}: entry {name!r}: {digest!r}: expected a file of the folder and its "
                f"SHA-256 as 64 lowercase hex digits"
            )
    return listed


def _sha256(path: str) -> str:
    viewed = sparse.stored_at(path)
    if viewed is not None:  # a file of a remote source's local view: its object, by pieces
        h = hashlib.sha256()
        for piece in ranged.pieces(*viewed):
            h.update(piece)
        return h.hexdigest()
    fd = files.open_regular(path)
    try:
        h = hashlib.sha256()
        while chunk := os.read(fd, 8 << 20):
            h.update(chunk)
        return h.hexdigest()
    finally:
        os.close(fd)


def verify_integrity(ckpt_dir: Path) -> int | None:
    """The number of files ``integrity.json`` vouches for, each hashed and equal to its record
    (None: the checkpoint has no record, as before megatron-core 0.19 or without
    ``verify_integrity``). Costs one more read of every file."""
    if not os.path.lexists(ckpt_dir / INTEGRITY_FILE):
        return None
    listed = _record(ckpt_dir)
    unlisted = sorted(n for n in os.listdir(ckpt_dir) if _READ.fullmatch(n) and n not in listed)
    if unlisted:
        raise SourceError(
            f"{ckpt_dir / INTEGRITY_FILE}: does not list {', '.join(unlisted)}, which the import "
            f"reads (megatron-core lists every file it saved: a file added since?)"
        )
    for name, digest in sorted(listed.items()):
        path = files.inside(ckpt_dir, name, f"{ckpt_dir / INTEGRITY_FILE}: a listed file")
        try:
            found = _sha256(path)
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
