"""A remote checkpoint folder (``s3://``, ``gs://``, any ``Storage`` that is not ``local``) seen
as a local folder, for the importers that walk folders and read ``torch.save`` archives
(DeepSpeed, Megatron, verl, torchtune, torch_checkpointing, ``torch.save`` files, torch DCP):
one listing gives the folder, each object a file of its size in a private temporary
directory. Small objects (trackers, configs) are fetched whole (at most :data:`MAX_WHOLE` bytes
each); a zip archive (``.pt``, ``.pth``, ``.bin``, ``.ckpt``) is a sparse file of which its
first :data:`HEAD` bytes and its zip directory are fetched (a suffix GET, two one-byte GETs
holding the size the directory implies to the object's, a GET of the head).
``torchfiles.torch_zip.TorchArchive`` fetches the rest as it needs it (:meth:`Remote.fetch`:
ranged GETs, concurrent within ``ranged.IN_FLIGHT`` bytes): a member when the pickle references it
or, for a lazily checked archive, when its bytes are first read (its mapping then cannot be
touched, only read through ``format.mapped_file``), so a process fetches the members it reads.
A torch DCP folder's ``.metadata`` and ``.distcp`` objects (plain, megatron-core's
``torch_dist`` and ``fsdp_dtensor``, verl's ``dist_ckpt``) stand as empty files: ``torchfiles.dcp`` opens the
folder at its storage (:func:`stored_at`) and fetches the byte ranges of the chunks it reads; a rank's
file of torch DCP's Hugging Face writer stands as a sparse file holding its header only, read the same
way. A prefix holding no torch archive nor torch DCP folder is never viewed (an Orbax step's arrays are not
fetched).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import struct
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator

import tensorstore as ts

from jax_ucp._src.errors import RequestError, SourceError, UCPError
from jax_ucp._src.format import safetensors
from jax_ucp._src.store.storage import ranged
from jax_ucp._src.store.storage.base import Storage
from jax_ucp._src.store.storage.local import LocalDirectory

ARCHIVES = (".pt", ".pth", ".bin", ".ckpt")  # fetched by ranges when they are zip archives
DCP = ".metadata"  # a torch DCP folder's: it and its .distcp files read at their URL
TAIL = 64 << 10  # the suffix GET that finds an archive's zip directory
HEAD = 4 << 10  # an archive's first bytes, fetched with its directory
MAX_SMALL = 64 << 20  # other objects up to this size are fetched PLACING at once
MAX_WHOLE = 1 << 30  # the largest other object fetched whole
MAX_DIRECTORY = 256 << 20  # the largest zip directory fetched
PLACING = 16  # objects of a view placed at once
#: small records whose reader takes a few bytes (a tracker's step number: ``runs.read_tracker``
#: reads 4 KiB): never fetched past this, so a ``latest`` served as 1.2 GB costs 4 KiB
RECORDS: dict[str, int] = dict.fromkeys(
    ("latest", "latest_universal", "latest_checkpointed_iteration.txt"), 4096
)

_counts = {"gets": 0, "bytes": 0}
_lock, _large = threading.Lock(), threading.Lock()
#: URL -> (when built, its listing, the view, the path): a view is reused by the next import of
#: its URL within ``REUSE`` seconds whose listing is the same (a restore's detection, its plan)
_views: dict[str, tuple[float, list[str], View, str]] = {}
REUSE = 30.0


class ViewError(SourceError):
    """An object of the remote folder that cannot stand as a file of its view (a name no
    folder holds, a zip directory the object disagrees with, gone since the listing): the
    source is there and damaged, unlike a prefix with nothing to view."""


def fetched() -> tuple[int, int]:
    """(GETs, bytes) this process has fetched into local views so far."""
    return _counts["gets"], _counts["bytes"]


def _count(gets: int, nbytes: int) -> None:
    with _lock:
        _counts["gets"] += gets
        _counts["bytes"] += nbytes


@dataclasses.dataclass(eq=False)
class Remote:
    """A zip archive in a remote storage (``key`` in ``kv``), standing as the sparse local file
    ``fd`` is open on (for writing, closed with this): ``size`` bytes, of which the ranges
    ``here`` are fetched."""

    url: str
    kv: ts.KvStore
    key: str
    size: int
    fd: int
    here: list[tuple[int, int]]  # the ranges fetched (merged, sorted)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def __del__(self) -> None:
        os.close(self.fd)

    def missing(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[start, end)`` not fetched yet."""
        out, at = [], max(0, start)
        for lo, hi in self.here:
            if lo >= end:
                break
            if hi > at:
                if lo > at:
                    out.append((at, lo))
                at = max(at, hi)
        return [*out, (at, end)] if at < end else out

    def fetch(self, ranges: list[tuple[int, int]]) -> None:
        """Bytes ``[start, end)`` of each of ``ranges`` into the local file, those not here
        yet: ranged GETs (``ranged.fetch_ranges``). An
        object shorter than ``size`` is an error naming it."""
        with self.lock:
            self._fetch([m for a, b in ranges for m in self.missing(a, min(b, self.size))])

    def _fetch(self, todo: list[tuple[int, int]]) -> None:
        ranged.fetch_ranges(self.kv, self.key, todo, self._put, self.url)
        merged: list[tuple[int, int]] = []
        for lo, hi in sorted([*self.here, *todo]):
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        self.here = merged

    def _put(self, at: int, n: int, data: bytes | None) -> None:
        if data is None:
            raise SourceError(f"{self.url}: the object is gone (deleted while being read)")
        _count(1, len(data))
        if len(data) != n:
            raise SourceError(
                f"{self.url}: bytes [{at}, {at + n}) asked, {len(data)} came; its zip directory "
                f"gave {self.size} bytes (truncated or replaced while being read)"
            )
        view = memoryview(data)
        while view:
            view = view[os.pwrite(self.fd, view, at + len(data) - len(view)) :]


#: local file -> the archive it stands for, while its view or a reader holds it
_remotes: weakref.WeakValueDictionary[str, Remote] = weakref.WeakValueDictionary()
#: local folder -> the view it is, while the view lives
_viewed: weakref.WeakValueDictionary[str, View] = weakref.WeakValueDictionary()


def remote_of(path: str) -> Remote | None:
    """The remote archive the local file ``path`` stands for (None: a file of its own)."""
    return _remotes.get(os.path.realpath(path)) if _remotes else None


def stored_at(path: os.PathLike | str) -> tuple[Storage, str] | None:
    """(the storage, the object name) the local ``path`` inside a live view stands for (None:
    not inside one): the view's own storage, so a Hub repo stays at the commit it listed."""
    real = os.path.realpath(path) if _viewed else ""
    for root, view in list(_viewed.items()):
        if real == root or real.startswith(root + os.sep):
            return view.storage, real[len(root) :].replace(os.sep, "/").strip("/")
    return None


@dataclasses.dataclass
class View:
    """A remote folder as the local folder ``path``; ``url`` is its name in messages."""

    url: str
    path: str
    tmp: tempfile.TemporaryDirectory
    storage: Storage
    remotes: list[Remote] = dataclasses.field(default_factory=list)

    def as_url(self, text: str) -> str:
        """``text`` naming ``url`` where it names the local folder."""
        return text.replace(self.path, self.url)

    def _rename(self, e: BaseException) -> None:
        e.args = tuple(self.as_url(a) if isinstance(a, str) else a for a in e.args)

    @contextlib.contextmanager
    def named(self) -> Iterator[None]:
        """Errors raised and warnings given inside name ``url``, not the local folder."""
        try:
            with warnings.catch_warnings(record=True) as seen:
                yield
        except UCPError as e:
            self._rename(e)
            raise
        finally:
            for w in seen:
                self._rename(w.message)  # type: ignore[arg-type]
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    def holding(self, read: Callable) -> Callable:
        """``read`` called later (a tensor built after its plan is read): the view's files
        live while it can be called, its errors name ``url``."""

        def call(*args):
            with self.named():
                return read(*args)

        return call

    def named_items(self, items: Iterator) -> Iterator:
        """``items``, the errors met reading them naming ``url``; once they are read, the view
        is not reused (its files go when the last reader lets them go)."""
        try:
            yield from items
        except UCPError as e:
            self._rename(e)
            raise
        finally:
            for key in [k for k, (*_, view, _) in _views.items() if view is self]:
                del _views[key]


def local_view(storage: Storage) -> tuple[View, LocalDirectory] | None:
    """(the view, the local storage standing for ``storage.root``): a folder, or a file when
    ``storage.root`` names one object (a ``torch.save`` file); None when it holds no torch
    archive nor torch DCP folder."""
    asked, now = storage.root, time.monotonic()
    names = [n for n in storage.names() if not n.endswith("/")]  # no folder markers
    parent, _, base = asked.rstrip("/").rpartition("/")
    single = not names and base.lower().endswith(ARCHIVES) and "/" in parent.partition("://")[2]
    if single:
        storage, names = type(storage)(parent), [base]
    if not any(n.lower().endswith(ARCHIVES) or n.rpartition("/")[2] == DCP for n in names) and (
        not holds_rank_pieces(names)
    ):
        return None  # never a zarr array fetched whole
    for key in [k for k, (built, *_) in _views.items() if now - built > REUSE]:
        del _views[key]
    if asked in _views and _views[asked][1] == names:
        return _views[asked][2], LocalDirectory(_views[asked][3])
    url = storage.root.rstrip("/")
    tmp = tempfile.TemporaryDirectory(prefix="ucp-view-")
    view = View(url, os.path.join(tmp.name, url.rpartition("/")[2] or "root"), tmp, storage)
    with concurrent.futures.ThreadPoolExecutor(PLACING) as pool:  # round trips overlapped
        list(pool.map(lambda name: _place(storage, name, view), names))
    path = os.path.join(view.path, base) if single else view.path
    _views[asked] = now, names, view, path
    _viewed[os.path.realpath(view.path)] = view
    return view, LocalDirectory(path)


def _place(storage: Storage, name: str, view: View) -> None:
    """Object ``name`` as a file under ``view.path``."""
    parts = name.split("/")
    if any(p in ("", ".", "..") or "\0" in p for p in parts):
        raise ViewError(f"{storage.join(name)[:300]!r}: an object name the folder cannot hold")
    path = os.path.join(view.path, *parts)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:  # "a" and "a/b" both objects: no folder holds both
        raise ViewError(
            f"{storage.join(name)[:300]}: cannot stand in a folder ({e.strerror})"
        ) from None
    try:
        if name.rpartition("/")[2] == DCP or name.endswith(".distcp"):
            return  # read in place by ranges (stored_at)
        if name.lower().endswith(ARCHIVES) and _archive(storage, name, path, fd, view):
            return
        if safetensors.RANK_FILE.fullmatch(parts[-1]) and _rank_piece(storage, name, fd):
            return
        record = RECORDS.get(parts[-1])
        try:
            data = storage.read(name, record or MAX_SMALL)
        except RequestError as e:  # a larger one: one at a time (memory: one, not PLACING)
            if record is not None:
                raise ViewError(f"{e}: a record holding a step number, refused unread") from None
            with _large:
                data = storage.read(name, MAX_WHOLE)
        if data is None:
            raise ViewError(f"{storage.join(name)}: listed, then gone")
        _count(2, len(data))
        os.write(fd, data)
    finally:
        os.close(fd)


def holds_rank_pieces(names: list[str]) -> bool:
    """Whether a prefix listing ``names`` holds rank files of torch DCP's Hugging Face writer
    (a ``.safetensors`` object so named, as torch names them, beside any other): a checkpoint of
    every rank's file, read through a view (``torchfiles.dcp_safetensors``, which checks their
    headers), not as safetensors weights. By name: detection fetches nothing."""
    return any(safetensors.RANK_FILE.fullmatch(n) for n in names if "/" not in n)


def _rank_piece(storage: Storage, name: str, fd: int) -> bool:
    """A rank's DCP safetensors file (so named) as a sparse file of its size holding its header
    (False: whole tensors, fetched whole): its pieces are read at the URL by ranges
    (:func:`stored_at`), never from the holes."""
    f = safetensors.SafetensorsFile.read_from(
        storage.join(name), storage.reader(name), dcp_shard=True
    )  # a header no reader takes: its error (the object's real size, when cut short)
    if not f.rank_piece:
        return False
    head = storage.reader(name).read(0, f.data_start) or b""
    if len(head) != f.data_start:
        raise ViewError(f"{storage.join(name)}: its header changed while being read")
    _count(3, len(head))
    os.ftruncate(fd, f.data_start + max((e for *_, e in f.header.values()), default=0))
    os.pwrite(fd, head, 0)
    return True


def _archive(storage: Storage, name: str, path: str, fd: int, view: View) -> bool:
    """A zip archive as a sparse file, its directory fetched (False: not one; fetched whole)."""
    kv, key = ranged.opened(storage, name)
    try:
        tail = kv.read(key, byte_range=slice(-TAIL, None)).result()
    except ValueError:  # shorter than TAIL: whole
        return False
    _count(1, len(tail.value))
    if tail.state != "value":
        raise ViewError(f"{storage.join(name)}: listed, then gone")
    found = zip_extent(bytes(tail.value))
    if found is None:
        return False
    size, directory = found
    held: list[int] = []  # the size, held to the object's: a byte at size - 1, none at size
    if len(tail.value) <= size <= directory + MAX_DIRECTORY:
        probes = [(size - 1, size), (size, size + 1)]
        ranged.fetch_ranges(
            kv, key, probes, lambda at, n, got: held.append(len(got or b"")), storage.join(name)
        )
    if held != [1, 0]:
        raise ViewError(
            f"{storage.join(name)}: its zip directory implies a {size}-byte archive "
            f"(directory at {directory}); the object disagrees (truncated or corrupt)"
        )
    os.ftruncate(fd, size)
    os.pwrite(fd, tail.value, size - len(tail.value))
    remote = Remote(storage.join(name), kv, key, size, os.dup(fd), [(size - len(tail.value), size)])
    # its first bytes (a reader checks the signature with a plain read); a directory larger
    # than the tail
    remote.fetch([(0, min(HEAD, size)), (directory, size)])
    _remotes[os.path.realpath(path)] = remote
    view.remotes.append(remote)
    return True


_EOCD = struct.Struct("<4sHHHHIIH")


def zip_extent(tail: bytes) -> tuple[int, int] | None:
    """(the archive's size, where its central directory starts) from its last bytes (zip64
    too), or None when they end no zip archive. The size is where a record the tail holds
    starts, by its own offsets, plus the bytes from it to the tail's end."""
    at = tail.rfind(b"PK\x05\x06", 0, max(0, len(tail) - _EOCD.size + 4))
    if at < 0:
        return None
    _, _, _, here, total, cd_size, cd_start, comment = _EOCD.unpack_from(tail, at)
    if at + _EOCD.size + comment != len(tail):
        return None
    record, pos, locator = cd_start + cd_size, at, at - 20
    if locator >= 0 and tail[locator : locator + 4] == b"PK\x06\x07":  # zip64 (torch's always)
        (record,) = struct.unpack_from("<Q", tail, locator + 8)
        pos = tail.rfind(b"PK\x06\x06", 0, locator)
        if pos < 0 or pos + 56 > locator:
            return None
        cd_size, cd_start = struct.unpack_from("<QQ", tail, pos + 40)
    elif 0xFFFFFFFF in (cd_size, cd_start) or 0xFFFF in (here, total):
        return None
    if cd_start + cd_size > record:
        return None
    return record + len(tail) - pos, cd_start
