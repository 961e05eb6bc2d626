"""The "open" stage of a restore straight from a source ``convert`` reads: which sources are
read through their import (``import_format``), the import planned (``registry.plan_import``:
the one edge restoring -> importers, docs/INTERNAL_CONTRACTS.md) and its items read in place by
an ``import_source.ImportSource`` (``opened_import``), and the manifest convert would write for
``jax_ucp.inspect`` (``manifest_of``). Iterating the items reads no tensor bytes (but what
``ImportSource`` builds to learn a shape) and runs the import's accounting (every source tensor
imported or listed in ``source["skipped"]``) as convert does before it commits. JAX-free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator

import numpy as np

from jax_ucp._src import format as fmt
from jax_ucp._src import store, writer
from jax_ucp._src.errors import RequestError, SourceError
from jax_ucp._src.restoring import locate, steps
from jax_ucp._src.restoring.engine import OpenedSource
from jax_ucp._src.restoring.import_source import ImportSource
from jax_ucp._src.store.storage.local_view import ViewError


def import_format(
    path, importing=None, format: str | None = None, *, weights_in_place: bool = True
) -> str | None:
    """The format ``convert`` would import ``path`` as, when a restore reads it through an
    import; None when it is a UCP checkpoint (or what ``locate`` explains: a missing path, a
    CheckpointManager root, a folder no importer claims) or plain safetensors (read in place by
    ``safetensors_source``, unless import options are given).

    Args:
      path: what was passed to restore / plan (its storage, once chosen).
      importing: the import options given (``RestoreOptions.importing``), or None.
      format: the format given (``RestoreOptions.format``), or None.
      weights_in_place: plain safetensors are read in place (None); False: imported too.
    """
    storage = store.storage_for(path)
    path, explicit = storage.root, importing is not None or format is not None
    if not storage.local:
        return _object_store_format(storage, format)
    if locate.is_ucp(storage):
        if explicit and os.path.exists(path):
            raise RequestError(
                f"{path}: a jax_ucp checkpoint; importing= and format= apply to the sources "
                f"convert reads (torch, DeepSpeed, Megatron, ...), not to a UCP checkpoint."
            )
        return None
    if os.path.isdir(path) and steps.with_ucp_items(path):
        return None  # a CheckpointManager root: locate says which step to pass
    from jax_ucp._src.importers import registry  # the edge restoring -> importers

    try:
        found = format or registry.detect_format(path)
    except SourceError:
        if explicit:
            raise
        step = run_root_step(path)  # a Trainer's output_dir: its newest complete checkpoint
        if step is not None:
            return import_format(step, importing, format, weights_in_place=weights_in_place)
        return None  # no importer claims it: the UCP reader's "not a jax_ucp checkpoint"
    from jax_ucp._src.importers.torch.files import has_torch_optimizer
    from jax_ucp._src.importers.trainer_files import check_optimizer_beside_scheduler

    if (
        found == "safetensors"
        and weights_in_place
        and not explicit
        and not has_torch_optimizer(path)
    ):
        check_optimizer_beside_scheduler(path, weights_only=False)  # a run's state lost it
        return None  # weights alone: safetensors_source reads them (a spec as restore's)
    return found


def _object_store_format(prefix: store.storage.Storage, format: str | None) -> str | None:
    """An object-store prefix without ``ucp.json`` is read through an import: a torch DCP
    folder (a ``.metadata`` object) fetches its chunks by ranged GETs, any other source is
    read through a local view of it (``registry``: its archives' ranges fetched as read). A
    prefix no importer claims is None (the UCP reader's "no manifest")."""
    from jax_ucp._src.importers import registry  # the edge restoring -> importers

    if prefix.exists(fmt.MANIFEST_FILE):
        return None
    dcp = registry.IMPORTERS["torch_dcp"]
    if format in (None, dcp.format, dcp.name) and dcp.detect(prefix.root).found:
        return dcp.name
    try:
        return format or registry.detect_format(prefix.root)
    except ViewError:
        raise  # a source there, damaged: never "no manifest"
    except SourceError:
        return None


@dataclasses.dataclass
class Import:
    """A source opened through its import: ``opened`` for the read engine (``restore_from``),
    ``source`` the record convert would write in the manifest (format, path, ``skipped``, the
    optimizer's ``param_groups``, a Trainer's arguments and schedule, notes), ``saved`` each
    tensor's (shape, dtype) as the converted checkpoint would hold it."""

    opened: OpenedSource
    source: dict
    saved: dict[tuple[str, ...], tuple[tuple[int, ...], np.dtype]]
    format: str

    def with_spec(self, spec) -> OpenedSource:
        """The same tensors seen through another restore-time ``spec`` (no new import)."""
        found = self.opened.source
        assert isinstance(found, ImportSource)
        from jax_ucp._src.language.recorded import spec_with_recorded_settings

        spec = spec_with_recorded_settings(spec, self.source)  # heads from its config.json
        return OpenedSource(found, found.available(spec), found.values)


@contextlib.contextmanager
def opened_import(
    path, checkpoint_format: str, importing=None, spec=None, memory_budget: int | None = None
) -> Iterator[Import]:
    """``path`` opened through ``registry.plan_import`` for one restore, its tensors read in
    place; what the plan holds open is dropped after.

    Args:
      path: the source (a folder, or a file).
      checkpoint_format: its format (``import_format``).
      importing: the import options (an ``ImportOptions`` or a format's subclass; None: the
        format's defaults).
      spec: a restore-time spec whose views of the imported tensors are restored.
      memory_budget: bytes the importer may hold at once (``writer.memory_budget``).
    """
    from jax_ucp._src.importers import registry  # the edge restoring -> importers

    path = os.fspath(path)
    path = run_root_step(path, warn=True) or path
    with writer.memory_budget_scope(memory_budget):
        plan = registry.plan_import(path, importing, format=checkpoint_format)
        where = f"the {checkpoint_format} checkpoint {path}"
        source = ImportSource(path, where, plan.items)
        record = json.loads(json.dumps(plan.source, default=str))  # as the manifest holds it
        if spec is not None:  # a spec by name: the source's heads
            from jax_ucp._src.language.recorded import spec_with_recorded_settings

            spec = spec_with_recorded_settings(spec, record)
        try:
            yield Import(
                OpenedSource(source, source.available(spec), source.values),
                record,
                {k: (t.shape, t.dtype) for k, t in source.tensors.items()},
                checkpoint_format,
            )
        finally:
            source.close()


def run_root_step(path: str, *, warn: bool = False) -> str | None:
    """The checkpoint folder to read for a torch trainer's run root that no importer reads
    itself (a Trainer's ``output_dir``, torchtitan's ``checkpoint/``, OLMo-core's save folder):
    its newest complete step, as ``restore(root, step="latest")`` takes it (``resume``), so
    ``restore(root)`` and ``optax_from_torch(root)`` continue the run from it; ``warn``: each
    newer step passed over, and why, as a ``ResumeWarning``. None for any other path (a root
    whose importer follows the run's own tracker, DeepSpeed's ``latest``, is read as it is)."""
    from jax_ucp._src.importers import registry  # the edge restoring -> importers

    if not os.path.isdir(path) or steps.with_ucp_items(path):
        return None
    try:
        if any(importer.detect(path).found for importer in registry.IMPORTERS.values()):
            return None  # an importer reads it as it is
    except (fmt.UCPError, OSError):
        return None  # a format's own file gone wrong: its importer says so
    if steps.trainer_steps(path) is None:
        return None
    from jax_ucp._src.restoring import resume

    found = resume.latest_readable(path, fallback=False)
    if warn:
        found.warn(stacklevel=4)
    return found.step.path


def manifest_of(path, checkpoint_format: str, importing=None) -> fmt.Manifest:
    """The manifest ``convert`` would write for ``path`` (``jax_ucp.inspect`` of a source read
    in place): every entry as the writer records it, the import's record as its source; no
    shard digests (nothing is written), no tensor read (except what ``ImportSource`` builds to
    learn a shape).

    Args:
      path: the source.
      checkpoint_format: its format (``import_format``).
      importing: the import options (None: the format's defaults).
    """
    from jax_ucp._src.writer import layout as layout_lib

    options = layout_lib.ArrayOptions()
    entries: list[fmt.Entry] = []
    with opened_import(path, checkpoint_format, importing) as imported:
        found = imported.opened.source
        assert isinstance(found, ImportSource)
        for key, t in found.tensors.items():
            item = t.item
            recorded = {
                f.name: getattr(item, f.name)
                for f in dataclasses.fields(item)
                if f.name not in ("key", "value", "key_types")
            }
            key_types = tuple(item.key_types or ("key",) * len(key))
            shape_only = np.broadcast_to(np.zeros((), t.dtype), t.shape)
            prepared = layout_lib.prepare_host_tensor(
                key, key_types, shape_only, options, primary=False, **recorded
            )
            entries.append(prepared.entry)
        entries.extend(found.values)
        record = imported.source
    return fmt.new_manifest(entries, source=record)
