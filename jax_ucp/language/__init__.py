"""The UCP language: rules over parameter names -> kinds (import) and lazy views (restore).

Public API:
  Spec, ImportRule, RestoreRule, Root, DEFAULT_ROOTS, optax_chain_roots   (spec)
  load_spec(name_or_path, **settings), list_specs(), spec_from_toml, spec_to_toml  (files)
  merge(kind, fragments, *, name, settings, lazy=False), split(kind, full, n, ...),
  split_parts(kind, full, settings=...), kind_from_obj, the Kind classes           (import side)
  compile_restore_plan(spec, saved) -> {target key: ViewPlan}, TensorInfo, ViewPlan,
  apply_restore_plan, restore_tree, describe_plan                                  (restore side)
  views: lazy TensorStore primitives (transpose, stack/unstack, stages, qkv, ...)
See docs/LANGUAGE.md.
"""

from jax_ucp.language import views
from jax_ucp.language.errors import (
    LanguageError,
    MergeError,
    SpecError,
    StrictnessError,
    TransformError,
)
from jax_ucp.language.kinds import (
    KINDS,
    QKV,
    Averaged,
    Expert,
    Kind,
    Partitioned,
    PipelineTied,
    Replicated,
    SubParams,
    SwiGLU,
    Vocab,
    expert_global_index,
    head_split,
    kind_from_obj,
    merge,
    split,
    split_parts,
)
from jax_ucp.language.ops import OPS, Op, op_from_obj
from jax_ucp.language.plan import (
    TensorInfo,
    ViewPlan,
    apply_restore_plan,
    compile_restore_plan,
    describe_plan,
    restore_tree,
    saved_infos,
)
from jax_ucp.language.settings import padded_vocab_size
from jax_ucp.language.spec import (
    DEFAULT_ROOTS,
    ImportMatch,
    ImportRule,
    RestoreRule,
    Root,
    Spec,
    optax_chain_roots,
)
from jax_ucp.language.toml_io import dump_spec, list_specs, load_spec, spec_from_toml, spec_to_toml

__all__ = [n for n in dir() if not n.startswith("_")]
