"""What every storage medium offers: read / write / list / delete of a checkpoint's small files,
a file read at any offset (``reader``), a lock, and a transaction that commits a checkpoint
whole or not at all.

A medium decides *how* (a rename, or a manifest written last); the writer decides *what* may be
replaced (``Claim``, ``writer.commit``). As Orbax's ``path/atomicity_types.py`` and torch DCP's
``StorageReader`` / ``StorageWriter``: one type per medium, chosen once (``storage_for``).
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from jax_ucp._src import format as fmt
from jax_ucp._src.errors import CheckpointError, RequestError, SourceError
from jax_ucp._src.format import certificate
from jax_ucp._src.format.mapped_file import FileMap, map_file
from jax_ucp._src.store.storage.ranged import RandomAccess, RangedObject
from jax_ucp._src.store.storage.sparse import RemoteArchive, remote_archive

# URL scheme -> TensorStore kvstore driver: the object stores (``object_store``); here, so that
# choosing a path's medium (``storage_for``) does not import the object-store code
SCHEMES = {"s3": "s3", "gs": "gcs"}
ORBAX_TMP_MARK = ".orbax-checkpoint-tmp"  # Orbax's temporary directories (its atomicity module)
#: (root, prefix) -> its names, inside ``listed_once`` (``ObjectStorePrefix.names``)
LISTINGS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("listings", default=None)


@contextlib.contextmanager
def listed_once() -> Iterator[None]:
    """Inside it a remote prefix is listed once: one open stage's detectors send one LIST."""
    token = LISTINGS.set(LISTINGS.get() or {})
    try:
        yield
    finally:
        LISTINGS.reset(token)


def held(where: str, name: str) -> str:
    """``name`` unless no folder holds it ('..', '.' or an empty part, a NUL): it is untrusted."""
    if any(p in ("", ".", "..") or "\0" in p for p in name.split("/")):
        raise SourceError(f"{where[:300]!r}: an object name the folder cannot hold")
    return name


class Claim(Protocol):
    """The writer's replace policy, asked by a medium under its lock before a save."""

    def directory(self, path: str) -> bool:
        """Before a save to the directory ``path``: True when a committed one is replaced
        (swapped out at the commit); raises when what is there may not be replaced."""
        ...

    def prefix(self, prefix: Storage) -> None:
        """Before a save to ``prefix``: raises when what is there may not be replaced, else
        deletes what a killed save of it left."""

    def failed(self, prefix: Storage) -> None:
        """After a failed save to ``prefix``: deletes what it wrote, if uncommitted."""


@dataclasses.dataclass
class Transaction:
    """One commit of ``dest`` in progress (see ``Storage.transaction``).

    ``path`` is where the writer writes: a fresh temporary directory (``staged``), or, when the
    writer commits atomically itself (Orbax's Checkpointer: temporary + rename), ``dest`` or
    ``dest + REPLACING`` (not created); for an object store, the prefix itself. ``inner``: the
    directory under ``path`` that is the checkpoint (a manager step Orbax wrote in a staging
    manager root), else ``path`` itself.
    """

    dest: str
    path: str
    replacing: bool
    staged: bool = True
    inner: str | None = None
    committed: bool = False
    finish: Callable[[Transaction], None] = lambda tx: None  # the medium's commit

    def commit(self) -> None:
        """Commits now (the ``with`` block commits at its end otherwise); idempotent."""
        if not self.committed:
            self.finish(self)
            self.committed = True


class Storage(abc.ABC):
    """Where one checkpoint lives. ``root`` is the path or URL as given; names are relative to
    it ("/"-separated)."""

    local = False  # files opened, linked and swapped by ``os`` at ``root`` (else: requests only)
    #: why ``root`` may hold no ``ucp.json`` yet, for ``read_manifest``'s error
    no_manifest_hint = ""

    def __init__(self, root: str):
        self.root = root

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r})"

    def at(self, root: str) -> Storage:
        """The same medium at ``root`` (a sibling, an item below: the medium not chosen again)."""
        return type(self)(root)

    def local_path(self) -> str | None:
        """``root`` as a folder ``os`` opens (None: requests only, nothing to link or swap)."""
        return self.root if self.local else None

    def local_folder(self, refusal: str) -> str:
        """``root`` for a caller of local files only (a framework's loader), else ``refusal``."""
        if not self.local:
            raise RequestError(refusal)
        return self.root

    def certificate(self, said: list[str]) -> dict | None:
        """``format.certificate`` of ``root`` (None where objects are read by ranges only)."""
        return certificate.certify(self.root, said) if self.local else None

    def refuse_renamed_later(self) -> None:
        """Orbax's temporary directory refused where a rename commits nothing (an object store)."""
        if ORBAX_TMP_MARK in self.root and not self.local:
            raise fmt.UCPError(
                f"{self.root}: Orbax is saving into a temporary prefix it would then rename, "
                f"which an object store cannot do atomically. Pass CheckpointManagerOptions("
                f"temporary_path_class=ocp.path.atomicity.CommitFileTemporaryPath) (Orbax's "
                f"default for gs://): each step is then committed by its commit_success.txt."
            )

    def check_listing(self) -> None:
        """Each name a remote listing gives refused unless a folder holds it (``held``)."""
        if not self.local:
            self.names()

    def absolute(self) -> str:
        """``root`` as a save returns it (a local path made absolute)."""
        return self.root

    @abc.abstractmethod
    def join(self, *parts: str) -> str:
        """``root`` joined with ``parts``, for messages and nested checkpoints."""

    @abc.abstractmethod
    def kvstore(self, *subpath: str) -> dict:
        """The TensorStore kvstore spec of ``root`` joined with ``subpath``."""

    def ranged(self, name: str) -> tuple[dict, str]:
        """A kvstore spec and the key in it that file ``name`` is read from by byte ranges
        (a medium whose files redirect elsewhere, the Hub's, says where)."""
        return self.kvstore(), name

    def inside(self, name: str, what: str) -> str:
        """The local path of ``name``, refused unless it resolves inside ``root`` (a local
        medium only: ``local.LocalDirectory.inside``)."""
        raise NotImplementedError(f"{self!r} has no local files ({what}: {name})")

    def reader(self, name: str, what: str = "") -> RandomAccess:
        """File ``name`` read at any offset (``ranged``: one GET a range; locally ``pread``;
        ``what``: where ``name`` was read, for the error refusing it)."""
        return RangedObject(self, name)

    def mapped(
        self, name: str, *, sealed: bool = False
    ) -> tuple[FileMap | None, RemoteArchive | None]:
        """Zip archive ``name`` (a ``torch.save`` file) mapped read-only, and what fetches its
        byte ranges before they are read (None: all here): here a sparse copy of it
        (``sparse.RemoteArchive``, ``sealed``: never touched, only read through
        ``format.mapped_file``); (None, None) when the object ends no zip archive."""
        remote = remote_archive(self, name)
        if remote is None:
            return None, None
        return map_file(remote.url, remote.fd, sealed=sealed), remote

    @abc.abstractmethod
    def read(self, name: str, limit: int) -> bytes | None:
        """The whole of ``name`` (None when absent); more than ``limit`` bytes is an error."""

    def folder(self, name: str, *, link: bool = True) -> Storage:
        """Folder ``name`` of ``root`` as a storage of its own (its names relative to it);
        ``link=False``: refused when ``name`` is a symlink (an object store holds none)."""
        return self.at(self.join(name))

    def parent(self) -> Storage | None:
        """The folder holding ``root``, where a reader may look above the folder it was given
        (a local directory's); None for a remote prefix, never read above the one given."""
        return None

    @abc.abstractmethod
    def exists(self, name: str) -> bool:
        """Whether ``name`` exists."""

    @abc.abstractmethod
    def write(self, name: str, data: bytes) -> None:
        """``name`` whole, durable when this returns."""

    @abc.abstractmethod
    def names(self, prefix: str = "") -> list[str]:
        """The names under ``root`` starting with ``prefix`` (the entries of ``root``, locally)."""

    @abc.abstractmethod
    def delete(self, names: list[str]) -> None:
        """Removes each of ``names`` (a missing one is no error)."""

    def make_durable(self) -> None:
        """Everything written under ``root`` so far durable (before it is reported written);
        nothing where a write is durable when it returns (an object store's PUT)."""
        return

    def read_manifest(self) -> fmt.Manifest:
        """The checkpoint's ``ucp.json``, strictly validated."""
        where = self.join(fmt.MANIFEST_FILE)
        try:
            data = self.read(fmt.MANIFEST_FILE, fmt.MAX_MANIFEST_BYTES)
        except RequestError as e:
            raise CheckpointError(str(e)) from None
        if data is None:
            raise CheckpointError(
                f"{where}: no manifest; {self.root} is not a jax_ucp checkpoint"
                f"{self.no_manifest_hint}."
            )
        return fmt.Manifest.loads(data, where=where)

    def write_manifest(self, manifest: fmt.Manifest, name: str = fmt.MANIFEST_FILE) -> None:
        """``ucp.json`` (or a part of it), whole; in an object store, the commit."""
        self.write(name, manifest.dumps().encode())

    @abc.abstractmethod
    def identity(self) -> Any:
        """What tells the committed checkpoint at ``root`` from the next one there (None when
        there is none)."""

    def swap_state(self) -> tuple:
        """``identity()`` of ``root`` and of what a forced replacement puts beside it while it
        swaps (``root``'s alone where nothing is swapped); a reader compares it before and after."""
        return (self.identity(),)

    @abc.abstractmethod
    def lock(self) -> contextlib.AbstractContextManager[None]:
        """An exclusive lock on saving to ``root``: a second saver gets ``SaveConflictError``."""

    @abc.abstractmethod
    def refuse_early(self, claim: Claim) -> None:
        """Before any lock: what ``transaction`` would refuse at once, so that every process
        of a save can check it and all raise alike."""

    @abc.abstractmethod
    def transaction(
        self, claim: Claim, *, kind: str, staged: bool, inner: str | None
    ) -> contextlib.AbstractContextManager[Transaction]:
        """Lock, recover, ``claim``, write, commit (``writer.commit.transaction``).

        Args:
            claim: what may be replaced.
            kind: what is written ("save", "import", "export"), for the log of a failure.
            staged: the writer writes into a new temporary directory the commit renames.
            inner: staged only: the checkpoint is that directory under ``tx.path``.
        """

    def remove_abandoned(self) -> list[str]:
        """What killed writers of ``root`` left, removed unless a save holds the lock (nothing
        where the next save deletes it, or nothing is written)."""
        return []


def kvstore_join(spec: Mapping[str, Any], *subpath: str) -> dict:
    """The kvstore spec ``spec`` with ``subpath`` appended to its path (a directory: "/" last)."""
    rel = "/".join(p.strip("/") for p in subpath if p)
    joined = dict(spec)
    base = joined.get("path", "")
    if base and not base.endswith("/"):
        base += "/"
    joined["path"] = base + rel + ("/" if rel else "")
    return joined
