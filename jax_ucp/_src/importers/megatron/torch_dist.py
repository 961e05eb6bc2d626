"""Planning the import of a megatron-core ``torch_dist`` (or ``fsdp_dtensor``) checkpoint: the
model tensors read whole (vocab padding stripped), the optimizer state in whichever layout it was
saved."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from jax_ucp._src import writer
from jax_ucp._src.format import files
from jax_ucp._src.importers.megatron import dcp, fsdp_dtensor, legacy
from jax_ucp._src.importers.megatron.common import (
    STATE_TREES,
    SUPPORTED_LAYOUTS,
    WEIGHTS_ONLY_HINT,
    MegatronImportError,
    OptimizerFound,
    is_optimizer_name,
    listed,
    named_errors,
    param_groups,
    sharding_type,
    step_from_param_groups,
    tied_embeddings,
)
from jax_ucp._src.importers.megatron.distopt import (
    bucket_states,
    chained_layouts,
    chained_states,
    gathered_states,
)
from jax_ucp._src.importers.megatron.integrity import verify_integrity
from jax_ucp._src.importers.megatron.model_space import (
    OPTIMIZER_STATE_TREES,
    check_model_space_tensors,
    model_space_tensors,
    unflatten,
)
from jax_ucp._src.importers.megatron.module_order import in_module_order
from jax_ucp._src.importers.megatron.rank_states import RankStates, members_step, rounds_to
from jax_ucp._src.importers.megatron.rules import add_arg_settings, import_rules_spec
from jax_ucp._src.importers.megatron.run_record import (
    MEGATRON_OPTIMIZER,
    optimizer_record,
    with_rank_groups,
)
from jax_ucp._src.importers.megatron.source import MegatronSource
from jax_ucp._src.importers.plan import (
    TENSORS,
    VALUES,
    ImportOptions,
    ImportPlan,
    agreed_step,
    count_item,
    host_item,
)
from jax_ucp._src.language import Spec, Vocab
from jax_ucp._src.store.storage import Storage
from jax_ucp._src.torchfiles import allow_list, torch_zip


def plan_torch_dist(
    source_dir: MegatronSource, settings: dict, options: ImportOptions
) -> ImportPlan:
    """torch_dist, or its fsdp_dtensor layout (no common state; its names, run state and
    optimizer state read by :mod:`fsdp_dtensor`): tensors read whole (vocab rows stripped);
    its ``source`` is the format's info.

    Args:
        source_dir: the detected torch_dist checkpoint.
        settings: the run's model settings.
        options: ``spec``: the loaded spec with import rules / settings (None: the defaults);
            ``weights_only``: the model weights alone, the optimizer state skipped and listed
            in ``source.skipped``.
    """
    checkpoint, common, common_name, vouched = open_torch_dist(source_dir.folder)
    fmt, names = "torch_dist", {}  # each model tensor's output name, where not its own
    if not common and fsdp_dtensor.is_fsdp_dtensor(checkpoint):
        fmt, common_name = "fsdp_dtensor", ".metadata"
        common, names, optimizer = fsdp_dtensor.read_fsdp_dtensor(checkpoint, options.weights_only)
        model_names, layout = sorted(names), "fsdp_dtensor" if optimizer.tensors else None
    if not settings.get("num_layers") and isinstance(common, dict):
        add_arg_settings(legacy.args_dict(common.get("args")), settings)
    if fmt == "torch_dist":
        model_names = [n for n in checkpoint.tensors if not is_optimizer_name(n)]
        chained = chained_layouts(checkpoint, common)
        optimizer = _find_optimizer_state(
            checkpoint, common, chained, model_names, settings, options.weights_only
        )
        optimizer.step = _optimizer_step(
            checkpoint, common, source_dir.folder.join(common_name), chained, optimizer, model_names
        )
        layout = (  # never "optimizer", which names a torch optimizer's record in other formats
            optimizer.buckets[0].sharding
            if optimizer.buckets
            else ("per_parameter" if optimizer.tensors else None)
        )
    reader = TorchDistReader(checkpoint, import_rules_spec(options.spec, settings))
    model_dtypes = {checkpoint.tensors[n].dtype for n in model_names}
    want_model = optimizer.present and any(d != np.dtype(np.float32) for d in model_dtypes)
    skipped = dict(optimizer.skipped)  # source.skipped: every .metadata tensor not imported
    if optimizer.present and not want_model:
        for name in model_names:  # where its fp32 master is read from
            states = optimizer.tensors.get(name, {})
            if states.get("param") == name:  # its own master (fsdp_dtensor): params/
                continue
            master = (
                repr(states.get("param") or states.get("fp32_param"))
                if not optimizer.buckets
                else f"the {optimizer.buckets[0].sharding} state, checked equal to this weight"
            )
            skipped[name] = (
                f"a float32 run's model weight: its fp32 master ({master}) is imported as params/"
            )
    for member in optimizer.buckets:
        skipped.update(member.unread())
    iteration = common.get("iteration") if isinstance(common, dict) else None
    info = {  # what the manifest's source records
        "format": fmt,
        "tensors": len(model_names),
        "optimizer_layout": layout,
        "iteration": iteration if type(iteration) is int else None,
        "skipped_objects": sorted(checkpoint.objects),
        # known before any byte is read
        "vocab_stripped": {names.get(k, k): v for k, v in reader.stripped(model_names).items()},
        "mcore_metadata": checkpoint.mcore_metadata,
        "dcp_version": checkpoint.version,
        "model_dtype": ", ".join(sorted(str(d) for d in model_dtypes)),
        **({"skipped": skipped} if skipped else {}),
        "tied_embeddings": tied_embeddings([names.get(n, n) for n in model_names], settings),
        **({"integrity": f"{vouched} files equal to integrity.json's SHA-256"} if vouched else {}),
    }
    where = common_name
    record = optimizer_record(common, where) if isinstance(common, dict) else None
    if optimizer.buckets:  # the per-rank groups: lr, betas, eps, weight decay...
        groups = [member.saved_groups() for member in optimizer.buckets]
        record = with_rank_groups(record, groups, where, checkpoint.index)
    if record is not None:  # how the run stepped: args, scheduler state, param groups
        info[MEGATRON_OPTIMIZER] = record
    mine = options.share.pick(model_names)
    if optimizer.buckets:
        items = bucket_items(reader, optimizer.buckets, mine, want_model)
    else:
        items = torch_dist_items(reader, mine, optimizer.tensors, want_model, fmt, names)
    if optimizer.step is not None and options.share.primary:  # else: another process's
        items = itertools.chain(items, [count_item(*optimizer.step)])
    return ImportPlan(items, info, len(mine), source_tensors=list(checkpoint.tensors))


def _find_optimizer_state(
    checkpoint: dcp.DcpCheckpoint,
    common: Any,
    chained: list[str | None] | None,
    model_names: list[str],
    settings: dict,
    weights_only: bool,
) -> OptimizerFound:
    """The optimizer state in the layout ``common`` names (a ChainedOptimizer's per member);
    a layout saved as objects this importer does not read is refused. ``weights_only``: none
    read, every optimizer tensor named as skipped (none dropped without a word) with its layout."""
    where = checkpoint.index
    sharding = sharding_type(common)
    optimizer_names = [n for n in checkpoint.tensors if is_optimizer_name(n)]
    if weights_only:
        layout = (
            f"ChainedOptimizer {chained}"
            if chained is not None
            else repr(sharding or ("fully_reshardable" if optimizer_names else None))
        )
        why = f"weights_only: optimizer state (layout {layout})"
        return OptimizerFound(skipped=dict.fromkeys(optimizer_names, why))
    if chained is not None:
        members = chained_states(checkpoint, model_names, settings, chained)
        if members is not None:
            return OptimizerFound(buckets=members)
        return OptimizerFound(tensors=model_space_tensors(checkpoint, common))
    if sharding == "dp_reshardable":
        return OptimizerFound(
            buckets=[in_module_order(bucket_states, checkpoint, model_names, settings)]
        )
    if sharding == "dp_zero_gather_scatter":
        if optimizer_names:  # this layout saves objects only: a tensor is something else
            raise MegatronImportError(
                f"{where}: optimizer tensor {optimizer_names[0]!r} in a "
                f"dp_zero_gather_scatter checkpoint (whose optimizer state is objects); "
                f"{SUPPORTED_LAYOUTS}. {WEIGHTS_ONLY_HINT}"
            )
        return OptimizerFound(
            buckets=[in_module_order(gathered_states, checkpoint, model_names, settings)]
        )
    tensors = model_space_tensors(checkpoint, common)
    objects = [n for n in checkpoint.objects if is_optimizer_name(n)]
    if not tensors and objects:
        # e.g. megatron-core 0.13's dp_zero_gather_scatter: the state is pickled bucket
        # objects; importing the weights alone without saying so would lose it silently
        raise MegatronImportError(
            f"{where}: the optimizer state is saved as {len(objects)} objects "
            f"({objects[0]!r}, ...) in layout {sharding!r}, which is not supported "
            f"({SUPPORTED_LAYOUTS}). {WEIGHTS_ONLY_HINT}"
        )
    return OptimizerFound(tensors=tensors)


def _optimizer_step(
    checkpoint: dcp.DcpCheckpoint,
    common: Any,
    common_path: str,
    chained: list[str | None] | None,
    optimizer: OptimizerFound,
    model_names: list[str],
) -> tuple[int, dict] | None:
    """The Adam step and where it was read (None without optimizer state): from the per-rank
    state objects, or from ``common.pt``'s param_groups (one per ChainedOptimizer member, which
    must agree)."""
    members = optimizer.buckets
    if members:
        objects = sorted(n for member in members for n in member.step_objects())
        read = {"pattern": "param_groups.step", "files": _files(members), VALUES: objects}
        return members_step(members), read
    if not optimizer.tensors:
        return None
    check_model_space_tensors(checkpoint, common, common_path, optimizer.tensors, model_names)
    optimizer_state = common.get("optimizer") if isinstance(common, dict) else None
    read = {
        "files": ["common.pt"],
        "pattern": "param_groups.step",
        VALUES: ["common.pt:optimizer.optimizer.param_groups"],
    }
    if chained is None:
        return step_from_param_groups(param_groups(optimizer_state), str(common_path)), read
    members = (  # a ChainedOptimizer's states by index, or listed
        optimizer_state.items()
        if isinstance(optimizer_state, dict)
        else enumerate(optimizer_state or ())
    )
    steps: dict[float, str] = {}
    for i, part in sorted(members):
        step = step_from_param_groups(param_groups(part), f"{common_path} (optimizer {i})")
        steps.setdefault(step, f"in optimizer {i}")
    agreed = agreed_step(
        steps, str(common_path), recorded_by="ChainedOptimizer members", error=MegatronImportError
    )
    return agreed, read


#: (the checkpoint, its common state, the name in the folder it was read from, the files
#: integrity.json vouched for)
Opened = tuple[dcp.MegatronDcpCheckpoint, Any, str, int | None]


def open_torch_dist(folder: Storage) -> Opened:
    """The checkpoint in ``folder`` with every shard file and chunk tiling checked
    (``integrity.json`` first, before any byte of it is read), and its ``common.pt``."""
    names = listed(folder) or []
    vouched = verify_integrity(folder, names)
    checkpoint = dcp.open_dcp(folder)
    backend = checkpoint.mcore_metadata.get("sharded_backend")
    if backend not in (None, "torch_dist"):
        raise MegatronImportError(
            f"{checkpoint.storage.join('metadata.json')}: sharded_backend {backend!r} is not supported "
            f"(only 'torch_dist')"
        )
    checkpoint.check_files()
    for tensor in checkpoint.tensors.values():
        dcp.check_coverage(tensor, checkpoint.index)
    common_name = "common.pt"
    common: Any = {}
    # megatron-core >= 0.19 saves the common state (args, iteration, optimizer param_groups,
    # sharding type) as one object of the checkpoint instead of common.pt
    objects = sorted(n for n in checkpoint.objects if n.startswith("common_state/"))
    if common_name in names:  # a FIFO or device there is an error, not "no common.pt"
        try:  # never a common.pt linked to another run's
            common = torch_zip.load_torch_file((folder, common_name), legacy.LEGACY_CLASSES)
        except (files.UnsafeFileError, allow_list.TorchFileError) as e:
            raise MegatronImportError(str(e)) from None
    elif objects:
        if len(objects) != 1:
            raise MegatronImportError(
                f"{checkpoint.index}: {len(objects)} common_state objects "
                f"({objects}); megatron-core saves one"
            )
        common = checkpoint.read_object(objects[0], legacy.LEGACY_CLASSES)
        if isinstance(common, list) and len(common) == 1:
            (common,) = common
        if not isinstance(common, dict):
            raise MegatronImportError(
                f"{checkpoint.index}: object {objects[0]!r} holds "
                f"{allow_list.short_repr(common)}, expected the common state dict"
            )
        common_name = objects[0]
    return checkpoint, common, common_name, vouched


class TorchDistReader:
    """Reads torch_dist tensors whole, keeping only the tokenizer's rows of vocab-parallel ones."""

    def __init__(self, checkpoint: dcp.DcpCheckpoint, spec: Spec):
        self.checkpoint = checkpoint
        self.spec = spec

    def vocab_rows(self, name: str) -> int | None:
        """The tokenizer's rows of ``name`` when its rule is a dim-0 vocab with a size (the
        padding rows past them are stripped), else None."""
        kind = getattr(self.spec.match(name), "kind", None)
        if isinstance(kind, Vocab) and isinstance(kind.vocab_size, int) and kind.dim == 0:
            return kind.vocab_size
        return None

    def stripped(self, names: list[str]) -> dict[str, list[int]]:
        """name -> [padded rows, kept rows] of every tensor whose padding is stripped."""
        return {
            name: [rows, vocab]
            for name in names
            if (vocab := self.vocab_rows(name)) is not None
            and (rows := self.checkpoint.tensors[name].shape[0]) > vocab
        }

    def layout(self, tensor: str, rule_name: str) -> tuple[tuple[int, ...], str, bool]:
        """What ``read(tensor, rule_name)`` gives, known without reading it: its shape (vocab
        padding rows stripped), the pattern the provenance records, and whether the tensor is
        stored flattened (megatron-core < 0.15's model-space optimizer state, see `unflatten`)."""
        shape = tuple(int(d) for d in self.checkpoint.tensors[rule_name].shape)
        found = tuple(int(d) for d in self.checkpoint.tensors[tensor].shape)
        vocab = self.vocab_rows(rule_name)
        if found != shape:
            if vocab is None or shape[0] <= vocab:
                return shape, "torch_dist-nd-flattened", True
            return (vocab, *shape[1:]), f"nd-flattened, vocab(strip {shape[0]} -> {vocab})", True
        if vocab is None:
            return found, "torch_dist-global", False
        if found[0] < vocab:
            raise MegatronImportError(
                f"tensor {tensor!r}: {found[0]} rows, fewer than vocab_size={vocab} "
                f"({self.checkpoint.index})"
            )
        return (vocab, *found[1:]), f"vocab(strip {found[0]} -> {vocab})", False

    def read_rows(self, tensor: str, lo: int, hi: int, rule_name: str | None = None) -> np.ndarray:
        """Rows ``lo:hi`` of ``read(tensor, rule_name)`` alone, from the chunks holding them
        (``rule_name`` None: ``tensor``'s own rule)."""
        kept, _, flattened = self.layout(tensor, rule_name or tensor)
        if flattened or not kept or not 0 <= lo <= hi <= kept[0]:
            raise MegatronImportError(
                f"tensor {tensor!r}: no rows {lo}:{hi} of {kept} ({self.checkpoint.path})"
            )
        return self.checkpoint.read_rows(tensor, lo, hi)

    def deferred(self, tensor: str, rule_name: str) -> tuple[writer.Deferred | np.ndarray, str]:
        """``read(tensor, rule_name)`` left for the consumer to make when it has room (the
        writer's memory budget, a direct restore's regions): whole, or in row slabs of the
        chunks that hold them unless stored flattened; a 0-d tensor is read now."""
        if not self.checkpoint.tensors[tensor].shape:
            return self.read(tensor, rule_name)
        kept, pattern, flattened = self.layout(tensor, rule_name)
        dtype = np.dtype(self.checkpoint.tensors[tensor].dtype)

        def whole() -> np.ndarray:
            with named_errors():
                return self.read(tensor, rule_name)[0]

        if flattened:  # built whole from the flat tensor (its bytes: ``bound``)
            nbytes = math.prod(self.checkpoint.tensors[tensor].shape) * dtype.itemsize
            return writer.Deferred(kept, dtype, whole, bound=nbytes), pattern

        def rows(lo: int, hi: int) -> np.ndarray:
            with named_errors():
                return self.read_rows(tensor, lo, hi, rule_name)

        def regions(dests: list) -> list:
            with named_errors():
                return self.checkpoint.region_jobs(tensor, dests)

        return writer.Deferred(kept, dtype, whole, rows=rows, regions=regions), pattern

    def read(self, tensor: str, rule_name: str) -> tuple[np.ndarray, str]:
        """One tensor (ruled as ``rule_name``), and the pattern the provenance records."""
        kept, pattern, flattened = self.layout(tensor, rule_name)
        if flattened:
            shape = tuple(int(d) for d in self.checkpoint.tensors[rule_name].shape)
            value = unflatten(self.checkpoint.read(tensor), shape, tensor)
            return (value if kept == shape else value[: kept[0]]), pattern
        vocab = self.vocab_rows(rule_name)
        return self.checkpoint.read(tensor, rows=None if vocab is None else kept[0]), pattern


def bucket_items(
    reader: TorchDistReader,
    members: list[RankStates],
    model_names: list[str],
    want_model: bool,
) -> Iterator[writer.HostItem]:
    """dp_reshardable / dp_zero_gather_scatter: per parameter its master weight (checked against
    the model weight) and moments from the flat vectors, vocab padding stripped like the
    weights.

    Args:
        reader: reads the model tensors (vocab rows stripped).
        members: the per-rank flat optimizer state of each optimizer (a ChainedOptimizer's
            members).
        model_names: this process's model tensors.
        want_model: also import the model-precision copy.
    """
    checkpoint, files, first = reader.checkpoint, _files(members), members[0]
    owner = {n: m for m in members for n in (*m.before, *m.stacked, *m.after)}
    for name in model_names:
        buckets = owner[name]
        full = checkpoint.tensors[name]
        weight = ModelWeight(reader, name)
        weight_bytes = math.prod(full.shape) * np.dtype(full.dtype).itemsize
        state_bytes = math.prod(full.shape) * 4
        provenance = {
            "format": "torch_dist",
            "files": files,
            "pattern": f"{first.sharding} (TP={first.grid.tp}, PP={first.grid.pp})",
        }
        for state, tree in STATE_TREES.items():
            sources = {VALUES if buckets.held else TENSORS: buckets.sources(state, name)}
            value = _bucket_state(buckets, state, name, weight, state_bytes + weight_bytes)
            yield host_item((*tree, name), value, {**provenance, **sources})
        if want_model:
            model = (  # built whole once its states are (kept), else in row slabs like them
                writer.Deferred(None, None, weight.take, bound=weight_bytes)
                if not weight.shape
                else writer.Deferred(
                    weight.shape, np.dtype(full.dtype), weight.take, rows=weight.rows
                )
            )
            yield host_item(
                ("model_params", name),
                model,
                {
                    "format": "torch_dist",
                    "files": full.files,
                    "pattern": weight.pattern,
                    TENSORS: [name],
                },
            )


def _files(members: list[RankStates]) -> list[str]:
    """The files every member's flat state is read from."""
    return sorted({f for member in members for f in member.files()})


class ModelWeight:
    """One parameter's model weight, read whole by the first of its states to be built whole
    (inside the memory budget, which reserves its bytes beside each state's) and kept for the
    masters' check and the model-precision copy; a state written in row slabs reads only the
    slab's rows of it instead (``rows``), so it is never held whole beside a slab."""

    def __init__(self, reader: TorchDistReader, name: str):
        self.reader, self.name = reader, name
        self.value: np.ndarray | None = None
        # its shape (vocab padding stripped from dim 0, as optimizer states are) and pattern
        self.shape, self.pattern, _ = reader.layout(name, name)

    def get(self) -> np.ndarray:
        if self.value is None:
            with named_errors():
                self.value, self.pattern = self.reader.read(self.name, self.name)
        return self.value

    def take(self) -> np.ndarray:
        """The weight for its model-precision copy, the last use: no longer kept here (this
        object outlives the item, and a kept weight stayed resident beside the next
        parameter's states: +72 MiB at a 128 MiB budget measured)."""
        value = self.get()
        self.value = None
        return value

    def rows(self, lo: int, hi: int) -> np.ndarray:
        if self.value is not None:
            return self.value[lo:hi]
        with named_errors():
            return self.reader.read_rows(self.name, lo, hi)


def _bucket_state(
    buckets: RankStates, state: str, name: str, model: ModelWeight, bound: int
) -> writer.Deferred:
    """One optimizer state of ``name``, put together from every rank's flat buckets only once
    the writer has room for it and the model weight (``bound`` bytes) in the memory budget
    (``writer.Deferred``); vocab padding stripped like the weight's, the master checked
    against it."""

    def checked(value: np.ndarray, weight: np.ndarray, what: str, does: str) -> np.ndarray:
        if state == "param" and not rounds_to(value, weight):
            raise MegatronImportError(
                f"tensor {name!r}: {what} found in the {buckets.sharding} state of "
                f"{buckets.where} {does} "
                f"{'equal' if weight.dtype == np.float32 else 'round to'} the model weight: the "
                f"grad-buffer layout jax_ucp derived does not match this checkpoint (another "
                f"megatron-core version or DDP config?). {WEIGHTS_ONLY_HINT}"
            )
        return value

    def make() -> np.ndarray:
        weight = model.get()
        full = tuple(model.reader.checkpoint.tensors[name].shape)
        with named_errors():
            value = buckets.read(state, name)
        if weight.ndim and weight.shape != full:
            value = value[: weight.shape[0]]
        return checked(value, weight, "the fp32 master", "does not")

    if not model.shape:  # 0-d: built whole
        return writer.Deferred(None, None, make, bound=bound)

    def rows(lo: int, hi: int) -> np.ndarray:
        """Rows ``lo:hi`` alone (the tensor is larger than the memory budget), the master
        checked against the same rows of the model weight (read alone too)."""
        with named_errors():
            value = buckets.read(state, name, rows=(lo, hi))
        if state != "param":
            return value
        return checked(value, model.rows(lo, hi), f"rows {lo}:{hi} of the fp32 master", "do not")

    return writer.Deferred(model.shape, np.dtype(np.float32), make, bound=bound, rows=rows)


def torch_dist_items(
    reader: TorchDistReader,
    model_names: list[str],
    optimizer_tensors: dict[str, dict[str, str]],
    want_model: bool,
    fmt: str = "torch_dist",
    names: dict[str, str] | None = None,
) -> Iterator[writer.HostItem]:
    """Per parameter: its master weight and moments (or the model weight when there is no
    optimizer state), its model-precision copy.

    Args:
        reader: reads the tensors (vocab rows stripped).
        model_names: this process's model tensors.
        optimizer_tensors: {parameter: {state: tensor name}}.
        want_model: also import the model-precision copy.
        fmt: the format each provenance names.
        names: each model tensor's output name (None: its own).
    """
    checkpoint, out = reader.checkpoint, names or {}
    for name in model_names:
        for state_name, tree in OPTIMIZER_STATE_TREES.items():
            source_name = optimizer_tensors[name].get(state_name) if optimizer_tensors else None
            if source_name is None:
                continue
            source = checkpoint.tensors[source_name]
            if tree == ("params",) and source.dtype != np.dtype(np.float32):
                raise MegatronImportError(
                    f"tensor {source_name!r}: master weights have dtype {source.dtype}, "
                    f"expected float32 ({', '.join(source.files)})"
                )
            value, pattern = reader.deferred(source_name, name)
            provenance = {
                "format": fmt,
                "files": source.files,
                "source_name": source_name,
                "pattern": pattern,
                TENSORS: [source_name],
            }
            yield host_item((*tree, out.get(name, name)), value, provenance)
        if want_model or not optimizer_tensors:  # the model weight, or its model-precision copy
            tensor = checkpoint.tensors[name]
            value, pattern = reader.deferred(name, name)
            provenance = {
                "format": fmt,
                "files": tensor.files,
                "chunks": len(tensor.chunks),
                TENSORS: [name],
                "pattern": pattern,
            }
            root = "model_params" if optimizer_tensors else "params"
            yield host_item((root, out.get(name, name)), value, provenance)
