"""``verify(SRC)`` of a source convert reads (a torch DCP folder, a Trainer checkpoint, DeepSpeed,
Megatron, torch.save files, ...), not a jax_ucp checkpoint: its import planned and every tensor
read through it, one at a time, as a restore reads it, so every check its readers make runs
(files and layout, zip CRC-32s, DCP chunk coverage, ``integrity.json``, ZeRO ranks); what its
files record no check of is said (``importers.source_checks``). JAX-free."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from jax_ucp._src import format as fmt
from jax_ucp._src.importers.source_checks import SourceCheck, source_check
from jax_ucp._src.restoring import engine, model
from jax_ucp._src.restoring.sources import import_open

if TYPE_CHECKING:
    from jax_ucp._src.importers.plan import Importer
    from jax_ucp._src.store.storage import Storage


def verify_source(
    path: str,
    storage: Storage,
    importer: Importer,
    progress: Callable[[str, int, int], None] | None = None,
    memory_budget: int | None = None,
):
    """``([(tensor name, error)], SourceCheck)`` of the source at ``path``: every tensor of its
    import read whole, one at a time (a damaged one is named and the next read); a plan the
    importer refuses (a rank file missing, chunks not covering a tensor) is the one problem,
    named by the path.

    Args:
      path: the source, as given (the name of a problem of its import).
      storage: the storage read (``import_open.import_for``'s: a run root's newest step).
      importer: its importer, detected there once (no detector is asked again).
      progress: called as ``progress(name, done, total)`` after each tensor.
      memory_budget: bytes the import and each read may hold at once.
    """
    problems: list[tuple[str, str]] = []
    try:
        with import_open.opened_import(storage, importer, memory_budget=memory_budget) as imported:
            opened = imported.opened
            keys = list(opened.available)
            for done, key in enumerate(keys, 1):
                name = fmt.key_to_str(key)
                try:  # read as a restore reads it, the data dropped
                    engine.read_from(
                        opened.source,
                        [model.Request(key=key)],
                        opened.available,
                        {},
                        memory_budget=memory_budget,
                    )
                except (fmt.UCPError, OSError) as e:
                    problems.append((name, str(e)))
                if progress is not None:
                    progress(name, done, len(keys))
            record = imported.source
    except (fmt.UCPError, OSError) as e:
        refused = SourceCheck(importer.format, [], ["the rest: the import was refused"])
        return [(path, str(e))], refused
    check = source_check(record, importer.format)
    check.checked.append(f"every tensor read whole: {len(keys)} tensors")
    check.tensors = len(keys)
    return problems, check
