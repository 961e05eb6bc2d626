"""``jax_ucp.inspect``: a checkpoint's manifest, read without JAX (it reads no tensor data, so
``jax-ucp inspect`` starts without paying JAX's and Orbax's import, ~1-3 s)."""

from __future__ import annotations

import os

from jax_ucp._src import format as fmt
from jax_ucp._src import store
from jax_ucp._src import tree as tree_lib
from jax_ucp._src.restoring import locate, sources


def inspect(path: str | os.PathLike) -> fmt.Manifest:
    """The manifest as typed objects (names, shapes, dtypes, bytes, roles, saved sharding).

    ``.notices`` lists what a restore without a target gives back differently from the save:
    a container class outside the allow-list (rebuilt as a dict of its fields). A source
    ``convert`` reads (torch, DeepSpeed, Megatron, a safetensors folder, ...) gives the
    manifest its conversion would write (``import_open.manifest_of``, the format's default
    import options): its tensors and the import's record (``source``), nothing written."""
    found = sources.opening(store.storage_for(path))  # its storage and importer, handed on
    if found.importer is not None:
        from jax_ucp._src.restoring.sources import import_open

        manifest = import_open.manifest_of(found.storage, found.importer)
        manifest.notices = []
        return manifest
    manifest = locate.read_consistently(found.storage, store.read_manifest, manifest=found.manifest)
    manifest.notices = [message for _, message in tree_lib.class_notices(manifest.tree)]
    return manifest
