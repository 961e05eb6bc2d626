"""Opening what a restore reads: a UCP checkpoint first (read whole while a concurrent forced
save swaps it, ``locate.read_consistently``), else Hugging Face safetensors read in place.
JAX-free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax_ucp._src.restoring import locate, safetensors_source, ucp_source
from jax_ucp._src.restoring.engine import OpenedSource


def read_source(path, spec, use: Callable[[OpenedSource], Any]):
    """``use(the source at path, opened)``: a UCP checkpoint (``locate.is_ucp``: detected
    first), else safetensors files, else the error ``locate.find_checkpoint_dir`` gives.

    Args:
      path: a checkpoint directory, an Orbax step directory holding one UCP item, an
        object-store URL, or a ``.safetensors`` file or folder.
      spec: a UCP-language spec whose views of the tensors are offered (None: the tensors).
      use: reads the opened source (run again on the new checkpoint if a forced save swapped
        it meanwhile).
    """
    if locate.is_ucp(path) or not safetensors_source.is_source(path):
        return locate.read_consistently(
            path, lambda root: use(ucp_source.open_checkpoint(root, spec))
        )
    with safetensors_source.opened_source(path, spec) as opened:
        return use(opened)
