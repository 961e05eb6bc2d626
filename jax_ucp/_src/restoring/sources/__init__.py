"""The sources of the read engine (``engine.TensorSource``) and the "open" stage that picks one:
a UCP checkpoint, read by its manifest (``ucp_source``), or any other source ``convert`` reads,
through its import (``import_open``: the importer detected once and handed down, its items read
in place by ``import_source``, a spec's transposes over ranged reads by ``gathered``). JAX-free.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jax_ucp._src import format as fmt
from jax_ucp._src.errors import CheckpointError
from jax_ucp._src.restoring import locate
from jax_ucp._src.store.storage.base import listed_once

if TYPE_CHECKING:
    from jax_ucp._src.importers.plan import Importer
    from jax_ucp._src.store.storage import Storage


@dataclasses.dataclass(frozen=True)
class Opening:
    """The open stage's one decision: ``storage`` read through ``importer`` (detected once),
    or as a UCP checkpoint (``importer`` None; ``manifest`` True: its ucp.json seen there, not
    asked again by the first read; None: asked then, a swap may have put it there since)."""

    storage: Storage
    importer: Importer | None = None
    manifest: bool | None = None


def opening(storage: Storage, importing=None, format=None, *, warn: bool = True) -> Opening:
    """The open stage's one decision for ``storage``: "a manifest here?" asked once (else
    ``locate.is_ucp``: an Orbax step, a manager root, a swap), else "which importer?" once
    (``import_open.import_for``; no importer code loaded for a UCP checkpoint); none claiming
    it: an object-store prefix's one UCP item, else the UCP reader's error with the detectors'
    report (``registry.Unclaimed``). ``storage``: the path restored, inspected or planned,
    chosen once; ``importing`` / ``format``: those given (``RestoreOptions``' fields), or None;
    ``warn``: a run root's newer steps passed over are said (``ResumeWarning``)."""
    manifest = storage.exists(fmt.MANIFEST_FILE)
    with listed_once():  # a remote prefix: one LIST for "UCP items below?" and the detectors
        if locate.is_ucp(storage, manifest, explicit=importing is not None or format is not None):
            return Opening(storage, manifest=manifest or None)
        from jax_ucp._src.restoring.sources import import_open

        found = import_open.import_for(storage, importing, format, warn=warn)
    if isinstance(found, tuple):
        return Opening(*found)
    try:  # an object-store prefix's one UCP item, else the error naming what each reader saw
        return Opening(locate.find_checkpoint(storage, manifest), manifest=True)
    except CheckpointError as e:
        raise CheckpointError(f"{e} Nor a source convert reads: {found.message}") from None
