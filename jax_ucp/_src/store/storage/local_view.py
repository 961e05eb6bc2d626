"""A remote checkpoint folder (``s3://``, ``gs://``, ``hf://``) seen as a local folder, for the
importers that walk folders and do not read its ``Storage`` themselves (all but
``importers.registry._IN_PLACE``): one listing gives the folder, each object a file in a private
temporary directory. Small objects (trackers, configs) are fetched whole (at most
:data:`MAX_WHOLE` bytes each); a zip archive (``.pt``, ``.pth``, ``.bin``, ``.ckpt``), a torch DCP
folder's ``.metadata`` and ``.distcp`` objects, and a rank's file of torch DCP's Hugging Face
writer (its header) stand as sparse files read at their storage (``sparse.stored_at``). A prefix
holding no torch archive nor torch DCP folder is never viewed (an Orbax step's arrays are not
fetched).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator

from jax_ucp._src.errors import RequestError, SourceError, UCPError
from jax_ucp._src.format import safetensors
from jax_ucp._src.store.storage import sparse
from jax_ucp._src.store.storage.base import Storage
from jax_ucp._src.store.storage.local import LocalDirectory

ARCHIVES = (".pt", ".pth", ".bin", ".ckpt")  # fetched by ranges when they are zip archives
DCP = ".metadata"  # a torch DCP folder's: it and its .distcp files read at their URL
MAX_SMALL = 64 << 20  # other objects up to this size are fetched PLACING at once
MAX_WHOLE = 1 << 30  # the largest other object fetched whole
PLACING = 16  # objects of a view placed at once
#: small records whose reader takes a few bytes (a tracker's step number: ``runs.read_tracker``
#: reads 4 KiB): never fetched past this, so a ``latest`` served as 1.2 GB costs 4 KiB
RECORDS: dict[str, int] = dict.fromkeys(
    ("latest", "latest_universal", "latest_checkpointed_iteration.txt"), 4096
)

_large = threading.Lock()
#: URL -> (when built, its listing, the view, the path): a view is reused by the next import of
#: its URL within ``REUSE`` seconds whose listing is the same (a restore's detection, its plan)
_views: dict[str, tuple[float, list[str], View, str]] = {}
REUSE = 30.0


class ViewError(SourceError):
    """An object of the remote folder that cannot stand as a file of its view (a name no
    folder holds, a zip directory the object disagrees with, gone since the listing): the
    source is there and damaged, unlike a prefix with nothing to view."""


@dataclasses.dataclass
class View:
    """A remote folder as the local folder ``path``; ``url`` is its name in messages."""

    url: str
    path: str
    tmp: tempfile.TemporaryDirectory
    storage: Storage

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
    sparse.standing[os.path.realpath(view.path)] = view
    return view, LocalDirectory(path)


def check_names(storage: Storage) -> None:
    """Refuses a remote listing naming an object no folder holds (through '..', absolutely, a NUL,
    an empty part): read in place or viewed, a listing is untrusted. Folder markers aside."""
    for name in storage.names():
        if not name.endswith("/") and any(
            p in ("", ".", "..") or "\0" in p for p in name.split("/")
        ):
            raise ViewError(f"{storage.join(name)[:300]!r}: an object name the folder cannot hold")


def _place(storage: Storage, name: str, view: View) -> None:
    """Object ``name`` as a file under ``view.path`` (its name checked: ``check_names``)."""
    parts = name.split("/")
    path = os.path.join(view.path, *parts)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:  # "a" and "a/b" both objects: no folder holds both
        raise ViewError(
            f"{storage.join(name)[:300]}: cannot stand in a folder ({e.strerror})"
        ) from None
    try:
        if name.rpartition("/")[2] == DCP or name.lower().endswith((".distcp", *ARCHIVES)):
            return  # read in place by ranges (stored_at)
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
        sparse.count(2, len(data))
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
    (``sparse.stored_at``), never from the holes."""
    f = safetensors.SafetensorsFile.read_from(
        storage.join(name), storage.reader(name), dcp_shard=True
    )  # a header no reader takes: its error (the object's real size, when cut short)
    if not f.rank_piece:
        return False
    head = storage.reader(name).read(0, f.data_start) or b""
    if len(head) != f.data_start:
        raise ViewError(f"{storage.join(name)}: its header changed while being read")
    sparse.count(3, len(head))
    os.ftruncate(fd, f.data_start + max((e for *_, e in f.header.values()), default=0))
    os.pwrite(fd, head, 0)
    return True
