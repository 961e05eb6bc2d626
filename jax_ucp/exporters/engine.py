"""One export, format-neutral: the options checked, the destination checked, then the format's
module (``WRITERS``) reads the checkpoint through the restore engine's reader (digests, crc32c,
casting rules) and writes every file into one ``commit.transaction`` of the destination, one row
slab in memory at a time."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from typing import Any

from jax_ucp import format as fmt
from jax_ucp import writer
from jax_ucp.errors import ExportError
from jax_ucp.exporters.options import Exported, Options, options_for
from jax_ucp.restoring import locate
from jax_ucp.writer import commit

#: each format's module, whose ``export(root, dst, options)`` plans the format's files and writes
#: them in one transaction of ``dst`` (imported when used: Orbax's only for an Orbax export)
WRITERS = {
    "safetensors": "safetensors_out",
    "torch-dcp": "torch_out",
    "deepspeed-universal": "deepspeed_out",
    "orbax": "orbax_out",
}


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
    with writer.memory_budget_scope(budget):  # what readers and writers hold
        return locate.read_consistently(
            ckpt, lambda root: _export_root(root, dst, options), redo=False
        )


def _export_root(root: str, dst: str, options: Options) -> Exported:
    _check_destination(root, dst, getattr(options, "force", False))
    module = importlib.import_module(f"jax_ucp.exporters.{WRITERS[options.format]}")
    return module.export(root, dst, options)


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
