"""The "open" stage of a restore straight from a source ``convert`` reads: which sources are
read through their import and by which importer, detected once (``import_for``), the import planned (``registry.plan_import``:
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
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from jax_ucp._src import format as fmt
from jax_ucp._src import store, writer
from jax_ucp._src.errors import (
    CheckpointError,
    MultiProcessError,
    ResumeWarning,
)
from jax_ucp._src.importers import registry
from jax_ucp._src.language.recorded import spec_with_recorded_settings
from jax_ucp._src.options import user_stacklevel
from jax_ucp._src.restoring.engine import OpenedSource
from jax_ucp._src.restoring.sources.import_source import ImportSource
from jax_ucp._src.writer import layout as layout_lib

if TYPE_CHECKING:
    from jax_ucp._src.importers.plan import Importer


def import_for(
    storage: store.storage.Storage, importing=None, format: str | None = None, *, warn: bool = False
) -> tuple[store.storage.Storage, Importer] | registry.Unclaimed:
    """``(the storage read, the importer convert would import it with)`` for a source that is
    no UCP checkpoint (``sources.opening`` asked that once), a trainer's run root read as its
    newest complete step, else the detectors' report; asked of the registry once
    (``registry.claim``) and passed down (``opened_import``): no detector is asked again.

    Args:
      storage: what was passed to restore / plan.
      importing: the import options given (``RestoreOptions.importing``), or None.
      format: the format given (``RestoreOptions.format``), or None.
      warn: a run root's newer steps passed over are said (``ResumeWarning``).
    """
    explicit = importing is not None or format is not None
    found = registry.claim(storage, format, importing or registry.ImportOptions())
    if not isinstance(found, registry.Unclaimed):
        return storage, found
    if explicit:
        raise found.error()
    if found.run is None:
        return found
    # A torch trainer's run root that no importer reads itself (a Trainer's output_dir,
    # torchtitan's checkpoint/, OLMo-core's save folder): its newest complete step, as
    # restore(root, step="latest") takes it (``resume.latest_readable`` without fallback), each
    # newer step passed over said (warn=); the run the detectors listed, not listed again.
    run, path = found.run, storage.root
    complete = [s for s in run.steps if s.problem is None]
    if not complete:
        whys = "; ".join(f"step {s.step}: {s.problem}" for s in run.steps)
        raise CheckpointError(f"{path}: no committed step can be read: {whys[:2000]}")
    for passed in run.steps[: run.steps.index(complete[0])] if warn else ():
        warnings.warn(
            f"{path}: step {passed.step} skipped: {passed.problem}",
            ResumeWarning,
            stacklevel=user_stacklevel(),  # the user's call
        )
    return import_for(storage.at(complete[0].path), importing, format)


def one_revision(storage: store.storage.Storage) -> store.storage.Storage:
    """``storage`` at its URL as process 0 of a multi-process job resolved it (``Storage.absolute``:
    a Hub branch pinned to its commit), so that every process of a restore reads one revision
    of a source in an object store or a Hub repo."""
    import jax

    if jax.process_count() == 1 or storage.local_path() is not None:
        return storage
    from jax_ucp._src.multihost import agreement

    try:
        hello = {"url": storage.absolute()}
    except fmt.UCPError as e:  # posted, so that the others stop waiting
        hello = {"error": f"{type(e).__name__}: {e}"[:2000]}
    where = f"{storage.root}: opening it in {jax.process_count()} processes:"
    peers = agreement.Exchange("remote-source", where, 300.0, hello=hello).peers
    for i, peer in enumerate(peers):
        if "error" in peer:
            raise MultiProcessError(f"{where} process {i}: {peer['error']}")
    return storage.at(peers[0]["url"])


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
        if spec is not None:  # a spec by name: the heads of its config.json
            spec = spec_with_recorded_settings(spec, self.source)
        return OpenedSource(found, found.available(spec), found.values)


@contextlib.contextmanager
def opened_import(
    storage: store.storage.Storage,
    importer: Importer,
    importing=None,
    spec=None,
    memory_budget: int | None = None,
) -> Iterator[Import]:
    """``storage`` opened through ``registry.plan_import`` for one restore, its tensors read in
    place; what the plan holds open is dropped after.

    Args:
      storage: the source (a folder, or a file).
      importer: its importer (``import_for``: ``storage`` is the one it gave).
      importing: the import options (an ``ImportOptions`` or a format's subclass; None: the
        format's defaults).
      spec: a restore-time spec whose views of the imported tensors are restored.
      memory_budget: bytes the importer may hold at once (``writer.memory_budget``).
    """
    path, checkpoint_format = storage.root, importer.format
    with writer.memory_budget_scope(memory_budget):
        plan = registry.plan_import(storage, importing, format=importer)  # no detector again
        where = f"the {checkpoint_format} checkpoint {path}"
        source = ImportSource(path, where, plan.items)
        record = json.loads(json.dumps(plan.source, default=str))  # as the manifest holds it
        saved = {k: (t.shape, t.dtype) for k, t in source.tensors.items()}
        imported = Import(OpenedSource(source, {}), record, saved, checkpoint_format)
        try:
            imported.opened = imported.with_spec(spec)
            yield imported
        finally:
            source.close()


def manifest_of(storage: store.storage.Storage, importer: Importer, importing=None) -> fmt.Manifest:
    """The manifest ``convert`` would write for ``storage`` (``jax_ucp.inspect`` of a source read
    in place): every entry as the writer records it, the import's record as its source; no
    shard digests (nothing is written), no tensor read (except what ``ImportSource`` builds to
    learn a shape).

    Args:
      storage: the source.
      importer: its importer (``import_for``).
      importing: the import options (None: the format's defaults).
    """
    options = layout_lib.ArrayOptions()
    entries: list[fmt.Entry] = []
    with opened_import(storage, importer, importing) as imported:
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
