"""One export, format-neutral: options and destination checked, then the format's module
(``WRITERS``) reads through the restore engine's reader and writes every file into one
``commit.transaction``, one row slab in memory at a time."""

from __future__ import annotations

import importlib
import os

from jax_ucp._src import format as fmt
from jax_ucp._src import writer
from jax_ucp._src.errors import RequestError
from jax_ucp._src.exporters.options import OPTIONS_TYPES, Exported, Options, SafetensorsExport
from jax_ucp._src.restoring import locate
from jax_ucp._src.writer import commit

#: each format's module, whose ``export(root, dst, options)`` writes it (imported when used)
WRITERS = {
    "safetensors": "safetensors_out",
    "torch-dcp": "torch_out",
    "deepspeed-universal": "deepspeed_out",
    "orbax": "orbax_out",
    "megatron": "megatron_out",
}


def export(
    ckpt: str | os.PathLike, dst: str | os.PathLike, options: Options | None = None
) -> Exported:
    """Writes the tensors of ``ckpt`` to ``dst`` in the format of ``options``, one row slab at a
    time, atomically; ``options_for(name, **fields)`` builds the options by name. See
    docs/EXPORT.md.

    Args:
        ckpt: a jax_ucp checkpoint directory (or an Orbax step holding one UCP item).
        dst: the directory to create.
        options: the format's options (None: ``SafetensorsExport()``, the model weights).

    Returns:
        ``Exported``: the destination, its files, the tensors and bytes written, what was left
        out.

    Raises:
        RequestError: nothing can be exported as asked (a dtype the format cannot hold, a name
            twice, an existing destination); nothing is written.
        CheckpointError: the checkpoint is missing or corrupt (names the tensor and the file)."""
    options = SafetensorsExport() if options is None else options
    if not isinstance(options, OPTIONS_TYPES):
        raise RequestError(
            f"export(options=): {type(options).__name__} is not an export's options (give one "
            f"of {', '.join(t.__name__ for t in OPTIONS_TYPES)})"
        )
    budget = options.memory_budget
    assert not isinstance(budget, str)  # parsed by the options
    dst = os.path.abspath(os.fspath(dst))
    # a read failing because a forced save replaced ``ckpt`` starts over, never reported as damage
    with writer.memory_budget_scope(budget):  # what readers and writers hold
        return locate.read_consistently(
            ckpt, lambda root: _export_root(root.root, dst, options), redo=False
        )


def _export_root(root: str, dst: str, options: Options) -> Exported:
    _check_destination(root, dst, getattr(options, "force", False))
    module = importlib.import_module(f"jax_ucp._src.exporters.{WRITERS[options.format]}")
    return module.export(root, dst, options)


def _check_destination(root: str, dst: str, force: bool) -> None:
    """``dst`` is new, or (with ``force``) an earlier export; never the checkpoint or inside it."""
    where = fmt.files.overlap(dst, root)
    if where in ("same", "inside"):
        raise RequestError(f"{dst}: the export destination is, or lies inside, the checkpoint")
    if where == "contains":
        raise RequestError(f"{dst}: the export destination contains the checkpoint {root}")
    try:
        # names and sizes now; content under the lock, before anything is written
        commit.check_replaceable(dst, force=force, export=True, content=False)
    except (commit.SaveConflictError, FileExistsError) as e:
        raise RequestError(str(e)) from None
