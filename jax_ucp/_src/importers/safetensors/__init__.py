"""Hugging Face safetensors: a single ``model.safetensors`` or shards with
``model.safetensors.index.json``, read without torch and without the ``safetensors`` package.

Headers are parsed and checked by ``format.safetensors`` (bounded, ranges against the file,
dtype and shape, no overlaps, no duplicate keys, index names only files beside it). Every tensor
is a read-only view of a memory map, streamed one at a time into the writer, so memory stays at a
few tensors whatever the model size.

Output tree: ``params/<HF name>`` in the stored dtype (safetensors hold model weights, not fp32
masters: bf16 stays bf16, bit for bit), no optimizer state. The plan is
:mod:`~jax_ucp._src.importers.safetensors_weights`'s (torchtune's weights are planned there too).
"""

from __future__ import annotations

import os

from jax_ucp._src.errors import RequestError
from jax_ucp._src.format import safetensors
from jax_ucp._src.importers import trainer_files
from jax_ucp._src.importers.plan import Detection, ImportOptions, ImportPlan
from jax_ucp._src.importers.safetensors_weights import holds_remote, plan_safetensors
from jax_ucp._src.store.storage import Storage

__all__ = ["detect", "plan"]


def detect(storage: Storage) -> Detection:
    """Whether ``src`` is a ``.safetensors`` file or a folder of them (with or without the
    index), from names and headers' lengths only. A folder is a weak claim: DeepSpeed,
    Megatron, Orbax and torch DCP folders may hold safetensors too."""
    src = storage.root
    if holds_remote(storage):  # read in place by ranges (a Trainer's folder: by hf_trainer)
        return Detection(True, "Hugging Face safetensors (read by ranges)", weak=True)
    if os.path.isfile(src):
        if src.endswith(".safetensors"):
            return Detection(True, "a .safetensors file")
        return Detection(False, "not a .safetensors file")
    if os.path.isdir(src) and safetensors.is_safetensors(src):
        return Detection(True, "Hugging Face safetensors", weak=True)
    return Detection(
        False, f"no Hugging Face safetensors (`*.safetensors`, `{safetensors.INDEX_FILE}`)"
    )


def plan(storage: Storage, options: ImportOptions) -> ImportPlan:
    """safetensors weights (:func:`~jax_ucp._src.importers.safetensors_weights.plan_safetensors`),
    a torch optimizer beside them refused unless only weights are wanted. ``options``: the torch
    importer's (``TorchOptions``). A folder beside a torch optimizer (a Trainer
    ``checkpoint-N/``, Accelerate's ``save_state``) is taken over by the torch format's
    ``hf_trainer`` importer (its ``takes_over``), which maps that state too."""
    for field in ("parameter_order", "model_config"):
        if getattr(options, field, None) is not None:
            raise RequestError(
                f"{storage.root}: {field}= orders a torch optimizer's state; these safetensors "
                f"come without one (or weights_only=True)"
            )
    trainer_files.check_optimizer_beside_scheduler(storage, options.weights_only)
    return plan_safetensors(storage, options)
