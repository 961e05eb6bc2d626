"""The importers, one per source layout, and which one a source is for.

Each importer (:class:`~jax_ucp._src.importers.plan.Importer`) has ``detect(path)`` (a
:class:`Detection`: its files are there, or why not) and ``plan(path, options)`` with its
format's typed options (:class:`ImportOptions` or a subclass). A format of one layout is one
importer (``deepspeed``); the torch format is several (its package's ``LAYOUTS``: torch DCP,
torch.save files, torchtune, ...), each its own entry here, asked once with the others. This
module holds them in the order detection asks them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from jax_ucp._src import store
from jax_ucp._src.errors import RequestError, SourceError
from jax_ucp._src.importers import deepspeed, megatron, orbax, safetensors, torch, verl
from jax_ucp._src.importers.deepspeed.files import deepspeed_run
from jax_ucp._src.importers.megatron.dcp import open_dcp, parsed_once
from jax_ucp._src.importers.megatron.source import megatron_run
from jax_ucp._src.importers.orbax.layout import orbax_run
from jax_ucp._src.importers.plan import (
    WHOLE,
    Detection,
    Importer,
    ImportOptions,
    ImportPlan,
    Share,
    accounted,
    listed,
)
from jax_ucp._src.importers.runs import TrainerRun
from jax_ucp._src.importers.verl.layout import verl_run
from jax_ucp._src.store.storage import Storage, base

# In the order detection asks them: the first claim by a format's own markers wins, else the
# first weak claim (a folder of .safetensors, of .bin / .pt files).
IMPORTERS: dict[str, Importer] = {
    importer.name: importer
    for importer in (
        Importer("safetensors", safetensors.detect, safetensors.plan, torch.TorchOptions),
        *torch.LAYOUTS,
        Importer("orbax", orbax.detect, orbax.plan, orbax.OrbaxOptions, run=orbax_run),
        Importer(
            "verl",
            verl.detect,
            verl.plan,
            verl.VerlOptions,
            outranks=("megatron", "deepspeed"),
            # megatron's reading of the .metadata tells verl's bridge mode (no model tensor)
            hands_over=lambda s: verl.megatron_backend(s, lambda d: open_dcp(d).tensors),
            run=verl_run,
        ),
        Importer(
            "megatron", megatron.detect, megatron.plan, megatron.MegatronOptions, run=megatron_run
        ),
        Importer(
            "deepspeed",
            deepspeed.detect,
            deepspeed.plan,
            deepspeed.DeepSpeedOptions,
            run=deepspeed_run,
            model_names=True,  # DeepSpeed saves the model's named_parameters
        ),
    )
}
#: the formats (``format=``, ``--from``): what detection reports
FORMATS = tuple(sorted({importer.format for importer in IMPORTERS.values()}))


@dataclasses.dataclass(frozen=True)
class Against:
    """How ``verify(against=)`` reads a source tensor with its framework's own loader
    (:mod:`jax_ucp._src.against`): ``loader`` (``ranks``: every rank file's piece; ``zero``:
    DeepSpeed's; ``file``; ``dcp``; ``recorded_dcp``: where the recorded path puts it) for a
    provenance whose pattern is ``read`` ("": none; None: any; another: built by the import);
    ``sep`` parts a source tensor's name into file and key; ``rank`` finds a file's rank."""

    loader: str
    read: str | None = ""
    sep: str = ""
    rank: str = ""


#: How ``verify(against=)`` reads a tensor, by the format its provenance (else source) records
AGAINST = {
    "verl": Against("ranks", sep="/", rank=r"_rank_([0-9]+)\.pt\Z"),
    "torch_checkpointing": Against("ranks", rank=r"_([0-9]+)\.pt\Z"),  # item:key, its files
    "deepspeed": Against("zero", read=None, sep=":"),
    "torch_dcp": Against("dcp"),
    "torch_dist": Against("recorded_dcp", read="torch_dist-global"),  # megatron-core's
    "fsdp_dtensor": Against("recorded_dcp", read="torch_dist-global"),  # megatron-core's
    "torch_files": Against("file", read=None, sep=":"),
    "safetensors": Against("file", read=None, sep=":"),
}


def _layouts(checkpoint_format: str) -> list[Importer]:
    """The importers of a format that claim sources (not those that take claims over), in
    the order they are asked."""
    return [i for i in IMPORTERS.values() if i.format == checkpoint_format and not i.takes_over]


@contextlib.contextmanager
def _opened(storage: Storage) -> Iterator[Storage]:
    """``storage``, listed once while its importer is chosen and planned; a listing naming an
    object no folder holds refused before any importer reads it (``Storage.check_listing``)."""
    with base.listed_once():
        storage.check_listing()
        yield storage


@dataclasses.dataclass(frozen=True)
class Unclaimed:
    """No importer claims the source (not a format's file gone wrong, nor two formats): the
    detectors' report, so that no caller asks again: ``message`` says what each found, ``run``
    the run root the source is (its steps: which to convert), or None."""

    message: str
    run: TrainerRun | None = None

    def error(self) -> SourceError:
        """The report as the error of a caller that needs an importer."""
        return SourceError(self.message)


def claim(
    storage: Storage, format: str | None = None, options: ImportOptions | None = None
) -> Importer | Unclaimed:
    """The importer reading ``storage`` (as :func:`importer_for`), or the :class:`Unclaimed`
    report when detection finds none: the one question a restore's open stage asks."""
    if format in IMPORTERS and options is None:
        return IMPORTERS[format]
    with _opened(storage) as src:
        claimed, answers = _claimed(src, format)
        if isinstance(claimed, Unclaimed) or options is None:
            return claimed
        return taken_over(src, claimed, options, answers)


def _detected(storage: Storage) -> tuple[Importer | Unclaimed, dict[str, Detection]]:
    """(the importer claiming ``storage`` or why none does, every importer's answer: takers'
    too)."""
    src = storage.root
    refused: dict[str, str] = {}
    weak: dict[str, Importer] = {}  # format -> its first layout that finds src
    strong: dict[str, Importer] = {}
    reasons: dict[str, str] = {}
    answers = {name: importer.detect(storage) for name, importer in IMPORTERS.items()}
    for name, importer in IMPORTERS.items():
        answer, fmt = answers[name], importer.format
        if not answer.found:
            refused[name] = answer.reason
        elif not importer.takes_over and fmt not in strong and fmt not in weak:
            # the format's first layout that finds src plans it; the format claims strongly
            # when any of its layouts does
            reasons[fmt] = answer.reason
            mine = [answers[i.name] for i in _layouts(fmt)]
            (weak if all(a.weak for a in mine if a.found) else strong)[fmt] = importer
    for fmt in list(strong):
        for other in strong[fmt].outranks if fmt in strong else ():
            if strong.pop(other, None) is not None:
                refused[other] = f"outranked by {fmt} ({reasons[fmt]})"
    if len(strong) > 1:  # two checkpoints in one folder: importing one would drop the other
        found = "; ".join(f"{fmt} ({reasons[fmt]})" for fmt in strong)
        raise SourceError(
            f"{src}: holds checkpoints of {len(strong)} formats: {found}. Pick one with "
            f"`--from {'|'.join(strong)}` (`format=` in Python)."
        )
    if strong or weak:
        return next(iter((strong or weak).values())), answers
    found = listed(storage)
    if found is None:
        return Unclaimed(
            f"{src}: not a directory (expected a checkpoint folder, or a .safetensors, .bin, "
            f".pt, .pth or .ckpt file)."
        ), answers
    run = trainer_run(storage)  # a run root of checkpoints (``Importer.run``): which to convert
    if run is not None:
        names = ", ".join(step.path.rpartition("/")[2] for step in reversed(run.steps))
        return Unclaimed(
            f"{src}: {run.what} with {len(run.steps)} checkpoints: {names}. Convert one of them "
            f"(e.g. {run.steps[0].path}).",
            run,
        ), answers
    listing = ", ".join(found[:12]) + (f", ... ({len(found)} entries)" if len(found) > 12 else "")
    tried = "; ".join(f"{name}: {reason}" for name, reason in refused.items())
    return Unclaimed(
        f"{src}: cannot tell the checkpoint format; it holds: {listing or 'nothing'}. Tried "
        f"{tried}. Use `--from {'|'.join(FORMATS)}` (`format=` in Python) to force one."
    ), answers


def trainer_run(root: Storage) -> TrainerRun | None:
    """The run root ``root`` of a torch trainer (a Trainer's ``output_dir``, torchtitan's
    ``checkpoint/``, a DeepSpeed ``save_dir``, a Megatron or verl save root): its steps, newest
    first, each with why its save did not complete; the first importer's listing that finds
    step folders in it (``Importer.run``), None when none does."""
    listings = dict.fromkeys(i.run for i in IMPORTERS.values() if i.run)
    return next((run for listing in listings if (run := listing(root)) is not None), None)


def detect_format(src) -> str:
    """The format (one of ``FORMATS``) a path's files hold (:func:`importer_for`)."""
    return importer_for(src).format


def importer_for(
    source, format: str | None = None, options: ImportOptions | None = None
) -> Importer:
    """The importer that reads ``source``: detected (``format`` None: from the files it holds,
    none unpickled; of a format's layouts that find it, the first; a format claiming by its own
    markers before one claiming weakly; none claiming it is an error giving each one's reason),
    the one named
    (``IMPORTERS``' names), or of a format of several layouts the first that reads the source
    (its ``given``, else its ``detect``; none: the last, which plans and says what is missing:
    ``--from torch`` on a folder no torch layout reads is read as torch.save files).

    Args:
        source: the checkpoint directory (or file).
        format: one of ``FORMATS`` or ``IMPORTERS``' names, or None (detected).
        options: given, the importer that reads the source whole with them (a taker's,
            :func:`taken_over`, told by the same detection: no detector is asked twice), to
            hand to :func:`plan_import` as its ``format``; None: the one claiming it.
    """
    found = claim(store.storage_for(source), format, options)
    if isinstance(found, Unclaimed):
        raise found.error()
    return found


def _claimed(storage: Storage, format: str | None) -> tuple[Importer | Unclaimed, dict | None]:
    """(the importer ``importer_for`` gives, the detection's answers when it detected)."""
    if format is None:
        return _detected(storage)
    if format in IMPORTERS:
        return IMPORTERS[format], None
    layouts = _layouts(format)
    if not layouts:
        raise SourceError(
            f"Unknown checkpoint format {format!r} (expected "
            f"{', '.join(repr(name) for name in FORMATS)})."
        )
    return _layout_reading(storage, layouts), None


def _layout_reading(src: Storage, layouts: list[Importer]) -> Importer:
    def reads(layout: Importer) -> bool:
        return layout.given(src) if layout.given is not None else layout.detect(src).found

    return next((layout for layout in layouts if reads(layout)), layouts[-1])


def taken_over(
    src: Storage, importer: Importer, options: ImportOptions, answers: dict | None = None
) -> Importer:
    """The importer that reads ``source`` whole: one whose ``takes_over`` names ``importer``'s
    format and whose ``detect`` finds the source too (safetensors weights beside a torch
    optimizer: the torch format's ``hf_trainer``, which maps the optimizer's state too), unless
    only weights are wanted; else ``importer``. Format packages never import each other: their
    importers say what they take over, this module hands it over.

    Args:
        src: the checkpoint directory's storage.
        importer: the importer detected or named for it.
        options: the import options (their ``weights_only``).
        answers: the takers' ``detect`` answers when the source was detected (None: asked).
    """
    if options.weights_only:
        return importer
    takers = [t for t in IMPORTERS.values() if t.takes_over]
    finds = (lambda t: answers[t.name]) if answers is not None else (lambda t: t.detect(src))
    found = (t for t in takers if importer.format in t.takes_over and finds(t).found)
    return next(found, importer)


def _takers(field: str) -> str:
    """The formats whose options take ``field``, for an error."""
    formats = dict.fromkeys(i.format for i in IMPORTERS.values() if field in _fields(i.options))
    return " and ".join(formats)


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def importer_options(importer: Importer, **fields: Any) -> ImportOptions:
    """``importer``'s typed options from ``fields`` (``convert``'s keywords, the CLI's flags,
    once the format is known); a field given (not None) that this format does not take is an
    error naming the formats that take it."""
    known = _fields(importer.options)
    for field, value in fields.items():
        if value is not None and field not in known:
            raise RequestError(
                f"{field}= applies to {_takers(field)} checkpoints, not to {importer.format} ones"
            )
    return importer.options(**{k: v for k, v in fields.items() if k in known and v is not None})


def for_format(importer: Importer, options: ImportOptions | None) -> ImportOptions:
    """The options ``importer.plan`` takes: ``options`` itself when of its class, else (a
    general class such as ``ImportOptions(weights_only=True)``) its fields in the format's
    class; a field given (not None) that the format does not take is an error naming the
    formats that take it."""
    if options is None:
        return importer.options()
    if isinstance(options, importer.options):
        return options
    return importer_options(importer, **{f: getattr(options, f) for f in _fields(type(options))})


def plan_import(
    source,
    options: ImportOptions | None = None,
    *,
    format: str | Importer | None = None,
    share: Share = WHOLE,
) -> ImportPlan:
    """The import of ``source`` by its importer (detected unless ``format`` names it), its
    items held to the accounting rule (:func:`plan.accounted`): every tensor of the checkpoint
    is imported or listed in ``source["skipped"]`` with a reason, or nothing is committed.

    Args:
        source: the checkpoint directory (or file).
        options: the import options (the format's class, or a more general one such as
            ``ImportOptions(weights_only=True)``: see :func:`for_format`; None: the defaults).
        format: one of ``FORMATS`` or ``IMPORTERS``' names (None: detected from the files),
            or the importer that reads the source whole (``importer_for`` with the options:
            planned as it is, no detector asked again).
        share: this process's part of a distributed import.

    Returns:
        The checked plan, its items accounted for.
    """
    storage = store.storage_for(source)  # chosen here unless given
    with _opened(storage) as src, parsed_once():  # verl hands over a parsed folder
        given = isinstance(format, Importer)  # takers already asked
        importer, answers = (format, None) if given else _claimed(src, format)
        if isinstance(importer, Unclaimed):
            raise importer.error()
        handed = importer.hands_over(src) if importer.hands_over else None
        if handed is not None:  # another format's checkpoint inside this layout
            importer, src = IMPORTERS[handed[0]], handed[1]
            answers = None  # asked of the folder around it
        options = for_format(importer, options)
        if share != WHOLE:
            options = dataclasses.replace(options, share=share)
        asked = given and handed is None
        reader = importer if asked else taken_over(src, importer, options, answers)
        plan = reader.plan(src, for_format(reader, options))
        plan.source.update(handed[2] if handed else {})
        items = accounted(
            plan, f"{storage.root} ({importer.format})", whole=options.share.count == 1
        )
    return dataclasses.replace(plan, items=items)
