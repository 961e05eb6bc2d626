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

import jax
import msgspec

from jax_ucp._src import format as fmt
from jax_ucp._src import store, writer
from jax_ucp._src import tree as tree_lib
from jax_ucp._src.multihost import agreement
from jax_ucp._src.multihost import commit as multihost_commit
from jax_ucp._src.saving import plan as save_plan
from jax_ucp._src.saving.options import SaveArgs
from jax_ucp._src.store import shard_file
from jax_ucp._src.writer import commit
from jax_ucp._src.writer.checkpoint import run_coroutine

DIGESTS_PREFIX = "ucp.digests."  # per-process shard digests, merged by the primary
#: seconds every process of a save waits at most for the slowest (a process of this host that
#: dies is noticed at once, one on another host by jax.distributed's heartbeat)
BARRIER_TIMEOUT = 3600.0
#: said when it runs out: save has no option for it (probe 9: "save's barrier_timeout" was said)
TIMEOUT_HINT = (
    f" (a save waits {BARRIER_TIMEOUT:g} s for each process at each step: a process of this "
    "host that is stopped (SIGSTOP) or hung still lives, and is waited for)"
)


@dataclasses.dataclass
class PreparedSave:
    """One process's save between its stages: the writes ``prepare`` laid out (dropped once
    written), and on the primary the manifest ``merge`` completes with every shard's digest."""

    storage: store.storage.Storage  # where it is written (a directory or an object-store prefix)
    primary: bool
    tensors: list[writer.PreparedTensor]
    manifest: fmt.Manifest | None
    digests: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    budget: int | None = None  # ``SaveArgs.memory_budget`` in bytes: writes in its window


def prepare(
    storage: store.storage.Storage,
    args: SaveArgs,
    *,
    primary: bool,
    copy: bool,
    pool: save_plan.HostCopyPool | None = None,
    copies_out: list | None = None,
) -> PreparedSave:
    """The layout of ``args.item`` and this process's shards on host, nothing written yet.

    Args:
        storage: where the checkpoint is written (a directory or an object-store prefix).
        args: the tree and its layout options.
        primary: this process writes what exists once and the manifest.
        copy: private host copies of CPU shards (an async save: the caller goes on).
        pool: where those copies come from (None: new memory).
        copies_out: receives the copies, for ``pool.release`` once they are written.
    """
    options = writer.ArrayOptions(
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
            kvstore_driver=store.kvstore_driver(storage.root),
        )
    return PreparedSave(storage, primary, tensors, manifest, budget=_budget(args))


def _budget(args: SaveArgs) -> int | None:
    return None if args.memory_budget is None else int(args.memory_budget)


async def write(save: PreparedSave, written: Callable[[], None] | None = None) -> None:
    """This process's shard files, made durable, and its digests reported: kept for ``merge``
    on the primary, a ``ucp.digests.<process>.json`` from the others.

    Args:
        save: what ``prepare`` laid out; its tensors are dropped once written.
        written: called once every write has settled (the host copies may be reused).
    """
    directory = save.storage.root
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
    storage = save.storage
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
    storage, digests = save.storage, save.digests
    root = storage.root
    others = [n for n in storage.names(DIGESTS_PREFIX) if n.endswith(".json")]
    expected = max(process_count - 1, 0)
    if len(others) != expected:
        raise fmt.UCPError(
            f"{root}: {len(others)} of the {expected} other processes reported their "
            f"shard digests; the save is incomplete and is not committed."
        )
    for name in others:
        reported = fmt.files.strict_json(
            storage.read(name, 64 << 20) or b"{}", f"{root}/{name}", fmt.UCPError
        )
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
    manifest = msgspec.structs.replace(save.manifest, entries=entries)
    storage.write_manifest(manifest)  # in an object store, the commit: the reports go after
    storage.delete(others)


def save(storage: store.storage.Storage, args: SaveArgs, *, force: bool) -> None:
    """``args`` saved at ``storage`` by every process, committed once (``commit_once``) in a
    ``commit.transaction``: a failed or killed save leaves the old checkpoint whole.

    Args:
        storage: the checkpoint directory or object-store prefix (``api.save``'s).
        args: the tree and its options, the same in every process.
        force: replace a jax_ucp checkpoint there.
    """
    path = storage.absolute().rstrip("/")
    # A malformed URL or a committed prefix fails here, in every process: all raise alike.
    storage.at(path).refuse_early(commit.Replace(force))
    job = agreement.join(path, BARRIER_TIMEOUT, purpose="save", hint=TIMEOUT_HINT)
    index, count, gather = job or (0, 1, None)
    saves: list[PreparedSave] = []

    def write_part(directory: str) -> str:
        saves.append(prepare(storage.at(directory), args, primary=index == 0, copy=False))
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
