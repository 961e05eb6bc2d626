"""Hugging Face safetensors in an object store (``s3://``, ``gs://``) or a Hub repo (``hf://``)
restored in place onto a mesh, as ``safetensors_source`` restores local files: each process
fetches only the byte ranges of the rows its devices' slices cover (one ranged GET per row
range, ``store.safetensors_remote``), nothing written. The tensors are seen as a conversion
would hold them (``params/<HF name>``); a spec's transforms are read through lazy TensorStore
views. JAX-free.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from jax_ucp._src import format as fmt
from jax_ucp._src import store
from jax_ucp._src.errors import MultiProcessError
from jax_ucp._src.restoring.engine import OpenedSource, TensorSource
from jax_ucp._src.restoring.model import Available
from jax_ucp._src.store import safetensors_remote

ROOT = "params"  # where the importer puts the weights, as safetensors_source
#: an object-store ``.safetensors`` object, or a prefix / Hub repo of them and no ``ucp.json``
is_source = safetensors_remote.holds


@contextlib.contextmanager
def opened_source(url, spec=None) -> Iterator[OpenedSource]:
    """The safetensors checkpoint at ``url`` opened for one restore (``jax_ucp.restore``).

    Args:
      url: a ``.safetensors`` object, or a prefix holding them (with the index when several).
      spec: a UCP-language spec whose views of the tensors are restored (None: the tensors).
    """
    url = _one_revision(str(url).rstrip("/"))
    _, found = safetensors_remote.open_remote(url)  # a Hub repo: at one commit throughout
    tensors = {(ROOT, name): t for name, t in found.items()}
    yield OpenedSource(RemoteSafetensorsSource(url, tensors), _available(tensors, spec))


def _one_revision(url: str) -> str:
    """``url`` as process 0 of a multi-process job resolved it (``Storage.absolute``: a Hub
    branch pinned to its commit), so that every process reads one revision of it."""
    import jax

    if jax.process_count() == 1:
        return url
    from jax_ucp._src.multihost import agreement

    try:
        hello = {"url": store.storage_for(url).absolute()}
    except fmt.UCPError as e:  # posted, so that the others stop waiting
        hello = {"error": f"{type(e).__name__}: {e}"[:2000]}
    where = f"{url}: opening it in {jax.process_count()} processes:"
    peers = agreement.Exchange("remote-safetensors", where, 300.0, hello=hello).peers
    for i, peer in enumerate(peers):
        if "error" in peer:
            raise MultiProcessError(f"{where} process {i}: {peer['error']}")
    return peers[0]["url"]


def _available(tensors: dict, spec) -> dict[tuple[str, ...], Available]:
    if spec is None:
        return {k: _stored(k, t.shape, t.dtype) for k, t in tensors.items()}
    from jax_ucp._src import language  # restore-time transforms

    saved = {k: language.TensorInfo(shape=t.shape, dtype=t.dtype) for k, t in tensors.items()}
    return {
        tuple(key): Available.view(key, plan, tuple(tuple(s) for s in plan.sources))
        for key, plan in language.compile_restore_plan(spec, saved).items()
    }


def _stored(key, shape, dtype) -> Available:
    return Available(
        key=key,
        key_types=("key",) * len(key),
        shape=tuple(shape),
        dtype=np.dtype(dtype),
        sources=(key,),
        build=lambda opened: opened[key],
        stored=True,
    )


class RemoteSafetensorsSource(TensorSource):
    """Safetensors objects read in place by byte ranges."""

    metadata = "safetensors header"

    def __init__(self, url: str, tensors: dict):
        self.path, self.where = url, f"the safetensors checkpoint {url}"
        self.tensors = tensors

    def files(self, found: Available) -> str:
        return ", ".join(f"{self.tensors[k].shown}:{k[-1]}" for k in found.sources[:3])

    def holder(self, found: Available) -> str:
        return self.files(found)

    def reader(self, found: Available):
        if found.stored and found.shape:
            return self.tensors[found.sources[0]]
        return found.build({k: self.tensors[k].view() for k in found.sources})

    def prepare(self, tensors) -> None:
        """Nothing to open: the objects are fetched by range as they are read."""

    def check_fits(self, found: Available, limit: int, what: str) -> None:
        """A region's rows are fetched whole: no more than the request's own bytes."""

    def verify(self, found: Available, reader) -> None:
        """Safetensors carry no checksum: the header was checked when opened."""

    def unit_rows(self, found: Available) -> int:
        return 1
