"""Hugging Face safetensors files read in place by byte ranges from a medium that is no local
directory (an object store's ``s3://`` / ``gs://`` prefix, a Hub repo's ``hf://``): each file's
header checked (its length, then the header, then the file's exact size), each tensor's rows
fetched as byte ranges through TensorStore's kvstore drivers (where the medium says a file is read
from: ``Storage.ranged``), nothing written. What the safetensors importer reads (a convert, or a
direct restore through ``restoring.sources.import_source``). JAX-free.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import tensorstore as ts

from jax_ucp._src import format as fmt
from jax_ucp._src.errors import CheckpointError, SourceError, tensorstore_message
from jax_ucp._src.format import safetensors
from jax_ucp._src.store import shard_reader
from jax_ucp._src.store.storage import Storage, storage_for
from jax_ucp._src.store.storage.base import size_when_short


def holds(prefix: Storage) -> bool:
    """A ``.safetensors`` object, or a prefix / repo holding safetensors (or their index) and
    no ``ucp.json``, in a medium that is no local directory."""
    if prefix.local:  # a local directory: ``format.safetensors`` reads it
        return False
    if prefix.root.rstrip("/").endswith(".safetensors"):
        return True
    if prefix.exists(fmt.MANIFEST_FILE):
        return False
    return prefix.exists(safetensors.INDEX_FILE) or any(
        "/" not in n and n.endswith(".safetensors") for n in prefix.names()
    )


def objects(url: str) -> tuple[Storage, list[str]]:
    """(the medium, the safetensors objects in it) of the checkpoint at ``url``: one storage,
    so a Hub repo's files are all read at the commit it resolved once."""
    if url.endswith(".safetensors"):
        prefix, _, name = url.rpartition("/")
        return storage_for(prefix), [name]
    prefix = storage_for(url)
    raw = prefix.read(safetensors.INDEX_FILE, safetensors.MAX_INDEX_BYTES)
    if raw is None:
        names = sorted(n for n in prefix.names() if "/" not in n and n.endswith(".safetensors"))
        if len(names) != 1:
            raise SourceError(
                f"{url}: {len(names)} .safetensors objects and no {safetensors.INDEX_FILE} "
                f"saying which belong to the model; add the index, or pass the one you mean."
            )
        return prefix, names
    where = prefix.join(safetensors.INDEX_FILE)
    return prefix, sorted(set(safetensors.weight_map_of(raw, where, ".safetensors").values()))


@dataclasses.dataclass
class RemoteTensor:
    """One tensor of a safetensors object: its rows fetched as byte ranges."""

    kv: ts.KvStore
    object: str  # the object's name under the kvstore's prefix
    shown: str  # its URL, for errors
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte in the object

    @property
    def row_bytes(self) -> int:
        return (
            math.prod(self.shape[1:]) * self.dtype.itemsize if self.shape else self.dtype.itemsize
        )

    def rows(self, a: int, b: int) -> np.ndarray:
        """Rows ``a:b`` of the tensor (``[0:1]`` of a scalar), one ranged read."""
        start = self.offset + a * self.row_bytes
        future = self.kv.read(
            self.object, byte_range=slice(start, start + (b - a) * self.row_bytes)
        )
        want = (b - a) * self.row_bytes
        try:
            got = future.result()
        except ValueError as e:  # a range past the end: the object shrank since it was opened
            size_when_short(e, self.shown)  # (another range answered: named as such)
            raise CheckpointError(
                f"{self.shown}: tensor {self.name!r}: rows {a}:{b} cannot be read "
                f"({tensorstore_message(e)})."
            ) from None
        if got.state != "value" or len(got.value) != want:
            raise CheckpointError(
                f"{self.shown}: tensor {self.name!r} truncated or gone (rows {a}:{b} need "
                f"{want} bytes from byte {self.offset + a * self.row_bytes}, got "
                f"{len(got.value) if got.state == 'value' else 'no object'})."
            )
        shard_reader.count_bytes_read(want)
        return np.frombuffer(got.value, self.dtype).reshape((b - a, *self.shape[1:]))


def header(kv: ts.KvStore, name: str, shown: str) -> safetensors.SafetensorsFile:
    """The object's checked header: its length, then the header, then its exact size."""
    try:
        got = kv.read(name, byte_range=slice(0, 8)).result()
    except ValueError as e:  # the server's answer (a Range ignored, an error status), named
        raise SourceError(f"{shown}: {tensorstore_message(e)}") from None
    if got.state != "value":
        raise SourceError(f"{shown}: no such object.")
    if len(got.value) < 8:
        raise SourceError(f"{shown}: {len(got.value)} bytes, too short for a header.")
    n = int.from_bytes(bytes(got.value), "little")
    if n > safetensors.MAX_HEADER_BYTES:
        raise SourceError(f"{shown}: header of {n} bytes (at most {safetensors.MAX_HEADER_BYTES}).")
    try:
        raw = bytes(kv.read(name, byte_range=slice(8, 8 + n)).result().value)
    except ValueError as e:  # shorter than its header says, or another range answered
        size = size_when_short(e, shown)
        raise SourceError(
            f"{shown}: header of {n} bytes, the object "
            f"{f'has {size} bytes' if size is not None else 'ends before it'}."
        ) from None
    if len(raw) != n:
        raise SourceError(f"{shown}: header of {n} bytes, the object ends after {len(raw)}.")
    # the data ends where the last tensor ends: the object must end there too
    parsed = safetensors.SafetensorsFile.from_header(shown, raw, 8 + n, None)
    end = 8 + n + max((e for *_, e in parsed.header.values()), default=0)
    if not _holds(kv, name, end, shown) or _holds(kv, name, end + 1, shown):
        raise SourceError(
            f"{shown}: the header's tensors end at byte {end}; the object is "
            f"{'longer' if _holds(kv, name, end, shown) else 'shorter (truncated)'}."
        )
    return parsed


def _holds(kv: ts.KvStore, name: str, size: int, shown: str) -> bool:
    """Whether object ``name`` has at least ``size`` bytes (a one-byte ranged read before it;
    a range past the end is TensorStore's OUT_OF_RANGE)."""
    try:
        got = kv.read(name, byte_range=slice(size - 1, size)).result()
    except ValueError as e:
        size_when_short(e, shown)
        return False
    return got.state == "value" and len(got.value) == 1


def open_remote(url: str) -> tuple[Storage, dict[str, RemoteTensor]]:
    """(the medium, each tensor by name) of the safetensors checkpoint at ``url`` (a
    ``.safetensors`` object, or a prefix / repo holding them, with the index when several),
    every header checked; no tensor bytes are read."""
    prefix, names = objects(url)
    tensors: dict[str, RemoteTensor] = {}
    for name in names:
        spec, key = prefix.ranged(name)
        kv, shown = ts.KvStore.open(spec).result(), prefix.join(name)
        parsed = header(kv, key, shown)
        for tensor, (dtype, shape, begin, _) in parsed.header.items():
            if tensor in tensors:
                raise SourceError(f"{url}: tensor {tensor[:100]!r} is in two objects.")
            tensors[tensor] = RemoteTensor(
                kv, key, shown, tensor, np.dtype(dtype), tuple(shape), parsed.data_start + begin
            )
    return prefix, tensors
