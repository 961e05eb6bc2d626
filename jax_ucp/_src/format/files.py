"""Opening files a user hands us: regular files only, bounded reads, never block.

A checkpoint directory is untrusted: a "file" may be a FIFO (an open() that never returns), a
symlink to /dev/zero (a read that never ends) or absurdly large. Everything that reads a
checkpoint's small files (manifests, tracker files) goes through ``read_regular``; bulk readers
use ``open_regular`` and check sizes themselves.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable
from typing import NoReturn, TypeVar

from jax_ucp._src.errors import SourceError, UnsafeFileError


def open_regular(path: str) -> int:
    """A read-only descriptor of ``path``, which must be (or link to) a regular file.

    O_NONBLOCK makes opening a FIFO return at once instead of waiting for a writer; the fstat
    check then refuses it (and devices, sockets, directories).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except IsADirectoryError:
        raise UnsafeFileError(f"{path}: is a directory, expected a regular file") from None
    try:
        _check_mode(path, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def check_regular(path: str) -> None:
    """Raises unless ``path`` exists and is (or links to) a regular file; never opens it."""
    _check_mode(path, os.stat(path).st_mode)


def _check_mode(path: str, mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise UnsafeFileError(
            f"{path}: not a regular file ({_describe(mode)}); refusing to read it"
        )


def no_json_constant(name: str) -> NoReturn:
    """``json.loads(..., parse_constant=no_json_constant)``: Python's json reads ``NaN``,
    ``Infinity`` and ``-Infinity``, which JSON has not; a record holding one could not be
    written back (``json.dumps(allow_nan=False)``), so a file holding one is refused."""
    raise ValueError(f"{name} is not valid JSON")


#: how ``unique_keys`` starts its error (a ``ValueError``, as any JSON error)
DUPLICATE_KEY = "names {!r} twice"


def unique_keys(pairs: list) -> dict:
    """``json.loads(..., object_pairs_hook=unique_keys)``: Python's json keeps the last of two
    equal keys silently, another reader the first (``"value":7,"value":8``), so which one a
    file means cannot be told and it is refused (``ValueError``)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(
            DUPLICATE_KEY.format(str(key)[:100]) + " (a JSON object with a duplicate key: "
            "which one is meant cannot be told, so the file is refused)"
        )
    return out


def strict_loads(raw: bytes | str):
    """``json.loads`` as the project reads a file: a key named twice (``unique_keys``) and
    ``NaN`` / ``Infinity`` raise ``ValueError``, which the caller names the file for."""
    return json.loads(raw, object_pairs_hook=unique_keys, parse_constant=no_json_constant)


def strict_json(raw: bytes | str, what: str, error: type[Exception] = SourceError):
    """JSON as the project reads every file: each object's keys unique (``unique_keys``), no
    ``NaN`` / ``Infinity`` (``no_json_constant``), a bounded nesting; anything else raises
    ``error`` starting with ``what``.

    Args:
        raw: the file's content.
        what: the file (and the part of it), for messages.
        error: the exception to raise (``SourceError`` for a source, ``CheckpointError``...).
    """
    try:
        return strict_loads(raw)
    except RecursionError:
        raise error(f"{what}: nested too deep to be the file it names") from None
    except (ValueError, UnicodeDecodeError) as e:
        if str(e).startswith("names "):  # unique_keys: the duplicate named
            raise error(f"{what}: {e}") from None
        raise error(f"{what}: not valid JSON ({str(e)[:200]})") from None


def read_regular(path: str, max_bytes: int) -> bytes:
    """The whole content of the regular file ``path``, refusing one larger than ``max_bytes``."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise UnsafeFileError(
                f"{path}: {size} bytes, more than the {max_bytes} this file may have"
            )
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:  # grew while we read it
                raise UnsafeFileError(f"{path}: more than {max_bytes} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def overlap(path: str, other: str) -> str | None:
    """How ``path`` sits against the directory ``other``, symlinks resolved: ``"same"``,
    ``"inside"`` (lies inside it), ``"contains"`` (contains it), or None (apart). Why: a
    destination written with ``force`` that overlaps its source would delete what it reads."""
    real_path, real_other = (os.path.realpath(os.fspath(p)) for p in (path, other))
    common = os.path.commonpath([real_path, real_other])
    if real_path == real_other:
        return "same"
    return "inside" if common == real_other else "contains" if common == real_path else None


def inside(root: str | os.PathLike, name: str, what: str, *, folder=None) -> str:
    """The path of ``name``, read from a checkpoint's own files, relative to ``folder`` (default
    ``root``), refused unless it lies inside ``root``'s real path once symlinks are resolved (the
    real path is returned when a link was followed).

    The one place where a name from a checkpoint becomes a path: an absolute name, a ``..`` part,
    a NUL or an empty name is refused as it stands, and a symlink leading out of the checkpoint
    after resolution (a ``.distcp`` linked to another user's file) too; a link that stays inside
    (a Hugging Face cache snapshot's links into ``blobs/``: see :func:`inside_checkpoint`) is
    followed.

    Args:
        root: the checkpoint's root folder.
        name: the name as read from the checkpoint's files.
        what: where it was read (file and entry), for the error.
        folder: the folder ``name`` is relative to (default ``root``).
    """
    shown = repr(name)[:200]
    if not isinstance(name, str) or not name:
        raise UnsafeFileError(f"{what}: file name {shown} is not a non-empty string")
    problem = None
    if "\0" in name:
        problem = "holds a NUL character"
    elif os.path.isabs(name) or name.startswith("/"):
        problem = "is an absolute path"
    elif ".." in name.replace("\\", "/").split("/"):
        problem = "has a '..' part"
    if problem is not None:
        raise UnsafeFileError(
            f"{what}: file name {shown} {problem}; a checkpoint may name only files inside "
            f"{os.fspath(root)}"
        )
    if folder is None and not _has_link(os.fspath(root), name):
        return os.path.join(os.fspath(root), name)  # nothing below the root to follow
    real_root = os.path.realpath(os.fspath(root))
    real = os.path.realpath(os.path.join(os.fspath(folder if folder is not None else root), name))
    if real != real_root and os.path.commonpath([real, real_root]) != real_root:
        raise UnsafeFileError(
            f"{what}: file name {shown} resolves to {real}, outside the checkpoint "
            f"{real_root} (a symlink leading out of it); refusing to read it"
        )
    return real


def _has_link(root: str, name: str) -> bool:
    """Whether some part of ``name`` below ``root`` is a symlink (a few lstat calls: the common
    case, no link, costs no ``realpath`` of the whole path)."""
    path = root
    for part in name.split("/"):
        if part in ("", "."):
            continue
        path = os.path.join(path, part)
        try:
            if stat.S_ISLNK(os.lstat(path).st_mode):
                return True
        except (FileNotFoundError, NotADirectoryError):
            return False  # nothing further exists to follow
    return False


def in_own_folder(path: str | os.PathLike) -> str:
    """:func:`inside` for a file found by its conventional name (a rank file, ``common.pt``):
    ``path``, a link followed, stays in the folder holding it."""
    folder, name = os.path.split(os.fspath(path))
    return inside(folder or ".", name, folder or ".")


#: a Hugging Face cache blob's name: the file's git sha1 (40 hex) or LFS sha256 (64 hex)
_BLOB_NAME = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def cache_repo(folder: str | os.PathLike) -> str | None:
    """The cache repo of a Hugging Face cache snapshot ``<repo>/snapshots/<rev>`` whose
    ``<repo>/blobs`` is a real directory (not a link), as ``huggingface_hub`` lays it out; None
    for any other folder."""
    real = os.path.realpath(os.fspath(folder))
    parent = os.path.dirname(real)
    repo = os.path.dirname(parent)
    blobs = os.path.join(repo, "blobs")
    if (
        os.path.basename(parent) == "snapshots"
        and os.path.isdir(blobs)
        and not os.path.islink(blobs)
    ):
        return repo
    return None


def inside_checkpoint(folder: str | os.PathLike, name: str, what: str) -> str:
    """:func:`inside` for a checkpoint folder, one rule for every entry point (convert and
    restore, a folder or one file of it): ``name`` resolves inside ``folder``, or — for a Hugging
    Face cache snapshot only (:func:`cache_repo`) — to a blob of its own cache repo,
    ``<repo>/blobs/<sha>``. A link into another repo, out of the cache, to a non-blob file of
    the repo or through a linked ``blobs/`` is refused. Returns the real path.

    Args:
        folder: the checkpoint folder the name was read in.
        name: the name, from the checkpoint's own files (untrusted).
        what: what the name is, for the error (``'shard file'``).
    """
    repo = cache_repo(folder)
    if repo is None:
        return inside(folder, name, what)
    real = inside(repo, name, what, folder=folder)  # never outside the repo
    real_folder = os.path.realpath(os.fspath(folder))
    if os.path.commonpath([real, real_folder]) == real_folder:
        return real
    if os.path.dirname(real) == os.path.join(repo, "blobs") and _BLOB_NAME.fullmatch(
        os.path.basename(real)
    ):
        return real
    raise UnsafeFileError(
        f"{what}: file name {name[:200]!r} resolves to {real}, outside the snapshot "
        f"{real_folder} and not a blob of its cache repo ({repo}/blobs/<sha>); refusing to "
        f"read it"
    )


#: a number in a file or folder name (a rank, an epoch, a step, a layer): ASCII digits only.
#: ``\d`` and ``str.isdigit`` also take ``١`` (Arabic-Indic), ``５`` (fullwidth) and ``²``, so a
#: planted ``rank_١.pt`` would stand in for ``rank_1.pt``.
DIGITS = "[0-9]+"
_NUMBER = re.compile(DIGITS)


def name_number(text: str) -> int | None:
    """The number ``text`` spells in ASCII digits (``"05"`` is 5), else None (``"١"``, ``"²"``,
    ``" 5"``, ``"5\\n"``): the one way a number is read from a name or a tracker file."""
    return int(text) if isinstance(text, str) and _NUMBER.fullmatch(text) else None


_Number = TypeVar("_Number", int, tuple)  # a number, or several (kind, world size, rank)


def numbered_names(
    found: Iterable[tuple[_Number, str]], where: str, what: str = "number"
) -> dict[_Number, str]:
    """``{number: name}`` from ``(number, name)`` pairs, ordered by number, refusing two names
    for one number (``epoch_5`` and ``epoch_05``; ``rank_1.pt`` and ``rank_1.pt\\n``): picking
    either would read one file and silently leave out the other.

    Args:
        found: each name with the number (or tuple of numbers) read from it.
        where: the folder listed, for the error.
        what: what the number is (``"rank"``, ``"epoch"``), for the error.
    """
    out: dict[_Number, str] = {}
    for number, name in found:
        other = out.setdefault(number, name)
        if other != name:
            first, second = sorted((other, name))
            raise SourceError(
                f"{where}: {first!r} and {second!r} both name {what} {number}; one name per "
                f"{what}: remove or rename one of them"
            )
    return {number: out[number] for number in sorted(out)}


def _describe(mode: int) -> str:
    kind = stat.filemode(mode)[0]
    names = {"p": "a FIFO", "c": "a character device", "b": "a block device", "s": "a socket"}
    return names.get(kind, "a directory" if kind == "d" else f"mode {oct(mode)}")
