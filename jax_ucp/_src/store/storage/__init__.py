"""Where a checkpoint lives, as one type chosen once from its path (``storage_for``): a local
directory (``local.LocalDirectory``: rename commit, syncfs, lock file) or an object-store prefix
(``object_store.ObjectStorePrefix``: ``ucp.json`` last, lock object). Everything above asks the
type (``base.Storage``); nothing above it asks whether a path is a URL.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from jax_ucp._src import format as fmt
from jax_ucp._src.store.storage.base import SCHEMES, Claim, Storage, Transaction, kvstore_join
from jax_ucp._src.store.storage.local import LocalDirectory

if TYPE_CHECKING:  # loaded on first use (``__getattr__``): a local checkpoint never needs it
    from jax_ucp._src.store.storage.object_store import ObjectStorePrefix

__all__ = [
    "Claim",
    "LocalDirectory",
    "ObjectStorePrefix",
    "Storage",
    "Transaction",
    "kvstore_join",
    "read_manifest",
    "storage_for",
]


def __getattr__(name: str):
    if name == "ObjectStorePrefix":
        from jax_ucp._src.store.storage.object_store import ObjectStorePrefix

        return ObjectStorePrefix
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def storage_for(path: str | os.PathLike[str] | Storage) -> Storage:
    """The storage of the checkpoint at ``path``: an object-store prefix for ``s3://`` and
    ``gs://`` URLs, a Hugging Face Hub repo (read-only) for ``hf://``, else a local directory."""
    if isinstance(path, Storage):
        return path
    path = os.fspath(path)
    if path.startswith("hf://"):
        from jax_ucp._src.store.storage.hub import HubRepo

        return HubRepo(path)
    if isinstance(path, str) and path.split("://", 1)[0] in SCHEMES and "://" in path:
        from jax_ucp._src.store.storage.object_store import ObjectStorePrefix

        return ObjectStorePrefix(path)
    return LocalDirectory(path)


def read_manifest(root) -> fmt.Manifest:
    """The checkpoint's ``ucp.json`` (strictly validated), local or in an object store."""
    return storage_for(root).read_manifest()
