"""The importers, one per source format, and which one a source is for.

Each format's package exposes ``detect(path)`` (a :class:`Detection`: its files are there, or
why not) and ``plan(path, options)`` with typed options (:class:`ImportOptions` or the format's
subclass); this module holds them in the order detection asks them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from jax_ucp._src.errors import RequestError, SourceError
from jax_ucp._src.importers import deepspeed, megatron, orbax, safetensors, torch, verl
from jax_ucp._src.importers.plan import (
    WHOLE,
    Detection,
    ImportOptions,
    ImportPlan,
    Share,
    accounted,
    trainer_checkpoints,
)
from jax_ucp._src.importers.torch.files import has_torch_optimizer, plan_torch_files
from jax_ucp._src.importers.torch.olmo_core import step_folders


@dataclasses.dataclass(frozen=True)
class Importer:
    """One source format: how its checkpoints are recognised and imported.

    Attributes:
        name: the format's name (``format=``, ``--from``).
        detect: ``detect(path)``: whether ``path`` holds this format, and why (not).
        plan: ``plan(path, options)``: the checked import, as an ``ImportPlan``.
        options: the format's options class (``ImportOptions`` or a subclass).
        outranks: formats whose claim on the same source this one's overrides, for shared
            marker names (verl's run root holds Megatron-LM's tracker file and DeepSpeed-like
            ``global_step_N/`` folders).
    """

    name: str
    detect: Callable[[str], Detection]
    plan: Callable[[str, Any], ImportPlan]
    options: type[ImportOptions]
    outranks: tuple[str, ...] = ()


# In the order detection asks them: the first claim by a format's own markers wins, else the
# first weak claim (a folder of .safetensors, of .bin / .pt files).
IMPORTERS: dict[str, Importer] = {
    importer.name: importer
    for importer in (
        Importer("safetensors", safetensors.detect, safetensors.plan, torch.TorchOptions),
        Importer("torch", torch.detect, torch.plan, torch.TorchOptions),
        Importer("orbax", orbax.detect, orbax.plan, orbax.OrbaxOptions),
        Importer(
            "verl", verl.detect, verl.plan, verl.VerlOptions, outranks=("megatron", "deepspeed")
        ),
        Importer("megatron", megatron.detect, megatron.plan, megatron.MegatronOptions),
        Importer("deepspeed", deepspeed.detect, deepspeed.plan, deepspeed.DeepSpeedOptions),
    )
}
FORMATS = tuple(sorted(IMPORTERS))
#: every import option some format takes (``share`` is the registry's, not the caller's)
OPTION_FIELDS = tuple(
    sorted({f.name for i in IMPORTERS.values() for f in dataclasses.fields(i.options)} - {"share"})
)
# the importers' options classes and their bases (what ``import_options`` may build)
_OPTION_CLASSES: tuple[type[ImportOptions], ...] = tuple(
    dict.fromkeys(
        cls
        for importer in IMPORTERS.values()
        for cls in importer.options.__mro__
        if isinstance(cls, type) and issubclass(cls, ImportOptions)
    )
)


def detect_format(src) -> str:
    """'deepspeed', 'megatron', 'orbax', 'safetensors', 'torch' (torch DCP or torch.save
    files) or 'verl', from the files a path holds (none is unpickled). A source no importer claims is an
    error giving each importer's reason."""
    src = os.fspath(src)
    refused: dict[str, str] = {}
    weak: list[str] = []
    strong: dict[str, str] = {}
    for name, importer in IMPORTERS.items():
        answer = importer.detect(src)
        if answer.found and not answer.weak:
            strong[name] = answer.reason
        elif answer.found:
            weak.append(name)
        else:
            refused[name] = answer.reason
    for name in list(strong):
        for other in IMPORTERS[name].outranks if name in strong else ():
            if strong.pop(other, None) is not None:
                refused[other] = f"outranked by {name} ({strong[name]})"
    if len(strong) > 1:  # two checkpoints in one folder: importing one would drop the other
        found = "; ".join(f"{name} ({reason})" for name, reason in strong.items())
        raise SourceError(
            f"{src}: holds checkpoints of {len(strong)} formats: {found}. Pick one with "
            f"`--from {'|'.join(strong)}` (`format=` in Python)."
        )
    if strong:
        return next(iter(strong))
    if weak:
        return weak[0]
    if not os.path.isdir(src):
        raise SourceError(
            f"{src}: not a directory (expected a checkpoint folder, or a .safetensors, .bin, "
            f".pt, .pth or .ckpt file)."
        )
    for runs, what in (
        (trainer_checkpoints(src), "a Hugging Face Trainer output directory"),
        (step_folders(src), "an OLMo-core save folder"),
    ):
        if runs:
            raise SourceError(
                f"{src}: {what} with {len(runs)} checkpoints: {', '.join(runs)}. Convert one of "
                f"them (e.g. {os.path.join(src, runs[-1])})."
            )
    found = sorted(os.listdir(src))
    listing = ", ".join(found[:12]) + (f", ... ({len(found)} entries)" if len(found) > 12 else "")
    tried = "; ".join(f"{name}: {reason}" for name, reason in refused.items())
    raise SourceError(
        f"{src}: cannot tell the checkpoint format; it holds: {listing or 'nothing'}. Tried "
        f"{tried}. Use `--from {'|'.join(FORMATS)}` (`format=` in Python) to force one."
    )


def handed_over(source, checkpoint_format: str, options: ImportOptions) -> ImportPlan | None:
    """The plan of a source one format claims and another format's importer reads whole, or
    None: safetensors weights beside a torch optimizer (a Trainer ``checkpoint-N/``,
    Accelerate's ``save_state``) are the torch files importer's, which maps the optimizer's
    state too, unless only weights are wanted. Decided here: format packages never import
    each other.

    Args:
        source: the checkpoint directory.
        checkpoint_format: the format detected or given for it.
        options: the import options (the torch files importer reads its fields).
    """
    if checkpoint_format != "safetensors" or options.weights_only:
        return None
    if not has_torch_optimizer(source):
        return None
    assert isinstance(options, torch.TorchOptions)
    return plan_torch_files(
        source,
        spec=options.spec,
        weights_only=options.weights_only,
        share=options.share,
        parameter_order=options.parameter_order,
        model_config=None if options.model_config is None else os.fspath(options.model_config),
    )


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _takers(field: str) -> str:
    """The formats whose options take ``field``, for an error."""
    return " and ".join(name for name, i in IMPORTERS.items() if field in _fields(i.options))


def importer_options(importer: Importer, **fields: Any) -> ImportOptions:
    """``importer``'s typed options from ``fields``; a field given (not None) that this format
    does not take is an error naming the formats that take it."""
    known = _fields(importer.options)
    for field, value in fields.items():
        if value is not None and field not in known:
            raise RequestError(
                f"{field}= applies to {_takers(field)} checkpoints, not to {importer.name} ones"
            )
    return importer.options(**{k: v for k, v in fields.items() if k in known and v is not None})


def import_options(format: str | None = None, **fields: Any) -> ImportOptions:
    """The import options built where a caller gives them as keywords (``convert``'s, the CLI's
    flags): ``format``'s options class, or without a format the most general class that takes
    every field given (``ImportOptions`` for ``spec``/``weights_only``, ``TaggedOptions`` for
    ``tag``, ...), which planning specialises to the format detected. Fields given as None
    are not given.

    Args:
        format: one of ``FORMATS``, or None (not known yet: the files decide when planning).
        **fields: fields of the importers' options classes (``OPTION_FIELDS``).
    """
    given = {k: v for k, v in fields.items() if v is not None}
    if format is not None:
        return importer_options(_importer(format), **given)
    fitting = [cls for cls in _OPTION_CLASSES if set(given) <= _fields(cls)]
    if not fitting:
        takers = "; ".join(f"{field}= applies to {_takers(field)}" for field in given)
        raise RequestError(
            f"{', '.join(f'{k}=' for k in given)}: options of different formats ({takers})"
        )
    return min(fitting, key=lambda cls: (len(_fields(cls)), len(cls.__mro__)))(**given)


def for_format(importer: Importer, options: ImportOptions | None) -> ImportOptions:
    """The options ``importer.plan`` takes: ``options`` itself when of its class, else (a
    general class built before the format was known) its fields in the format's class; a field
    given (not None) that the format does not take is an error naming the formats that take it."""
    if options is None:
        return importer.options()
    if isinstance(options, importer.options):
        return options
    return importer_options(importer, **{f: getattr(options, f) for f in _fields(type(options))})


def _importer(checkpoint_format: str) -> Importer:
    importer = IMPORTERS.get(checkpoint_format)
    if importer is None:
        raise SourceError(
            f"Unknown checkpoint format {checkpoint_format!r} (expected "
            f"{', '.join(repr(name) for name in FORMATS)})."
        )
    return importer


def plan_import(
    source, options: ImportOptions | None = None, *, format: str | None = None, share: Share = WHOLE
) -> ImportPlan:
    """The import of ``source`` by the importer of its format (detected unless given), its items
    held to the accounting rule (:func:`plan.accounted`): every tensor of the checkpoint is
    imported or listed in ``source["skipped"]`` with a reason, or nothing is committed.

    Args:
        source: the checkpoint directory (or file).
        options: the import options (the format's class, or a more general one such as
            ``ImportOptions(weights_only=True)``: see :func:`for_format`; None: the defaults).
        format: one of ``FORMATS`` (None: detected from the files).
        share: this process's part of a distributed import.

    Returns:
        The checked plan, its items accounted for.
    """
    checkpoint_format = format or detect_format(source)
    importer = _importer(checkpoint_format)
    options = for_format(importer, options)
    if share != WHOLE:
        options = dataclasses.replace(options, share=share)
    plan = handed_over(source, checkpoint_format, options)
    if plan is None:
        plan = importer.plan(source, options)
    items = accounted(
        plan, f"{os.fspath(source)} ({checkpoint_format})", whole=options.share.count == 1
    )
    return dataclasses.replace(plan, items=items)
