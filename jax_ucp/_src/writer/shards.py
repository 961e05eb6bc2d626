"""Writing a prepared tensor's shards, and a bounded pipeline of tensors in flight.

Whole shards of host memory go through ``store.shard_writer`` (TensorStore's bytes, hardware
crc32c); anything else (compression, lazy sources, other kvstores) through TensorStore.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import tensorstore as ts

from jax_ucp._src import format as fmt
from jax_ucp._src import store
from jax_ucp._src.errors import UCPError, tensorstore_message
from jax_ucp._src.store import shard_file, shard_reader, shard_writer
from jax_ucp._src.writer import durable
from jax_ucp._src.writer.layout import PreparedTensor


def _write_error(p: PreparedTensor, kv, e: Exception) -> IOError:
    return OSError(
        f"Writing tensor {p.entry.name!r} (shape {p.layout.shape}, {p.layout.dtype}) "
        f"to {kv.get('path', kv)}: {tensorstore_message(e)}"
    )


async def write_tensor(
    root, p: PreparedTensor, *, primary: bool, sync: bool = True
) -> dict[str, str] | None:
    """Creates (primary) or attaches to (others) the array and writes this process's shards.

    Returns the digest of every shard file written (shard key -> ``shard_file`` digest; None
    for arrays without checksums, or on an object store when a shard was not written whole
    from uncompressed host memory), for the manifest. Every write is waited for, even after
    one fails, so a caller's cleanup never races a write still in flight.

    Args:
        root: the checkpoint directory.
        p: the tensor, laid out.
        primary: this process creates the array.
        sync: fsync each file (False: the caller makes the directory durable).
    """
    kv = store.kvstore_config(root, p.entry.dir)
    try:
        # An async save's private copies may still be in flight: wait for this tensor's off the
        # event loop (while it creates the array), so other tensors whose copies have landed go on
        # being written meanwhile instead of queueing behind this one.
        if not any(callable(data) for _, data in p.writes):  # host data: nothing to wait for
            t = await store.create(kv, p.layout, primary=primary, sync=sync)
            writes = _issue_writes(t, p, kv, sync)
        else:
            landed = asyncio.ensure_future(_landed(p.writes))
            try:
                t = await store.create(kv, p.layout, primary=primary, sync=sync)
            except BaseException:
                await asyncio.gather(landed, return_exceptions=True)
                raise
            writes = _issue_writes(t, p, kv, sync, await landed)
        results = await asyncio.gather(*(w for w, _ in writes), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        if p.layout.checksum != "crc32c":
            return None
        if kv.get("driver") != "file":  # object store: digests computed from the data written
            whole = all(isinstance(r, str) for r in results)
            return {keys[0]: str(r) for (_, keys), r in zip(writes, results)} if whole else None
        digests: dict[str, str] = {}
        for (_, keys), result in zip(writes, results):
            if isinstance(result, str):  # written by shard_writer, which knows its digest
                digests[keys[0]] = result
                continue
            for key in keys:  # written by TensorStore: read the trailers back
                digests[key] = shard_reader.file_digest(
                    os.path.join(kv["path"], *key.split("/")), p.layout.inner_chunk_count
                )
        return digests
    except Exception as e:
        raise _write_error(p, kv, e) from e


def _chunk_position(index, chunk_shape) -> tuple[int, ...] | None:
    """Grid position of the shard that ``index`` (a tuple of slices) covers exactly, else None."""
    starts = [sl.start or 0 for sl in index]
    if len(index) != len(chunk_shape) or any(s % c for s, c in zip(starts, chunk_shape)):
        return None
    return tuple(s // c for s, c in zip(starts, chunk_shape))


def _shard_keys(index, layout) -> list[str]:
    """Keys of the shard files a write of ``index`` (a tuple of slices, () = all) touches."""
    ranges = []
    for d, (n, c) in enumerate(zip(layout.shape, layout.chunk_shape)):
        sl = index[d] if index else slice(None)
        start, stop, _ = sl.indices(n)
        ranges.append(range(start // c, (max(stop, start + 1) - 1) // c + 1))
    return [shard_file.shard_key(pos) for pos in itertools.product(*ranges)]


async def _landed(writes: list[tuple[tuple, Any]]) -> list[tuple[tuple, Any]]:
    """``writes`` with every zero-argument producer replaced by its data, produced in threads."""
    produced = await asyncio.gather(
        *(asyncio.to_thread(d) if callable(d) else asyncio.sleep(0, d) for _, d in writes)
    )
    return [(index, data) for (index, _), data in zip(writes, produced)]


def _issue_writes(
    t: ts.TensorStore, p: PreparedTensor, kv: Mapping[str, Any], sync: bool, writes=None
) -> list:
    """Starts every shard write of ``p`` (or of ``writes``, its data produced) ->
    [(awaitable, shard keys)]; whole shards of host memory go through ``shard_writer``."""
    commits = []
    loop = asyncio.get_running_loop()
    for index, given in p.writes if writes is None else writes:
        data: Any = given() if callable(given) else given
        if p.layout.shape and 0 in p.layout.shape:
            continue  # nothing to store for a zero-size array; zarr.json says it all
        position = _chunk_position(index, p.layout.chunk_shape) if index else None
        if position is not None and shard_writer.can_write(p.layout, data, kv):
            future = loop.run_in_executor(
                durable.write_pool(),
                functools.partial(_write_whole_shard, kv["path"], position, data, p, sync),
            )
            commits.append((future, [shard_file.shard_key(position)]))
            continue
        target = t[index] if index else t
        written = target.write(data, can_reference_source_data_indefinitely=p.stable_source)
        if (
            kv.get("driver") != "file"
            and position is not None
            and p.layout.checksum == "crc32c"
            and shard_writer.can_encode(p.layout, data)
        ):  # an object store: the digest of the object TensorStore writes, from the data
            digest = loop.run_in_executor(
                durable.write_pool(), shard_writer.digest_of_data, data, p.layout
            )
            commits.append((_committed(written, digest), [shard_file.shard_key(position)]))
            continue
        commits.append((_committed(written), _shard_keys(index, p.layout)))
    return commits


async def _committed(write_futures, digest=None) -> str | None:
    await write_futures.commit
    return None if digest is None else await digest


def _write_whole_shard(array_dir: str, position, data, p: PreparedTensor, sync: bool) -> str | None:
    digest = shard_writer.write(array_dir, position, data, p.layout, sync=sync)
    if sync:  # the file is on disk; now the directories that name it, up to the array's
        key = shard_file.shard_key(position)
        durable.fsync_tree_to(array_dir, os.path.dirname(key))
    return digest


def can_stream(p: PreparedTensor, root) -> bool:
    """Whether ``p`` (one shard: the whole tensor) can be written in row slabs straight into its
    shard file, byte for byte what ``shard_writer.write`` writes for the whole tensor: a local
    file, no compression, inner chunks that are consecutive byte ranges in row order."""
    layout = p.layout
    return (
        store.kvstore_config(root, p.entry.dir).get("driver") == "file"
        and 0 not in layout.shape
        and tuple(layout.chunk_shape) == tuple(layout.shape)
        and shard_writer.encodes(layout, fmt.to_numpy_dtype(layout.dtype))
    )


def slab_rows(p: PreparedTensor, max_bytes: int) -> int:
    """Rows per slab: a whole number of inner chunks along dim 0, at most ``max_bytes`` (at
    least one chunk's rows)."""
    layout = p.layout
    step = int(layout.inner_chunk_shape[0])
    row_bytes = math.prod(layout.shape[1:]) * fmt.to_numpy_dtype(layout.dtype).itemsize
    return max(step, max_bytes // max(1, row_bytes * step) * step)


def _write_slabs(
    array_dir: str, p: PreparedTensor, rows: Callable[[int, int], np.ndarray], step: int, sync
) -> str | None:
    """Writes the one shard of ``p`` slab by slab (``rows(start, stop)`` builds rows of dim 0):
    the inner chunks and their crc32c trailers in order, then the index, as
    ``shard_writer.encode`` lays out the whole tensor. Returns the shard's digest."""
    layout = p.layout
    dtype = fmt.to_numpy_dtype(layout.dtype)
    chunk_bytes = math.prod(layout.inner_chunk_shape) * dtype.itemsize
    checksum = layout.checksum == "crc32c"
    origin = (0,) * len(layout.shape)
    trailers = bytearray()
    n = 0
    with shard_writer.opened(array_dir, origin, sync=sync) as fd:
        for start in range(0, layout.shape[0], step):
            stop = min(layout.shape[0], start + step)
            slab = rows(start, stop)
            want = (stop - start, *layout.shape[1:])
            if tuple(slab.shape) != want or slab.dtype != dtype:
                raise TypeError(
                    f"HostItem {p.entry.name!r}: rows {start}:{stop} built "
                    f"{slab.dtype}{list(slab.shape)}, expected {dtype}{list(want)}"
                )
            parts = shard_writer.chunk_parts(slab, layout)
            shard_writer.write_parts(fd, parts)
            trailers += b"".join(parts[1::2]) if checksum else b""
            n += len(parts) // (2 if checksum else 1)
            del slab, parts  # nothing of this slab stays alive while the next is built
        shard_writer.write_parts(fd, shard_writer.index_parts(n, chunk_bytes, checksum))
    if sync:
        durable.fsync_tree_to(array_dir, os.path.dirname(shard_file.shard_key(origin)))
    return shard_file.digest_of_trailers(bytes(trailers)) if checksum else None


class PipelinedWriter:
    """Keeps a bounded number of host tensors in flight (single process, primary).

    An importer produces the next tensor while TensorStore is still creating and writing the
    previous ones (each create fsyncs its zarr.json, so awaiting them one by one dominated
    imports); the byte and count caps (one ``store.InFlightBytes``) bound the memory that
    pipelining adds.

    Args:
      root: the checkpoint directory written into.
      max_bytes: bytes of tensors in flight (one tensor larger than it goes alone).
      max_tensors: tensors in flight.
      sync: fsync each file as it is written (False: the caller makes the tree durable).
    """

    def __init__(
        self, root, *, max_bytes: int = 256 << 20, max_tensors: int = 64, sync: bool = True
    ):
        self.root = str(root)
        self.sync = sync
        self.max_bytes, self.max_tensors = max_bytes, max_tensors
        self._window: store.InFlightBytes[tuple[asyncio.Task, tuple]] = store.InFlightBytes(
            max_bytes, max_items=max_tensors
        )
        self.digests: dict[tuple, dict[str, str]] = {}  # tensor key -> shard digests, once written

    @property
    def bytes_in_flight(self) -> int:
        """Bytes of the tensors written but not yet retired (at most ``max_bytes``, or one tensor)."""
        return self._window.bytes

    @property
    def tensors_in_flight(self) -> int:
        return len(self._window)

    async def add(self, p: PreparedTensor) -> None:
        await self.reserve(p.entry.nbytes)
        task = asyncio.ensure_future(write_tensor(self.root, p, primary=True, sync=self.sync))
        self._window.add((task, p.entry.key), p.entry.nbytes)
        await asyncio.sleep(0)  # let the new task issue its create before the next tensor is made
        # Surface a failure early instead of after the whole stream was produced.
        for task, _ in self._window:
            if task.done() and (error := task.exception()) is not None:
                raise error

    async def reserve(self, nbytes: int) -> None:
        """Retires written tensors until ``nbytes`` more fit under ``max_bytes``: called before
        an importer allocates a tensor (``stream.Deferred``), so the tensor being built and the
        tensors being written share one memory budget."""
        for done in self._window.make_room(nbytes):
            await self._retire(done)

    async def stream(
        self, p: PreparedTensor, rows: Callable[[int, int], np.ndarray], max_bytes: int
    ) -> None:
        """Writes ``p`` (``can_stream``) alone, in row slabs of at most ``max_bytes`` built by
        ``rows(start, stop)`` one at a time: a tensor larger than the memory budget is never
        whole in memory. Its shard digest is the whole tensor's (same file, same bytes).

        Args:
            p: the tensor, laid out (``can_stream``).
            rows: builds rows ``start:stop``.
            max_bytes: bytes per slab at most.
        """
        await self.flush()
        kv = store.kvstore_config(self.root, p.entry.dir)
        try:
            await store.create(kv, p.layout, primary=True, sync=self.sync)
        except Exception as e:
            raise _write_error(p, kv, e) from e
        try:  # the importer's own errors (raised by ``rows``) pass through as they are
            digest = await asyncio.get_running_loop().run_in_executor(
                durable.write_pool(),
                functools.partial(
                    _write_slabs, kv["path"], p, rows, slab_rows(p, max_bytes), self.sync
                ),
            )
        except UCPError:
            raise  # a source file that failed to read (truncated while read): said as it is
        except OSError as e:
            raise _write_error(p, kv, e) from e
        if digest is not None:
            self.digests[p.entry.key] = {shard_file.shard_key((0,) * len(p.layout.shape)): digest}

    async def _retire(self, done: tuple[asyncio.Task, tuple]) -> None:
        task, key = done
        self.digests[key] = await task

    async def flush(self) -> None:
        for done in self._window.drain():
            await self._retire(done)

    async def abandon(self) -> None:
        """After a failure: let in-flight writes settle so cleanup does not race them."""
        await asyncio.gather(*(task for task, _ in self._window.drain()), return_exceptions=True)
