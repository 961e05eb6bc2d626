"""Import DeepSpeed checkpoints: ZeRO 1/2/3 (fp32 / bf16 / fp16) and Megatron-DeepSpeed TP/PP.

The entry point of the DeepSpeed importers: finds the tag folder, dispatches on its layout
(:mod:`deepspeed.zero` for one model-parallel rank, :mod:`deepspeed.megatron` for a TP/PP grid)
and returns an :class:`ImportPlan` that :mod:`jax_ucp._src.conversion` streams into the writer, one
parameter at a time (its fp32 master, Adam moments, model-precision copy), so peak anonymous
memory is about one parameter, not the checkpoint. Files are read with :mod:`jax_ucp._src.torchfiles.torch_zip` (no
torch, no pickled code executed; tensors are memory-mapped).

Output tree (the importer contract, docs/FORMAT.md section 2.6): ``params`` = fp32 master weights keyed by DeepSpeed's
``param_shapes`` names, ``opt_state`` = {``mu``, ``nu`` (same keys), ``count`` (int32 step)},
``model_params`` = model-precision weights when the run was bf16/fp16.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any

from jax_ucp._src.errors import SourceError
from jax_ucp._src.importers.deepspeed import autoep, megatron, moe, universal, zero, zero0
from jax_ucp._src.importers.deepspeed.files import (
    DS_CLASSES,
    check_every_file_read,
    is_model_parallel,
    is_moe,
    is_tag_dir,
    listed,
    parse_once,
    resolve_tag_dir,
)
from jax_ucp._src.importers.deepspeed.megatron import MegatronDeepSpeedCheckpoint
from jax_ucp._src.importers.deepspeed.zero import DeepSpeedCheckpoint
from jax_ucp._src.importers.plan import (
    Detection,
    ImportOptions,
    ImportPlan,
    TaggedOptions,
    refuse_spec,
)
from jax_ucp._src.importers.trainer_files import (
    model_config,
    trainer_folder_above,
    trainer_record,
)
from jax_ucp._src.store.storage import Storage

__all__ = [
    "DS_CLASSES",
    "DeepSpeedCheckpoint",
    "DeepSpeedOptions",
    "MegatronDeepSpeedCheckpoint",
    "detect",
    "open_deepspeed_checkpoint",
    "plan",
]


def open_deepspeed_checkpoint(
    src: Storage, tag: str | None = None, *, spec: Any = None
) -> DeepSpeedCheckpoint | MegatronDeepSpeedCheckpoint:
    """Finds and validates the files of one checkpoint tag; tensors stay memory-mapped.

    A Megatron-DeepSpeed checkpoint with tensor/pipeline parallelism (several ``mp_rank_XX``
    ranks or ``layer_XX-model_YY`` files) gives a :class:`MegatronDeepSpeedCheckpoint`.

    Args:
        src: the checkpoint folder (``latest`` + tags) or one tag folder.
        tag: the tag to open instead of ``latest``.
        spec: import rules to use instead of ``universal_checkpoint_info``.
    """
    tag_dir = resolve_tag_dir(src, tag)
    if autoep.autoep_states(tag_dir) is not None:
        raise SourceError(f"{tag_dir.root}: a DeepSpeed AutoEP checkpoint: read it with convert")
    names = listed(tag_dir) or []
    if is_moe(names):
        return moe.open_moe_zero_checkpoint(tag_dir)[0]
    if is_model_parallel(names):
        return megatron.open_megatron_deepspeed_checkpoint(tag_dir, spec=spec)
    return zero.open_zero_checkpoint(tag_dir)


def _plan_training_checkpoint(tag_dir: Storage, options: ImportOptions) -> ImportPlan:
    spec, weights_only, share = options.spec, options.weights_only, options.share
    found = autoep.autoep_states(tag_dir)
    if found is not None:
        refuse_spec(spec, "convert: a DeepSpeed AutoEP checkpoint is imported raw")
        return autoep.plan_autoep(tag_dir, *found, options)
    names = listed(tag_dir) or []
    if is_moe(names):
        refuse_spec(
            spec,
            "convert: a DeepSpeed MoE checkpoint is imported raw (experts under their "
            "global names), so an import spec has nothing to do",
        )
        return moe.plan_moe(tag_dir, options)
    zero0_file = zero0.zero0_model_file(tag_dir)
    if zero0_file is not None:
        return zero0.plan_zero0(tag_dir, zero0_file, options)
    if is_model_parallel(names):
        # TP/PP fragments merged by the universal_checkpoint_info patterns (translated into the
        # UCP language), or by the import rules of ``spec``
        checkpoint = megatron.open_megatron_deepspeed_checkpoint(tag_dir, spec=spec)
        items = megatron.iter_megatron_deepspeed_items(checkpoint, share)
        source = megatron.source_info(checkpoint)
        found = megatron.megatron_deepspeed_tensors(checkpoint, source, weights_only=weights_only)
        if weights_only:
            items = (item for item in items if item.role != "opt_state")
        return ImportPlan(items, source, len(share.pick(checkpoint.names)), source_tensors=found)
    refuse_spec(
        spec,
        "convert: a ZeRO checkpoint (no tensor/pipeline parallelism) is imported raw, "
        "keyed by DeepSpeed's parameter names, so an import spec has nothing to do",
    )
    checkpoint = zero.open_zero_checkpoint(tag_dir)
    source = zero.zero_source_info(checkpoint)
    found = zero.zero_tensors(checkpoint, source, weights_only=weights_only)
    optimizer = None if weights_only else zero.torch_optimizer_record(checkpoint)
    if optimizer is not None:  # what optax_from_torch continues from
        source["optimizer"] = optimizer
    total = len(share.pick(checkpoint.names)) + len(share.pick(checkpoint.frozen))
    return ImportPlan(zero.iter_zero_items(checkpoint, options), source, total, found)


@dataclasses.dataclass(frozen=True)
class DeepSpeedOptions(TaggedOptions):
    """``ImportOptions`` and the tag folder to import (``tag``, None: the one ``latest``
    names)."""


# Files only DeepSpeed writes: a folder holding one is read as DeepSpeed.
MARKERS = (
    "latest",
    "latest_universal",
    "global_step*",
    "*mp_rank_*_model_states.pt",
    "*zero_pp_rank_*_optim_states.pt",
    "layer_*-model_*-model_states.pt",
)


def detect(storage: Storage) -> Detection:
    """Whether ``storage`` is a DeepSpeed checkpoint folder, from its entries' names (hidden ones
    aside, as ``glob`` leaves them)."""
    names = [n for n in listed(storage) or () if not n.startswith(".")]
    if not names and listed(storage) is None:
        return Detection(False, "not a directory")
    for pattern in MARKERS:
        if fnmatch.filter(names, pattern):
            return Detection(True, f"DeepSpeed files ({pattern})")
    return Detection(
        False,
        "no `latest`, `global_stepN/`, `mp_rank_XX_model_states.pt` (universal: "
        "`latest_universal`, `<tag>_universal/zero/`)",
    )


def plan(storage: Storage, options: DeepSpeedOptions) -> ImportPlan:
    """The import of a DeepSpeed checkpoint folder (``latest`` + tags, or ``options.tag``, or
    one tag folder); every file is found and checked before this returns. ``options.spec``:
    the import rules of a Megatron-DeepSpeed TP/PP checkpoint, instead of its
    ``universal_checkpoint_info``; ``weights_only``: the fp32 masters, or the module's weights
    of a ZeRO-0 checkpoint.

    A universal checkpoint (``ds_to_universal``'s output or ``jax-ucp export --to
    deepspeed-universal``'s: its ``<tag>_universal`` folder, or a folder whose
    ``latest_universal`` names it) is read by :mod:`deepspeed.universal`.
    """
    tag = None if options.tag is None else str(options.tag)
    universal_dir = universal.universal_tag_dir(storage, tag)
    if universal_dir is not None:
        return universal.plan_universal(universal_dir, options)
    tag_dir = resolve_tag_dir(storage, tag)
    with parse_once():  # AutoEP's detection, the importer and the check read one parse
        plan = _plan_training_checkpoint(tag_dir, options)
        # every file of the tag folder is read: a file nobody reads is a silent loss (refused)
        check_every_file_read(tag_dir, plan.source_tensors)
    trainer = trainer_folder_above(tag_dir, storage)  # a Trainer's checkpoint-N/
    if trainer is not None:  # its schedule, clipping, step: what continues the run
        record = trainer_record(trainer)
        scheduler = (plan.source.get("optimizer") or {}).get("scheduler")
        if "scheduler" not in record and scheduler is not None:  # no scheduler.pt under DeepSpeed
            record["scheduler"] = scheduler  # its state is in the model states file
        plan.source.update(trainer=record, trainer_path=trainer.root)
        zero.trainer_facts(plan.source, trainer.root)  # the config it filled from its arguments
    elif (root := trainer_folder_above(tag_dir, storage, "latest")) is not None:
        config = model_config(root)  # the model's config.json saved beside `latest`
        if config:  # the head settings a spec by name takes (language.recorded)
            plan.source["config"] = config
    return plan
