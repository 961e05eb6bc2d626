"""Export a jax_ucp checkpoint to formats PyTorch tools read (``jax_ucp.export``).

Above the handler (it reads through the same strict reader as a restore: digests, crc32c,
casting rules) and below the CLI. Torch-free: every format is written byte by byte
(``safetensors_out``: Hugging Face safetensors; ``torch_out``: torch.save archives and DCP).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_ucp import format as fmt
from jax_ucp.exporters import safetensors_out, torch_out
from jax_ucp.exporters.safetensors_out import ExportError
from jax_ucp.handler import reader
from jax_ucp.writer import commit, durable

__all__ = ["ExportError", "Exported", "FORMATS", "export"]

FORMATS = ("safetensors", "torch-dcp")


@dataclasses.dataclass(frozen=True)
class Exported:
    """What ``export`` wrote: the destination, its files, the tensors, and what it left out."""

    path: str
    files: list[str]
    tensors: int
    bytes: int
    skipped: list[str]  # leaves outside ``select`` or not tensors (saved Python values)


def export(
    ckpt: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    to: str = "safetensors",
    select: str | None = None,
    spec: Any = None,
    dtype: Any = None,
    casting: str = "same_kind",
    max_file_bytes: int = 5 * 10**9,
    force: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
) -> Exported:
    """Writes the tensors of the checkpoint ``ckpt`` to ``dst`` in the format ``to``.

    Streamed one tensor at a time (memory: the largest tensor), atomic (written into a temporary
    sibling of ``dst`` and renamed into place: a failed export leaves ``dst`` as it was).

    Args:
        ckpt: a jax_ucp checkpoint directory (or an Orbax step holding one UCP item).
        dst: the directory to create.
        to: ``"safetensors"`` (``model.safetensors``, or shards plus
            ``model.safetensors.index.json``) or ``"torch-dcp"`` (a
            ``torch.distributed.checkpoint`` directory: ``.metadata`` + ``__0_0.distcp``).
        select: the key-path prefix to export: ``"params"`` (the model weights), ``"opt_state/mu"``,
            ``""`` for everything. Default: ``"params"`` for safetensors, everything (params,
            optimizer state, saved Python values) for torch-dcp. Names are the rest of the key
            path joined with ``.`` (a checkpoint imported from safetensors gives back its
            Hugging Face names; DCP's nested state dicts use the same dotted names).
        spec: a UCP-language spec (name, path or ``Spec``) whose restore-time views are
            exported instead of the stored arrays (renames, splits, stacks).
        dtype: write every tensor in this dtype (e.g. ``"bfloat16"``); default: as saved.
        casting: numpy casting rule for ``dtype`` (a float narrowed to an int needs "unsafe").
        max_file_bytes: safetensors: data bytes per file before the output is split.
        force: replace ``dst`` if it is an earlier export (never any other directory).
        progress: called as ``progress(name, done, total)`` after each tensor.

    Raises:
        ExportError: nothing can be exported as asked (a dtype the format cannot hold, a name
            twice, an existing destination); nothing is written.
        CheckpointError: the checkpoint is missing or corrupt (names the tensor and the file).
    """
    if to not in FORMATS:
        raise ExportError(f"export format {to!r} is not supported (choose from {FORMATS})")
    if select is None:
        select = "params" if to == "safetensors" else ""
    dst = os.path.abspath(os.fspath(dst))
    root = reader.find_checkpoint_dir(ckpt)
    _check_destination(root, dst, force)
    manifest = fmt.read_manifest(root)
    if isinstance(spec, (str, os.PathLike)):
        from jax_ucp import language

        spec = language.load_spec(spec)
    available = reader.available_tensors(manifest, spec)
    chosen, values, skipped = _choose(available, manifest, select, with_values=to == "torch-dcp")
    want = None if dtype is None else np.dtype(dtype)
    tensors = []
    for name, key in chosen:
        saved = available[key].dtype
        target = saved if want is None else want
        reader.check_cast(name, saved, target, casting)
        if to == "safetensors":  # refused before anything is written
            safetensors_out.dtype_name(name, target)
        else:
            torch_out.torch_dtype(name, target)
        tensors.append(safetensors_out.Tensor(name, tuple(available[key].shape), target))
    if not tensors:
        raise ExportError(f"{root}: no tensor under {select!r} to export")
    keys = dict(chosen)
    done = 0

    def read(group):
        nonlocal done
        for tensor in group:
            request = reader.Request(keys[tensor.name], dtype=tensor.dtype)
            (value,) = reader.read(
                root, manifest, [request], spec=spec, available=available, casting=casting
            )
            yield value
            done += 1
            if progress is not None:
                progress(tensor.name, done, len(tensors))

    commit.remove_stale_temporaries(dst)
    tmp = commit.temporary_path(dst)
    os.makedirs(tmp)
    try:
        if to == "safetensors":
            files = _write_safetensors(tmp, tensors, read, max_file_bytes, manifest.save_id)
        else:
            prefix = len([p for p in select.split("/") if p])
            items = [
                torch_out.DcpItem(t.name, tuple(keys[t.name][prefix:]), t.shape, t.dtype)
                for t in tensors
            ] + [torch_out.DcpItem(name, path, value=v) for name, path, v in values]
            torch_out.write_dcp(tmp, items, read(tensors), str(manifest.save_id))
            files = [torch_out.METADATA_FILE, torch_out.DATA_FILE]
        durable.fsync_path(tmp)
        if os.path.lexists(dst):  # an earlier export (checked): swapped out, then removed
            commit.replace_committed(tmp, dst)
        else:
            os.rename(tmp, dst)
            durable.fsync_path(os.path.dirname(dst))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(
        path=dst,
        files=files,
        tensors=len(tensors),
        bytes=sum(t.nbytes for t in tensors),
        skipped=skipped,
    )


def _write_safetensors(tmp, tensors, read, max_file_bytes, save_id) -> list[str]:
    groups = safetensors_out.plan_files(tensors, max_file_bytes)
    names = safetensors_out.file_names(len(groups))
    metadata = {"format": "pt", "jax_ucp.save_id": str(save_id)}
    for group, name in zip(groups, names):
        safetensors_out.write_file(os.path.join(tmp, name), group, read(group), metadata)
    if len(groups) == 1:
        return names
    safetensors_out.write_index(os.path.join(tmp, safetensors_out.INDEX_FILE), groups, names)
    return names + [safetensors_out.INDEX_FILE]


def _choose(available, manifest, select, *, with_values: bool):
    """(name, key) of the tensors under ``select``; (name, relative path, value) of the saved
    Python values under it when the format holds them; and the names of every other leaf."""
    prefix = tuple(p for p in (select or "").split("/") if p)
    chosen, values, skipped, seen = [], [], [], {}

    def name_of(key):
        name = ".".join(key[len(prefix) :]) or key[-1]
        if name in seen:
            raise ExportError(
                f"leaves {fmt.key_to_str(seen[name])!r} and {fmt.key_to_str(key)!r} would both "
                f"be named {name!r} in the export"
            )
        seen[name] = key
        return name

    for key in available:
        if tuple(key[: len(prefix)]) != prefix:
            skipped.append(fmt.key_to_str(key))
        else:
            chosen.append((name_of(key), key))
    for entry in manifest.values:
        if with_values and tuple(entry.key[: len(prefix)]) == prefix:
            values.append((name_of(entry.key), tuple(entry.key[len(prefix) :]), entry.value))
        else:
            skipped.append(fmt.key_to_str(entry.key))
    return chosen, values, skipped


def _check_destination(root: str, dst: str, force: bool) -> None:
    """``dst`` is new, or (with ``force``) an earlier export; never the checkpoint or inside it."""
    real_root, real_dst = os.path.realpath(root), os.path.realpath(dst)
    if real_dst == real_root or real_dst.startswith(real_root + os.sep):
        raise ExportError(f"{dst}: the export destination is, or lies inside, the checkpoint")
    if real_root.startswith(real_dst + os.sep):
        raise ExportError(f"{dst}: the export destination contains the checkpoint {root}")
    if not os.path.lexists(dst):
        return
    if not force:
        raise ExportError(f"{dst}: already exists (pass force=True / --force to replace it)")
    if not _is_export(dst):
        raise ExportError(
            f"{dst}: exists and is not an export (only *.safetensors and *.json files with "
            "model.safetensors or its index, or .metadata and *.distcp); refusing to replace it"
        )


def _is_export(path: str) -> bool:
    """A directory holding only what an export writes (safetensors or torch DCP files)."""
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    names = set(os.listdir(path))
    safetensors = {safetensors_out.SINGLE_FILE, safetensors_out.INDEX_FILE} & names and all(
        n.endswith((".safetensors", ".json")) for n in names
    )
    dcp = torch_out.METADATA_FILE in names and all(
        n == torch_out.METADATA_FILE or n.endswith(".distcp") for n in names
    )
    return bool(safetensors or dcp) and all(
        os.path.isfile(os.path.join(path, n)) and not os.path.islink(os.path.join(path, n))
        for n in names
    )
