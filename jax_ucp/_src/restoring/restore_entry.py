"""``jax_ucp.restore``, importing JAX but not Orbax (a restore reads through TensorStore; only
saving and Orbax's handlers need Orbax, ~0.5 s more to start): the stages in order, each
entered once: the source located and opened (``sources``: ``locate`` and ``ucp_source``, or
``import_open``) → its requests (``requests``, the JAX part) → the read engine (``engine``) → the
result's tree."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

from jax_ucp._src import store
from jax_ucp._src.options import keywords_of
from jax_ucp._src.restoring import engine, locate, requests, sources
from jax_ucp._src.restoring import options as restore_options
from jax_ucp._src.restoring.engine import OpenedSource
from jax_ucp._src.restoring.sources import ucp_source


@keywords_of(restore_options.RestoreOptions)
def restore(path: str | os.PathLike, options: restore_options.RestoreOptions):
    """Restores a UCP checkpoint onto any mesh; the keywords are ``RestoreOptions``' fields
    (``target`` may be given second, positionally).

    Args:
      path: the checkpoint directory (holding ucp.json) or an Orbax step directory with one UCP
        item; or any source ``convert`` reads, e.g. Hugging Face safetensors (a ``.safetensors``
        file, or a folder of them with ``model.safetensors.index.json``, also in an object
        store or a Hub repo) read in place as its conversion would hold it (``params/<HF
        name>``): each process reads only its slices' byte ranges, a ``spec``
        (``"hf_llama"``) applied as lazy views; no copy on disk. Or any other source ``convert`` reads (torch DCP, torch.save files, a Trainer folder, DeepSpeed,
        Megatron, verl, Orbax, ...): opened through its import (``importing=``, ``format=``)
        and read in place; the tree is the one convert + restore gives, nothing is written.
      options: built from the keywords, each documented in ``RestoreOptions``.
    """
    if options.step is not None:  # a CheckpointManager root: one of its committed steps
        return _restore_step(os.fspath(path), options)
    return restore_tree(path, options)


def restore_tree(path, options: restore_options.RestoreOptions) -> Any:
    """Restores the checkpoint at ``path`` (see ``jax_ucp.restore``), whole or not at all: its
    source opened (a UCP checkpoint, else its import read in place), the requests ``options``
    make of it, read by the engine.

    A concurrent forced save swaps directories: the restore starts over on the new one
    (``locate.consistent_reads``), so the result is never a mix of two saves nor a false
    "corrupt".

    Args:
      path: the checkpoint directory, an Orbax step directory holding one UCP item, or
        safetensors (a file, or a folder of them).
      options: what to restore and how (checked when constructed).
    """
    opened = sources.opening(store.storage_for(path), options.importing, options.format)
    if opened.importer is not None:  # read in place through its import: no UCP checkpoint there
        with imported(opened, options) as source:
            return restore_from(source, options)
    result: Any = None
    for attempt in locate.consistent_reads(opened.storage, manifest=opened.manifest):
        with attempt:
            opened_ucp = ucp_source.open_checkpoint(attempt.find(), options.spec)
            result = restore_from(opened_ucp, options)
    return result


@contextlib.contextmanager
def imported(opened: sources.Opening, options) -> Iterator[OpenedSource]:
    """The "open" stage of a source read through its import (safetensors too): its plan opened
    with the importer ``sources.opening`` detected once and ``options.importing``."""
    from jax_ucp._src.restoring.sources import import_open

    assert opened.importer is not None
    storage = import_open.one_revision(opened.storage)  # one Hub commit for every process
    with import_open.opened_import(
        storage, opened.importer, options.importing, options.spec, options.read_budget
    ) as found:
        yield found.opened


def restore_from(opened: OpenedSource, options: restore_options.RestoreOptions):
    """A restore from ``opened``, whatever its source: into ``options.target`` / ``.shardings``,
    or every tensor (or those ``select`` matches) on ``mesh=`` (saved PartitionSpecs and logical
    axes through ``rules``) or to host.

    Args:
      opened: the source and what it holds (``engine.OpenedSource``).
      options: a restore's options.
    """
    wanted = requests.requests_for(opened, options)
    results = engine.read_from(
        opened.source,
        wanted.requests,
        wanted.available,
        {v.key: v for v in opened.values},
        casting=options.casting,
        memory_budget=options.read_budget,
        replicated_read=options.replicated_read,
    )
    if options.mesh is not None:  # the names a save of the run records again
        from jax_ucp._src.sharding import restored_axes

        restored_axes.remember(
            [
                (r.key, x, getattr(wanted.available.get(r.key), "logical_axes", None))
                for r, x in zip(wanted.requests, results)
            ]
        )
    return wanted.assemble(results)


def _restore_step(root: str, options: restore_options.RestoreOptions):
    """``restore(root, step=N | "latest", fallback=)``: the step's UCP item restored; for
    "latest" the step ``resume.latest_readable`` takes (the rule ``latest_step`` gives too)."""
    from jax_ucp._src.restoring import resume

    plain = dataclasses.replace(options, step=None, fallback=False)
    if isinstance(options.step, int):  # checked when the options were made: N or "latest"
        return restore_tree(resume.step_item(root, options.step), plain)
    found = resume.latest_readable(
        root, fallback=options.fallback, read=lambda item: restore_tree(item, plain)
    )
    found.warn(stacklevel=4)
    return found.value
