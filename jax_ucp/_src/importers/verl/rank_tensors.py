"""The model's tensors across verl's rank files: each rank's piece of a DTensor (FSDP2,
``Shard(0)``) or ShardedTensor (FSDP1), checked to agree and to tile the tensor, read into
place one tensor at a time (:mod:`jax_ucp._src.torchfiles.sharded`), each a torch state's
``TensorRef`` (tied keys known by their shared storage)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from jax_ucp._src.errors import SourceError
from jax_ucp._src.format import files
from jax_ucp._src.importers.torch_state import TensorRef
from jax_ucp._src.store.storage import Storage
from jax_ucp._src.torchfiles import allow_list, sharded, torch_zip

__all__ = ["Params", "Pieces", "gather", "load", "parameters", "tensor_ref"]


Params = dict[str, tuple[tuple[int, ...], np.dtype, "Pieces"]]


def load(folder: Storage, name: str) -> Any:
    """Rank file ``name`` of ``folder``, its tensors' stand-ins read (a link out refused)."""
    try:
        return torch_zip.load_torch_file((folder, name), allow_list.SHARDED_TENSOR_CLASSES)
    except (allow_list.TorchFileError, files.UnsafeFileError) as e:
        raise SourceError(str(e)) from None


def _pieces(value: Any, world: int, file: str, key: str) -> list[sharded.Piece]:
    """The blocks of ``value`` (DTensor / ShardedTensor / plain tensor) this rank holds."""
    if isinstance(value, np.ndarray):
        return [sharded.Piece((0,) * value.ndim, value, replicated=True)]
    if not isinstance(value, allow_list.WrapperTensor):
        raise SourceError(f"{file}: {key!r} holds a {type(value).__name__}, expected a tensor")
    try:
        return sharded.local_pieces(value, world)
    except sharded.ShardLayoutError as e:
        raise SourceError(f"{file}: {key!r}: {e}") from None


Pieces = list[tuple[str, "sharded.Piece | None"]]  # (file, its block; None: rank 0's copy)


def gather(
    what: str, values: list[Any], files_: list[str], world: int, folder: str
) -> tuple[tuple[int, ...], np.dtype, Pieces]:
    """One tensor's pieces from every rank, checked to agree on shape and dtype and to tile it;
    a replicated tensor is read from rank 0's file (the others' copies named as its source).

    Args:
        what: the tensor's key, for errors.
        values: its value in each rank's file, by rank.
        files_: the rank files' names, by rank.
        world: the number of ranks.
        folder: the folder of the rank files.
    """
    first = values[0]
    shape = tuple(first.shape)
    dtype = np.dtype(first.dtype)
    out: Pieces = []
    kind = getattr(first, "qualname", "tensor")
    for file, value in zip(files_, values):
        if getattr(value, "qualname", "tensor") != kind:  # files of two runs (FSDP1 and FSDP2)
            raise SourceError(
                f"{os.path.join(folder, file)}: {what!r} is a "
                f"{getattr(value, 'qualname', 'tensor').rsplit('.', 1)[-1]}, rank 0's "
                f"({files_[0]}) a {kind.rsplit('.', 1)[-1]}: the rank files are of different saves"
            )
        if tuple(value.shape) != shape or np.dtype(value.dtype) != dtype:
            raise SourceError(
                f"{os.path.join(folder, file)}: {what!r} is {tuple(value.shape)} {value.dtype}, "
                f"rank 0's ({files_[0]}) {shape} {dtype}"
            )
        out += [(file, p) for p in _pieces(value, world, os.path.join(folder, file), what)]
    blocks = [p for _, p in out if p is not None]
    if all(p.replicated for p in blocks):  # the same tensor on every rank: rank 0's is read
        return shape, dtype, [(f, p if i == 0 else None) for i, (f, p) in enumerate(out)]
    if any(p.replicated for p in blocks):
        raise SourceError(f"{folder}: {what!r} is sharded on some ranks and whole on others")
    problem = sharded.covers(shape, blocks)
    if problem:
        raise SourceError(
            f"{folder}: the {world} ranks' pieces of {what!r} ({shape}) do not tile it: {problem}"
        )
    return shape, dtype, out


def parameters(
    folder: str, names: list[str], models: list[Any], world: int, found: list[str]
) -> Params:
    """The model's tensors, by name in the state dict's order, every rank's keys equal.

    Args:
        folder: the folder of the rank files.
        names: the model rank files' names, by rank.
        models: their loaded state dicts, by rank.
        world: the number of ranks.
        found: every source tensor's name, added to.
    """
    for name, state in zip(names, models):
        if not isinstance(state, dict):
            raise SourceError(
                f"{os.path.join(folder, name)}: holds a {type(state).__name__}, expected "
                f"model.state_dict()"
            )
        if list(state) != list(models[0]):
            extra = sorted(set(map(str, state)) ^ set(map(str, models[0])))
            raise SourceError(
                f"{os.path.join(folder, name)}: its keys differ from {names[0]}'s"
                + (f" ({', '.join(extra[:6])})" if extra else " (order)")
            )
    params: Params = {}
    for key in models[0]:
        key_s = str(key)
        params[key_s] = gather(key_s, [m[key] for m in models], names, world, folder)
        found += [f"{file}/{key_s}" for file in names]
    return params


def tensor_ref(what: str, shape, dtype, pieces: Pieces) -> TensorRef:
    """One tensor of the rank files, named ``<file>/<what>`` after each rank's file, assembled
    from its pieces when the writer has room for it (in row slabs when it is larger than the
    budget). Its identity is where its bytes lie on every rank: a tied ``lm_head.weight`` saved
    beside ``model.embed_tokens.weight`` shares one storage in each rank's file.

    Args:
        what: its key in the rank files.
        shape: its global shape.
        dtype: its dtype.
        pieces: (file, its block) of every rank (``gather``).
    """
    blocks = [p for _, p in pieces if p is not None]
    names = [f"{f}/{what}" for f, _ in pieces]
    where = tuple(
        (f, p.offsets, p.array.__array_interface__["data"][0], p.array.strides)
        for f, p in pieces
        if p is not None and p.array.size
    )
    return TensorRef(
        names[0],
        shape,
        dtype,
        lambda: sharded.assemble(shape, dtype, blocks),
        {},
        identity=(shape, str(dtype), where) if where else None,
        rows=lambda a, b: sharded.assemble(shape, dtype, blocks, a, b),
        other_names=tuple(names[1:]),
    )
