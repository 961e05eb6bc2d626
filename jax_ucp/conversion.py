"""``convert``: a torch checkpoint in, a UCP checkpoint out (standalone or as a manager step).

Sits above the importers (which only read and yield ``writer.HostItem``s) and the writers: the
standalone form commits without JAX or Orbax (``writer.write_host_checkpoint``); ``step=N`` goes
through Orbax's CheckpointManager (``handler.manager_step``), imported only then.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

from jax_ucp import store, writer
from jax_ucp.format import UCPError
from jax_ucp.importers import detect
from jax_ucp.importers.plan import Share

Progress = Callable[[str, int, int], None]


def convert(
    source,
    dest,
    *,
    format: str | None = None,
    spec: Any = None,
    force: bool = False,
    step: int | None = None,
    progress: Progress | None = None,
    compression: str | None = None,
    weights_only: bool = False,
    distributed: bool = False,
    barrier_timeout: float = 24 * 3600,
    **importer_options,
) -> str:
    """Imports the torch checkpoint directory ``source`` as a UCP checkpoint at ``dest``.

    ``format``: "deepspeed" or "megatron" (detected from the files when None). ``spec``: a
    UCP-language spec (``Spec``, shipped name or TOML path) with the import rules / settings.
    ``step`` writes ``<dest>/<step>/state`` as a CheckpointManager step. ``progress(name, done,
    total)`` is called per parameter. ``weights_only``: the model weights alone; the optimizer
    state is skipped whatever its layout (recorded under ``source.skipped`` in the manifest).
    ``distributed``: every process of a ``jax.distributed`` job calls ``convert`` with the same
    arguments; each reads and writes every N-th parameter into one directory on a shared file
    system, and process 0 commits once all are done (``barrier_timeout`` seconds at most for
    the slowest). Importer options (``tag=``, ``vocab_size=``) pass through.
    Everything that needs no tensor bytes is checked before anything is written, and a failure
    leaves ``dest`` untouched. Returns the UCP directory (the one holding ucp.json).
    """
    dest = os.fspath(dest)
    remote = store.is_url(dest)
    if remote and (step is not None or distributed):
        raise ValueError(
            f"convert: {dest} is an object store; step= and distributed=True write local (or "
            f"shared file system) directories only"
        )
    if not remote:
        check_destination(source, dest)
    if step is None and not remote and os.path.exists(dest) and not force:
        raise FileExistsError(f"{dest} already exists; pass force=True to replace it.")
    if weights_only:
        importer_options["weights_only"] = True
    share, barrier = _distributed_share(barrier_timeout) if distributed else (None, None)
    if share is not None:
        if step is not None:
            raise ValueError("convert: distributed=True writes a standalone checkpoint (step=None)")
        importer_options["share"] = share
    plan = detect.plan_import(source, format=format, spec=spec, **importer_options)
    items = writer.with_progress(plan.items, plan.total_params, progress)
    if share is not None:
        return writer.write_shared_checkpoint(
            dest,
            items,
            index=share.index,
            count=share.count,
            barrier=barrier,
            force=force,
            source=plan.source,
            compression=compression,
        )
    if step is None:
        return writer.write_host_checkpoint(
            dest, items, force=force, source=plan.source, compression=compression
        )
    from jax_ucp.handler.manager_step import write_manager_step

    return write_manager_step(
        dest, items, step=step, force=force, source=plan.source, compression=compression
    )


_BARRIERS = itertools.count()


def _distributed_share(timeout: float):
    """This process's share of a conversion by every process of the ``jax.distributed`` job,
    and a barrier across them (jax.distributed's key-value barrier, no device collective);
    ``(None, None)`` in a single-process job."""
    import jax

    if jax.process_count() == 1:
        return None, None
    from orbax.checkpoint import multihost

    sync = multihost.get_barrier_sync_fn()
    run = next(_BARRIERS)

    def barrier(name: str) -> None:
        sync(key=f"{name}:{run}", timeout_ms=int(timeout * 1000))

    return Share(jax.process_index(), jax.process_count()), barrier


class DestinationError(UCPError, ValueError):
    """A conversion destination that would overwrite or nest inside its own source."""


def check_destination(source, dest) -> None:
    """Refuses a destination that is, contains or lies inside the source: a forced convert
    there would delete the checkpoint it reads (or write into it)."""
    src = os.path.realpath(os.fspath(source))
    dst = os.path.realpath(os.fspath(dest))
    if dst == src or _inside(dst, src) or _inside(src, dst):
        raise DestinationError(
            f"convert: the destination {dest} is, contains or lies inside the source {source}; "
            f"choose a destination outside the source checkpoint (nothing was written)."
        )


def _inside(path: str, directory: str) -> bool:
    return os.path.commonpath([path, directory]) == directory


def convert_deepspeed(src, dst, **kwargs) -> str:
    """``convert`` of a DeepSpeed checkpoint (ZeRO 1/2/3, Megatron-DeepSpeed TP/PP)."""
    return convert(src, dst, format="deepspeed", **kwargs)


def convert_safetensors(src, dst, **kwargs) -> str:
    """``convert`` of Hugging Face safetensors (a file, or a folder with shards and an index)."""
    return convert(src, dst, format="safetensors", **kwargs)


def convert_megatron(src, dst, **kwargs) -> str:
    """``convert`` of a Megatron checkpoint (torch_dist or legacy iter_N/mp_rank_XX)."""
    return convert(src, dst, format="megatron", **kwargs)


def convert_torch(src, dst, **kwargs) -> str:
    """``convert`` of a torch DCP checkpoint (FSDP1/FSDP2, torchtitan, Accelerate, Lightning)
    or torch.save files (pytorch_model.bin single or sharded, Lightning .ckpt, state-dict .pt)."""
    return convert(src, dst, format="torch", **kwargs)
