"""The sources of the read engine (``engine.TensorSource``) and the "open" stage that picks one:
a UCP checkpoint, read by its manifest (``ucp_source``), or any other source ``convert`` reads,
through its import (``import_open``: the importer detected once and handed down, its items read
in place by ``import_source``, a spec's transposes over ranged reads by ``gathered``). JAX-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jax_ucp._src.restoring import locate

if TYPE_CHECKING:
    from jax_ucp._src.importers.plan import Importer
    from jax_ucp._src.store.storage import Storage


def imported(
    storage: Storage, importing=None, format=None, *, warn: bool = True
) -> tuple[Storage, Importer] | None:
    """The open stage's one decision for ``storage``: None for a UCP checkpoint (a manifest
    there, or what ``locate`` explains: ``locate.is_ucp``, asked once), else ``(the storage
    read, the importer detected for it)`` (``import_open.import_for``: which importer, asked
    once). A UCP checkpoint is told first, without loading any importer's code.

    Args:
      storage: the path restored, inspected or planned (its ``Storage``, chosen once).
      importing: the import options given (``RestoreOptions.importing``), or None.
      format: the format given (``RestoreOptions.format``), or None.
      warn: a run root's newer steps passed over are said (``ResumeWarning``).
    """
    if locate.is_ucp(storage, explicit=importing is not None or format is not None):
        return None
    from jax_ucp._src.restoring.sources import import_open

    return import_open.import_for(storage, importing, format, warn=warn)
