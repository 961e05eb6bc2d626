"""The TP x PP rank grid merged into one tensor, for both Megatron readers (Megatron-LM's legacy
``mp_rank_*`` files, Megatron-DeepSpeed's model-parallel ranks)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jax_ucp._src.errors import LanguageError, SourceError
from jax_ucp._src.language import PipelineTied, merge


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
