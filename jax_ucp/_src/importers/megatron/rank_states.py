"""The one reader of Megatron's distributed-optimizer state kept per model-parallel rank as flat
vectors over the rank's grad buffer (no parameter names): which parameters a rank holds, in which
order, where megatron-core's grad buffer puts them (``bucket_layout``, ``distrib_optim_layout``),
the ``distrib_optim.pt`` buffer (``distrib_optim_state``: a legacy rank directory's file and
``dp_zero_gather_scatter``'s object), and how their pieces join into global tensors. The
torch_dist layouts (:mod:`distopt`) say where the vectors are."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jax_ucp._src import writer
from jax_ucp._src.errors import SourceError
from jax_ucp._src.importers.megatron import dcp, legacy
from jax_ucp._src.importers.megatron.common import (
    STATE_TREES,
    WEIGHTS_ONLY_HINT,
    MegatronImportError,
    element_count,
    step_from_param_groups,
    tied_embeddings,
)
from jax_ucp._src.importers.megatron.module_order import PER_LAYER, STACKED_EXPERT
from jax_ucp._src.importers.plan import agreed_step
from jax_ucp._src.importers.rank_grid import RankGrid

#: Bytes of a tensor's rows read from a rank's flat state at once (``RankStates.read``).
BLOCK_BYTES = 16 << 20


#: megatron-core's ``param_state_sharding_type`` names of the layouts read as :class:`RankStates`
RESHARDABLE, GATHERED = "dp_reshardable", "dp_zero_gather_scatter"


class RankStates:
    """The one reader of megatron-core's distributed-optimizer state saved per model-parallel
    rank (``dp_group_idx`` = TP rank + TP x PP rank, :class:`RankGrid`) as flat fp32 ``param``
    / ``exp_avg`` / ``exp_avg_sq`` vectors over the rank's grad buffer, without parameter
    names. Their places are re-derived as megatron-core lays out its grad buffers (``legacy``:
    the rank's local parameters in module order, reversed, starts padded to 64, a
    pipeline-tied embedding alone in its bucket); every master weight is then checked against
    the model weight it must equal (fp32) or round to (bf16).

    A rank's local piece of a tensor is the tensor's saved chunks for that TP rank: the chunks
    (per layer) sorted by offset, every TP-th one (SwiGLU's fc1 is two chunks per rank, gate and
    up) joined along the split axis; a tensor saved in one chunk is replicated over TP.
    The layouts (:mod:`distopt`) fill in where the flat vectors are (``buffers``, ``held``) and
    how each rank's buffer splits into buckets (``layout``). ``prefix``: a ChainedOptimizer
    member's key prefix (``chained_N.``); ``experts``: the MoE expert member (SequentialMLP's
    or GroupedMLP's experts, saved ``[layers, experts, ...]``); ``grouped``: GroupedMLP's
    experts (per layer one ``weight1`` ``[h, E_local * X]`` and one ``weight2``
    ``[E_local * ffn, h]`` in the grad buffer, each expert's block saved transposed);
    ``sharding``: megatron-core's name of the saved layout.
    """

    STATES = tuple(STATE_TREES)

    def __init__(
        self,
        checkpoint: dcp.DcpCheckpoint,
        model_names: list[str],
        settings: dict,
        ranks: int,
        pp: int | None = None,
        prefix: str = "",
        experts: bool = False,
        grouped: bool = False,
        sharding: str = RESHARDABLE,
    ):
        self.checkpoint, self.prefix, self.experts = checkpoint, prefix, experts
        self.sharding = sharding
        self.where = checkpoint.index
        self.ranks = ranks
        self._groups: list[tuple[str, Any]] | None = None  # saved_groups, read once
        self.grouped = grouped
        #: rank -> per bucket {state: the tensor (or pickled object) holding it}
        self.buffers: dict[int, list[dict[str, str]]] = {}
        #: rank -> its whole buffer, unpickled (``dp_zero_gather_scatter``); else read by range
        self.held: dict[int, DistribOptimState] = {}
        #: rank -> {param: (bucket, start, end)}
        self.layout: dict[int, dict[str, tuple[int, int, int]]] = {}
        self._read_layers(model_names)
        self._read_experts()
        self.grid = self._read_parallelism(self._tp_size(model_names), ranks, pp)
        tied = tied_embeddings(model_names, settings)
        self.tied_copy = tied[0] if self.grid.pp > 1 and tied else None

    def _read_layers(self, model_names: list[str]) -> None:
        """The stacked (or per-layer) decoder tensors, the layer count, and the tensors before
        (first pipeline stage) and after them (last stage)."""
        where = self.where
        stacked = [n for n in model_names if n.startswith("decoder.layers.")]
        if self.experts and stacked != model_names:
            raise MegatronImportError(
                f"{where}: expert tensors {sorted(set(model_names) - set(stacked))} are not "
                f"stacked decoder layers"
            )
        first = model_names.index(stacked[0]) if stacked else len(model_names)
        if model_names[first : first + len(stacked)] != stacked:
            raise MegatronImportError(f"{where}: stacked layer tensors are not contiguous")
        # singleton_local_shards: one tensor per layer (decoder.layers.<i>.*), a SwiGLU fc1 as
        # two tensors <name>_w / <name>_v (one parameter [w; v] in the grad buffer)
        self.layer_of = {
            n: int(m.group(1)) for n in stacked if (m := PER_LAYER.fullmatch(n)) is not None
        }
        if self.layer_of and (len(self.layer_of) != len(stacked) or self.experts):
            raise MegatronImportError(
                f"{where}: per-layer (singleton_local_shards) and stacked layer tensors mixed"
            )
        if self.layer_of:
            layers = {max(self.layer_of.values()) + 1}
        else:
            layers = {self.checkpoint.tensors[n].shape[0] for n in stacked}
        if len(layers) > 1:
            raise MegatronImportError(f"{where}: stacked layers disagree on the count {layers}")
        self.layers = layers.pop() if layers else 0
        self.stacked = stacked
        self.before = model_names[:first]  # on the first pipeline stage
        self.after = model_names[first + len(stacked) :]  # on the last

    def _read_experts(self) -> None:
        """SequentialMLP's (or GroupedMLP's) experts, saved ``[layers, experts, ...]``: in the
        expert optimizer's own buffer (EP > 1), or in the dense one with the other parameters
        (EP = 1)."""
        self.expert_names = {n for n in self.stacked if STACKED_EXPERT.fullmatch(n)}
        self.num_experts = 0
        if self.expert_names:
            counts = {self.checkpoint.tensors[n].shape[1] for n in self.expert_names}
            if len(counts) != 1:
                raise MegatronImportError(
                    f"{self.where}: expert tensors disagree on the count {counts}"
                )
            self.num_experts = counts.pop()
        odd = sorted(n for n in self.expert_names if not n.endswith(".weight"))
        if self.grouped and odd:
            raise MegatronImportError(
                f"{self.where}: expert biases {odd}: megatron-core's GroupedMLP has none"
            )

    def _read_parallelism(self, tp: int, ranks: int, pp: int | None) -> RankGrid:
        """The grid: PP (and EP for the expert optimizer) from the rank count and the TP size."""
        where = self.where
        if ranks % tp:
            raise MegatronImportError(
                f"{where}: optimizer state of {ranks} model-parallel ranks, not a multiple of the "
                f"tensor-parallel size {tp} the model tensors are split by"
            )
        pp = ranks // tp if pp is None else pp
        # the expert optimizer's ranks are megatron-core's expert tensor x expert x pipeline
        # group: its TP is the expert TP
        ep = ranks // (tp * pp) if self.experts else 1
        if self.experts and (tp * ep * pp != ranks or not ep or self.num_experts % ep):
            raise MegatronImportError(
                f"{where}: expert optimizer state of {ranks} ranks does not split into expert "
                f"TP={tp} x PP={pp} x EP ranks of {self.num_experts} experts. "
                f"{WEIGHTS_ONLY_HINT}"
            )
        if self.layers % pp:
            raise MegatronImportError(
                f"{where}: {self.layers} layers over {pp} pipeline stages (uneven or "
                f"virtual pipeline stages are not supported). {WEIGHTS_ONLY_HINT}"
            )
        return RankGrid(tp, pp, ep)

    def _distinct(self, name: str) -> list[dcp.DcpChunk]:
        """One chunk per distinct place outside the layer (and expert) axes, sorted by offset."""
        skip = self._lead(name)
        seen: dict[tuple, dcp.DcpChunk] = {}
        for c in self.checkpoint.tensors[name].chunks:
            seen.setdefault(c.offsets[skip:], c)
        return [seen[k] for k in sorted(seen)]

    def _lead(self, name: str) -> int:
        """How many leading axes index layers (and experts) rather than the parameter."""
        stacked = name in self.stacked and name not in self.layer_of  # all layers in one tensor
        return 2 if name in self.expert_names else 1 if stacked else 0

    def _pair(self, name: str) -> str | None:
        """The grad-buffer parameter of a singleton_local_shards SwiGLU half (``X_w`` /
        ``X_v`` -> ``X``), else None."""
        base = name[:-2]
        halves = name[-2:] in ("_w", "_v") and {base + "_w", base + "_v"} <= self.layer_of.keys()
        return base if halves and name in self.layer_of else None

    def _swiglu(self, name: str) -> bool:
        """Whether ``name`` is a SwiGLU ``linear_fc1`` (twice the rows its ``linear_fc2``
        takes): megatron-core saves it as two chunks per TP rank (gate, up), even at TP 1."""
        fc2 = name.replace("linear_fc1.", "linear_fc2.", 1)
        if fc2 == name:
            return False
        fc2 = fc2.rpartition(".")[0] + ".weight"
        tensors = self.checkpoint.tensors
        if fc2 not in tensors or not tensors[fc2].shape:
            return False
        axis = -2 if name.endswith(".weight") else -1
        shape = tensors[name].shape
        return len(shape) >= -axis and shape[axis] == 2 * tensors[fc2].shape[-1]

    def _tp_size(self, model_names: list[str]) -> int:
        """The TP size: the chunk count of the least-split split tensor, a SwiGLU fc1's halved
        (two chunks per rank: at TP 1 it is the only split tensor)."""
        counts = set()
        for n in model_names:
            count = len(self._distinct(n))
            counts.add(count // 2 if self._swiglu(n) and count % 2 == 0 else count)
        tp = min((c for c in counts if c > 1), default=1)
        if any(c % tp for c in counts if c > 1):
            raise MegatronImportError(
                f"{self.where}: model tensors are saved in {sorted(counts)} chunks; no common "
                f"tensor-parallel size"
            )
        return tp

    def piece(self, name: str, tp_rank: int) -> tuple[tuple[int, ...], int | None, list]:
        """TP rank ``tp_rank``'s local shape of ``name`` (per layer), the axis its chunks join
        along (None: replicated), and those chunks."""
        chunks = self._distinct(name)
        skip = self._lead(name)
        shape = self.checkpoint.tensors[name].shape[skip:]
        if len(chunks) == 1:
            return tuple(shape), None, chunks
        mine = chunks[tp_rank :: self.grid.tp]
        axes = {a for c in chunks for a in range(len(shape)) if c.sizes[skip + a] != shape[a]}
        if len(axes) != 1 or len(chunks) % self.grid.tp:
            raise MegatronImportError(
                f"{self.where}: tensor {name!r} is saved in {len(chunks)} chunks split along "
                f"axes {sorted(axes)}; expected a split along one axis into a multiple of "
                f"TP={self.grid.tp}"
            )
        (axis,) = axes
        local = list(shape)
        local[axis] = sum(c.sizes[skip + axis] for c in mine)
        return tuple(local), axis, mine

    def _numel(self, name: str, tp_rank: int) -> int:
        return element_count(self.piece(name, tp_rank)[0])

    def rank_params(self, rank: int) -> tuple[list[tuple[str, int]], set[str]]:
        """The local parameters of model-parallel rank ``rank`` in module order (a stacked
        layer's as ``name#layer``), and which of them megatron-core puts alone in a bucket (a
        pipeline-tied embedding and its copy on the last stage)."""
        grid = self.grid
        tp_rank, stage, ep_rank = grid.coords(rank)
        params: list[tuple[str, int]] = []
        shared: set[str] = set()
        if self.experts:  # the expert optimizer's ranks: expert TP x EP x PP
            for i in grid.layers_of(stage, self.layers):
                params += self._layer_params(i, tp_rank, ep_rank)
            return params, shared
        if stage == 0:
            params += [(n, self._numel(n, tp_rank)) for n in self.before]
        for i in grid.layers_of(stage, self.layers):
            params += self._layer_params(i, tp_rank, 0)
        if stage == grid.pp - 1:
            params += [(n, self._numel(n, tp_rank)) for n in self.after]
        if self.tied_copy is not None:
            if stage == 0:
                shared.add(self.tied_copy)
            if stage == grid.pp - 1:
                copy = f"{self.tied_copy}#tied_output_copy"
                params.append((copy, self._numel(self.tied_copy, tp_rank)))
                shared.add(copy)
        return params, shared

    def _layer_params(self, layer: int, tp_rank: int, ep_rank: int) -> list[tuple[str, int]]:
        """Layer ``layer``'s local parameters in module order: the stacked tensors in saved
        order, a run of expert tensors expanded expert by expert (``local_experts.<e>.fc1,
        fc2``; EP rank ``ep_rank``'s experts), or GroupedMLP's ``weight1``, ``weight2`` holding
        all of them."""
        local = self.num_experts // self.grid.ep if self.num_experts else 0
        out: list[tuple[str, int]] = []
        if self.layer_of:  # singleton_local_shards: this layer's own tensors
            for n in self.stacked:
                base = self._pair(n)
                if self.layer_of[n] != layer or (base is not None and n.endswith("_v")):
                    continue
                numel = self._numel(n, tp_rank)
                if base is not None:
                    numel += self._numel(base + "_v", tp_rank)
                out.append((base or n, numel))
            return out
        run: list[str] = []
        for n in [*self.stacked, None]:
            if n is not None and n in self.expert_names:
                run.append(n)
                continue
            if self.grouped:  # weight1 (fc1), weight2 (fc2): all local experts in each
                out += [(f"{r}#{layer}#grouped", local * self._numel(r, tp_rank)) for r in run]
            else:
                out += [
                    (f"{r}#{layer}#{e}", self._numel(r, tp_rank))
                    for e in range(ep_rank * local, (ep_rank + 1) * local)
                    for r in run
                ]
            run = []
            if n is not None:
                out.append((f"{n}#{layer}", self._numel(n, tp_rank)))
        return out

    def _key(self, rank: int) -> str:
        return f"{self.prefix}optimizer.distributed.dp_group_idx_{rank}"

    def object(self, rank: int, what: str) -> Any:
        prefix = f"{self._key(rank)}.{what}/"
        name = next((n for n in self.checkpoint.objects if n.startswith(prefix)), None)
        return None if name is None else self.checkpoint.read_object(name, legacy.LEGACY_CLASSES)

    def step_objects(self) -> list[str]:
        """The objects the step is read from (one per model-parallel rank, when saved)."""
        prefixes = tuple(f"{self._key(rank)}.optimizer/" for rank in range(self.ranks))
        return sorted(n for n in self.checkpoint.objects if n.startswith(prefixes))

    def saved_groups(self) -> list[tuple[str, Any]]:
        """(each model-parallel rank's ``optimizer`` object, its param_groups) (None where not
        saved): the step and the run's hyper-parameters are read there."""
        if self._groups is None:
            self._groups = []
            for rank in range(self.ranks):
                state = self.object(rank, "optimizer")
                first = state[0] if isinstance(state, list) and state else None
                groups = first.get("param_groups") if isinstance(first, dict) else None
                self._groups.append((f"{self._key(rank)}.optimizer", groups))
        return self._groups

    def step(self) -> int:
        steps: dict[float, str] = {}
        for rank, (name, groups) in enumerate(self.saved_groups()):
            where = f"{self.where} ({name})"
            steps.setdefault(step_from_param_groups(groups, where), f"in rank {rank}")
        return agreed_step(
            steps, str(self.where), recorded_by="model-parallel ranks", error=MegatronImportError
        )

    def files(self) -> list[str]:
        """The files the flat state is read from."""
        names = {n for per in self.buffers.values() for states in per for n in states.values()}
        tensors, objects = self.checkpoint.tensors, self.checkpoint.objects
        return sorted(
            {f for n in names for f in (tensors[n].files if n in tensors else [objects[n].file])}
        )

    def flat(self, rank: int, bucket: int, state: str, start: int, end: int) -> np.ndarray:
        """Elements ``start:end`` of ``state`` in ``rank``'s ``bucket``: from the buffer held,
        else only that range of its tensor."""
        if rank in self.held:
            return self.held[rank].arrays[state][start:end]
        return self.checkpoint.read_rows(self.buffers[rank][bucket][state], start, end)

    def source(self, rank: int, bucket: int, state: str) -> str:
        """The tensor (or object) holding ``state`` of ``rank``'s ``bucket``.

        Args:
            rank: the model-parallel rank.
            bucket: the bucket of that rank.
            state: "param", "exp_avg" or "exp_avg_sq".
        """
        return self.buffers[rank][bucket][state]

    def _pieces(self, name: str) -> Iterator[tuple]:
        """What :meth:`read` takes for ``name``: (rank, layout key, layer, local shape, join
        axis, chunks) of every TP rank's (and pipeline stage's) piece; a tensor replicated over
        TP from TP rank 0 only, a pipeline-tied embedding from the first stage only."""
        skip, grid = self._lead(name), self.grid
        for tp_rank in range(grid.tp):
            local, axis, chunks = self.piece(name, tp_rank)
            if axis is None and tp_rank:
                break  # replicated over TP: rank 0's copy
            if name in self.expert_names:  # expert e of layer i: EP rank e // local experts
                local_experts = self.num_experts // grid.ep
                for layer in range(self.layers):
                    for e in range(self.num_experts):
                        stage = grid.stage_of(layer, self.layers)
                        rank = grid.rank(tp_rank, stage, e // local_experts)
                        key = f"{name}#{layer}#{'grouped' if self.grouped else e}"
                        yield rank, key, (layer, e), local, axis, chunks
                continue
            if name in self.layer_of:
                rank = grid.rank(tp_rank, grid.stage_of(self.layer_of[name], self.layers))
                yield rank, self._pair(name) or name, None, local, axis, chunks
                continue
            for layer in range(self.layers) if skip else [None]:
                if layer is not None:  # skip: one piece per layer
                    stage = grid.stage_of(layer, self.layers)
                else:
                    stage = 0 if name in self.before else grid.pp - 1
                key = f"{name}#{layer}" if skip else name
                yield grid.rank(tp_rank, stage), key, layer, local, axis, chunks

    def sources(self, state: str, name: str) -> list[str]:
        """The tensors (or objects) :meth:`read` takes ``state`` of ``name`` from."""
        return sorted(
            {
                self.source(rank, self.layout[rank][key][0], state)
                for rank, key, *_ in self._pieces(name)
            }
        )

    def unread(self) -> dict[str, str]:
        """Flat state tensors :meth:`read` takes nothing from, and why: buckets holding only
        the last stage's copy of a pipeline-tied embedding, or a TP rank > 0's copy of
        parameters replicated over TP. A bucket holding anything else is left out (the import
        is then refused as not accounting for it)."""
        if self.held:
            return {}
        names = [*self.before, *self.stacked, *self.after]
        read = {(rank, key) for n in names for rank, key, *_ in self._pieces(n)}
        out: dict[str, str] = {}
        for rank, layout in self.layout.items():
            per_bucket: dict[int, list[str]] = {}
            for key, (bucket, _, _) in layout.items():
                per_bucket.setdefault(bucket, []).append(key)
            for bucket, keys in per_bucket.items():
                if any((rank, key) in read for key in keys):
                    continue
                why = [w for key in keys if (w := self._unread_why(rank, key)) is not None]
                if len(why) != len(keys):
                    continue
                for state in self.STATES:
                    out[self.source(rank, bucket, state)] = (
                        f"{self.sharding} bucket of model-parallel rank {rank} holding only "
                        f"{'; '.join(dict.fromkeys(why))}: not read"
                    )
        return out

    def _unread_why(self, rank: int, key: str) -> str | None:
        name = key.partition("#")[0]
        if not self.experts and key == f"{self.tied_copy}#tied_output_copy":
            return (
                f"the last pipeline stage's copy of the tied embedding {name!r} (the first "
                f"stage's state is imported)"
            )
        if rank % self.grid.tp and self.piece(name, rank % self.grid.tp)[1] is None:
            return f"TP rank {rank % self.grid.tp}'s copy of replicated {name!r} (TP rank 0's is imported)"
        return None

    def spot_check(self, limit: int = 1 << 16) -> str | None:
        """The first model tensor of at most ``limit`` elements (or the smallest one) whose
        master does not equal (fp32) or round to (bf16) its weight, else None: a cheap test of
        the derived order before anything is written (every tensor is checked when written)."""
        names = [*self.before, *self.stacked, *self.after]
        tensors = self.checkpoint.tensors
        small = sorted(names, key=lambda n: element_count(tensors[n].shape))
        for i, name in enumerate(small):
            if i and element_count(tensors[name].shape) > limit:
                break
            if not rounds_to(self.read("param", name), self.checkpoint.read(name)):
                return name
        return None

    def read(self, state: str, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        """One optimizer state of model tensor ``name``, in its (stacked) global shape, put
        together from every TP rank's (and pipeline stage's) local piece; ``rows=(lo, hi)``:
        rows ``lo:hi`` of dim 0 only, reading only their part of the flat buckets (a tensor
        larger than the memory budget is written slab by slab, ``writer.Deferred.rows``).

        Args:
            state: "param", "exp_avg" or "exp_avg_sq".
            name: the model tensor.
            rows: (lo, hi) rows of dim 0 alone (None: all).
        """
        shape = self.checkpoint.tensors[name].shape
        lo, hi = (0, shape[0] if shape else 0) if rows is None else rows
        out = writer.unpooled_empty(shape if rows is None else (hi - lo, *shape[1:]), np.float32)
        skip = self._lead(name)
        for rank, key, layer, local, axis, chunks in self._pieces(name):
            bucket, start, end = self.layout[rank][key]
            if key != name and name.endswith("_v"):  # after the _w half of [w; v]
                start += self._numel(key + "_w", rank % self.grid.tp)
            if skip:  # dim 0 indexes layers: a piece is all in the rows or not at all
                first = layer if isinstance(layer, int) else layer[0]
                if not lo <= first < hi:
                    continue
                layer = first - lo if isinstance(layer, int) else (first - lo, *layer[1:])
            if key.endswith("#grouped"):  # the local expert's block, saved transposed
                assert layer is not None and not isinstance(layer, int)  # (layer, expert)
                start += layer[1] % (self.num_experts // self.grid.ep) * element_count(local)
                end = start + element_count(local)
                value = self.flat(rank, bucket, state, start, end)
                value = value.reshape(*local[:-2], local[-1], local[-2]).swapaxes(-1, -2)
            elif skip or not shape:
                end = start + element_count(local)
                value = self.flat(rank, bucket, state, start, end).reshape(local)
            else:  # a few MiB of rows at a time: a whole TP piece beside ``out`` was +50% of it
                step = max(1, BLOCK_BYTES // max(1, 4 * element_count(shape[1:])))
                for a in range(lo, hi, step):
                    b = min(hi, a + step)
                    block = out[a - lo : b - lo]
                    self._place_rows(block, rank, bucket, state, start, local, axis, chunks, a, b)
                continue
            _place(out[layer] if skip else out, value, axis, chunks, skip)
        return out

    def _place_rows(self, out, rank, bucket, state, start, local, axis, chunks, lo, hi) -> None:
        """Rows ``lo:hi`` of one unstacked piece into ``out`` (rows ``lo:hi`` of the tensor),
        read from the piece's flat range: its rows are consecutive in it (C order)."""
        row = element_count(local[1:])

        def local_rows(a: int, b: int) -> np.ndarray:
            return self.flat(rank, bucket, state, start + a * row, start + b * row).reshape(
                b - a, *local[1:]
            )

        if axis != 0:  # replicated, or split along another axis: every piece holds all rows
            _place(out, local_rows(lo, hi), axis, chunks, 0, rows=True)
            return
        at = 0
        for c in chunks:  # split along dim 0: the chunks' rows that fall in lo:hi
            size = c.sizes[0]
            g0, g1 = max(lo, c.offsets[0]), min(hi, c.offsets[0] + size)
            if g0 < g1:
                index = tuple(slice(o, o + n) for o, n in zip(c.offsets[1:], c.sizes[1:]))
                a = at + g0 - c.offsets[0]
                out[(slice(g0 - lo, g1 - lo), *index)] = local_rows(a, a + g1 - g0)
            at += size


def _place(target, value, axis, chunks, skip: int, rows: bool = False) -> None:
    """A rank's local piece ``value`` (its ``chunks`` joined along ``axis``; None: replicated,
    the piece is the tensor) into ``target`` at the chunks' places, past ``skip`` leading layer
    (and expert) axes; ``rows``: ``target`` and ``value`` are rows of dim 0 only."""
    if axis is None:
        target[...] = value
        return
    at = 0
    for c in chunks:
        size = c.sizes[skip + axis]
        index = [slice(o, o + n) for o, n in zip(c.offsets[skip:], c.sizes[skip:])]
        if rows:  # every row of the chunk's dim 0 is in ``value``
            index[0] = slice(None)
        # a view of the piece (np.take would copy it first)
        target[tuple(index)] = value[(slice(None),) * axis + (slice(at, at + size),)]
        at += size


def rounds_to(master: np.ndarray, weight: np.ndarray, block: int = 1 << 20) -> bool:
    """``master`` cast to ``weight``'s dtype equals ``weight`` bit for bit; compared ``block``
    elements at a time, so the temporaries are a few MiB instead of the tensor's size (the
    cast copy and a byte-wise comparison of it were 1.5x the master under the memory budget)."""
    if master.shape != weight.shape:
        return False
    m, w = master.reshape(-1), np.ascontiguousarray(weight).reshape(-1)
    return all(
        m[i : i + block].astype(w.dtype).tobytes() == w[i : i + block].tobytes()
        for i in range(0, m.size, block)
    )


def members_step(members: list[RankStates]) -> int:
    """The step of an optimizer's state (a ChainedOptimizer's: one per member, which agree)."""
    steps: dict[float, str] = {}
    for member in members:
        steps.setdefault(member.step(), f"in {member.prefix}optimizer")
    where = str(members[0].where)
    by = "ChainedOptimizer members"
    return agreed_step(steps, where, recorded_by=by, error=MegatronImportError)


# ------------------------------------------- the flat buffers' layout (megatron-core's grad buffer)
def _buckets(
    params: list[tuple[str, int]], shared: set[str], limit: Callable[[int], int | None]
) -> list[tuple[dict[str, tuple[int, int]], int]]:
    """megatron-core's grad-buffer walk (``_ParamAndGradBuffer``, 0.16): parameters in reverse
    module order, each start padded to 64 elements, a shared-embedding parameter alone in its
    bucket, a bucket closed once it holds ``limit(bucket)`` elements (None: never). Returns
    every bucket's ({name: (start, end)} within it, its size)."""
    out: list[tuple[dict[str, tuple[int, int]], int]] = []
    places: dict[str, tuple[int, int]] = {}
    rel = 0
    for name, numel in reversed(params):
        rel = -(-rel // 64) * 64
        if name in shared and places:
            out.append((places, rel))
            places, rel = {}, 0
        places[name] = (rel, rel + numel)
        rel += numel
        size = limit(len(out))
        if name in shared or (size is not None and rel >= size):
            out.append((places, rel))
            places, rel = {}, 0
    if places:
        out.append((places, rel))
    return out


def distrib_optim_layout(
    params: list[tuple[str, int]],
    shared: set[str],
    bucket_size: int | None,
    state: DistribOptimState,
    whose: str,
) -> dict[str, tuple[int, int]]:
    """Where each parameter sits in a ``distrib_optim.pt`` flat buffer (megatron-core 0.16):
    the buckets of ``_buckets`` concatenated without their end padding, as
    ``get_parameter_state_dp_zero`` does; refused unless they fill the buffer exactly.
    Returns {name: (start, end)}.

    Args:
        params: (name, numel) of the rank's local parameters, in module order.
        shared: the pipeline-tied embedding parameters.
        bucket_size: DDP's bucket size in elements (None: one bucket).
        state: the buffer (its ``numel_unpadded``, its path for the error).
        whose: the rank the parameters are of, for the error.
    """
    out: dict[str, tuple[int, int]] = {}
    base = 0
    for places, size in _buckets(params, shared, lambda _: bucket_size):
        out.update({name: (base + a, base + b) for name, (a, b) in places.items()})
        base += size
    if base != state.numel_unpadded:
        raise MegatronImportError(
            f"{state.path}: the buffer holds {state.numel_unpadded} elements, but the "
            f"{len(params)} local parameters of {whose} lay out to {base} (megatron-core's "
            f"grad-buffer layout, bucket_size={bucket_size}); another megatron-core version or "
            f"DDP bucket setting? {WEIGHTS_ONLY_HINT}"
        )
    return out


def bucket_layout(
    params: list[tuple[str, int]], shared: set[str], bucket_numels: list[int], where: str
) -> dict[str, tuple[int, int, int]]:
    """Where each parameter sits in megatron-core's grad-buffer buckets, given the unpadded
    size of every bucket (which megatron-core records): ``{name: (bucket, start, end)}``.

    A bucket closes where its recorded size says, so the DDP ``bucket_size`` (not saved, and
    ``None`` past the first pipeline stage) is not needed; every recorded size is checked, so
    a wrong parameter list cannot fit silently (a misfit: ``MegatronImportError``, which
    :func:`module_order.in_module_order` answers by trying the next order).

    Args:
        params: (name, numel) of the rank's local parameters, in module order.
        shared: the pipeline-tied embedding parameters.
        bucket_numels: the recorded unpadded size of every bucket.
        where: the file, for errors.
    """
    buckets = _buckets(
        params, shared, lambda b: bucket_numels[b] if b < len(bucket_numels) else None
    )
    why = "(megatron-core 0.16 grad-buffer layout; another version or DDP config?)"
    for bucket, (places, size) in enumerate(buckets):
        if bucket >= len(bucket_numels) or size != bucket_numels[bucket]:
            recorded = bucket_numels[bucket] if bucket < len(bucket_numels) else None
            raise MegatronImportError(
                f"{where}: bucket {bucket} would end after {list(places)[-1]!r} at element "
                f"{size}, but megatron-core recorded {recorded} elements (buckets "
                f"{bucket_numels}); the parameter list does not match this checkpoint's grad "
                f"buffer {why}. {WEIGHTS_ONLY_HINT}"
            )
    if len(buckets) != len(bucket_numels):
        raise MegatronImportError(
            f"{where}: the parameters fill {len(buckets)} buckets, megatron-core recorded "
            f"{len(bucket_numels)} ({bucket_numels}) {why}. {WEIGHTS_ONLY_HINT}"
        )
    return {
        name: (bucket, a, b)
        for bucket, (places, _) in enumerate(buckets)
        for name, (a, b) in places.items()
    }


@dataclass
class DistribOptimState:
    """One buffer of a ``distrib_optim.pt``: its flat fp32 states, checked."""

    path: str
    arrays: dict[str, np.ndarray]  # "param" (fp32 masters), "exp_avg", "exp_avg_sq"
    numel_unpadded: int
    #: state name -> the flat tensor's dotted path in the loaded dict (``tensor_names`` form)
    names: dict[str, str] = field(default_factory=dict)


def distrib_optim_state(saved: Any, path: str, index: int = 0, count: int = 1) -> DistribOptimState:
    """Buffer ``index`` of a loaded ``get_parameter_state_dp_zero`` dict holding ``count``
    buffers (more than one: a virtual pipeline's model chunks), checked: the content of a
    ``distrib_optim.pt`` and of megatron-core 0.13's ``dp_zero_gather_scatter`` object.

    Args:
        saved: the loaded dict.
        path: where it was loaded from, for errors.
        index: which buffer.
        count: how many buffers it holds.
    """
    if not isinstance(saved, dict) or saved.get("buckets_coalesced") is not True:
        raise SourceError(
            f"{path}: not a megatron-core distrib_optim.pt with buckets_coalesced=True "
            f"(older per-bucket layouts are not supported)"
        )
    buffers = [k for k in saved if k != "buckets_coalesced"]
    if buffers != list(range(count)):
        raise SourceError(
            f"{path}: {len(buffers)} gradient buffers {buffers}; expected {count} (one per "
            f"model chunk: a single dtype, no expert-parallel buffer)"
        )
    per_dtype = saved[index]
    if not isinstance(per_dtype, dict) or len(per_dtype) != 1:
        raise SourceError(
            f"{path}: buffer {index} holds "
            f"{len(per_dtype) if isinstance(per_dtype, dict) else '?'} dtype groups, expected 1"
        )
    ((dtypes, buffer),) = per_dtype.items()
    arrays = {}
    for state_name in ("param", "exp_avg", "exp_avg_sq"):
        array = buffer.get(state_name) if isinstance(buffer, dict) else None
        if not isinstance(array, np.ndarray) or array.ndim != 1 or array.dtype != np.float32:
            raise SourceError(
                f"{path}: buffer {index} {state_name!r} must be a flat float32 tensor, found "
                f"{getattr(array, 'dtype', type(array).__name__)} {getattr(array, 'shape', '')}"
            )
        arrays[state_name] = array
    numel = buffer.get("numel_unpadded")
    if type(numel) is not int or any(a.size != numel for a in arrays.values()):
        raise SourceError(
            f"{path}: numel_unpadded={numel!r} but the flat tensors hold "
            f"{[a.size for a in arrays.values()]} elements"
        )
    names = {state_name: f"{index}.{dtypes}.{state_name}" for state_name in arrays}
    return DistribOptimState(path, arrays, numel, names)
