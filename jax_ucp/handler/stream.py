"""Streams of host tensors (what importers produce), written one tensor at a time.

Free of JAX and Orbax: an import is a host-only job (see ``host_writer``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import tensorstore as ts

from jax_ucp import format as fmt
from jax_ucp import store
from jax_ucp.handler import tensor_writes


@dataclasses.dataclass
class HostItem:
    """One tensor (or JSON scalar) of a stream.

    ``value`` must not be modified once yielded: TensorStore may encode straight from it while
    later items are produced (importers yield read-only memory maps or fresh arrays).
    """

    key: tuple[str, ...]
    value: Any  # np.ndarray (incl. memmap, ml_dtypes), tensorstore.TensorStore, or JSON scalar
    role: str | None = None
    sub_role: str | None = None
    provenance: dict | None = None
    logical_axes: tuple | None = None


async def write_stream(
    directory: os.PathLike | str,
    items: Iterable[HostItem],
    *,
    source: Mapping | None = None,
    compression: str | None = None,
    inner_chunk_bytes: int | None = None,
    sync: bool = True,
) -> None:
    """Writes every item under ``directory``, then ``ucp.json`` (single process: the primary).

    ``sync=False`` defers durability to the caller (``commit.commit`` syncs the file system once).
    """
    directory = os.fspath(directory)
    options = tensor_writes.SaveOptions(
        compression=compression,
        inner_chunk_bytes=inner_chunk_bytes or store.DEFAULT_INNER_CHUNK_BYTES,
    )
    entries: list[fmt.Entry] = []
    writer = tensor_writes.PipelinedWriter(directory, sync=sync)
    try:
        for item in items:
            key = tuple(str(k) for k in item.key)
            kinds = ("key",) * len(key)
            v = item.value
            if isinstance(v, (type(None), bool, int, float, str)):
                entries.append(
                    tensor_writes.value_entry(key, kinds, v, role=item.role, sub_role=item.sub_role)
                )
                continue
            if not isinstance(v, (np.ndarray, np.generic, ts.TensorStore)):
                raise TypeError(
                    f"HostItem {fmt.key_to_str(key)!r}: cannot write a {type(v).__name__}."
                )
            p = tensor_writes.prepare_host_tensor(
                key,
                kinds,
                v,
                options,
                primary=True,
                stable_source=True,
                role=item.role,
                sub_role=item.sub_role,
                provenance=item.provenance,
                logical_axes=item.logical_axes,
            )
            await writer.add(p)  # returns once in-flight tensors are under the byte cap
            entries.append(p.entry)
            del p, v
        await writer.flush()
    except BaseException:
        await writer.abandon()
        raise
    manifest = tensor_writes.build_manifest(entries, source=source)
    with open(os.path.join(directory, fmt.MANIFEST_FILE), "w") as f:
        f.write(manifest.dumps())
