"""Export a jax_ucp checkpoint to formats PyTorch tools read (``jax_ucp.export``).

Above the handler (it reads through the same strict reader as a restore: digests, crc32c,
casting rules) and below the CLI. Torch-free: every format is written byte by byte
(``safetensors_out``: Hugging Face safetensors; ``torch_out``: torch.save archives and DCP).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jax_ucp import format as fmt
from jax_ucp import store
from jax_ucp.exporters import deepspeed_out, safetensors_out, torch_out
from jax_ucp.exporters.safetensors_out import ExportError
from jax_ucp.handler import reader
from jax_ucp.writer import commit, durable

__all__ = ["ExportError", "Exported", "FORMATS", "export"]

FORMATS = ("safetensors", "torch-dcp", "deepspeed-universal", "orbax")


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
    param_groups: int = 1,
    config: Mapping[str, Any] | str | os.PathLike | None = None,
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
            ``model.safetensors.index.json``), ``"torch-dcp"`` (a
            ``torch.distributed.checkpoint`` directory: ``.metadata`` + ``__0_0.distcp``) or
            ``"deepspeed-universal"`` (what DeepSpeed's ``ds_to_universal`` writes: fp32 master,
            Adam moments and step per parameter, loadable at any DP size with
            ``"checkpoint": {"load_universal": true}``; needs the params, both moments and the
            step count, found by their manifest roles) or ``"orbax"`` (the whole tree, saved
            containers included, as an Orbax ``PyTreeCheckpointHandler`` checkpoint that
            ``ocp.StandardCheckpointer().restore(dst)`` reads bit-exact, written by Orbax one
            tensor at a time; ``exporters.orbax_out.export_orbax`` writes a CheckpointManager
            step; docs/ORBAX.md).
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
        config: safetensors: a ``config.json`` to write beside the weights (a dict, or the path
            of a JSON file), so ``transformers``' ``from_pretrained`` can load the export.
        param_groups: deepspeed-universal: how many param groups the loading engine's optimizer
            has (DeepSpeed pairs them by position; hyperparameters are the engine's own).
        force: replace ``dst`` if it is an earlier export (never any other directory).
        progress: called as ``progress(name, done, total)`` after each tensor.

    Raises:
        ExportError: nothing can be exported as asked (a dtype the format cannot hold, a name
            twice, an existing destination); nothing is written.
        CheckpointError: the checkpoint is missing or corrupt (names the tensor and the file).
    """
    if to not in FORMATS:
        raise ExportError(f"export format {to!r} is not supported (choose from {FORMATS})")
    if to == "deepspeed-universal" and (select is not None or dtype is not None or spec):
        raise ExportError(
            "deepspeed-universal writes the fp32 master, both Adam moments and the step of "
            "every parameter, found by their manifest roles: select=, dtype= and spec= do not "
            "apply to it"
        )
    if to == "orbax":
        if select is not None or dtype is not None or spec or force:
            raise ExportError(
                "an Orbax export writes the whole tree as saved: select=, dtype=, spec= and "
                "force= do not apply to it"
            )
        from jax_ucp.exporters import orbax_out

        dst = os.path.abspath(os.fspath(dst))
        root = reader.find_checkpoint_dir(ckpt)
        _check_destination(root, dst, False)
        path = orbax_out.export_orbax(root, dst, progress=progress)
        manifest = store.read_manifest(root)
        return Exported(
            path=path,
            files=sorted(os.listdir(path)),
            tensors=len(manifest.tensors),
            bytes=sum(e.nbytes for e in manifest.tensors),
            skipped=[],
        )
    if config is not None and to != "safetensors":
        raise ExportError(f"config= (a config.json) applies to safetensors exports, not {to!r}")
    if select is None:
        select = "params" if to == "safetensors" else ""
    dst = os.path.abspath(os.fspath(dst))
    root = reader.find_checkpoint_dir(ckpt)
    _check_destination(root, dst, force)
    manifest = store.read_manifest(root)
    if isinstance(spec, (str, os.PathLike)):
        from jax_ucp import language

        spec = language.load_spec(spec)
    available = reader.available_tensors(manifest, spec)
    if to == "deepspeed-universal":
        return _export_universal(root, dst, manifest, available, param_groups, progress, force)
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

    def write(tmp: str) -> list[str]:
        if to == "safetensors":
            files = _write_safetensors(tmp, tensors, read, max_file_bytes, manifest.save_id)
            if config is not None:
                _write_config(os.path.join(tmp, "config.json"), config)
                files.append("config.json")
            return files
        prefix = len([p for p in select.split("/") if p])
        items = [
            torch_out.DcpItem(t.name, tuple(keys[t.name][prefix:]), t.shape, t.dtype)
            for t in tensors
        ] + [torch_out.DcpItem(name, path, value=v) for name, path, v in values]
        torch_out.write_dcp(tmp, items, read(tensors), str(manifest.save_id))
        return [torch_out.METADATA_FILE, torch_out.DATA_FILE]

    files = _write_atomically(dst, write, force)
    return Exported(
        path=dst,
        files=files,
        tensors=len(tensors),
        bytes=sum(t.nbytes for t in tensors),
        skipped=skipped,
    )


def _export_universal(root, dst, manifest, available, param_groups, progress, force) -> Exported:
    """Params with their Adam moments (by manifest role) and the step, as DeepSpeed universal."""
    by_key = {e.key: e for e in manifest.tensors}
    # frozen parameters have no optimizer state and no place under zero/ (DeepSpeed keeps
    # them out of its optimizer); they are listed as skipped
    params = {
        k: k[1:]
        for k, e in by_key.items()
        if e.role == "param" and e.sub_role is None and not e.frozen
    }
    moments: dict[tuple[str, str], tuple] = {}
    count = None
    for key, entry in by_key.items():
        if entry.role == "opt_state" and entry.sub_role in ("mu", "nu"):
            for pkey, rel in params.items():
                if (
                    len(key) > len(rel)
                    and key[-len(rel) :] == rel
                    and key[-len(rel) - 1] == entry.sub_role
                ):
                    moments[(pkey, entry.sub_role)] = key
        elif entry.role == "opt_state" and entry.sub_role == "count":
            count = key
    missing = [
        f"{fmt.key_to_str(p)} ({m})" for p in params for m in ("mu", "nu") if (p, m) not in moments
    ]
    if not params or missing or count is None:
        raise ExportError(
            f"{root}: DeepSpeed universal needs every parameter's Adam moments and the step "
            f"count; missing: {missing[:5] or ([] if params else ['params'])}"
            f"{'' if count is not None else ' and opt_state count'}"
        )
    ds_names = {p: ".".join(rel) for p, rel in params.items()}
    for p in params:
        reader.check_cast(ds_names[p], available[p].dtype, np.dtype(np.float32), "same_kind")
    (step,) = reader.read(root, manifest, [reader.Request(count)], available=available)
    model = {k[1:]: k for k, e in by_key.items() if e.role == "param" and e.sub_role == "model"}

    def read(key, dtype=np.float32):
        request = reader.Request(key, dtype=np.dtype(dtype))
        return reader.read(root, manifest, [request], available=available)[0]

    def states():
        for done, (p, name) in enumerate(ds_names.items(), 1):
            yield name, "fp32", read(p)
            yield name, "exp_avg", read(moments[(p, "mu")])
            yield name, "exp_avg_sq", read(moments[(p, "nu")])
            if progress is not None:
                progress(name, done, len(ds_names))

    def weights():
        for p, name in ds_names.items():
            key = model.get(params[p], p)
            yield name, read(key, available[key].dtype)

    universal = [
        deepspeed_out.UniversalParam(ds_names[p], tuple(available[p].shape)) for p in params
    ]
    files = _write_atomically(
        dst,
        lambda tmp: deepspeed_out.write_universal(
            tmp,
            universal,
            states(),
            step=int(step),
            model_weights=weights(),
            param_groups=param_groups,
        ),
        force,
    )
    return Exported(
        path=dst,
        files=files,
        tensors=3 * len(universal),
        bytes=3 * sum(4 * int(np.prod(u.shape, dtype=np.int64)) for u in universal),
        skipped=[
            fmt.key_to_str(k)
            for k in by_key
            if k not in params and k != count and k not in set(moments.values())
        ]
        + [fmt.key_to_str(v.key) for v in manifest.values],
    )


def _write_atomically(dst: str, write: Callable[[str], list[str]], force: bool) -> list[str]:
    """``write(tmp)`` into a temporary sibling of ``dst``, made durable and renamed into place
    (an earlier export there is swapped out, then removed); on any failure the temporary goes
    and ``dst`` is as it was. Returns what ``write`` returned (the files written)."""
    with commit.save_lock(dst):
        commit.recover_interrupted_swap(dst)
        try:  # checked again: the destination may have changed while the tensors were read
            replacing = commit.claim(dst, force=force, export=True)
        except (commit.SaveConflictError, FileExistsError) as e:
            raise ExportError(str(e)) from None
        commit.remove_stale_temporaries(dst)
        tmp = commit.temporary_path(dst)
        os.makedirs(tmp)
        try:
            files = write(tmp)
            commit.write_export_record(tmp)  # what a later force may replace: these files only
            durable.make_tree_durable(tmp)
            if replacing:
                os.rename(tmp, dst + commit.REPLACING)
                commit.replace_committed(dst + commit.REPLACING, dst)
            else:
                os.rename(tmp, dst)
                durable.fsync_path(os.path.dirname(dst))
        except BaseException:
            commit.discard(tmp, "temporary directory of a failed export")
            raise
    return files


def _write_config(path: str, config) -> None:
    """``config.json``: a dict as JSON, or a JSON file's content (checked, size-bounded)."""
    if not isinstance(config, Mapping):
        try:
            raw = fmt.files.read_regular(os.fspath(config), 16 << 20)
            config = json.loads(raw)
        except (OSError, ValueError) as e:
            raise ExportError(f"config {config}: not a readable JSON file ({e})") from None
        if not isinstance(config, dict):
            raise ExportError("config: a config.json holds a JSON object")
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


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
    try:
        commit.check_replaceable(dst, force=force, export=True)
    except (commit.SaveConflictError, FileExistsError) as e:
        raise ExportError(str(e)) from None
