"""Tensors every process of a ``jax.distributed`` job needs whole, read once across them.

In a multi-process restore a tensor replicated over the processes (``P()``, a spec whose mesh
axes stay inside each process, a host numpy result) is wanted whole by each process; read the
usual way every process reads every byte of it (N× the checkpoint for N processes). With
``replicated_read="once"`` each process reads a share instead (runs of whole inner chunks along
dimension 0; the shares of a batch of tensors balanced by bytes), the shares travel by one
all-gather over JAX's collectives (gloo on CPU) and every process builds its result from the
gathered bytes: the storage is read once in all.

Orbax's single-replica restore (``multislice.broadcast_one_replica_to_all``) reads on one
replica and broadcasts by a summing all-reduce; here every process reads a share in parallel
and an all-gather moves (N-1)/N of the bytes into each process. Before each all-gather the
processes agree through ``jax.distributed``'s key-value store that every share was read, so a
process that failed makes all of them raise its error, and one that died on this host is named
at once (jax's own heartbeat ends the job after 100 s); a peer lost during the all-gather
breaks gloo's connections, which raises. Host memory: one batch's own share plus the gathered
batch, together within the restore's ``memory_budget``, besides the results themselves.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jax_ucp._src import format as fmt
from jax_ucp._src.errors import MultiProcessError
from jax_ucp._src.multihost import agreement
from jax_ucp._src.sharding import assemble

if TYPE_CHECKING:
    import jax

# A process waits this long for the others to finish reading their shares of a batch (a peer
# that died on this host is named at once; one on another host ends the job by jax's heartbeat).
PEER_TIMEOUT_S = 600.0
_ALIGN = 64  # each piece of a share starts 64-byte aligned (a view of any dtype, adoptable)
_MIN_SHARE = 4096  # the smallest share an all-gather moves (smaller batches are padded to it)


@dataclasses.dataclass
class SharedTensor:
    """A tensor of a read-once restore: what was asked, how it is stored, (while read) the
    host buffer its share lands in; then, as the reader finishes a ``PendingArray``,
    ``result()``, the bytes this process read of it and the values a narrowing cast
    overflowed."""

    position: int
    item: Any  # what the caller passed (handed back with the result)
    name: str
    shape: tuple[int, ...]
    stored: np.dtype  # dtype read
    sharding: jax.sharding.Sharding | None
    want: np.dtype  # dtype of the result
    unit_rows: int  # rows read together (an inner chunk's extent along dimension 0)
    source: Any = None
    host: np.ndarray | None = None
    read_bytes: int = 0
    overflowed: int = 0
    value: Any = None

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.stored.itemsize

    @property
    def units(self) -> int:
        return -(-self.shape[0] // self.unit_rows)

    def unit_span(self, u0: int, u1: int) -> tuple[int, int]:
        return u0 * self.unit_rows, min(u1 * self.unit_rows, self.shape[0])

    @property
    def dtype(self) -> np.dtype:
        return self.want

    @property
    def result_bytes(self) -> int:
        return math.prod(self.shape) * self.want.itemsize

    @property
    def host_bytes(self) -> int:
        """The whole tensor in this process (every process gets it whole), plus its converted
        copy when the dtype changes."""
        whole = math.prod(self.shape) * self.stored.itemsize
        return whole + (self.result_bytes if self.want != self.stored else 0)

    @property
    def on_host(self) -> bool:
        return assemble.on_host(self.sharding)

    def result(self):
        return self.value


@dataclasses.dataclass(frozen=True)
class _Piece:
    tensor: int  # index into the session's tensors
    rows: tuple[int, int]
    offset: int  # where it lies in its process's share
    nbytes: int


@dataclasses.dataclass
class _Batch:
    pieces: list[list[_Piece]]  # per process
    length: int  # bytes of every process's share (padded alike)
    last_of: list[int]  # tensors whose final rows are in this batch


def wanted_whole(shape: Sequence[int], sharding, processes: int) -> bool:
    """Every process of the job needs all of the tensor: a host result (``sharding`` None), or
    a sharding whose slices on each process's devices cover the whole tensor. Decided from the
    global device map, so every process decides the same.

    Args:
        shape: the tensor's shape.
        sharding: its target sharding (None: a host result).
        processes: the number of processes.
    """
    if sharding is None:
        return True
    return _covers_every_process(tuple(shape), sharding, processes)


@functools.lru_cache(maxsize=4096)
def _covers_every_process(shape: tuple[int, ...], sharding, processes: int) -> bool:
    by_process: dict[int, set] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        key = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        by_process.setdefault(device.process_index, set()).add(key)
    if len(by_process) != processes:
        return False
    whole = tuple((0, n) for n in shape)
    return all(
        whole in keys or assemble.tile(list(keys), math.prod(shape)) for keys in by_process.values()
    )


def select(items: Sequence[tuple[int, Any, Any]]) -> list[tuple[int, Any, Any]]:
    """The ``(position, request, available)`` items of a ``replicated_read="once"`` restore to
    read once: several processes, a tensor with at least one element and one dimension that
    every process needs whole."""
    import jax  # here and below: imported where used (host-only reads never load it)

    n = jax.process_count()
    if n == 1:
        return []
    return [
        (position, req, found)
        for position, req, found in items
        if len(found.shape) > 0
        and math.prod(found.shape) > 0
        and wanted_whole(found.shape, req.sharding, n)
    ]


def read_once(
    items: Sequence[tuple[int, Any, Any]],
    source_of: Callable[[Any], Any],
    *,
    budget: int,
    check: Callable[[Any, SharedTensor], None] | None = None,
    unit_rows: Callable[[Any], int] = lambda found: 1,
    timeout: float = PEER_TIMEOUT_S,
) -> Iterator[tuple[int, Any, Any, SharedTensor]]:
    """Reads the ``select``ed items, each process a share of every batch, and yields
    ``(position, request, available, SharedTensor)`` as each tensor is complete.

    Every process of the job must call this with the same items and ``budget`` (as a restore
    does): they meet at each batch. ``source_of(available)``: the reader of a tensor
    (a ``sharding.RegionReader``, or a TensorStore view). ``check(available, tensor)``: called
    before a tensor's host buffer is allocated (raises to refuse it).

    Args:
        items: (position, request, available) of each tensor.
        source_of: gives the reader of an available tensor.
        budget: host bytes each batch may hold.
        check: called before a tensor's host buffer is allocated.
        unit_rows: rows of an available tensor read together (a share holds whole units).
        timeout: seconds to wait for the other processes.
    """
    if not items:
        return
    tensors = [
        SharedTensor(
            position=position,
            item=(position, req, found),
            name=found.name,
            shape=tuple(found.shape),
            stored=np.dtype(found.dtype),
            sharding=req.sharding,
            want=np.dtype(req.dtype if req.dtype is not None else found.dtype),
            unit_rows=unit_rows(found),
        )
        for position, req, found in items
    ]
    import jax

    n, me = jax.process_count(), jax.process_index()
    # own share + the gathered batch within the budget, the shares' rounding (1/8) included
    batch_bytes = max(1, int(budget) * n * 8 // ((n + 1) * 9))
    batches = list(share_batches(tensors, n, batch_bytes))
    peers = _meet(timeout, _fingerprint(tensors, batches))
    try:
        for number, batch in enumerate(batches):
            share = assemble.aligned_empty((batch.length,), np.uint8)
            error = None
            try:
                _start(tensors, batch, check)
                _read_share(tensors, batch.pieces[me], share, source_of)
            except Exception as e:  # every process raises it, below
                error = e
            names = _names(tensors, batch)
            _agree(peers, f"batch{number}", error, names)
            gathered = _all_gather(share, peers, names)
            del share
            _place(tensors, batch, gathered, me)
            del gathered
            for index in batch.last_of:
                t = tensors[index]
                yield (*t.item, _finish(t))
                t.host = t.source = None
    except BaseException as e:
        peers.abort(e)
        raise


def _place(tensors: list[SharedTensor], batch: _Batch, gathered: np.ndarray, me: int) -> None:
    """Every process's pieces of the all-gathered ``batch`` copied into their tensors' host
    buffers (process p's share at ``p * batch.length``); the bytes this process read counted
    in their ``read_bytes``."""
    for process, pieces in enumerate(batch.pieces):
        base = process * batch.length
        for piece in pieces:
            t = tensors[piece.tensor]
            assert t.host is not None  # freed only when done
            start = piece.rows[0] * t.row_bytes
            flat = t.host.reshape(-1).view(np.uint8)
            flat[start : start + piece.nbytes] = gathered[
                base + piece.offset : base + piece.offset + piece.nbytes
            ]
            if process == me:
                t.read_bytes += piece.nbytes


def share_batches(tensors: list[SharedTensor], n: int, batch_bytes: int) -> Iterator[_Batch]:
    """Tensors in order, in batches of at most ``batch_bytes`` (a unit larger alone), each
    batch cut into ``n`` runs of whole units balanced by bytes: process p's share (the runs
    handed out in an order rotating with the batch, so a unit too many evens out).

    Args:
        tensors: the tensors to share, in order.
        n: the process count.
        batch_bytes: the bound on a batch.
    """
    runs: list[tuple[int, int, int]] = []  # (tensor, first unit, end unit)
    size, number = 0, 0
    for index, t in enumerate(tensors):
        unit_bytes = t.unit_rows * t.row_bytes
        u = 0
        while u < t.units:
            room = batch_bytes - size
            take = min(t.units - u, max(room // max(unit_bytes, 1), 0))
            if take == 0 and not runs:
                take = 1  # one unit larger than a batch travels alone
            if take == 0:
                yield _cut(tensors, runs, n, number)
                runs, size, number = [], 0, number + 1
                continue
            runs.append((index, u, u + take))
            rows = t.unit_span(u, u + take)
            size += (rows[1] - rows[0]) * t.row_bytes
            u += take
    if runs:
        yield _cut(tensors, runs, n, number)


def _cut(
    tensors: list[SharedTensor], runs: list[tuple[int, int, int]], n: int, shift: int
) -> _Batch:
    units = [(index, k) for index, u0, u1 in runs for k in range(u0, u1)]
    spans = [tensors[i].unit_span(k, k + 1) for i, k in units]
    sizes = np.array(
        [(b - a) * tensors[i].row_bytes for (i, _), (a, b) in zip(units, spans)], dtype=np.int64
    )
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if len(ends) else 0
    # process p takes the units whose middle byte falls in [p*total/n, (p+1)*total/n)
    middles = ends - sizes / 2
    owner = np.minimum((middles * n // max(total, 1)).astype(np.int64), n - 1)
    owner = (owner + shift) % n
    pieces: list[list[_Piece]] = [[] for _ in range(n)]
    for p in range(n):
        offset = 0
        mine = [units[i] for i in np.flatnonzero(owner == p)]
        for index, group in itertools.groupby(mine, key=lambda x: x[0]):
            ks = [k for _, k in group]
            t = tensors[index]
            rows = (t.unit_span(ks[0], ks[0] + 1)[0], t.unit_span(ks[-1], ks[-1] + 1)[1])
            nbytes = (rows[1] - rows[0]) * t.row_bytes
            pieces[p].append(_Piece(index, rows, offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
    longest = max(
        (pc[-1].offset + -(-pc[-1].nbytes // _ALIGN) * _ALIGN for pc in pieces if pc), default=0
    )
    last_of = sorted({i for i, _, u1 in runs if u1 == tensors[i].units})
    return _Batch(pieces, _bucket(longest), last_of)


def _bucket(length: int) -> int:
    """``length`` rounded up to one of few sizes (at most 1/8 more), so the all-gather of every
    batch of a restore is compiled a few times, not once per batch."""
    if length <= _MIN_SHARE:
        return _MIN_SHARE
    step = 1 << max(0, length.bit_length() - 4)
    return -(-length // step) * step


def _start(tensors, batch: _Batch, check) -> None:
    """The host buffer of each tensor the batch starts, in every process (the pieces of the
    others arrive by the all-gather); ``check`` refuses one this host cannot hold."""
    for index in sorted({p.tensor for ps in batch.pieces for p in ps}):
        t = tensors[index]
        if t.host is not None:
            continue
        if check is not None:
            check(t.item[2], t)
        t.host = assemble.aligned_empty(t.shape, t.stored)


def _read_share(tensors, pieces: list[_Piece], share: np.ndarray, source_of) -> None:
    """Reads this process's pieces of a batch into ``share``."""
    reads = []
    for piece in pieces:
        t = tensors[piece.tensor]
        if t.source is None:
            t.source = source_of(t.item[2])
        out = share[piece.offset : piece.offset + piece.nbytes].view(t.stored)
        out = out.reshape((piece.rows[1] - piece.rows[0],) + t.shape[1:])
        region = (piece.rows,) + tuple((0, d) for d in t.shape[1:])
        if isinstance(t.source, assemble.RegionReader):
            reads.append((t.source.read_into([(region, out)]), None))
        else:
            reads.append((t.source[piece.rows[0] : piece.rows[1]].read(), out))
    for future, out in reads:
        got = future.result()
        if out is not None:
            np.copyto(out, np.asarray(got))


def _names(tensors, batch: _Batch) -> list[str]:
    return list(dict.fromkeys(tensors[p.tensor].name for ps in batch.pieces for p in ps))


def _finish(t: SharedTensor) -> SharedTensor:
    """The tensor's result from its whole host copy: numpy, or a jax.Array whose local devices
    hold their slices (replicated devices share the one buffer, as ``PendingArray`` does)."""
    host = t.host
    assert host is not None  # set for every tensor of a batch
    if t.want != t.stored:
        host, t.overflowed = assemble.convert(host, t.want)
    if t.sharding is None:
        t.value = host
        return t
    import jax

    singles = [
        jax.device_put(host[index], device, may_alias=True)
        for device, index in t.sharding.addressable_devices_indices_map(t.shape).items()
    ]
    t.value = jax.make_array_from_single_device_arrays(t.shape, t.sharding, singles)
    return t


def _fingerprint(tensors, batches) -> str:
    """What every process must agree on before the first all-gather: the same tensors and the
    same batches (a restore called with other requests or another ``memory_budget`` in one
    process would otherwise meet the others in mismatched collectives)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(repr((t.name, t.shape, str(t.stored))).encode())
    for b in batches:
        h.update(repr((b.length, [[(p.tensor, p.rows) for p in ps] for ps in b.pieces])).encode())
    return h.hexdigest()[:16]


@functools.cache
def _gather_program(devices: tuple):
    """An all-gather over one device of each process (replicated output: one copy per
    process, the least gloo moves), and the sharding of its input."""
    import jax

    mesh = jax.sharding.Mesh(np.array(devices), ("process",))
    spec = jax.sharding.PartitionSpec
    out = jax.sharding.NamedSharding(mesh, spec())
    return jax.sharding.NamedSharding(mesh, spec("process")), jax.jit(
        lambda x: x, out_shardings=out
    )


def _process_devices() -> tuple:
    import jax

    firsts: dict[int, Any] = {}
    for d in jax.devices():
        if d.process_index not in firsts or d.id < firsts[d.process_index].id:
            firsts[d.process_index] = d
    return tuple(firsts[p] for p in sorted(firsts))


def _all_gather(share: np.ndarray, peers: agreement.Exchange, names: list[str]) -> np.ndarray:
    """Every process's ``share`` concatenated in process order (host bytes of this process)."""
    import jax

    devices = _process_devices()
    sharding, program = _gather_program(devices)
    me = devices[jax.process_index()]
    length = share.shape[0]
    try:
        local = jax.device_put(share, me, may_alias=True)
        x = jax.make_array_from_single_device_arrays((length * len(devices),), sharding, [local])
        y = program(x)
        y.block_until_ready()
    except Exception as e:  # gloo's errors come as JaxRuntimeError or ValueError
        what = f"Reading {_shown(names)} once across {len(devices)} processes: the all-gather"
        peers.raise_if_lost(range(peers.count), None, what + ":")
        raise MultiProcessError(
            f"{what} of the shares failed ({e}); a process of the job died or left the restore."
        ) from e
    return np.asarray(y.addressable_shards[0].data)


def _shown(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:3])
    return f"tensor(s) {shown}" + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _meet(timeout: float, fingerprint: str) -> agreement.Exchange:
    """The processes of this read meeting through ``jax.distributed``'s key-value store: once
    at the start (who they are, and that they plan the same batches), then after each batch's
    shares are read, before its all-gather (``_agree``)."""
    import jax

    where = f"Reading replicated tensors once across {jax.process_count()} processes:"
    peers = agreement.Exchange(
        "restore", where, timeout, lost=MultiProcessError, hello={"plan": fingerprint}
    )
    plans = {i: v["plan"] for i, v in enumerate(peers.peers)}
    if len(set(plans.values())) > 1:
        raise MultiProcessError(
            f"{where} the processes asked for different restores (plans {plans}); every "
            f"process must restore the same tensors with the same memory_budget."
        )
    return peers


def _agree(peers: agreement.Exchange, step: str, error: BaseException | None, names: list[str]):
    """Waits until every process has read its share of ``step``; raises (in every process) the
    error of one that failed, as soon as it is known (the failing one without waiting)."""
    head = f"Reading {_shown(names)} once across {peers.count} processes:"
    if error is None:

        def failed(values: dict[int, str]) -> None:
            for i, value in sorted(values.items()):
                if value.startswith("error:"):
                    raise MultiProcessError(
                        f"{head} process {i} failed to read its share: {value[len('error:') :]}"
                    )

        peers.gather(step, "ok", head=head, check=failed)
        return
    peers.gather(step, f"error:{type(error).__name__}: {error}"[:4000], wait=False)
    if isinstance(error, fmt.UCPError):  # it names the tensor and file already
        raise error
    raise MultiProcessError(
        f"{head} process {peers.index} (this one) failed to read its share: "
        f"{type(error).__name__}: {error}"
    ) from error
