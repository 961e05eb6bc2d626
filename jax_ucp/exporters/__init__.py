"""Export a jax_ucp checkpoint to formats PyTorch tools read (``jax_ucp.export``).

Above the handler (it reads through the same strict reader as a restore: digests, crc32c,
casting rules) and below the CLI. Torch-free: every format is written byte by byte.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_ucp import format as fmt
from jax_ucp.exporters import safetensors_out
from jax_ucp.exporters.safetensors_out import ExportError
from jax_ucp.handler import reader
from jax_ucp.writer import commit, durable

__all__ = ["ExportError", "Exported", "FORMATS", "export"]

FORMATS = ("safetensors",)


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
    select: str | None = "params",
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
        dst: the directory to create (``model.safetensors``, or shards plus
            ``model.safetensors.index.json``).
        to: the output format; ``"safetensors"``.
        select: the key-path prefix to export (``"params"``: the model weights; ``"opt_state/mu"``
            for a moment; None for every tensor). Names are the rest of the key path joined with
            ``.`` (a checkpoint imported from safetensors gives back its Hugging Face names).
        spec: a UCP-language spec (name, path or ``Spec``) whose restore-time views are
            exported instead of the stored arrays (renames, splits, stacks).
        dtype: write every tensor in this dtype (e.g. ``"bfloat16"``); default: as saved.
        casting: numpy casting rule for ``dtype`` (a float narrowed to an int needs "unsafe").
        max_file_bytes: data bytes per file before the output is split into shards.
        force: replace ``dst`` if it is an earlier export (never any other directory).
        progress: called as ``progress(name, done, total)`` after each tensor.

    Raises:
        ExportError: nothing can be exported as asked (a dtype the format cannot hold, a name
            twice, an existing destination); nothing is written.
        CheckpointError: the checkpoint is missing or corrupt (names the tensor and the file).
    """
    if to not in FORMATS:
        raise ExportError(f"export format {to!r} is not supported (choose from {FORMATS})")
    dst = os.path.abspath(os.fspath(dst))
    root = reader.find_checkpoint_dir(ckpt)
    _check_destination(root, dst, force)
    manifest = fmt.read_manifest(root)
    if isinstance(spec, (str, os.PathLike)):
        from jax_ucp import language

        spec = language.load_spec(spec)
    available = reader.available_tensors(manifest, spec)
    chosen, skipped = _choose(available, manifest, select)
    want = None if dtype is None else np.dtype(dtype)
    tensors = []
    for name, key in chosen:
        saved = available[key].dtype
        target = saved if want is None else want
        reader.check_cast(name, saved, target, casting)
        safetensors_out.dtype_name(name, target)  # refused before anything is written
        tensors.append(safetensors_out.Tensor(name, tuple(available[key].shape), target))
    if not tensors:
        raise ExportError(f"{root}: no tensor under {select!r} to export")
    groups = safetensors_out.plan_files(tensors, max_file_bytes)
    names = safetensors_out.file_names(len(groups))
    keys = dict(chosen)
    metadata = {"format": "pt", "jax_ucp.save_id": str(manifest.save_id)}
    commit.remove_stale_temporaries(dst)
    tmp = commit.temporary_path(dst)
    os.makedirs(tmp)
    done = 0

    def values(group):
        for tensor in group:
            request = reader.Request(keys[tensor.name], dtype=tensor.dtype)
            (value,) = reader.read(
                root, manifest, [request], spec=spec, available=available, casting=casting
            )
            yield value

    def on_tensor(tensor):
        nonlocal done
        done += 1
        if progress is not None:
            progress(tensor.name, done, len(tensors))

    try:
        for group, name in zip(groups, names):
            safetensors_out.write_file(
                os.path.join(tmp, name), group, values(group), metadata, on_tensor
            )
        if len(groups) > 1:
            safetensors_out.write_index(
                os.path.join(tmp, safetensors_out.INDEX_FILE), groups, names
            )
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
        files=names + ([safetensors_out.INDEX_FILE] if len(groups) > 1 else []),
        tensors=len(tensors),
        bytes=sum(t.nbytes for t in tensors),
        skipped=skipped,
    )


def _choose(available, manifest, select):
    """(output name, key) of the tensors under ``select``, and the names of every other leaf."""
    prefix = tuple(p for p in (select or "").split("/") if p)
    chosen, skipped, seen = [], [], {}
    for key in available:
        if tuple(key[: len(prefix)]) != prefix:
            skipped.append(fmt.key_to_str(key))
            continue
        name = ".".join(key[len(prefix) :]) or key[-1]
        if name in seen:
            raise ExportError(
                f"tensors {fmt.key_to_str(seen[name])!r} and {fmt.key_to_str(key)!r} would both "
                f"be named {name!r} in the export"
            )
        seen[name] = key
        chosen.append((name, key))
    skipped += [fmt.key_to_str(v.key) for v in manifest.values]
    return chosen, skipped


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
            f"{dst}: exists and is not a safetensors export (only *.safetensors and *.json "
            "files, one of them model.safetensors or its index); refusing to replace it"
        )


def _is_export(path: str) -> bool:
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    names = os.listdir(path)
    if not ({safetensors_out.SINGLE_FILE, safetensors_out.INDEX_FILE} & set(names)):
        return False
    return all(
        n.endswith((".safetensors", ".json")) and os.path.isfile(os.path.join(path, n))
        for n in names
    )
