"""``convert``: a torch checkpoint in, a UCP checkpoint out (standalone or as a manager step).

Sits above the importers (which only read and yield ``writer.HostItem``s) and the writers: the
standalone form commits without JAX or Orbax (``writer.write_host_checkpoint``); ``step=N`` goes
through Orbax's CheckpointManager (``orbax.manager_step``), imported only then.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import os
from collections.abc import Callable, Sequence
from typing import Any

from jax_ucp import store, writer
from jax_ucp.errors import RequestError
from jax_ucp.format import files
from jax_ucp.format.sizes import parse_size
from jax_ucp.importers import registry
from jax_ucp.importers.plan import Share
from jax_ucp.multihost import agreement
from jax_ucp.multihost.agreement import Gather
from jax_ucp.options import field_namer, keywords_of_2
from jax_ucp.writer import commit

Progress = Callable[[str, int, int], None]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    """How ``convert`` imports: the one definition of its keywords, checked once on
    construction and passed down whole.

    Attributes:
        format: "deepspeed", "megatron", "safetensors", "torch" or "orbax" (detected from the
            files when None).
        spec: a UCP-language spec (``Spec``, shipped name or TOML path) with the import rules /
            settings.
        force: replace a jax_ucp checkpoint at ``dest`` (the old one kept whole until the new
            one is committed).
        step: write ``<dest>/<step>/state`` as a CheckpointManager step (None: a standalone
            checkpoint).
        progress: called as ``progress(name, done, total)`` per parameter.
        compression: the arrays' codec (None: the format's default).
        weights_only: the model weights alone; the optimizer state is skipped whatever its
            layout (recorded under ``source.skipped`` in the manifest).
        distributed: every process of a ``jax.distributed`` job calls ``convert`` with the same
            arguments; each reads and writes every N-th parameter into one directory on a shared
            file system, and process 0 commits once every process reported its part.
        barrier_timeout: with ``distributed``, seconds at most for the slowest process (a
            process on this host that dies is noticed at once, one on another host by
            jax.distributed's heartbeat).
        memory_budget: bytes of tensor data the import may hold at once: an int or a size such
            as "1GiB" (None: ``DEFAULT_MEMORY_BUDGET``, 256 MiB); the tensors the writer has in
            flight plus what the importer is building (a tensor-parallel merge, chunks read
            into place); each process of a distributed import has its own.
        tag: DeepSpeed: the tag folder to import (default: the one ``latest`` names); Orbax:
            the CheckpointManager step (default: the latest committed one).
        vocab_size: Megatron: the tokenizer's vocabulary size, before Megatron's padding (the
            padded rows are stripped; default: the spec's, else they are kept).
        parameter_order: torch: the names of an index-keyed optimizer's parameters in the
            order torch numbered them.
        model_config: torch: a Hugging Face ``config.json`` to rebuild that order from (an
            Accelerate ``save_state`` folder, a Trainer checkpoint without its config.json).
    """

    format: str | None = None
    spec: Any = None
    force: bool = False
    step: int | None = None
    progress: Progress | None = None
    compression: str | None = None
    weights_only: bool = False
    distributed: bool = False
    barrier_timeout: float = 24 * 3600
    memory_budget: int | str | None = None
    tag: str | int | None = None
    vocab_size: int | None = None
    parameter_order: Sequence[str] | None = None
    model_config: str | os.PathLike | None = None

    def __post_init__(self):
        if self.step is not None:
            try:
                step = operator.index(self.step)
            except TypeError:
                step = -1
            if isinstance(self.step, bool) or step < 0:
                raise RequestError(f"convert: step={self.step!r}: a non-negative int, or None")
            object.__setattr__(self, "step", step)
        if self.distributed and self.step is not None:
            raise RequestError(
                "convert: distributed=True writes a standalone checkpoint (step=None)"
            )
        if self.memory_budget is not None:
            budget = parse_size(self.memory_budget, field_namer(self)("memory_budget"))
            object.__setattr__(self, "memory_budget", budget)


@keywords_of_2(ConvertOptions)
def convert(source, dest, options: ConvertOptions) -> str:
    """Imports the torch checkpoint directory ``source`` as a UCP checkpoint at ``dest``; the
    keywords are ``ConvertOptions``' fields.

    Everything that needs no tensor bytes is checked before anything is written, and a failure
    leaves ``dest`` untouched (one ``commit.transaction``).

    Args:
        source: the checkpoint directory (or file) to import.
        dest: the UCP directory to create, or an ``s3://`` / ``gs://`` prefix.
        options: built from the keywords, each documented in ``ConvertOptions``.

    Returns:
        The UCP directory (the one holding ucp.json).
    """
    return convert_with(source, dest, options)


def convert_with(source, dest, options: ConvertOptions) -> str:
    """``convert`` with its options as one ``ConvertOptions``.

    Args:
        source: the checkpoint directory (or file) to import.
        dest: the UCP directory to create, or an ``s3://`` / ``gs://`` prefix.
        options: what to import and how.

    Returns:
        The UCP directory (the one holding ucp.json).
    """
    dest = os.fspath(dest)
    _check_target(source, dest, options)
    budget = options.memory_budget
    with writer.memory_budget_scope(None if budget is None else int(budget)):
        job = agreement.join(dest, options.barrier_timeout) if options.distributed else None
        plan = _plan(source, dest, options, job)
        items = writer.with_progress(plan.items, plan.total_params, options.progress)
        common: dict[str, Any] = dict(
            force=options.force, source=plan.source, compression=options.compression
        )
        if job is not None:
            index, count, gather = job
            return writer.write_shared_checkpoint(
                dest, items, index=index, count=count, gather=gather, **common
            )
        if options.step is None:
            return writer.write_host_checkpoint(dest, items, **common)
        from jax_ucp.orbax.manager_step import write_manager_step

        return write_manager_step(dest, items, step=options.step, **common)


def _check_target(source, dest: str, options: ConvertOptions) -> None:
    """What the destination refuses, before the source is read (checked again under the save
    lock, in the transaction)."""
    if store.is_url(dest):
        if options.step is not None or options.distributed:
            raise RequestError(
                f"convert: {dest} is an object store; step= and distributed=True write local "
                f"(or shared file system) directories only"
            )
        return
    if files.overlap(dest, source):  # a forced convert there would delete what it reads
        raise RequestError(
            f"convert: the destination {dest} is, contains or lies inside the source {source}; "
            f"choose a destination outside the source checkpoint (nothing was written)."
        )
    target = dest if options.step is None else os.path.join(dest, str(options.step))
    commit.check_replaceable(os.path.abspath(target), force=options.force)


def _plan(source, dest: str, options: ConvertOptions, job: tuple[int, int, Gather] | None):
    """The importer's plan; in a distributed import every process's planning is agreed on, so a
    process that refuses the source does not leave the others waiting."""
    fields = {name: getattr(options, name) for name in registry.OPTION_FIELDS}
    plan_import = functools.partial(registry.plan_import, source, format=options.format, **fields)
    if job is None:
        return plan_import()
    index, count, gather = job
    try:
        plan = plan_import(share=Share(index, count))
    except BaseException as e:
        agreement.agree(gather, "planned", e, dest)
    agreement.agree(gather, "planned", "", dest)
    return plan
