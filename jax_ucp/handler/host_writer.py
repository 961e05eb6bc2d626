"""Streaming writes of host data (importers): one tensor at a time, committed atomically.

An importer yields ``HostItem``s; each is written and released before the next is pulled, so
peak memory is one tensor, not the checkpoint.  The directory is committed by Orbax's temporary
path + rename: if the generator raises, the destination is untouched.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

import orbax.checkpoint as ocp

from jax_ucp.handler import api
from jax_ucp.handler.stream import HostItem, UCPStreamSave


def write_host_checkpoint(dest, items: Iterable[HostItem], *, force: bool = False,
                          source: Optional[Mapping] = None, step: Optional[int] = None,
                          item_name: str = "state", compression: Optional[str] = None) -> str:
  """Writes ``items`` as a UCP checkpoint at ``dest`` (or as step ``step`` of a manager dir).

  Returns the UCP directory (the one holding ucp.json).
  """
  dest = os.path.abspath(os.fspath(dest))
  args = UCPStreamSave(items=items, source=dict(source or {}), compression=compression)
  if step is None:
    if os.path.exists(dest) and not force:
      raise FileExistsError(f"{dest} already exists; pass force=True to replace it.")
    api.atomic_save(dest, args, force=force)
    return dest
  step_dir = os.path.join(dest, str(step))
  if os.path.exists(step_dir) and not force:
    raise FileExistsError(f"{step_dir} already exists; pass force=True to replace step {step}.")
  options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
  with ocp.CheckpointManager(dest, options=options) as mngr:
    try:
      mngr.save(step, args=ocp.args.Composite(**{item_name: args}), force=force)
      mngr.wait_until_finished()
    except BaseException:
      api.remove_failed_save_leftovers(step_dir)
      raise
  return os.path.join(step_dir, item_name)


def host_items_with_progress(tensors: Iterable[Any], total: int,
                             progress: Optional[Callable[[str, int, int], None]]) -> Iterator[HostItem]:
  """Importer tensors (anything with key/value/provenance) → HostItems, reporting each parameter.

  ``progress(name, done, total)`` counts the ``params`` entries, which is what a user waits on.
  """
  done = 0
  for t in tensors:
    yield HostItem(key=t.key, value=t.value, provenance=t.provenance)
    if t.key[0] == "params":
      done += 1
      if progress is not None:
        progress(t.key[-1], done, total)
