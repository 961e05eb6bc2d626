"""``convert``: a torch checkpoint in, a UCP checkpoint out (standalone or as a manager step).

Sits above the importers (which only read and yield ``writer.HostItem``s) and the writers: the
standalone form commits without JAX or Orbax (``writer.write_host_checkpoint``); ``step=N`` goes
through Orbax's CheckpointManager (``orbax.manager_step``), imported only then.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import warnings
from collections.abc import Callable
from typing import Any

from jax_ucp._src import store, writer
from jax_ucp._src.continuation.megatron import RECORD, SCHEDULER_REQUIRED, megatron_recipe
from jax_ucp._src.errors import RequestError, SourceError
from jax_ucp._src.format import certificate, files
from jax_ucp._src.format.sizes import parse_size
from jax_ucp._src.importers import registry
from jax_ucp._src.importers.plan import ImportOptions, Share
from jax_ucp._src.multihost import agreement
from jax_ucp._src.multihost.agreement import Gather
from jax_ucp._src.options import field_namer, source_dest_keywords
from jax_ucp._src.writer import commit

Progress = Callable[[str, int, int], None]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    """How ``convert`` imports: its own options, checked once on construction, and the
    format's options (``importing``) as built at the edge, which reach the format whole.

    Attributes:
        format: one of ``importers.registry.FORMATS``, or a layout's importer (its
            ``IMPORTERS``' names); detected from the files when None.
        importing: the import options: the format's options class (``TorchOptions``,
            ``MegatronOptions``, ``DeepSpeedOptions``, ``OrbaxOptions``) or a more general one
            (``ImportOptions``: ``spec``, ``weights_only``) specialised once the format is
            known (None: the format's defaults).
        force: replace a jax_ucp checkpoint at ``dest`` (the old one kept whole until the new
            one is committed).
        step: write ``<dest>/<step>/state`` as a CheckpointManager step (None: a standalone
            checkpoint).
        progress: called as ``progress(name, done, total)`` per parameter.
        compression: the arrays' codec (None: the format's default).
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
    """

    format: str | None = None
    importing: ImportOptions | None = None
    force: bool = False
    step: int | None = None
    progress: Progress | None = None
    compression: str | None = None
    distributed: bool = False
    barrier_timeout: float = 24 * 3600
    memory_budget: int | str | None = None

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


@source_dest_keywords(ConvertOptions)
def convert(source, dest, options: ConvertOptions) -> str:
    """Imports the checkpoint at ``source`` (torch, DeepSpeed, Megatron, Orbax, safetensors,
    verl, ...) as a UCP checkpoint at ``dest``.

    Everything that needs no tensor bytes is checked before anything is written, and a failure
    leaves ``dest`` untouched (one ``commit.transaction``).

    Args:
        source: the checkpoint directory (or file) to import.
        dest: the UCP directory to create, or an ``s3://`` / ``gs://`` prefix.
        options: built from the keywords, each documented in ``ConvertOptions``; the format's
            import options are one object, ``importing=`` (``ImportOptions(weights_only=True)``,
            ``MegatronOptions(vocab_size=...)``, ...).

    Returns:
        The UCP directory (the one holding ucp.json).
    """
    dest = os.fspath(dest)
    _check_target(source, dest, options)
    source = store.storage_for(source)  # chosen once: planned, read and certified through it
    budget = options.memory_budget
    with writer.memory_budget_scope(None if budget is None else int(budget)):
        job = agreement.join(dest, options.barrier_timeout) if options.distributed else None
        plan = _plan(source, dest, options, job)
        items = writer.with_progress(plan.items, plan.total_params, options.progress)
        record = plan.source
        if job is None and record.get(RECORD) is not None:
            items = _run_checked(items, record, source.root)
        if job is None or job[0] == 0:  # the process that commits records it
            record = _certified(source, record)
        common: dict[str, Any] = dict(
            force=options.force, source=record, compression=options.compression
        )
        if job is not None:
            index, count, gather = job
            return writer.write_shared_checkpoint(
                dest, items, index=index, count=count, gather=gather, **common
            )
        if options.step is None:
            return writer.write_host_checkpoint(dest, items, **common)
        from jax_ucp._src.orbax.manager_step import write_manager_step

        return write_manager_step(dest, items, step=options.step, **common)


def _run_checked(items, record: dict[str, Any], where: str):
    """``items`` unchanged; once all are read, a Megatron run's records (args, scheduler, param
    groups, iteration) read as ``optax_from_torch`` reads them: records that disagree, or any
    other reason it cannot continue the run, are warned at convert, each record named (probe 9:
    said first by the continuation, long after)."""
    saved = {}
    for item in items:
        shape = getattr(item.value, "shape", None)
        saved[tuple(item.key)] = (tuple(shape or ()), getattr(item.value, "dtype", None))
        yield item
    scheduler = (record[RECORD] or {}).get("opt_param_scheduler")
    if not isinstance(scheduler, dict) or any(k not in scheduler for k in SCHEDULER_REQUIRED):
        return  # no schedule saved whole (a step count alone): no continuation to check
    if not any(k[:2] == ("opt_state", "mu") for k in saved):
        return  # the weights alone
    try:
        megatron_recipe(_as_recorded(record), saved, where)
    except SourceError as e:
        warnings.warn(
            f"{e} (imported as the files hold it: optax_from_torch will refuse to continue it)",
            UserWarning,
            stacklevel=2,
        )
    except RequestError:  # what a Recipe cannot hold (another optimizer): said by optax_from_torch
        pass


def _as_recorded(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` as the manifest will hold it (tuples as lists: what a continuation reads)."""
    import json

    return json.loads(json.dumps(record, default=str))


def _certified(source: store.storage.Storage, record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with the certificate of the source's files (``format.certificate``), taken
    before the import reads them, which ``verify --against`` checks first; a source in an
    object store has none (its objects are read by ranged GETs, never listed whole)."""
    said = (
        [f"megatron-core's integrity.json: {record['integrity']}"]
        if record.get("integrity")
        else []
    )
    made = source.certificate(said)
    return record if made is None else {**record, certificate.KEY: made}


def _check_target(source, dest: str, options: ConvertOptions) -> None:
    """What the destination refuses, before the source is read (checked again under the save
    lock, in the transaction)."""
    target = store.storage_for(dest)
    if options.step is not None or options.distributed:
        target.local_folder(
            f"convert: {dest} is an object store; step= and distributed=True write local "
            f"(or shared file system) directories only"
        )
    if target.local_path() is None:  # the checks below are of a local directory (os)
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
    if job is None:
        return registry.plan_import(source, options.importing, format=options.format)
    index, count, gather = job
    try:
        share = Share(index, count)
        plan = registry.plan_import(source, options.importing, format=options.format, share=share)
    except BaseException as e:
        agreement.agree(gather, "planned", e, dest)
    agreement.agree(gather, "planned", "", dest)
    return plan
