"""Hugging Face safetensors weights as an import plan: ``params/<HF name>`` in the stored dtype,
each tensor a read-only view of a memory map (read with ``pread``: the writer streams it, a direct
restore reads each region's rows straight into its buffer), or in an object store or Hub repo a
``Deferred`` whose rows are ranged reads.

Shared importer layer: the safetensors importer's plan, and torchtune's (its ``epoch_N/``
folders are such weights). Format packages never import each other; what two of them share
lives here.
"""

from __future__ import annotations

import os

from jax_ucp._src import store, writer
from jax_ucp._src.errors import SourceError
from jax_ucp._src.format import safetensors
from jax_ucp._src.importers.plan import (
    ImportOptions,
    ImportPlan,
    host_item,
    jsonable,
    refuse_spec,
    skip,
)
from jax_ucp._src.importers.trainer_files import (
    CONFIG_FILE,
    adapter_beside_model,
    read_json,
    side_file,
)
from jax_ucp._src.store import safetensors_remote

__all__ = ["plan_safetensors"]


def plan_safetensors(src, options: ImportOptions) -> ImportPlan:
    """The import of a Hugging Face safetensors checkpoint (file, directory or sharded index).

    Args:
        src: a ``.safetensors`` file, a folder, or a sharded index.
        options: ``spec`` refused (Hugging Face's names are kept); ``weights_only``: the model
            weights alone, a torch optimizer beside them in ``source.skipped`` (else refused).
    """
    spec, weights_only, share = options.spec, options.weights_only, options.share
    refuse_spec(spec, "safetensors imports keep Hugging Face's names", SourceError)
    storage = store.storage_for(src)  # the importer's (torchtune's: a path)
    src = storage.root
    if not storage.local:  # an object store's or the Hub's: read by ranges
        return _plan_remote(src, options)
    opened, owner = safetensors.open_checkpoint(src)
    names = sorted(owner)
    dtypes = sorted({str(owner[n].header[n][0]) for n in names})
    source = {
        "framework": "safetensors",
        "path": os.path.abspath(src),
        "files": [os.path.basename(f.path) for f in opened],
        "dtypes": dtypes,
        "metadata": {k: v for f in opened for k, v in f.metadata.items() if isinstance(v, str)},
    }
    found = list(names)
    if os.path.isdir(src) and os.path.isfile(config := side_file(src, CONFIG_FILE)):
        config = read_json(config)  # the model's settings: an export writes them back
        if isinstance(config, dict):
            source["config"] = {k: jsonable(v) for k, v in config.items()}
    # a Trainer's optimizer.pt (Accelerate's optimizer.bin) in the folder would be lost without a
    # word if the weights were imported alone; a file given by its own path is that file only
    beside = ("optimizer.pt", "optimizer.bin") if os.path.isdir(src) else ()
    trainer_state = next((p for n in beside if os.path.lexists(p := os.path.join(src, n))), None)
    if trainer_state is not None:
        optimizer_file = os.path.basename(trainer_state)
        trainer = optimizer_file == "optimizer.pt"
        writer_name = "Hugging Face Trainer" if trainer else "Accelerate save_state"
        if not weights_only:
            raise SourceError(
                f"{trainer_state}: {'a' if trainer else 'an'} {writer_name} "
                f"{'checkpoint' if trainer else 'folder'}; its "
                f"torch optimizer state ({optimizer_file}, keyed by parameter index) is not "
                f"imported. To import the model weights without it: convert(..., "
                f"importing=ImportOptions(weights_only=True)) / jax-ucp convert --weights-only"
            )
        # not opened (it is not read): accounted for as one unit
        skip(source, [optimizer_file], f"weights_only: {writer_name}'s torch optimizer state")
        found.append(optimizer_file)
    adapters = adapter_beside_model(src)  # LoRA / peft adapter files: listed, never ignored
    for name, why in adapters.items():
        skip(source, [name], why)
        found.append(name)
    mine = share.pick(names)
    items = (
        host_item(
            ("params", n),
            owner[n].tensor(n),  # a mapped view: never touched, read with pread
            {"file": os.path.basename(owner[n].path), "tensors": [n]},
        )
        for n in mine
    )
    return ImportPlan(items, source, len(mine), source_tensors=found)


def _plan_remote(url: str, options: ImportOptions) -> ImportPlan:
    """The import of safetensors in an object store or a Hub repo (``hf://``): each tensor's
    rows ranged reads (in slabs when larger than the memory budget); ``path`` the source as
    read, a Hub repo's pinned to the commit it was read at (``hf://ORG/NAME@SHA``)."""
    prefix, tensors = safetensors_remote.open_remote(url.rstrip("/"))
    names = sorted(tensors)
    source = {
        "framework": "safetensors",
        "path": prefix.absolute(),
        "files": sorted({t.shown.rpartition("/")[2] for t in tensors.values()}),
        "dtypes": sorted({str(tensors[n].dtype) for n in names}),
    }

    def deferred(t: safetensors_remote.RemoteTensor) -> writer.Deferred:
        rows = t.shape[0] if t.shape else 1
        return writer.Deferred(
            t.shape,
            t.dtype,
            lambda: t.rows(0, rows).reshape(t.shape),
            rows=t.rows if t.shape else None,
            ranged=True,
        )

    mine = options.share.pick(names)
    items = (
        host_item(("params", n), deferred(tensors[n]), {"file": tensors[n].shown, "tensors": [n]})
        for n in mine
    )
    return ImportPlan(items, source, len(mine), source_tensors=names)
