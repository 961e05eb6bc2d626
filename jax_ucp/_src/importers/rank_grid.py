"""The model-parallel rank grid of a Megatron run (megatron-core, Megatron-LM's legacy files,
Megatron-DeepSpeed): which rank holds which stage, TP and EP piece, and the TP x PP fragments
merged into one tensor."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jax_ucp._src.errors import LanguageError, SourceError
from jax_ucp._src.language import PipelineTied, merge


@dataclass(frozen=True)
class RankGrid:
    """A run's model-parallel ranks, numbered as megatron-core numbers its tensor x expert x
    pipeline group ('tp-ep-pp': rank = tp_rank + TP * (ep_rank + EP * stage)) and
    Megatron-DeepSpeed its ``mp_rank_XX`` files (stage * TP + tp_rank): one numbering for every
    Megatron reader's files and flat state. ``pp`` counts virtual stages when ``vpp`` (model
    chunks per pipeline rank) > 1: chunk v of pipeline rank p is stage v * (pp // vpp) + p."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    vpp: int = 1
    dp: int = 1  # data-parallel ranks each model-parallel rank's state is split over (ZeRO)

    @property
    def size(self) -> int:  # model-parallel ranks
        return self.tp * self.ep * self.pp

    def rank(self, tp_rank: int, stage: int = 0, ep_rank: int = 0) -> int:
        """The model-parallel rank holding TP rank ``tp_rank`` of (EP rank, stage)."""
        return tp_rank + self.tp * (ep_rank + self.ep * stage)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(TP rank, stage, EP rank) of model-parallel rank ``rank``."""
        return rank % self.tp, rank // (self.tp * self.ep), rank // self.tp % self.ep

    def stage_of(self, layer: int, layers: int) -> int:
        """The pipeline stage holding layer ``layer`` of ``layers`` split evenly."""
        return layer // (layers // self.pp)

    def layers_of(self, stage: int, layers: int) -> range:
        """The layers stage ``stage`` holds of ``layers`` split evenly."""
        per_stage = layers // self.pp
        return range(stage * per_stage, (stage + 1) * per_stage)

    def chunk(self, stage: int) -> int:
        """The model chunk (``model<v>``, grad buffer ``v``) of virtual stage ``stage``."""
        return stage // (self.pp // self.vpp)


def merged(kind, stages: Sequence, name: str, spec, files, what="", error=SourceError):
    """``name`` (an array) from ``stages``, each one's TP fragments (one stage: merged by
    ``kind`` with ``spec``'s settings; several: its pipeline-tied copies); a merge that fails
    is ``error``, saying ``what`` was merged and naming the files (``files()``)."""
    tied = len(stages) > 1
    try:
        kind, fragments = (PipelineTied(inner=kind), list(stages)) if tied else (kind, stages[0])
        return np.asarray(merge(kind, fragments, name=name, settings=spec.settings))
    except LanguageError as e:
        raise error(f"{what}{': ' if what else ''}{e} [files: {files()}]") from None
