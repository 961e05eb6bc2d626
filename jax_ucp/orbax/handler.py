"""Orbax integration: ``UCPCheckpointHandler`` with registered ``UCPSave`` / ``UCPRestore`` args.

Follows Orbax's own async handlers (``JsonCheckpointHandler``): the blocking part of
``async_save`` only decides the layout and copies this process's shards to host memory; all file
I/O runs in a commit future after Orbax has created the (temporary) item directory, and Orbax's
temporary-path + commit machinery makes the save atomic. ``save`` is ``async_save`` plus waiting
on its commit futures. Only Orbax's public API is used.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import Iterable
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_args as ocp_checkpoint_args
from orbax.checkpoint import future as ocp_future

from jax_ucp import format as fmt
from jax_ucp import store, writer
from jax_ucp import tree as tree_lib
from jax_ucp.errors import RequestError
from jax_ucp.format.sizes import parse_optional_size
from jax_ucp.restoring import requests
from jax_ucp.restoring.options import RestoreOptions
from jax_ucp.saving import plan as save_plan
from jax_ucp.store import shard_file
from jax_ucp.writer import commit, durable

DIGESTS_PREFIX = "ucp.digests."  # per-process shard digests, merged by the primary's finalize


class UCPCheckpointHandler(ocp.handlers.AsyncCheckpointHandler):
    """Saves a pytree as one consolidated zarr v3 array per leaf plus ``ucp.json``."""

    def __init__(
        self,
        *,
        multiprocessing_options: ocp.options.MultiprocessingOptions | None = None,
        reuse_host_copies: bool = True,
    ):
        """``reuse_host_copies=False``: every async save copies into new memory and keeps none
        between saves (the pool holds one copy of the process's replica-0 CPU shards)."""
        options = multiprocessing_options or ocp.options.MultiprocessingOptions()
        self._primary_host = options.primary_host
        # Primary only: the manifest of each save in flight, completed and written by finalize.
        self._pending: dict[str, tuple[fmt.Manifest, dict]] = {}
        # An async save's private host copies (CPU devices), reused by the next one (released
        # by close()).
        self.copy_pool = save_plan.HostCopyPool()
        self._reuse_host_copies = reuse_host_copies

    def _is_primary(self) -> bool:
        return ocp.multihost.is_primary_host(self._primary_host)

    async def _write(self, directory: str, prepared, primary: bool, copies=(), budget=None):
        # No fsync per file (each costs a disk round trip: thousands of small tensors spent most
        # of a save there); one syncfs makes this process's files durable before Orbax commits.
        try:
            digests = await save_plan.write_all(
                directory, prepared, primary=primary, sync=False, budget=budget
            )
        finally:  # every write has settled: the next save may write over these copies
            del prepared
            if copies and self._reuse_host_copies:
                self.copy_pool.release(copies)
        if not store.is_url(directory):  # an object store's PUT is durable when it returns
            await asyncio.to_thread(durable.make_tree_durable, directory)
        if primary:
            self._pending[directory][1].update(digests)
        else:  # the primary merges every process's digests into ucp.json in finalize
            name = f"{DIGESTS_PREFIX}{jax.process_index()}.json"
            if store.is_url(directory):
                store.location.write(directory, name, json.dumps(digests).encode())
                return
            durable.write_file(os.path.join(directory, name), json.dumps(digests))

    def _commit_futures(self, directory, args, *, copy: bool) -> list[ocp_future.Future]:
        """Decides the layout, copies this process's shards to host, defers all I/O to a future.

        ``copy``: private host copies of CPU device buffers, for saves whose caller goes on (a
        donated or deleted array would change under the write); a blocking save skips them.
        """
        if store.is_url(os.fspath(directory)) and commit.ORBAX_TMP_MARK in os.fspath(directory):
            raise fmt.UCPError(
                f"{directory}: Orbax is saving into a temporary prefix it would then rename, which "
                f"an object store cannot do atomically. Pass CheckpointManagerOptions("
                f"temporary_path_class=ocp.path.atomicity.CommitFileTemporaryPath) (Orbax's "
                f"default for gs://): each step is then committed by its commit_success.txt."
            )
        if isinstance(args, UCPStreamSave):
            coro = writer.write_stream(
                os.fspath(directory),
                args.items,
                source=args.source,
                compression=args.compression,
                inner_chunk_bytes=args.inner_chunk_bytes,
                budget=args.memory_budget,
            )
            return [ocp_future.CommitFutureAwaitingContractedSignals(coro, name="ucp_stream_save")]
        options = writer.SaveOptions(
            compression=args.compression,
            compression_level=args.compression_level,
            inner_chunk_bytes=args.inner_chunk_bytes or store.DEFAULT_INNER_CHUNK_BYTES,
            checksum=args.checksum,
        )
        primary = self._is_primary()
        copies: list = []
        # host copies made, written and freed within it (saving.budget); bytes once checked
        budget = None if args.memory_budget is None else int(args.memory_budget)
        pooled = copy and self._reuse_host_copies and budget is None
        entries, prepared = save_plan.prepare_tree(
            args.item,
            options,
            primary=primary,
            copy=copy,
            logical_axes=args.logical_axes,
            pool=self.copy_pool if pooled else None,
            copies_out=copies,
            budget=budget,
        )
        if primary:
            manifest = fmt.new_manifest(
                entries,
                source=args.source,
                tree=tree_lib.describe_structure(args.item),
                kvstore_driver=store.kvstore_driver(os.fspath(directory)),
            )
            self._pending[os.fspath(directory)] = (manifest, {})
        coro = self._write(os.fspath(directory), prepared, primary, copies, budget)
        return [ocp_future.CommitFutureAwaitingContractedSignals(coro, name="ucp_save")]

    async def async_save(
        self, directory: epath.Path, item: Any = None, args: UCPSave | UCPStreamSave | None = None
    ) -> list[ocp_future.Future] | None:
        return self._commit_futures(directory, args or UCPSave(item), copy=True)

    def save(
        self,
        directory: epath.Path | str,  # a str: an object-store URL (api.save)
        item: Any = None,
        args: UCPSave | UCPStreamSave | None = None,
    ) -> None:
        # The same path as async_save, waited on; the caller blocks, so no private copies.
        for f in self._commit_futures(directory, args or UCPSave(item), copy=False):
            f.result()

    def restore(
        self, directory: epath.Path, item: Any = None, args: UCPRestore | None = None
    ) -> Any:
        if args is not None and not isinstance(args, UCPRestore):
            raise RequestError(
                f"{directory}: restore args are a {type(args).__name__}; expected "
                f"jax_ucp.UCPRestore."
            )
        args = args or UCPRestore(target=item)
        return requests.restore_tree(str(directory), args.options)

    def metadata(self, directory: epath.Path) -> fmt.Manifest:
        return store.read_manifest(str(directory))

    def finalize(self, directory: epath.Path | str) -> None:
        """Primary, after every process finished writing: ``ucp.json`` last, with the digest of
        every shard file, so a checkpoint is listed only once all its data is in place."""
        pending = self._pending.pop(os.fspath(directory), None)
        if pending is None:  # a stream save (it writes its own manifest)
            return
        manifest, digests = pending
        root = os.fspath(directory)
        remote = store.is_url(root)
        names = store.location.list_names(root, DIGESTS_PREFIX) if remote else os.listdir(root)
        others = sorted(n for n in names if n.startswith(DIGESTS_PREFIX) and n.endswith(".json"))
        expected = max(jax.process_count() - 1, 0)
        if len(others) != expected:
            raise fmt.UCPError(
                f"{root}: {len(others)} of the {expected} other processes reported their "
                f"shard digests; the save is incomplete and is not committed."
            )
        for name in others:
            if remote:
                reported = json.loads(store.location.read(root, name, 64 << 20) or b"{}")
            else:
                with open(os.path.join(root, name)) as f:
                    reported = json.load(f)
            for array_dir, shard_digests in reported.items():
                digests.setdefault(array_dir, {}).update(shard_digests)
        entries = []
        for e in manifest.entries:
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
        manifest = dataclasses.replace(manifest, entries=entries)
        if remote:  # the commit: one PUT; the digest reports go after, as files do locally
            store.write_manifest(root, manifest)
            for name in others:
                store.location.delete(root, name)
            return
        durable.write_file(os.path.join(root, fmt.MANIFEST_FILE), manifest.dumps())
        for name in others:
            os.remove(os.path.join(root, name))

    def close(self):
        self.copy_pool.close()


def _refuse_args_as_item(cls: str, field: str, value) -> None:
    """Args inside args (``UCPRestore(target=UCPRestore(...))``, what ``restore(dir, item)``
    with args as the item gives) would be matched as a pytree; refused, never unwrapped."""
    if isinstance(value, ocp.args.CheckpointArgs):
        raise RequestError(
            f"{cls}.{field}: got a {type(value).__name__}, which is checkpoint args, not a "
            f"pytree; pass it as args= (mngr.save(step, args=ocp.args.Composite(state="
            f"jax_ucp.UCPSave(tree))), mngr.restore(step, args=ocp.args.Composite(state="
            f"jax_ucp.UCPRestore(target=...))))."
        )


@ocp_checkpoint_args.register_with_handler(UCPCheckpointHandler, for_save=True)
@dataclasses.dataclass
class UCPSave(ocp.args.CheckpointArgs):
    """Save args: the pytree, plus layout options. Checked when constructed (as Orbax's
    ``StandardSaveArgs``), so a wrong option fails in the training loop's ``mngr.save`` call,
    not later in the background commit.

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
        (None: unbounded, every shard copied to host before ``mngr.save`` returns). With it,
        ``mngr.save`` copies only the first shards up to it and the commit copies, writes and
        frees the rest batch by batch (``jax_ucp.saving.budget``); a single device shard
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
        _refuse_args_as_item("UCPSave", "item", self.item)
        if self.compression not in (None, "zstd"):
            raise RequestError(
                f"UCPSave.compression: expected None or 'zstd', got {self.compression!r}."
            )
        level = self.compression_level
        if isinstance(level, bool) or not isinstance(level, int) or not -131072 <= level <= 22:
            raise RequestError(
                f"UCPSave.compression_level: expected an int in -131072..22 (zstd's levels), "
                f"got {level!r}."
            )
        try:  # an int or a size such as "1MiB", as every byte-size option
            self.inner_chunk_bytes = parse_optional_size(
                self.inner_chunk_bytes, "UCPSave.inner_chunk_bytes"
            )
            self.memory_budget = parse_optional_size(self.memory_budget, "UCPSave.memory_budget")
        except RequestError as e:
            raise RequestError(f"{e}.") from None
        if self.checksum not in ("crc32c", None):
            raise RequestError(
                f"UCPSave.checksum: expected 'crc32c' or None, got {self.checksum!r}."
            )
        if self.source is not None and not isinstance(self.source, dict):
            raise RequestError(
                f"UCPSave.source: expected None or a dict (a JSON object), got "
                f"{type(self.source).__name__}."
            )


@ocp_checkpoint_args.register_with_handler(UCPCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class UCPRestore(RestoreOptions, ocp.args.CheckpointArgs):
    """Restore args: ``RestoreOptions`` (``jax_ucp.restore``'s keywords, documented there) as
    Orbax's args, checked when constructed: a wrong option fails in the training loop's
    ``mngr.restore`` call."""

    def __post_init__(self):
        _refuse_args_as_item("UCPRestore", "target", self.target)
        if self.step is not None or self.fallback:  # the manager picks the step
            raise RequestError(
                "UCPRestore(step=, fallback=): inside a CheckpointManager the step is "
                "mngr.restore's first argument; pass jax_ucp.latest_step(run_root) there "
                "(fallback=True to pass over unreadable steps)."
            )
        super().__post_init__()

    @property
    def options(self) -> RestoreOptions:
        """These args as the read path's options (they are ``RestoreOptions``)."""
        return self


@ocp_checkpoint_args.register_with_handler(UCPCheckpointHandler, for_save=True)
@dataclasses.dataclass
class UCPStreamSave(ocp.args.CheckpointArgs):
    """Save args for a stream of ``HostItem`` (single process: the primary writes everything).

    What ``manager_step`` uses to write an import as a CheckpointManager step; a standalone
    import commits without Orbax (``writer.write_host_checkpoint``).
    """

    items: Iterable[writer.HostItem]
    source: dict | None = None
    compression: str | None = None
    inner_chunk_bytes: int | None = None
    # bytes held at once (None: ``writer.memory_budget()`` where the write runs); Orbax may run
    # the write in another thread, where the caller's budget context is not set
    memory_budget: int | None = None
