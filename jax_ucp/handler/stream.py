"""Streams of host tensors (what importers produce), written one tensor at a time."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional

import numpy as np
import tensorstore as ts
from orbax.checkpoint import checkpoint_args

from jax_ucp import format as fmt
from jax_ucp.handler import save_plan


@dataclasses.dataclass
class HostItem:
  key: tuple[str, ...]
  value: Any  # np.ndarray (incl. memmap, ml_dtypes), tensorstore.TensorStore, or JSON scalar
  role: Optional[str] = None
  sub_role: Optional[str] = None
  provenance: Optional[dict] = None
  logical_axes: Optional[tuple] = None


@dataclasses.dataclass
class UCPStreamSave(checkpoint_args.CheckpointArgs):
  """Save args for a stream of ``HostItem`` (single process: the primary writes everything)."""

  items: Iterable[HostItem]
  source: Optional[dict] = None
  compression: Optional[str] = None
  inner_chunk_bytes: Optional[int] = None


async def write_stream(directory, args: UCPStreamSave) -> None:
  options = save_plan.SaveOptions(
      compression=args.compression,
      inner_chunk_bytes=args.inner_chunk_bytes or save_plan.store.DEFAULT_INNER_CHUNK_BYTES)
  entries: list[fmt.Entry] = []
  writer = save_plan.PipelinedWriter(directory)
  try:
    for item in args.items:
      key = tuple(str(k) for k in item.key)
      kinds = ("key",) * len(key)
      v = item.value
      if isinstance(v, (type(None), bool, int, float, str)):
        entries.append(save_plan.value_entry(key, kinds, v, role=item.role, sub_role=item.sub_role))
        continue
      if not isinstance(v, (np.ndarray, np.generic, ts.TensorStore)):
        raise TypeError(f"HostItem {fmt.key_to_str(key)!r}: cannot write a {type(v).__name__}.")
      p = save_plan.prepare_host_tensor(key, kinds, v, options, primary=True, role=item.role,
                                        sub_role=item.sub_role, provenance=item.provenance,
                                        logical_axes=item.logical_axes)
      await writer.add(p)  # returns once in-flight tensors are under the byte cap
      entries.append(p.entry)
      del p, v
    await writer.flush()
  except BaseException:
    await writer.abandon()
    raise
  manifest = save_plan.build_manifest(entries, source=args.source)
  (directory / fmt.MANIFEST_FILE).write_text(manifest.dumps())
