"""Translate DeepSpeed's ``universal_checkpoint_info`` (what Megatron-DeepSpeed stores in its
``mp_rank_XX_model_states.pt``) into UCP-language import rules.

DeepSpeed's ``ds_to_universal`` decides per parameter name (``re.match``, i.e. anchored at the
start only), in this order: tp-replicated (checked equal) > parameters to average
(sum / n) > 2 sub-params concatenated on dim 0 (SwiGLU) > sub-params of given shapes
(``parameter_with_sub_params``: fused QKV ...) > row parallel (cat dim 1) > otherwise cat
dim 0; then, independently, vocabulary parameters have their padding stripped to
``original_vocab_size`` along dim 0. Tensors matching ``pipeline_replicated_parameter_patterns``
are held on several pipeline stages (tied embeddings).

The rules below reproduce exactly that decision with the language's first-match-wins order:
``re.match(A, name)`` is the full match of ``(?:A).*``, and a name that must match both A and B
(a vocabulary or pipeline-replicated parameter of some category) gets a rule with pattern
``(?:A).*`` and ``also = ["(?:B).*"]``. The patterns come from a checkpoint file, so they are
matched with RE2 (time linear in the name, ``language.patterns``); one RE2 cannot compile
(look-arounds, back-references) is an error naming the file and the pattern.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from jax_ucp._src.errors import LanguageError
from jax_ucp._src.language.kinds import (
    Averaged,
    Kind,
    Partitioned,
    PipelineTied,
    Replicated,
    SubParams,
    SwiGLU,
    Vocab,
)
from jax_ucp._src.language.patterns import compile_pattern
from jax_ucp._src.language.spec import ImportRule, Spec

SUB_PARAMS = "parameter_with_sub_params"
ROW_PARALLEL = "parameter_with_row_parallelism_patterns"
ORIGINAL_VOCAB_SIZE = "original_vocab_size"
PADDED_VOCAB_SIZE = "padded_vocab_size"


def spec_from_ucp_info(
    info: Mapping[str, Any],
    *,
    name: str = "deepspeed-ucp-info",
    strict: bool = False,
    where: str = "universal_checkpoint_info",
    **settings,
) -> Spec:
    """A Spec whose import rules reproduce ds_to_universal for ``info`` (see module doc);
    ``where`` (the file holding ``info``) starts every error. ``strict``: every pattern
    DeepSpeed lists must match some tensor (ds_to_universal --strict); by default unused
    patterns are allowed, as DeepSpeed only warns.

    Args:
        info: ``universal_checkpoint_info``.
        name: the spec's name.
        strict: every pattern must match some tensor.
        where: the file holding ``info``, for errors.
        **settings: the spec's settings (head counts, ...).
    """
    s = dict(settings)
    if ORIGINAL_VOCAB_SIZE in info and "vocab_size" not in s:
        s["vocab_size"] = int(info[ORIGINAL_VOCAB_SIZE])
    if PADDED_VOCAB_SIZE in info:
        s.setdefault("padded_vocab_size", int(info[PADDED_VOCAB_SIZE]))
    categories: list[tuple[str | None, Kind, str, bool]]
    categories = [(p, k, f"{k.kind} {p!r}", strict) for p, k in _categories(info, where)]
    categories.append((None, Partitioned(dim=0), "default: cat dim 0", False))
    vocab = _patterns(info, "vocabulary_parameter_patterns", where)
    pipe = _patterns(info, "pipeline_replicated_parameter_patterns", where)
    vocab_size = info.get(ORIGINAL_VOCAB_SIZE, "vocab_size")
    rules = [
        rule
        for p, kind, label, required in categories
        for rule in _rules_for(p, kind, label, required, vocab, pipe, vocab_size)
    ]
    return Spec(name=name, settings=s, imports=tuple(rules), strict=strict)


def _patterns(info: Mapping[str, Any], key: str, where: str) -> list[str]:
    """The patterns ``info[key]`` lists (one string is a list of one), each RE2-compiled."""
    v = info.get(key) or []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, (list, tuple)):
        raise LanguageError(f"{where}.{key}: expected a list of patterns, found {type(v).__name__}")
    for p in v:  # each alone, so an error names the pattern as the file holds it
        compile_pattern(p, f"{where}.{key}: ")
    return [str(p) for p in v]


def _categories(info: Mapping[str, Any], where: str) -> list[tuple[str, Kind]]:
    """(pattern, kind) of every category, in ds_to_universal's order of precedence."""
    first = (
        ("tp_replicated_parameter_patterns", Replicated()),
        ("parameter_to_average_patterns", Averaged()),
        ("parameter_with_2_sub_params_cat_dim_0", SwiGLU(dim=0)),
    )
    categories: list[tuple[str, Kind]]
    categories = [(p, k) for key, k in first for p in _patterns(info, key, where)]
    for i, e in enumerate(info.get(SUB_PARAMS) or []):
        at = f"{where}.{SUB_PARAMS}[{i}]"
        try:
            patterns, shape, dim = list(e["patterns"]), list(e["shape"]), int(e["partition_dim"])
        except (KeyError, TypeError, ValueError) as err:
            raise LanguageError(
                f"{at}: a {SUB_PARAMS} entry needs patterns, shape and partition_dim ({err})"
            ) from None
        sizes = shape[dim]
        sizes = tuple(int(x) for x in sizes) if isinstance(sizes, (list, tuple)) else (int(sizes),)
        for p in patterns:
            compile_pattern(p, f"{at}: ")
        categories += [(p, SubParams(dim=dim, sizes=sizes)) for p in patterns]
    return categories + [(p, Partitioned(dim=1)) for p in _patterns(info, ROW_PARALLEL, where)]


def _rules_for(
    p: str | None,
    kind: Kind,
    label: str,
    required: bool,
    vocab: list[str],
    pipe: list[str],
    vocab_size: Any,
) -> list[ImportRule]:
    """One category's rules: with each vocabulary and pipeline-replicated pattern it may also
    match (the kind wrapped accordingly), then alone; only the plain rule may be required."""
    rules = []
    for v, q in itertools.product([*vocab, None], [*pipe, None]):
        inner = kind if v is None else Vocab(dim=0, vocab_size=vocab_size, inner=kind)
        rules.append(
            ImportRule(
                f"(?:{p}).*" if p is not None else ".*",
                inner if q is None else PipelineTied(inner=inner),
                required=required and v is None and q is None,
                label=f"{label}{' + vocab ' + repr(v) if v else ''}"
                f"{' + pipeline-replicated ' + repr(q) if q else ''}",
                also=tuple(f"(?:{x}).*" for x in (v, q) if x is not None),
            )
        )
    return rules
