"""What every importer hands to :mod:`jax_ucp._src.conversion`: an :class:`ImportPlan`.

The importers only read; the writer only writes. Between them flows one record,
``writer.HostItem``, whose manifest role the importer states (the writer does not guess roles
from key names): :func:`host_item` is that contract, written once for every importer.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import numpy as np

from jax_ucp._src import writer
from jax_ucp._src.errors import RequestError, SourceError
from jax_ucp._src.format import files, keypath
from jax_ucp._src.importers.runs import TrainerRun, numbered_steps
from jax_ucp._src.store.storage import Storage


@dataclasses.dataclass(frozen=True)
class ImportPlan:
    """A checkpoint import, validated and ready to stream into the writer.

    Returned only after every check that needs no tensor bytes, so a bad checkpoint fails before
    the destination is touched. ``items`` is lazy: it reads one parameter at a time (errors met
    while reading are the importer's own, naming the file). ``source`` is recorded in the
    manifest; ``total_params`` is what progress counts to.

    ``source_tensors``: every tensor the importer found in the checkpoint's files (names as
    :func:`tensor_names` gives them, or the format's own keys). :func:`accounted` holds the
    import to them: each is named by some item's ``provenance["tensors"]`` or listed in
    ``source["skipped"]`` (name -> reason), else nothing is committed.
    """

    items: Iterator[writer.HostItem]
    source: dict[str, Any]
    total_params: int
    source_tensors: Collection[str] | None = None


#: torch's Adam moments and their place in the output tree (the contract's ``opt_state/mu|nu``),
#: whichever framework saved them.
ADAM_TREES: dict[str, tuple[str, ...]] = {
    "exp_avg": ("opt_state", "mu"),
    "exp_avg_sq": ("opt_state", "nu"),
}

# The importer contract (docs/FORMAT.md, section 2.6): the output tree of every importer, and the manifest role of each part.
_ROLES: dict[tuple[str, ...], tuple[str, str | None]] = {
    ("params",): ("param", None),
    ("model_params",): ("param", "model"),
    ("opt_state", "mu"): ("opt_state", "mu"),
    ("opt_state", "nu"): ("opt_state", "nu"),
    ("opt_state", "count"): ("opt_state", "count"),
}


@dataclasses.dataclass(frozen=True)
class Share:
    """This process's part of an import run by several processes (``convert(...,
    distributed=True)``, ``jax-ucp convert --processes N``): every ``count``-th parameter from
    ``index`` on, in the importer's own order; items that are not per parameter (the step) go to
    index 0. Each process reads only its parameters' bytes."""

    index: int = 0
    count: int = 1

    def __post_init__(self):
        if not 0 <= self.index < self.count:
            raise RequestError(f"Share index {self.index} is not in [0, {self.count})")

    def pick(self, names):
        """This process's parameters of ``names`` (round-robin over their order)."""
        return list(names)[self.index :: self.count]

    @property
    def primary(self) -> bool:
        return self.index == 0


WHOLE = Share()


@dataclasses.dataclass(frozen=True)
class ImportOptions:
    """What every importer takes; a format with options of its own subclasses it
    (``DeepSpeedOptions``, ``MegatronOptions``, ``OrbaxOptions``).

    Attributes:
        spec: a UCP-language spec (``Spec``, shipped name or TOML path) with import rules /
            settings.
        weights_only: the model weights alone; the optimizer state is skipped (and listed under
            ``source["skipped"]``).
        share: this process's part of an import run by several processes.
    """

    spec: Any = None
    weights_only: bool = False
    share: Share = WHOLE


@dataclasses.dataclass(frozen=True)
class TaggedOptions(ImportOptions):
    """``ImportOptions`` and which checkpoint of a folder holding several: the options of the
    formats that name one (``DeepSpeedOptions``, ``OrbaxOptions``), defined once.

    Attributes:
        tag: DeepSpeed: the tag folder (``global_step2``; None: the one ``latest`` names);
            Orbax: the step of a CheckpointManager directory (None: the latest committed one).
    """

    tag: str | int | None = None


@dataclasses.dataclass(frozen=True)
class Detection:
    """An importer's answer to "is this source a checkpoint of your format?", and why either
    way: a source no importer claims is an error giving every importer's reason.

    Attributes:
        found: the source holds this format's files.
        reason: what was found, or what is missing.
        weak: found by files other formats' folders hold too (a ``.bin``, a ``.safetensors``
            in a folder): a format found by its own markers comes first.
    """

    found: bool
    reason: str
    weak: bool = False


@dataclasses.dataclass(frozen=True)
class Importer:
    """One source layout: how its checkpoints are recognised and imported. A format of several
    layouts (torch: DCP, torch.save files, torchtune, ...) has one importer per layout, each
    naming the format; a format of one layout is its own.

    Attributes:
        name: the layout's name (``torch_dcp``; the format's name for a format of one layout).
        detect: ``detect(storage)``: whether the ``Storage`` the source's entry chose
            (``store.storage_for``, once) holds this layout, and why (not).
        plan: ``plan(storage, options)``: the checked import, as an ``ImportPlan``.
        options: the format's options class (``ImportOptions`` or a subclass).
        format: the format it is a layout of (``format=``, ``--from``, what detection reports;
            "": its name). Of a format's layouts that find a source, the first listed plans it.
        outranks: formats whose claim on the same source this one's overrides, for shared
            marker names (verl's run root holds Megatron-LM's tracker file and DeepSpeed-like
            ``global_step_N/`` folders).
        takes_over: formats whose claim this importer takes over when its ``detect`` finds the
            source too and the optimizer state is wanted (not ``weights_only``): their importer
            reads the weights, this one the optimizer state beside them as well. Such an
            importer claims no source of its own.
        given: with its format given by name (``--from torch``), whether this layout reads a
            source (None: when ``detect`` finds it); torch DCP reads megatron-core's
            torch_dist folders as plain DCP then, which detection leaves to Megatron.
        hands_over: ``hands_over(storage)``: (format, folder, record) when it is this
            layout around another format's checkpoint (verl's Megatron backend: megatron-core's
            ``dist_ckpt/``): that format's importer reads the folder, ``record`` joins its
            source record; None otherwise.
        run: ``run(root)``: the steps of a run root (its ``Storage``, read through it) of the
            trainers that save this layout (a Trainer's ``checkpoint-N``, DeepSpeed's tags,
            ...) and which completed (:mod:`~jax_ucp._src.importers.runs`); None when it is no
            such root, or the layout has none.
        model_names: whether the layout keys tensors by a torch model's ``state_dict()`` names
            (transformers' fused experts), not by the files' names a spec reads by default.
    """

    name: str
    detect: Callable[[Storage], Detection]
    plan: Callable[[Storage, Any], ImportPlan]
    options: type[ImportOptions]
    format: str = ""
    outranks: tuple[str, ...] = ()
    takes_over: tuple[str, ...] = ()
    given: Callable[[Storage], bool] | None = None
    hands_over: Callable[[Storage], tuple[str, Storage, dict[str, Any]] | None] | None = None
    run: Callable[[Storage], TrainerRun | None] | None = None
    model_names: bool = False

    def __post_init__(self):
        if not self.format:
            object.__setattr__(self, "format", self.name)


def listed(folder: Storage) -> list[str] | None:
    """The entries of ``folder`` (a remote folder's nested objects by their first part), None
    when it is no folder."""
    try:
        return sorted({name.split("/", 1)[0] for name in folder.names()})
    except OSError:
        return None


def refuse_spec(spec: Any, keeps: str, error: type[Exception] = RequestError) -> None:
    """Refuses a spec given to an import that keeps the source's names (``keeps`` says which):
    a spec maps them at restore time, not at import.

    Args:
        spec: the spec given (None passes).
        keeps: which names the import keeps, for the error.
        error: the exception class raised.
    """
    if spec is not None:
        raise error(
            f"{keeps}; apply a spec at restore time (jax_ucp.restore(path, spec=...)) instead "
            f"of at import."
        )


def host_item(key: tuple[str, ...], value: Any, provenance: dict) -> writer.HostItem:
    """``value`` at ``key`` with the role its place in the output tree means.

    ``params/<name>`` is a parameter (fp32 master), ``model_params/<name>`` its model-precision
    copy (sub-role "model"), ``opt_state/mu|nu/<name>`` Adam's moments, ``opt_state/count`` the
    step; anything else is "other".

    Args:
        key: the key path in the output tree.
        value: the array or scalar.
        provenance: where it was read (files, tensors, pattern).
    """
    role, sub_role = _ROLES.get(tuple(key[:2])) or _ROLES.get(tuple(key[:1]), ("other", None))
    return writer.HostItem(key, value, role=role, sub_role=sub_role, provenance=provenance)


def count_item(step: int, provenance: dict) -> writer.HostItem:
    """``opt_state/count``: the optimizer's step as the int32 scalar optax counts in.

    Args:
        step: the step (every rank and parameter agreeing: :func:`agreed_step`).
        provenance: where it was read (files, pattern, tensors or values).
    """
    return host_item(("opt_state", "count"), np.asarray(step, np.int32), provenance)


def jsonable(value: Any) -> Any:
    """A hyper-parameter as JSON: tuples as lists, 0-d tensors as numbers, the rest as text."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if np.isfinite(value) else str(value)
    if isinstance(value, np.ndarray) and value.size == 1:
        return jsonable(value.reshape(()).item())
    if isinstance(value, np.generic):
        return jsonable(value.item())
    return str(value)[:200]


def agreed_step(
    found: Mapping[float, str], where: str, *, recorded_by: str, error: type[Exception]
) -> int:
    """The optimizer step every rank and parameter group recorded, as an int32 count. Two steps
    mean files of different runs or saves were mixed.

    Args:
        found: each step seen -> where it was first seen, phrased to follow the number ("in
            rank_0.pt group 0", "(group 1)").
        where: the checkpoint, for the error.
        recorded_by: who disagrees, for the error ("ranks", "parameter groups").
        error: the error class to raise.
    """
    if not found:
        raise error(f"{where}: no optimizer step recorded in any group")
    if len(found) > 1:
        raise error(
            f"{where}: {recorded_by} disagree on the optimizer step: "
            + ", ".join(f"{step:g} {place}" for step, place in found.items())
        )
    (step,) = found
    if step != int(step) or not 0 <= step < 2**31:
        raise error(f"{where}: optimizer step {step} is not a valid int32 count")
    return int(step)


# --------------------------------------------------------------------------- accounting

#: ``source["skipped"]``: source tensor name -> why it is not imported (docs/FORMAT.md 2.2.1).
SKIPPED = "skipped"
#: ``provenance["tensors"]``: the source tensors an output tensor was built from.
TENSORS = "tensors"
#: ``provenance["values"]``: what an output tensor was built from when that is no source tensor
#: (a pickled object, or a field such as Megatron's ``param_groups`` step): named, not counted.
VALUES = "values"

#: Names of optimizer state, never the name of a model weight: an output key under ``params/``
#: or ``model_params/`` matching this is an optimizer buffer mistaken for a weight.
OPTIMIZER_NAME = re.compile(
    r"(?:^|[._/])(?:exp_avg(?:_sq)?|optimizer|fp32_from_fp16(?:_params)?|param_state|"
    r"momentum_buffer|gbuf_idx_[0-9]+|bucket_idx_[0-9]+|dp_group_idx_[0-9]+)(?:$|[._/])"
)


def tensor_names(obj: Any, prefix: str = "") -> Iterator[str]:
    """The dotted paths of every array inside a loaded state dict (nested dicts, lists, tuples):
    ``{"a": {"b": [t0, t1]}}`` gives ``a.b.0``, ``a.b.1``. How importers of pickled state dicts
    name their source tensors, so each can be accounted for."""
    if isinstance(obj, np.ndarray):
        yield prefix
    elif isinstance(obj, (Mapping, list, tuple)):
        for key, value in obj.items() if isinstance(obj, Mapping) else enumerate(obj):
            yield from tensor_names(value, f"{prefix}.{key}" if prefix else str(key))


def skip(source: dict[str, Any], names, reason: str) -> None:
    """Lists ``names`` in ``source["skipped"]`` with ``reason`` (the first reason given stays).

    Args:
        source: the manifest's source record.
        names: the source tensors not imported.
        reason: why.
    """
    skipped = source.setdefault(SKIPPED, {})
    for name in names:
        skipped.setdefault(name, reason)


def accounted(plan: ImportPlan, where: str, *, whole: bool = True) -> Iterator[writer.HostItem]:
    """``plan.items``, held to the accounting rule before the writer may commit.

    Every source tensor must be imported (named by an item's ``provenance["tensors"]``) or
    skipped with a reason; an item may only name tensors the importer found; nothing under
    ``params/`` or ``model_params/`` may be named like optimizer state. Raised after the last
    item (the writer commits only once the stream ends), naming the tensors.

    Args:
        plan: the importer's plan.
        where: the checkpoint, for the error.
        whole: check the whole import (False: one process's share, each item checked alone:
            the other processes import the rest).
    """
    if plan.source_tensors is None:  # an importer not yet reporting its tensors
        yield from plan.items
        return
    found = set(plan.source_tensors)
    skipped = plan.source.get(SKIPPED) or {}
    bad_skips = sorted(n for n, why in skipped.items() if n not in found or not why)
    if bad_skips:
        raise SourceError(
            f"{where}: the import's record of what it leaves out (source.skipped lists "
            f"{_few(bad_skips)}) names tensors the checkpoint does not hold, or gives no reason; "
            f"nothing was committed. jax_ucp does not handle this layout correctly: please "
            f"report it"
        )
    imported: set[str] = set()
    for item in plan.items:
        if item.key[:1] in (("params",), ("model_params",)) and any(
            OPTIMIZER_NAME.search(part) for part in item.key[1:]
        ):
            raise SourceError(
                f"{where}: output tensor {keypath.key_to_str(item.key)!r} is named like optimizer "
                f"state, not a model weight; refusing to write it under {item.key[0]!r}"
            )
        names = (item.provenance or {}).get(TENSORS)
        if not names and not (item.provenance or {}).get(VALUES):
            raise SourceError(
                f"{where}: the import cannot say which entries of the checkpoint "
                f"{keypath.key_to_str(item.key)!r} would be built from, so it cannot show that "
                f"nothing of the checkpoint is dropped; nothing was committed. jax_ucp does not "
                f"handle this layout correctly: please report it (with `jax-ucp inspect` of "
                f"the source, or its file names)"
            )
        names = names or []
        unknown = [n for n in names if n not in found]
        if unknown:
            raise SourceError(
                f"{where}: {keypath.key_to_str(item.key)!r} would be built from "
                f"{_few(unknown)}, which are not among the checkpoint's tensors; nothing was "
                f"committed. jax_ucp does not handle this layout correctly: please report it"
            )
        both = [n for n in names if n in skipped]
        if both:
            raise SourceError(
                f"{where}: {keypath.key_to_str(item.key)!r} would be built from {_few(both)}, "
                f"which the import also lists as not imported (source.skipped); nothing was "
                f"committed. jax_ucp does not handle this layout correctly: please report it"
            )
        imported.update(names)
        yield item
    lost = sorted(found - imported - set(skipped))
    if lost and whole:
        raise SourceError(
            f"{where}: {len(lost)} of the checkpoint's {len(found)} tensors have no place in "
            f"the import and no reason to be left out: {_few(lost)}. Nothing was committed "
            f"(an import takes every tensor or says why not). The checkpoint holds state this "
            f"importer does not know where to put; if it is a standard layout, please report it"
        )


def _few(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n[:200]) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def trainer_checkpoints(src: str) -> list[str]:
    """The ``checkpoint-N`` folders of a Hugging Face Trainer output directory, by step."""
    return list(numbered_steps(src, rf"checkpoint-({files.DIGITS})", os.path.isdir).values())
