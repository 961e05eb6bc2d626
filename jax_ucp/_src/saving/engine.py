"""The save engine: ``prepare`` (the layout, this process's shards on host: all an async save
blocks on) → ``write`` (its shard files, durable, its digests reported) → ``merge`` (the
primary: every digest into ``ucp.json``, written last). ``save`` runs them in one
``multihost.commit.commit_once``; Orbax's CheckpointManager runs them through the adapter
``orbax.handler``. No Orbax here."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from typing import Any

import jax

from jax_ucp._src import format as fmt
from jax_ucp._src import store, writer
from jax_ucp._src import tree as tree_lib
from jax_ucp._src.errors import RequestError
from jax_ucp._src.format.sizes import parse_optional_size
from jax_ucp._src.multihost import agreement
from jax_ucp._src.multihost import commit as multihost_commit
from jax_ucp._src.options import field_namer
from jax_ucp._src.saving import plan as save_plan
from jax_ucp._src.store import shard_file
from jax_ucp._src.writer import commit
from jax_ucp._src.writer.checkpoint import run_coroutine

DIGESTS_PREFIX = "ucp.digests."  # per-process shard digests, merged by the primary
#: seconds every process of a save waits at most for the slowest (a process of this host that
#: dies is noticed at once, one on another host by jax.distributed's heartbeat)
BARRIER_TIMEOUT = 3600.0


@dataclasses.dataclass
class SaveArgs:
    """What to save and how, checked when constructed (``UCPSave`` is these as Orbax's args),
    so a wrong option fails in the caller's line, not later in a background write.

    Attributes:
      item: pytree of jax.Array / numpy arrays / Python scalars, strings, None (flax
        ``nn.Partitioned`` / ``LogicallyPartitioned`` boxes included).
      logical_axes: optional pytree (same structure) of flax-style logical axis-name tuples,
        recorded so a restore can map them with new rules; flax boxes in ``item`` are
        recorded automatically.
      compression: None (default: the fastest save and restore) or "zstd" (smaller on disk;
        the trade-off is measured in docs/BENCHMARKS.md, "Compression").
      compression_level: zstd level (-131072..22; default 3), used with "zstd".
      inner_chunk_bytes: bound on inner chunks: bytes or e.g. "1MiB" (what a reader fetches
        at least); None: the store's default.
      checksum: "crc32c" (default: every inner chunk and shard index verified on read) or None
        (corruption then goes undetected; restores no faster here: docs/BENCHMARKS.md).
      source: provenance recorded in the manifest (a JSON object).
      memory_budget: host bytes of shard data in flight: an int or a size such as "1GiB"
        (None: unbounded, every shard copied to host before an async save returns). With it,
        an async save copies only the first shards up to it and the commit copies, writes and
        frees the rest batch by batch (``jax_ucp._src.saving.budget``); a single device shard
        larger than it is an error naming the tensor.
    """

    item: Any
    logical_axes: Any = None
    compression: str | None = None
    compression_level: int = 3
    inner_chunk_bytes: int | str | None = None
    checksum: str | None = "crc32c"
    source: dict | None = None
    memory_budget: int | str | None = None

    def __post_init__(self):
        field, level = field_namer(self), self.compression_level  # save(x=) or UCPSave.x
        if self.compression not in (None, "zstd"):
            raise RequestError(
                f"{field('compression')}: expected None or 'zstd', got {self.compression!r}."
            )
        if isinstance(level, bool) or not isinstance(level, int) or not -131072 <= level <= 22:
            raise RequestError(
                f"{field('compression_level')}: expected an int in -131072..22 (zstd's levels), "
                f"got {level!r}."
            )
        try:  # an int or a size such as "1MiB", as every byte-size option
            self.inner_chunk_bytes = parse_optional_size(
                self.inner_chunk_bytes, field("inner_chunk_bytes")
            )
            self.memory_budget = parse_optional_size(self.memory_budget, field("memory_budget"))
        except RequestError as e:
            raise RequestError(f"{e}.") from None
        if self.checksum not in ("crc32c", None):
            raise RequestError(
                f"{field('checksum')}: expected 'crc32c' or None, got {self.checksum!r}."
            )
        if self.source is not None and not isinstance(self.source, dict):
            raise RequestError(
                f"{field('source')}: expected None or a dict (a JSON object), got "
                f"{type(self.source).__name__}."
            )


@dataclasses.dataclass
class SaveOptions(SaveArgs):
    """``jax_ucp.save``'s arguments after the path (``options.keywords_of``): ``SaveArgs``
    and ``force``.

    Attributes:
      force: replace a jax_ucp checkpoint at the path (kept whole until the new one is in
        place; a committed object-store checkpoint is never replaced).
    """

    _: dataclasses.KW_ONLY
    force: bool = False


@dataclasses.dataclass
class PreparedSave:
    """One process's save between its stages: the writes ``prepare`` laid out (dropped once
    written), and on the primary the manifest ``merge`` completes with every shard's digest."""

    directory: str
    primary: bool
    tensors: list[writer.PreparedTensor]
    manifest: fmt.Manifest | None
    digests: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    budget: int | None = None  # ``SaveArgs.memory_budget`` in bytes: writes in its window


def prepare(
    directory: str,
    args: SaveArgs,
    *,
    primary: bool,
    copy: bool,
    pool: save_plan.HostCopyPool | None = None,
    copies_out: list | None = None,
) -> PreparedSave:
    """The layout of ``args.item`` and this process's shards on host, nothing written yet.

    Args:
        directory: where the checkpoint is written (a directory or an object-store prefix).
        args: the tree and its layout options.
        primary: this process writes what exists once and the manifest.
        copy: private host copies of CPU shards (an async save: the caller goes on).
        pool: where those copies come from (None: new memory).
        copies_out: receives the copies, for ``pool.release`` once they are written.
    """
    options = writer.SaveOptions(
        compression=args.compression,
        compression_level=args.compression_level,
        inner_chunk_bytes=int(args.inner_chunk_bytes or store.DEFAULT_INNER_CHUNK_BYTES),
        checksum=args.checksum,
    )
    entries, tensors = save_plan.prepare_tree(
        args.item,
        options,
        primary=primary,
        copy=copy,
        logical_axes=args.logical_axes,
        pool=pool,
        copies_out=copies_out,
        budget=_budget(args),
    )
    manifest = None
    if primary:
        manifest = fmt.new_manifest(
            entries,
            source=args.source,
            tree=tree_lib.describe_structure(args.item),
            kvstore_driver=store.kvstore_driver(directory),
        )
    return PreparedSave(directory, primary, tensors, manifest, budget=_budget(args))


def _budget(args: SaveArgs) -> int | None:
    return None if args.memory_budget is None else int(args.memory_budget)


async def write(save: PreparedSave, written: Callable[[], None] | None = None) -> None:
    """This process's shard files, made durable, and its digests reported: kept for ``merge``
    on the primary, a ``ucp.digests.<process>.json`` from the others.

    Args:
        save: what ``prepare`` laid out; its tensors are dropped once written.
        written: called once every write has settled (the host copies may be reused).
    """
    directory = save.directory
    # No fsync per file (each costs a disk round trip: thousands of small tensors spent most
    # of a save there); one syncfs makes this process's files durable before the commit.
    try:
        digests = await save_plan.write_all(
            directory, save.tensors, primary=save.primary, sync=False, budget=save.budget
        )
    finally:  # every write has settled: the next save may write over these copies
        save.tensors = []
        if written is not None:
            written()
    storage = store.storage_for(directory)
    await asyncio.to_thread(storage.make_durable)
    if save.primary:
        save.digests.update(digests)
        return
    storage.write(f"{DIGESTS_PREFIX}{jax.process_index()}.json", json.dumps(digests).encode())


def merge(save: PreparedSave, process_count: int) -> None:
    """The primary, after every process wrote: ``ucp.json`` last, with the digest of every
    shard file, so a checkpoint is listed only once all its data is in place; the other
    processes' reports removed.

    Args:
        save: the primary's save, written.
        process_count: how many processes wrote (each other one reported its digests).
    """
    assert save.manifest is not None, "merge runs on the primary"
    root, digests = save.directory, save.digests
    storage = store.storage_for(root)
    others = [n for n in storage.names(DIGESTS_PREFIX) if n.endswith(".json")]
    expected = max(process_count - 1, 0)
    if len(others) != expected:
        raise fmt.UCPError(
            f"{root}: {len(others)} of the {expected} other processes reported their "
            f"shard digests; the save is incomplete and is not committed."
        )
    for name in others:
        reported = json.loads(storage.read(name, 64 << 20) or b"{}")
        for array_dir, shard_digests in reported.items():
            digests.setdefault(array_dir, {}).update(shard_digests)
    entries = []
    for e in save.manifest.entries:
        if isinstance(e, fmt.TensorEntry) and e.dir in digests:
            e = writer.with_digests(e, digests[e.dir])
            keys = shard_file.grid_keys(e.shape, e.chunk_shape)
            missing = [k for k in keys if k not in digests[e.dir]]
            if missing:
                raise fmt.UCPError(
                    f"{root}: tensor {e.name!r}: no process wrote shard(s) "
                    f"{missing[:5]}; the save is incomplete and is not committed."
                )
        entries.append(e)
    manifest = dataclasses.replace(save.manifest, entries=entries)
    storage.write_manifest(manifest)  # in an object store, the commit: the reports go after
    storage.delete(others)


def save(path: str, args: SaveArgs, *, force: bool) -> None:
    """``args`` saved at ``path`` by every process, committed once (``commit_once``) in a
    ``commit.transaction``: a failed or killed save leaves the old checkpoint whole.

    Args:
        path: the checkpoint directory (absolute) or object-store prefix.
        args: the tree and its options, the same in every process.
        force: replace a jax_ucp checkpoint at ``path``.
    """
    path = path.rstrip("/")
    # A malformed URL or a committed prefix fails here, in every process: all raise alike.
    store.storage_for(path).refuse_early(commit.Replace(force))
    job = agreement.join(path, BARRIER_TIMEOUT, purpose="save")
    index, count, gather = job or (0, 1, None)
    saves: list[PreparedSave] = []

    def write_part(directory: str) -> str:
        saves.append(prepare(directory, args, primary=index == 0, copy=False))
        run_coroutine(write(saves[0]))
        return ""

    multihost_commit.commit_once(
        path,
        index=index,
        gather=gather,
        begin=lambda: commit.transaction(path, force=force),
        write=write_part,
        merge=lambda _directory, _reports: merge(saves[0], count),
    )
