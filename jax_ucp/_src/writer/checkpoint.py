"""A standalone checkpoint written from a stream of host tensors, committed atomically.

An importer yields ``HostItem``s; each is written as it comes, with a bounded number of bytes in
flight (``shards.PipelinedWriter``), so peak memory is a few tensors, not the checkpoint. No JAX
or Orbax: a conversion is a host-only job and their import was ~1 s of it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import itertools
import os
import pathlib
from collections.abc import Iterable, Mapping

from jax_ucp._src import format as fmt
from jax_ucp._src.multihost import commit as multihost_commit
from jax_ucp._src.multihost.agreement import Gather, MultiProcessError
from jax_ucp._src.store.storage import local
from jax_ucp._src.writer import commit
from jax_ucp._src.writer.stream import HostItem, write_stream

PART_FILE = "ucp.part-{}.json"  # one process's entries, merged into ucp.json by the primary


def write_host_checkpoint(
    dest,
    items: Iterable[HostItem],
    *,
    force: bool = False,
    source: Mapping | None = None,
    compression: str | None = None,
) -> str:
    """Writes ``items`` as a UCP checkpoint at ``dest`` in one ``commit.transaction``.

    Args:
        dest: a directory, or an ``s3://`` / ``gs://`` prefix (committed by its ``ucp.json``,
            written last: an object store has no rename).
        items: the tensors and values, written as they come.
        force: replace a jax_ucp checkpoint at ``dest`` (kept whole until the new one is in).
        source: provenance recorded in the manifest.
        compression: the arrays' codec (``None``: the format's default).

    Returns:
        ``dest`` (the directory of ``ucp.json``).
    """
    with commit.transaction(dest, force=force, kind="import") as tx:
        # Nothing fsynced per file: the commit makes the directory durable with one syncfs.
        run_coroutine(
            write_stream(tx.path, items, source=source, compression=compression, sync=False)
        )
    return tx.dest


def write_shared_checkpoint(
    dest,
    items: Iterable[HostItem],
    *,
    index: int,
    count: int,
    gather: Gather,
    force: bool = False,
    source: Mapping | None = None,
    compression: str | None = None,
) -> str:
    """One UCP checkpoint written by ``count`` processes on a shared file system, process
    ``index`` writing ``items`` (its share of the tensors), committed once by the primary
    (``multihost.commit.commit_once``): each process writes its part file, makes it durable
    and reports its sha256; the primary merges the parts and renames once.

    Args:
        dest: the checkpoint directory, on a file system every process sees.
        items: this process's share of the tensors and values.
        index: this process's index (0: the primary, which locks and commits).
        count: how many processes write.
        gather: the exchange of outcomes between the processes (``agreement.Gather``, e.g.
            jax.distributed's key-value store: this layer stays JAX-free).
        force: replace a jax_ucp checkpoint at ``dest``.
        source: provenance recorded in the manifest.
        compression: the arrays' codec (``None``: the format's default).

    Returns:
        ``dest``.
    """
    dest = os.path.abspath(os.fspath(dest)).rstrip("/")
    part_file = PART_FILE.format(index)

    def write(shared: str) -> str:
        run_coroutine(
            write_stream(
                shared,
                items,
                source=source,
                compression=compression,
                sync=False,
                manifest_file=part_file,
            )
        )
        # On a shared file system each host holds its own dirty pages: the primary's syncfs
        # at commit flushes only its host's, so every process makes its part durable before
        # it reports it written (as each process of a JAX save does).
        local.make_tree_durable(shared)
        return hashlib.sha256(pathlib.Path(shared, part_file).read_bytes()).hexdigest()

    multihost_commit.commit_once(
        dest,
        index=index,
        gather=gather,
        begin=lambda: commit.transaction(dest, force=force, kind="import"),
        write=write,
        merge=lambda shared, digests: _merge_parts(shared, digests, source),
    )
    return dest


def _merge_parts(tmp: str, digests: list[str], source: Mapping | None) -> None:
    """The parts' entries as one ``ucp.json`` (per-parameter groups interleaved in the order the
    processes took them round-robin); the part files removed. Each part must be the one its
    process reported (``digests``: their sha256), and no tensor may come from two parts."""
    groups: list[list[list[fmt.Entry]]] = []
    seen: dict[tuple[str, ...], int] = {}
    for i, digest in enumerate(digests):
        path = os.path.join(tmp, PART_FILE.format(i))
        try:
            data = pathlib.Path(path).read_bytes()
        except OSError as e:
            raise MultiProcessError(f"{path}: process {i} reported its part, but: {e}") from e
        found = hashlib.sha256(data).hexdigest()
        if found != digest:
            raise MultiProcessError(
                f"{path}: not the part process {i} reported (sha256 {digest}, found {found})"
            )
        part = fmt.Manifest.loads(data, where=path)
        mine: dict[str, list[fmt.Entry]] = {}
        for entry in part.entries:
            if entry.key in seen:
                raise MultiProcessError(
                    f"{path}: {fmt.key_to_str(entry.key)!r} written by process {seen[entry.key]} "
                    f"and process {i}"
                )
            seen[entry.key] = i
            mine.setdefault(entry.key[-1], []).append(entry)
        groups.append(list(mine.values()))
    for i in range(len(digests)):
        os.remove(os.path.join(tmp, PART_FILE.format(i)))
    rounds = itertools.zip_longest(*groups, fillvalue=[])
    entries = [entry for round_ in rounds for group in round_ for entry in group]
    manifest = fmt.new_manifest(entries, source=source)
    pathlib.Path(tmp, fmt.MANIFEST_FILE).write_text(manifest.dumps())


def run_coroutine(coro) -> None:
    """``asyncio.run``, also from code that already runs an event loop (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(coro)
        return
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, coro).result()
