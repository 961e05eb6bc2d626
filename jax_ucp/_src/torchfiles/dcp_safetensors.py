"""torch DCP's rank-local Hugging Face safetensors (``shard-<rank>-model-<i>-of-<n>.safetensors``,
no ``.metadata``) as one DCP checkpoint: each file's ``DCP_SHARDING_INFO`` places its pieces (the
full shape, when unrecorded, their largest extent, as torch takes it), read as raw-byte chunks;
a folder's headers read by ranges through its ``Storage`` (``Storage.reader``)."""

from __future__ import annotations

import os
import warnings
from typing import Any

from jax_ucp._src.errors import SourceError, UCPError
from jax_ucp._src.format import files, safetensors
from jax_ucp._src.store.storage import Storage
from jax_ucp._src.torchfiles import dcp

#: ``__metadata__`` keys of the writer: the version of its layout (``HF_DCP_VERSION``).
DCP_VERSION = "DCP_VERSION"
#: The fields a tensor's DCP_SHARDING_INFO entry may have.
_FIELDS = ("saved_offsets", "global_shape")
#: the largest config.json read beside the files (transformers' is a few KB)
_MAX_CONFIG_BYTES = 1 << 20


def holds_rank_pieces(names: list[str]) -> bool:
    """Whether a folder's entries ``names`` hold rank files of torch DCP's Hugging Face writer
    (so named, beside any other): read here, never as safetensors weights. Nothing fetched."""
    return any(safetensors.RANK_FILE.fullmatch(n) for n in names if "/" not in n)


def _opened(path: os.PathLike | str | Storage) -> tuple[Storage, str, list[str]]:
    """(the folder's storage, its name for messages, the names of its files: a remote prefix's
    from its one listing)."""
    storage = dcp.folder(path)
    return storage, dcp.shown(storage), [n for n in storage.names() if "/" not in n]


def is_rank_local(path: os.PathLike | str | Storage) -> bool:
    """A folder of torch DCP Hugging Face shards (and no ``.metadata``): rank files by name, the
    first of them one rank's piece by its header (cut short: yes, its reader names the fault)."""
    try:
        storage, _, names = _opened(path)
        if dcp.METADATA_FILE in names or not holds_rank_pieces(names):
            return False
        first = min(n for n in names if safetensors.RANK_FILE.fullmatch(n))
        reader = storage.reader(first)
    except (SourceError, OSError):
        return False
    try:  # not the safetensors reader, which would call the folder given one rank's piece
        return safetensors.SafetensorsFile.read_from(first, reader, dcp_shard=True).rank_piece
    except (SourceError, OSError):
        return True


def _dims(value: Any, rank: int, what: str) -> tuple[int, ...]:
    if (
        not isinstance(value, list)
        or len(value) != rank
        or not all(type(v) is int and 0 <= v < 2**48 for v in value)
    ):
        raise SourceError(
            f"{what} is {str(value)[:80]}: expected {rank} non-negative integers (the rank of "
            f"the piece stored)"
        )
    return tuple(value)


def _entries(f: safetensors.SafetensorsFile) -> dict[str, dict[str, tuple[int, ...]]]:
    """The checked DCP_SHARDING_INFO of ``f``: tensor -> {field: dims}, one per tensor."""
    what = f"{f.path}: __metadata__ {safetensors.DCP_SHARDING_INFO}"
    if f.sharding is None:
        raise SourceError(
            f"{f.path}: no {safetensors.DCP_SHARDING_INFO} in its __metadata__, beside torch "
            f"DCP's rank-local shards that have one: not one of their files"
        )
    try:
        info = safetensors.strict_json(f.sharding, what)
    except (ValueError, RecursionError) as e:
        raise SourceError(f"{what}: not valid JSON ({str(e)[:200]})") from None
    if not isinstance(info, dict):
        raise SourceError(f"{what}: expected a JSON object of tensor name -> offsets")
    missing = sorted(set(f.header) - set(info))
    extra = sorted(set(info) - set(f.header))
    if missing or extra:
        name = (missing or extra)[0]
        raise SourceError(
            f"{what}: tensor {name[:100]!r} is "
            f"{'in the file but not in it' if missing else 'in it but not in the file'}; "
            f"each tensor of the file has its offsets"
        )
    out: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, entry in info.items():
        where = f"{what}: tensor {name[:100]!r}"
        unknown = sorted(set(entry) - set(_FIELDS)) if isinstance(entry, dict) else None
        if unknown is None or "saved_offsets" not in entry or unknown:
            raise SourceError(
                f"{where}: {str(entry)[:100]}: expected saved_offsets (and global_shape) only"
                + (f", found {unknown[0][:60]!r}" if unknown else "")
            )
        rank = len(f.header[name][1])
        out[name] = {k: _dims(v, rank, f"{where} {k}") for k, v in entry.items()}
    return out


def _check_index(storage: Storage, root: str, names: list[str], pieces: dict) -> None:
    """The writer's index agrees with the files (a file gone would drop its tensors silently)."""
    if safetensors.INDEX_FILE not in names:
        return
    index = f"{root}/{safetensors.INDEX_FILE}"
    raw = storage.read(safetensors.INDEX_FILE, safetensors.MAX_INDEX_BYTES) or b""
    weight_map = safetensors.weight_map_of(raw, index, ".safetensors")
    for tensor, name in weight_map.items():
        if name not in {p[0] for p in pieces.get(tensor, ())}:
            raise SourceError(
                f"{index}: weight_map puts tensor {tensor[:100]!r} in {name[:100]!r}, which "
                f"does not hold it (or is missing)"
            )
    unlisted = sorted(set(pieces) - set(weight_map))
    if unlisted:
        raise SourceError(f"{index}: tensor {unlisted[0][:100]!r} is in the files, not the index")


def _sharded(pieces: dict[str, list]) -> list[str]:
    """The tensors split over several files (each rank held a piece of them)."""
    return sorted(t for t, found in pieces.items() if len({p[0] for p in found}) > 1)


def _ranks(names: list[str]) -> set[int]:
    return {int(m[1]) for n in names if (m := safetensors.RANK_FILE.fullmatch(n))}


def _check_ranks(root: str, names: list[str], pieces: dict[str, list]) -> None:
    """Every rank from 1 to the highest holds a file (torch's writer numbers them so): a gap is
    a rank file gone, whose pieces and whole tensors would otherwise vanish without a word."""
    ranks = _ranks(names)
    gone = sorted(set(range(1, max(ranks, default=0) + 1)) - ranks)
    if gone:
        raise SourceError(
            f"{root}: no shard-{gone[0]:05d}-model-*.safetensors (rank {gone[0]}) while ranks "
            f"{sorted(ranks)[:8]} wrote theirs: a rank's file is missing; the tensors it held a "
            f"piece of ({', '.join(_sharded(pieces)[:8]) or 'unknown'}) and any it alone held "
            f"would be short or gone"
        )


def _check_config(storage: Storage, root: str, names: list[str], tensors: dict, inferred) -> bool:
    """transformers' ``config.json`` beside the files: its ``vocab_size`` and ``hidden_size`` are
    dimensions of the model's tensors (the embedding's), so shapes inferred from the pieces
    that hold neither mean the files stop short (the last rank's file missing). False: no such
    config to compare with."""
    if "config.json" not in names:
        return False
    try:
        raw = storage.read("config.json", _MAX_CONFIG_BYTES) or b""
        config = files.strict_json(raw, f"{root}/config.json")
    except (UCPError, OSError):
        return False
    dims = {d for t in tensors.values() for d in t.shape}
    wants = (
        [(f, config.get(f)) for f in ("vocab_size", "hidden_size")]
        if isinstance(config, dict)
        else []
    )
    wants = [(f, w) for f, w in wants if type(w) is int and w > 0]
    for field, want in wants:
        if want not in dims:
            last = max(_ranks([c.file for t in tensors.values() for c in t.chunks]), default=0)
            raise SourceError(
                f"{root}: config.json says {field} {want}, but no tensor has that dimension: "
                f"the pieces end short, rank {last + 1}'s file (shard-{last + 1:05d}-model-*"
                f".safetensors) is missing; tensors whose shape is only their pieces' extent: "
                f"{', '.join(inferred[:8])}"
            )
    return bool(wants)


def _shown(shape: tuple[int, ...] | None) -> str:
    return "not recorded" if shape is None else str(list(shape))


def open_rank_local(path: os.PathLike | str | Storage) -> dcp.DcpCheckpoint:
    """Every ``.safetensors`` file of the folder ``path`` (a path or its ``Storage``) checked by
    its header, each tensor's pieces gathered as chunks; no tensor read."""
    storage, root, listed = _opened(path)
    names = sorted(n for n in listed if n.endswith(".safetensors"))
    # tensor -> (file, dtype, offsets, sizes, byte offset, byte length, global_shape or None)
    pieces: dict[str, list[tuple[str, Any, tuple[int, ...], tuple[int, ...], int, int, Any]]] = {}
    versions = set()
    for name in names:
        reader = storage.reader(name)
        f = safetensors.SafetensorsFile.read_from(f"{root}/{name}", reader, dcp_shard=True)
        versions.add(f.metadata.get(DCP_VERSION))
        for tensor, entry in _entries(f).items():
            dtype, sizes, begin, end = f.header[tensor]
            pieces.setdefault(tensor, []).append(
                (
                    name,
                    dtype,
                    entry["saved_offsets"],
                    sizes,
                    f.data_start + begin,
                    end - begin,
                    entry.get("global_shape"),
                )
            )
    if not pieces:
        raise SourceError(f"{root}: no tensor in its torch DCP Hugging Face shards {names[:5]}")
    _check_index(storage, root, listed, pieces)
    _check_ranks(root, names, pieces)
    tensors: dict[str, dcp.DcpTensor] = {}
    inferred = []
    for tensor, found in pieces.items():
        first_file, dtype, offsets, _, _, _, recorded = found[0]
        for file, other, offs, _, _, _, shape in found[1:]:
            if other != dtype or len(offs) != len(offsets) or shape != recorded:
                raise SourceError(
                    f"{root}: tensor {tensor[:100]!r} disagrees between its pieces: {dtype} of "
                    f"rank {len(offsets)}, global_shape {_shown(recorded)} in {first_file}; "
                    f"{other} of rank {len(offs)}, global_shape {_shown(shape)} in {file}"
                )
        if recorded is None:
            inferred.append(tensor)
        shape = (
            recorded
            if recorded is not None
            else tuple(max(p[2][d] + p[3][d] for p in found) for d in range(len(offsets)))
        )
        chunks = tuple(dcp.DcpChunk(p[2], p[3], p[0], p[4], p[5]) for p in found)
        tensors[tensor] = dcp.DcpTensor(tensor, shape, dtype, chunks)
    version = next(iter(versions)) if len(versions) == 1 else None
    notes = ()
    if inferred:
        notes = (
            f"{len(inferred)} of {len(tensors)} tensors' shapes are the extent of their pieces "
            f"across {len(names)} shard files (no global_shape recorded; torch's own "
            f"HuggingFaceStorageReader takes them so): a folder missing its last rank's file "
            f"would read as smaller tensors, so compare the shapes with the model's config",
        )
        if not _check_config(
            storage, root, listed, tensors, inferred
        ):  # nothing tells a last rank gone
            warnings.warn(f"{root}: {notes[0]}", UserWarning, stacklevel=2)
    return dcp.DcpCheckpoint(
        storage,
        tensors,
        {},
        version if isinstance(version, str) else None,
        layout="hf_safetensors",
        notes=notes,
    )
