"""Write tensors as Hugging Face safetensors, one tensor at a time, without torch: every header
computed from shapes and dtypes first, so each file is written front to back in one pass, one row
slab in memory; shards tied by ``model.safetensors.index.json`` as ``transformers`` writes them."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence

import numpy as np

from jax_ucp._src.errors import RequestError
from jax_ucp._src.exporters import by_spec, peft_adapter, source
from jax_ucp._src.exporters.options import Exported, SafetensorsExport
from jax_ucp._src.exporters.source import RowSlabs, Tensor, pieces
from jax_ucp._src.format import safetensors
from jax_ucp._src.writer import durable

SINGLE_FILE = "model.safetensors"
INDEX_FILE = safetensors.INDEX_FILE

#: numpy dtype -> safetensors dtype name: ``format.safetensors.DTYPES`` read the other way.
DTYPE_NAMES: dict[np.dtype, str] = {dt: name for name, dt in safetensors.DTYPES.items()}


def dtype_name(tensor: str, dtype: np.dtype) -> str:
    """The safetensors name of ``dtype``, or an error naming the tensor."""
    name = DTYPE_NAMES.get(np.dtype(dtype))
    if name is None:
        raise RequestError(
            f"tensor {tensor!r}: dtype {np.dtype(dtype)} cannot be stored in safetensors "
            f"(it holds {', '.join(sorted(DTYPE_NAMES.values()))}); pass dtype= to convert it"
        )
    return name


def plan_files(tensors: Sequence[Tensor], max_file_bytes: int) -> list[list[Tensor]]:
    """Tensors grouped in order into files of at most ``max_file_bytes`` (a larger one alone)."""
    files: list[list[Tensor]] = [[]]
    size = 0
    for tensor in tensors:
        if files[-1] and size + tensor.nbytes > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append(tensor)
        size += tensor.nbytes
    return [f for f in files if f] or [[]]


def file_names(count: int) -> list[str]:
    """``model.safetensors``, or ``model-00001-of-00003.safetensors`` ... for several files."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def header_bytes(tensors: Sequence[Tensor], metadata: dict[str, str]) -> bytes:
    """The length-prefixed, space-padded JSON header of a file holding ``tensors`` in order."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for tensor in tensors:
        header[tensor.name] = {
            "dtype": dtype_name(tensor.name, tensor.dtype),
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_file(
    path: str,
    tensors: Sequence[Tensor],
    values: Sequence[np.ndarray | RowSlabs],
    metadata: dict[str, str],
) -> None:
    """Writes one safetensors file, each tensor's bytes slab by slab at its data offset.

    Args:
        path: the file to write.
        tensors: name, dtype and shape of each tensor, in file order.
        values: their arrays (or ``RowSlabs`` ones, read as they are written), in that order,
            of the tensors' shapes and dtypes (``source.select`` plans both alike).
        metadata: the header's ``__metadata__`` strings."""
    with durable.durable_file(path) as f:
        f.write(header_bytes(tensors, metadata))
        for tensor, value in zip(tensors, values, strict=True):
            for piece in pieces(value, f"tensor {tensor.name!r}"):
                f.write(piece.reshape(-1).view(np.uint8).data)
                del piece


def write_index(path: str, files: Sequence[Sequence[Tensor]], names: Sequence[str]) -> None:
    """``model.safetensors.index.json``: total size and the file of every tensor.

    Args:
        path: the index file to write.
        files: the tensors of each shard file, in file order.
        names: the shard files' names."""
    index = {
        "metadata": {"total_size": sum(t.nbytes for group in files for t in group)},
        "weight_map": {t.name: name for group, name in zip(files, names) for t in group},
    }
    durable.write_file(path, json.dumps(index, indent=2) + "\n")


def export(root: str, dst: str, options: SafetensorsExport) -> Exported:
    """The tensors under ``select`` as ``model.safetensors`` (or shards), and ``config.json``;
    with ``adapter``, peft's ``adapter_model.safetensors`` and ``adapter_config.json``.

    Args:
        root: the UCP checkpoint directory (a manager step already resolved).
        dst: the directory to create.
        options: this format's options (``engine.export`` checked them)."""
    chosen = source.select(root, options, dtype_name, with_values=False)
    if options.adapter:  # peft reads one file and the adapter's config as recorded
        tensors = peft_adapter.without_base(chosen.tensors, chosen.recorded)
        config_file, groups = peft_adapter.CONFIG_FILE, [tensors]
        config = peft_adapter.adapter_config(tensors, options.config, chosen.recorded)
    else:  # the one given, else the import's; of a family the spec maps (checked before writing)
        config_file = "config.json"
        groups = plan_files(chosen.tensors, int(options.max_file_bytes))  # parsed
        config = by_spec.config_for(chosen.spec, options.config, chosen.recorded)

    def write(tmp: str) -> list[str]:
        names = [peft_adapter.WEIGHTS_FILE] if options.adapter else file_names(len(groups))
        metadata = {"format": "pt", "jax_ucp.save_id": chosen.save_id}
        arrays = dict(zip((t.name for t in chosen.tensors), chosen.arrays))
        for group, name in zip(groups, names):
            write_file(os.path.join(tmp, name), group, [arrays[t.name] for t in group], metadata)
        if len(groups) > 1:
            write_index(os.path.join(tmp, INDEX_FILE), groups, names)
            names.append(INDEX_FILE)
        if config is not None:
            text = json.dumps(config, indent=2, sort_keys=True)
            durable.write_file(os.path.join(tmp, config_file), text + "\n")
            names.append(config_file)
        return names

    return chosen.exported(dst, source.write_atomically(dst, write, options.force))
