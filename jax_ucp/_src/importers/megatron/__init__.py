"""Import Megatron-LM / megatron-core checkpoints (torch_dist and legacy TP x PP) as UCP.

* ``torch_dist`` (megatron-core ``dist_checkpointing``: torch DCP on disk, :mod:`.torch_dist`):
  tensors have their global shape in ``.metadata``; layers stay stacked ``[L, ...]``, only the
  vocab padding is stripped; the distributed optimizer's state in any supported layout.
* legacy (``latest_checkpointed_iteration.txt`` + ``iter_NNNNNNN/mp_rank_TT[_PPP]/
  model_optim_rng.pt``, :mod:`.legacy_import`): per-rank state dicts merged over TP with the UCP
  language's kinds, per-stage layer numbers made global.

Neither format records the original vocab size: it comes from ``vocab_size=`` (CLI
``--vocab-size``) or the spec's settings; without it the padded rows are kept and the manifest
says so. Output: the importer contract's tree (docs/FORMAT.md section 2.6), keyed by the source
names.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterator
from typing import Any

import numpy as np

from jax_ucp._src import writer
from jax_ucp._src.importers.megatron import bridge
from jax_ucp._src.importers.megatron.common import (
    MegatronImportError,
    agreed_iteration,
    entries_of,
    listed,
    named_errors,
)
from jax_ucp._src.importers.megatron.legacy_import import plan_legacy
from jax_ucp._src.importers.megatron.source import MegatronSource, detect_megatron
from jax_ucp._src.importers.megatron.torch_dist import plan_torch_dist
from jax_ucp._src.importers.plan import (
    Detection,
    ImportOptions,
    ImportPlan,
    jsonable,
)
from jax_ucp._src.language import Spec, load_spec
from jax_ucp._src.store.storage import Storage

__all__ = [
    "MegatronImportError",
    "MegatronOptions",
    "detect",
    "detect_megatron",
    "plan",
    "plan_megatron",
]


# ----------------------------------------------------------------------------- entry point


def plan_megatron(src: Storage, options: MegatronOptions) -> ImportPlan:
    """The import of a Megatron checkpoint (torch_dist or legacy; detected). Every check that
    needs no tensor bytes runs before this returns.

    Args:
        src: the checkpoint folder (a save root or one ``iter_N``).
        options: ``spec``: a UCP-language spec (``Spec``, shipped name or TOML path) whose
            settings (e.g. ``vocab_size``) and import rules are used; ``vocab_size``: the
            tokenizer's vocabulary size, before Megatron's padding (overrides the spec's);
            ``weights_only``: the model weights alone, the optimizer state (whatever its
            layout) skipped and listed in ``source.skipped``.
    """
    spec, vocab_size = options.spec, options.vocab_size
    with named_errors():
        source_dir = detect_megatron(src)
    if source_dir is None:
        raise MegatronImportError(
            f"{src.root}: not a Megatron checkpoint (no .metadata, no "
            f"latest_checkpointed_iteration.txt / iter_NNNNNNN/mp_rank_* layout)"
        )
    user_spec = None if spec is None else spec if isinstance(spec, Spec) else load_spec(spec)
    settings: dict[str, Any] = dict(user_spec.env) if user_spec is not None else {}
    if vocab_size is not None:
        settings["vocab_size"] = int(vocab_size)
    planner = plan_torch_dist if source_dir.format == "torch_dist" else plan_legacy
    with named_errors():
        plan = planner(source_dir, settings, dataclasses.replace(options, spec=user_spec))
    info = dict(plan.source)
    iteration = info.pop("iteration", None)
    padded = {v[0] for v in (info.get("vocab_stripped") or {}).values()}
    if len(padded) == 1:  # the rows stripped: the padded vocabulary, args recorded or not
        settings.setdefault("padded_vocab_size", padded.pop())
    source = {
        "framework": "megatron",
        "path": source_dir.folder.absolute(),
        "iteration": agreed_iteration(source_dir.iteration, iteration, source_dir.folder.root),
        "vocab_size": settings.get("vocab_size"),
        "settings": jsonable(settings),
        **jsonable(info),
    }
    if settings.get("vocab_size") is None:
        source.setdefault("notes", []).append(
            "vocab padding kept: the original vocab size was not given (vocab_size= / --vocab-size)"
        )
    return ImportPlan(
        _reader_errors_named(plan.items), source, plan.total_params, plan.source_tensors
    )


def _reader_errors_named(items: Iterator[writer.HostItem]) -> Iterator[writer.HostItem]:
    """``items``, with the readers' errors met while reading raised as this importer's."""
    with named_errors():
        yield from items


@dataclasses.dataclass(frozen=True)
class MegatronOptions(ImportOptions):
    """``ImportOptions`` and the vocabulary size.

    Attributes:
        vocab_size: the tokenizer's vocabulary size, before Megatron's padding (None: the
            spec's, else the padded rows are kept).
    """

    vocab_size: int | None = None


_MARKERS = (
    "latest_checkpointed_iteration.txt",
    bridge.LATEST_TRAIN_STATE_FILE,  # Megatron Bridge (also run_config.yaml)
    bridge.RUN_CONFIG_FILE,
    "iter_*",
    "metadata.json",  # torch_dist: megatron's own beside torch DCP's .metadata
    "common.pt",
    "integrity.json",  # megatron-core's record: a DCP with it is never read as plain torch
    "mp_rank_*/model_optim_rng.pt",
)


def detect(storage: Storage) -> Detection:
    """Whether ``storage`` is a Megatron-LM / megatron-core / Megatron Bridge checkpoint folder,
    from its file names (hidden ones aside, as ``glob`` leaves them)."""
    entries = listed(storage)
    if entries is None:
        return Detection(False, "not a directory")
    names = [n for n in entries if not n.startswith(".")]
    for pattern in _MARKERS:
        folder, _, file = pattern.rpartition("/")
        if any(file in entries_of(storage, d) for d in fnmatch.filter(names, folder)) or (
            not folder and fnmatch.filter(names, pattern)
        ):
            return Detection(True, f"Megatron files ({pattern})")
    return Detection(
        False,
        "no `latest_checkpointed_iteration.txt`, `iter_N/`, torch_dist `.metadata` + "
        "`*.distcp` with `common.pt`, Megatron Bridge `latest_train_state.pt` / "
        "`run_config.yaml`",
    )


def plan(storage: Storage, options: MegatronOptions) -> ImportPlan:
    """Megatron Bridge (``latest_train_state.pt``, ``train_state.pt`` + ``run_config.yaml``)
    or Megatron-LM / megatron-core, with its options as one ``MegatronOptions``."""
    if bridge.is_megatron_bridge(storage):
        return bridge.plan_megatron_bridge(storage, options, plan_megatron)
    return plan_megatron(storage, options)
