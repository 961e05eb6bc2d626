"""Export a UCP checkpoint as a torch distributed checkpoint
(:func:`~jax_ucp._src.torchfiles.dcp.write_dcp`)."""

from __future__ import annotations

from jax_ucp._src.exporters import source
from jax_ucp._src.exporters.options import Exported, TorchDcpExport
from jax_ucp._src.torchfiles.dcp import DATA_FILE, METADATA_FILE, DcpItem, write_dcp
from jax_ucp._src.torchfiles.dtypes import torch_dtype


def export(root: str, dst: str, options: TorchDcpExport) -> Exported:
    """The tensors and values under ``select`` as a single-file DCP checkpoint.

    Args:
        root: the UCP checkpoint directory (a manager step already resolved).
        dst: the directory to create.
        options: this format's options (``engine.export`` checked them)."""
    chosen = source.select(root, options, torch_dtype, with_values=True)
    items = [DcpItem(t.name, p, t.shape, t.dtype) for t, p in zip(chosen.tensors, chosen.paths)]
    items += [DcpItem(name, path, value=v) for name, path, v in chosen.values]

    def write(tmp: str) -> list[str]:
        write_dcp(tmp, items, chosen.arrays, chosen.save_id, source.pieces)
        return [METADATA_FILE, DATA_FILE]

    return chosen.exported(dst, source.write_atomically(dst, write, options.force))
