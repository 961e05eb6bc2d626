"""``jax_ucp.restore``, importing JAX but not Orbax (a restore reads through TensorStore; only
saving and Orbax's handlers need Orbax, ~0.5 s more to start)."""

from __future__ import annotations

import dataclasses
import os
import warnings

from jax_ucp._src.errors import CheckpointError, ResumeWarning
from jax_ucp._src.options import keywords_of
from jax_ucp._src.restoring import locate, requests
from jax_ucp._src.restoring import options as restore_options


@keywords_of(restore_options.RestoreOptions)
def restore(path: str | os.PathLike, options: restore_options.RestoreOptions):
    """Restores a UCP checkpoint onto any mesh; the keywords are ``RestoreOptions``' fields
    (``target`` may be given second, positionally).

    Args:
      path: the checkpoint directory (holding ucp.json) or an Orbax step directory with one UCP
        item; or Hugging Face safetensors (a ``.safetensors`` file, or a folder of them with
        ``model.safetensors.index.json``), read in place as its conversion would hold it
        (``params/<HF name>``): each process reads only its slices' byte ranges, a ``spec``
        (``"hf_llama"``) applied as lazy views; no copy on disk.
      options: built from the keywords, each documented in ``RestoreOptions``.
    """
    if options.step is not None:  # a CheckpointManager root: one of its committed steps
        return _restore_step(os.fspath(path), options)
    # the source opened (a UCP checkpoint first, else safetensors) -> its requests -> the engine
    return requests.restore_tree(path, options)


def _restore_step(root: str, options: restore_options.RestoreOptions):
    """``restore(root, step=N | "latest", fallback=)``: the step's UCP item restored; for
    "latest" the newest committed step that reads, older ones only with ``fallback``."""
    steps = locate.committed_steps(root)
    listed = ", ".join(str(s) for s, _ in steps[:10]) or "none"
    plain = dataclasses.replace(options, step=None, fallback=False)
    if options.step != "latest":
        chosen = [item for s, item in steps if s == options.step]
        if not chosen:
            raise CheckpointError(
                f"{root}: no committed step {options.step} with a UCP item (committed: {listed})."
            )
        return requests.restore_tree(chosen[0], plain)
    if not steps:
        raise CheckpointError(f"{root}: no committed step with a UCP item.")
    why: list[str] = []
    for step, item in steps:
        try:
            locate.check_readable(item)
            return requests.restore_tree(item, plain)
        except CheckpointError as e:
            if not options.fallback:
                raise CheckpointError(
                    f"{root}: the latest committed step {step} cannot be read: {e} "
                    f"(committed steps: {listed}; step='latest', fallback=True moves on to the "
                    f"next older one)"
                ) from e
            why.append(f"step {step}: {e}")
            warnings.warn(
                f"{root}: step {step} skipped, it cannot be read: {e}", ResumeWarning, stacklevel=3
            )
    raise CheckpointError(f"{root}: no committed step can be read: {'; '.join(why)[:2000]}")
