"""One export: the checkpoint read through the restore engine's reader (digests, crc32c,
casting rules), the tensors chosen and planned, every file written into one
``commit.transaction`` of the destination by the format's writer (``safetensors_out``,
``torch_out``, ``deepspeed_out``, ``orbax_out``), one row slab in memory at a time."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jax_ucp import format as fmt
from jax_ucp import store, writer
from jax_ucp.errors import ExportError
from jax_ucp.exporters import deepspeed_out, safetensors_out, torch_out
from jax_ucp.exporters.options import (
    DeepSpeedUniversalExport,
    Exported,
    Options,
    OrbaxExport,
    SafetensorsExport,
    options_for,
)
from jax_ucp.exporters.source import Source
from jax_ucp.restoring import reader
from jax_ucp.writer import commit, durable


def export(
    ckpt: str | os.PathLike,
    dst: str | os.PathLike,
    options: Options | None = None,
    *,
    to: str | None = None,
    select: str | None = None,
    spec: Any = None,
    dtype: Any = None,
    casting: str | None = None,
    max_file_bytes: int | str | None = None,
    param_groups: int | None = None,
    config: Mapping[str, Any] | str | os.PathLike | None = None,
    force: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
    memory_budget: int | str | None = None,
) -> Exported:
    """Writes the tensors of the checkpoint ``ckpt`` to ``dst`` in the format ``to``.

    Streamed one row slab at a time (at most half of ``memory_budget``), atomic (one
    ``commit.transaction``: written into a temporary sibling of ``dst`` under the save lock and
    renamed into place: a failed export leaves ``dst`` as it was). The keywords build the
    format's options (``SafetensorsExport``, ``TorchDcpExport``, ``DeepSpeedUniversalExport``,
    ``OrbaxExport``; or pass one as ``options``); one that does not apply to ``to`` is refused.

    Args:
        ckpt: a jax_ucp checkpoint directory (or an Orbax step holding one UCP item).
        dst: the directory to create.
        options: the format's options, instead of ``to`` and the keywords.
        to: ``"safetensors"`` (the default: ``model.safetensors``, or shards plus
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
        select: safetensors, torch-dcp: the key-path prefix to export: ``"params"`` (the model
            weights), ``"opt_state/mu"``, ``""`` for everything. Default: ``"params"`` for
            safetensors, everything (params, optimizer state, saved Python values) for
            torch-dcp. Names are the rest of the key path joined with ``.`` (a checkpoint
            imported from safetensors gives back its Hugging Face names; DCP's nested state
            dicts use the same dotted names).
        spec: safetensors, torch-dcp: a UCP-language spec (name, path or ``Spec``) whose
            restore-time views are exported instead of the stored arrays.
        dtype: safetensors, torch-dcp: write every tensor in this dtype (e.g. ``"bfloat16"``).
        casting: safetensors, torch-dcp: numpy casting rule for ``dtype`` (default
            "same_kind"; a float narrowed to an int needs "unsafe").
        max_file_bytes: safetensors: data per file before the output is split: bytes or
            e.g. "5GB" (default 5 GB).
        param_groups: deepspeed-universal: how many param groups the loading engine's optimizer
            has (default 1; DeepSpeed pairs them by position).
        config: safetensors: a ``config.json`` to write beside the weights (a dict, or the path
            of a JSON file), so ``transformers``' ``from_pretrained`` can load the export.
        force: all but orbax: replace ``dst`` if it is an earlier export (never any other
            directory).
        progress: called as ``progress(name, done, total)`` after each tensor.
        memory_budget: bytes of tensor data held at once (an int, or e.g. "256MiB", "1GiB";
            default ``format.sizes.DEFAULT_MEMORY_BUDGET``), as ``convert``'s.

    Returns:
        ``Exported``: the destination, its files, the tensors and bytes written, what was left
        out.

    Raises:
        ExportError: nothing can be exported as asked (a dtype the format cannot hold, a name
            twice, an existing destination, an option that does not apply to ``to``); nothing
            is written.
        CheckpointError: the checkpoint is missing or corrupt (names the tensor and the file).
    """
    given = dict(
        select=select,
        spec=spec,
        dtype=dtype,
        casting=casting,
        max_file_bytes=max_file_bytes,
        param_groups=param_groups,
        config=config,
        force=force,
        progress=progress,
        memory_budget=memory_budget,
    )
    if options is None:
        options = options_for(to or "safetensors", **given)
    elif (to is not None and to != options.format) or any(
        v is not None and v is not False for v in given.values()
    ):
        raise ExportError(f"export: pass {type(options).__name__} or keywords, not both")
    budget = options.memory_budget
    assert not isinstance(budget, str)  # parsed by the options
    dst = os.path.abspath(os.fspath(dst))
    # a read that fails because a concurrent forced save replaced ``ckpt`` starts over (its
    # transaction removed what it wrote), never reported as damage
    # what readers and writers hold; Orbax's writer threads share one malloc arena
    arena = (
        writer.one_malloc_arena() if isinstance(options, OrbaxExport) else contextlib.nullcontext()
    )
    with writer.memory_budget_scope(budget), arena:
        return reader.read_consistently(
            ckpt, lambda root: _export_root(root, dst, options), redo=False
        )


def _export_root(root: str, dst: str, options: Options) -> Exported:
    _check_destination(root, dst, getattr(options, "force", False))
    if isinstance(options, OrbaxExport):
        return _export_orbax(root, dst, options)
    manifest = store.read_manifest(root)
    if isinstance(options, DeepSpeedUniversalExport):
        return _export_universal(root, dst, manifest, options)
    spec = options.spec
    if isinstance(spec, (str, os.PathLike)):
        from jax_ucp import language

        spec = language.load_spec(spec)
    available = reader.available_tensors(manifest, spec)
    source = Source(root, manifest, available, options.casting, options.progress)
    to_safetensors = isinstance(options, SafetensorsExport)
    chosen, values, skipped = _choose(
        available, manifest, options.prefix, with_values=not to_safetensors
    )
    tensors = _planned_tensors(root, chosen, available, options)
    source.total = len(tensors)
    keys = dict(chosen)
    arrays = [source.tensor(keys[t.name], t.dtype, t.name) for t in tensors]  # read when written
    if isinstance(options, SafetensorsExport):
        files = _write_atomically(
            dst,
            lambda tmp: _write_safetensors(tmp, tensors, arrays, manifest, options),
            options.force,
        )
    else:
        prefix = len([p for p in options.prefix.split("/") if p])
        items = [
            torch_out.DcpItem(t.name, tuple(keys[t.name][prefix:]), t.shape, t.dtype)
            for t in tensors
        ] + [torch_out.DcpItem(name, path, value=v) for name, path, v in values]

        def write_dcp(tmp):
            torch_out.write_dcp(tmp, items, arrays, str(manifest.save_id))
            return [torch_out.METADATA_FILE, torch_out.DATA_FILE]

        files = _write_atomically(dst, write_dcp, options.force)
    return Exported(
        path=dst,
        files=files,
        tensors=len(tensors),
        bytes=sum(t.nbytes for t in tensors),
        skipped=skipped,
    )


def _export_orbax(root: str, dst: str, options: OrbaxExport) -> Exported:
    """The whole tree through Orbax's own writer, inside the export's transaction (the save
    lock; Orbax writes its temporary directory and renames it)."""
    from jax_ucp.exporters import orbax_out

    with _transaction(dst, force=False, staged=False) as tx:
        path = orbax_out.export_orbax(root, tx.path, progress=options.progress)
    manifest = store.read_manifest(root)
    return Exported(
        path=path,
        files=sorted(os.listdir(path)),
        tensors=len(manifest.tensors),
        bytes=sum(e.nbytes for e in manifest.tensors),
        skipped=[],
    )


def _planned_tensors(root, chosen, available, options) -> list[safetensors_out.Tensor]:
    """Each chosen tensor with its output dtype, every cast and dtype checked before anything
    is written."""
    tensors = []
    for name, key in chosen:
        saved = available[key].dtype
        target = saved if options.dtype is None else options.dtype
        reader.check_cast(name, saved, target, options.casting)
        if isinstance(options, SafetensorsExport):
            safetensors_out.dtype_name(name, target)
        else:
            torch_out.torch_dtype(name, target)
        tensors.append(safetensors_out.Tensor(name, tuple(available[key].shape), target))
    if not tensors:
        raise ExportError(f"{root}: no tensor under {options.prefix!r} to export")
    return tensors


def _export_universal(root, dst, manifest, options: DeepSpeedUniversalExport) -> Exported:
    """Params with their Adam moments (by manifest role) and the step, as DeepSpeed universal."""
    available = reader.available_tensors(manifest)
    by_key = {e.key: e for e in manifest.tensors}
    params, moments, count = _universal_keys(root, by_key)
    ds_names = {p: ".".join(rel) for p, rel in params.items()}
    for p in params:
        reader.check_cast(ds_names[p], available[p].dtype, np.dtype(np.float32), "same_kind")
    (step,) = reader.read(root, manifest, [reader.Request(count)], available=available)
    model = {k[1:]: k for k, e in by_key.items() if e.role == "param" and e.sub_role == "model"}
    source = Source(root, manifest, available, progress=options.progress, total=len(ds_names))

    def states():
        for p, name in ds_names.items():
            yield name, "fp32", source.tensor(p, np.float32)
            yield name, "exp_avg", source.tensor(moments[(p, "mu")], np.float32)
            yield name, "exp_avg_sq", source.tensor(moments[(p, "nu")], np.float32, name)

    weights = [(name, source.tensor(model.get(params[p], p))) for p, name in ds_names.items()]
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
            model_weights=weights,
            param_groups=options.param_groups,
        ),
        options.force,
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


def _universal_keys(root, by_key):
    """The keys DeepSpeed universal needs, found by manifest role: each trainable parameter's
    (key -> its path below the top level), its Adam moments ((param, "mu"/"nu") -> key) and the
    step count; ``ExportError`` naming what is missing."""
    # frozen parameters have no optimizer state and no place under zero/ (DeepSpeed keeps
    # them out of its optimizer); they are listed as skipped. A tied one is its twin's.
    params = {
        k: k[1:]
        for k, e in by_key.items()
        if e.role == "param" and e.sub_role is None and not e.frozen and e.tied_to is None
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
    return params, moments, count


def _write_atomically(dst: str, write: Callable[[str], list[str]], force: bool) -> list[str]:
    """``write(tmp)`` in one ``commit.transaction`` of ``dst``: a temporary sibling, recorded
    (``EXPORT_RECORD``: each file's size and content digest, taken as it is written), made
    durable and renamed into place (an earlier export there swapped
    out, then removed); on any failure the temporary goes and ``dst`` is as it was. Returns what
    ``write`` returned (the files written)."""
    with _transaction(dst, force=force) as tx:
        with commit.export_record(tx.path):  # what a later force may replace: these files only
            files = write(tx.path)
    return files


@contextlib.contextmanager
def _transaction(dst: str, *, force: bool, staged: bool = True):
    """``commit.transaction`` of an export; a destination it refuses is an ``ExportError``
    (checked again under the lock: it may have changed while the tensors were planned)."""
    with contextlib.ExitStack() as stack:
        try:
            tx = stack.enter_context(
                commit.transaction(dst, force=force, kind="export", export=True, staged=staged)
            )
        except (commit.SaveConflictError, FileExistsError) as e:
            raise ExportError(str(e)) from None
        yield tx


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
    durable.write_file(path, json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_safetensors(tmp, tensors, arrays, manifest, options: SafetensorsExport) -> list[str]:
    """``model.safetensors`` (or shards of ``max_file_bytes`` and their index), and
    ``config.json`` when one was given."""
    groups = safetensors_out.plan_files(tensors, int(options.max_file_bytes))  # parsed
    names = safetensors_out.file_names(len(groups))
    metadata = {"format": "pt", "jax_ucp.save_id": str(manifest.save_id)}
    by_name = dict(zip((t.name for t in tensors), arrays))
    for group, name in zip(groups, names):
        values = [by_name[t.name] for t in group]
        safetensors_out.write_file(os.path.join(tmp, name), group, values, metadata)
    files = list(names)
    if len(groups) > 1:
        safetensors_out.write_index(os.path.join(tmp, safetensors_out.INDEX_FILE), groups, names)
        files.append(safetensors_out.INDEX_FILE)
    if options.config is not None:
        _write_config(os.path.join(tmp, "config.json"), options.config)
        files.append("config.json")
    return files


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
    where = fmt.files.overlap(dst, root)
    if where in ("same", "inside"):
        raise ExportError(f"{dst}: the export destination is, or lies inside, the checkpoint")
    if where == "contains":
        raise ExportError(f"{dst}: the export destination contains the checkpoint {root}")
    try:
        # names and sizes now; content under the lock, before anything is written
        commit.check_replaceable(dst, force=force, export=True, content=False)
    except (commit.SaveConflictError, FileExistsError) as e:
        raise ExportError(str(e)) from None
