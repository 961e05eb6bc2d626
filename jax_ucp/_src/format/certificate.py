"""The certificate of a conversion's source: every file under the source path, its size and
SHA-256, recorded by ``convert`` in the manifest's ``source.certificate`` (docs/FORMAT.md 2.2.2),
so ``verify --against SRC`` can say first whether SRC is byte for byte the source that was
converted, naming each file added, removed or changed, before any tensor is compared.

Files are read in fixed-size chunks (bounded memory); a name is never joined from a record:
the check walks the source and compares the two listings, so a recorded name leading out of
the source is only ever reported, never opened.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jax_ucp._src.errors import UnsafeFileError
from jax_ucp._src.format import files

__all__ = ["ALGORITHM", "CHANGED", "KEY", "certify", "check", "file_digest"]

#: ``source[KEY]`` holds the certificate
KEY = "certificate"
ALGORITHM = "sha256"
#: how ``check`` starts the problem of a file whose bytes differ
CHANGED = "changed: "
#: bytes read at a time: large enough that the hash, not the system calls, sets the pace
CHUNK = 4 << 20
#: files hashed at once: SHA-256 runs at about 1.5 GB/s on one core, below a local NVMe
WORKERS = max(1, min(8, os.cpu_count() or 1))
#: how a listed name that leads out of the source (a link) is said instead of its path
OUT = "not read: "
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's zip files: the readers check each record's CRC-32


def file_digest(path: str) -> tuple[int, str, bool]:
    """(size, SHA-256 hex digest, whether the file is a zip archive) of the regular file
    ``path``, read ``CHUNK`` bytes at a time into one buffer."""
    fd = files.open_regular(path)
    try:
        digest = hashlib.sha256()
        buffer = bytearray(CHUNK)
        view = memoryview(buffer)
        size, head = 0, b""
        while n := os.readv(fd, [buffer]):
            if not size:
                head = bytes(view[:4])
            digest.update(view[:n])
            size += n
        return size, digest.hexdigest(), head == _ZIP_MAGIC
    finally:
        os.close(fd)


def _digest_or_why(path: str) -> tuple[int, str, bool] | str:
    """``file_digest(path)``, or why the file cannot be read (no permission, gone since)."""
    try:
        return file_digest(path)
    except OSError as e:  # UnsafeFileError included
        return f"cannot be read: {type(e).__name__}: {e}"[:300]


def _digests(paths: list[str]) -> list[tuple[int, str, bool] | str]:
    """``_digest_or_why`` of each path, ``WORKERS`` files at a time (hashlib releases the GIL
    while it hashes a chunk): memory ``WORKERS * CHUNK`` at most."""
    if len(paths) < 2:
        return [_digest_or_why(p) for p in paths]
    with ThreadPoolExecutor(min(WORKERS, len(paths)), thread_name_prefix="certify") as pool:
        return list(pool.map(_digest_or_why, paths))


def _listing(source: str) -> Iterator[tuple[str, str]]:
    """(name relative to ``source`` with ``/``, path) of every regular file under ``source``
    (itself when it is a file), in sorted order; symlinked folders are not followed, things
    that are no regular file (FIFOs, sockets, devices) are passed over."""
    if not os.path.isdir(source):
        yield os.path.basename(source), source
        return
    for folder, dirs, names in os.walk(source):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(folder, name)
            try:
                regular = stat.S_ISREG(os.stat(path).st_mode)
            except OSError:  # a dangling link
                regular = False
            if regular:
                yield _inside(source, os.path.relpath(path, source).replace(os.sep, "/"))


def _inside(source: str, name: str) -> tuple[str, str]:
    """(name, its path) through the one rule for names (``files.inside_checkpoint``): a link
    leading out of the source is never read (its path is then why, starting with ``OUT``), but
    a Hugging Face cache snapshot's links into its repo's ``blobs/`` are followed, as the
    import reads them."""
    try:
        return name, files.inside_checkpoint(source, name, f"{source}: certificate")
    except UnsafeFileError as e:
        return name, f"{OUT}{e}"[:300]


def certify(source: str | os.PathLike, checked_by_import: list[str] | None = None) -> dict:
    """The certificate of the source path ``source`` (a folder or one file).

    Args:
        source: the path ``convert`` read.
        checked_by_import: what the import's readers checked against the framework's own
            digests (megatron-core's ``integrity.json``), recorded as said.

    Returns:
        ``{"algorithm": "sha256", "files": {name: {"size": n, "sha256": hex}},
        "checked_by_import": [...]}``, and ``"unread": {name: why}`` for the files that
        cannot be read (the import did not read them either, or it would have failed).
    """
    listed: dict[str, dict[str, Any]] = {}
    unread: dict[str, str] = {}
    zips = []
    paths = dict(_listing(os.fspath(source)))
    unread.update({n: p for n, p in paths.items() if p.startswith(OUT)})
    paths = {n: p for n, p in paths.items() if n not in unread}
    for name, found in zip(paths, _digests(list(paths.values()))):
        if isinstance(found, str):
            unread[name] = found
            continue
        size, digest, is_zip = found
        listed[name] = {"size": size, ALGORITHM: digest}
        if is_zip and not name.endswith(".distcp"):  # DCP's: records joined, no archive
            zips.append(name)
    said = list(checked_by_import or ())
    if zips:
        said.append(
            f"the CRC-32 of every record read from the zip files {', '.join(zips[:5])}"
            + (f" and {len(zips) - 5} more" if len(zips) > 5 else "")
            + " (torch.save's format), checked by the reader as the import read it"
        )
    out = {"algorithm": ALGORITHM, "files": listed, "checked_by_import": said}
    return {**out, "unread": unread} if unread else out


def check(source: str | os.PathLike, recorded: Any) -> tuple[dict[str, str], int]:
    """The files of ``source`` against the certificate ``recorded`` (``source.certificate`` of
    a manifest): ({file name: what differs}, how many files are equal). A certificate that is
    not one (another algorithm, malformed entries) is one problem named ``certificate``."""
    listed = recorded.get("files") if isinstance(recorded, dict) else None
    algorithm = recorded.get("algorithm") if isinstance(recorded, dict) else None
    if algorithm != ALGORITHM or not isinstance(listed, dict):
        return {
            KEY: f"source.certificate: expected algorithm {ALGORITHM!r} and a 'files' object, "
            f"found {str(recorded)[:200]}"
        }, 0
    problems: dict[str, str] = {}
    equal = 0
    unread = recorded.get("unread")
    unread = unread if isinstance(unread, dict) else {}
    present = {n: p for n, p in _listing(os.fspath(source)) if n not in unread}
    for name, path in list(present.items()):
        if path.startswith(OUT):  # a link out since: named, never read
            problems[name] = path
            present.pop(name)
            listed = {n: w for n, w in listed.items() if n != name}
    same_size = [  # only these are read: another size is another file
        n
        for n, w in listed.items()
        if n in present and isinstance(w, dict) and w.get("size") == os.stat(present[n]).st_size
    ]
    digests = dict(zip(same_size, _digests([present[n] for n in same_size])))
    for name, want in listed.items():
        path = present.pop(name, None)
        size = want.get("size") if isinstance(want, dict) else None
        digest = want.get(ALGORITHM) if isinstance(want, dict) else None
        if type(size) is not int or not isinstance(digest, str):
            problems[name] = f"source.certificate: malformed entry {str(want)[:200]}"
            continue
        if path is None:
            problems[name] = f"missing from {os.fspath(source)} (certified: {size} bytes)"
            continue
        found = digests.get(name) or (os.stat(path).st_size, "", False)
        if isinstance(found, str):
            problems[name] = found
            continue
        found_size, found_digest, _ = found
        if found_size != size:
            problems[name] = f"{CHANGED}{size} bytes certified, {found_size} found"
        elif found_digest != digest:
            problems[name] = f"{CHANGED}same size ({size} bytes), another {ALGORITHM}"
        else:
            equal += 1
    for name in present:
        problems[name] = f"in {os.fspath(source)} but not in the certificate (added since)"
    return problems, equal
