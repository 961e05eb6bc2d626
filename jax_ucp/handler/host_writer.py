"""Streaming writes of host data (importers), committed atomically.

An importer yields ``HostItem``s; each is written as it comes, with a bounded number of bytes in
flight (``save_plan.PipelinedWriter``), so peak memory is a few tensors, not the checkpoint.  The
directory is committed by Orbax's temporary path + rename: if the generator raises, the
destination is untouched.
"""

from __future__ import annotations

import os
import shutil
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
  replacing = os.path.exists(step_dir)
  if replacing and not force:
    raise FileExistsError(f"{step_dir} already exists; pass force=True to replace step {step}.")
  # An existing step is replaced like a forced standalone save: the new step is committed in a
  # staging manager directory first, then swapped in.
  root = os.path.join(dest, f".ucp-staging-step-{step}") if replacing else dest
  if replacing and os.path.exists(root):
    shutil.rmtree(root)
  options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
  with ocp.CheckpointManager(root, options=options) as mngr:
    try:
      mngr.save(step, args=ocp.args.Composite(**{item_name: args}))
      mngr.wait_until_finished()
    except BaseException:
      api.remove_failed_save_leftovers(os.path.join(root, str(step)))
      if replacing:
        shutil.rmtree(root, ignore_errors=True)
      raise
  if replacing:
    api.replace_committed(os.path.join(root, str(step)), step_dir)
    shutil.rmtree(root)
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
