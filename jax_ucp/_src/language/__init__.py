"""The UCP language: rules over parameter names -> kinds (import) and lazy views (restore).

Modules, bottom up: ``errors``; ``settings`` (model hyper-parameters, integer expressions, name
templates); ``plain_form`` (the dict/TOML form of kinds and ops); ``views`` (lazy TensorStore
primitives); ``kinds`` (import side: how fragments merge); ``ops`` (restore side: what a rule
does); ``spec`` (rules, roots, ``Spec`` and their dict form); ``toml_io`` (TOML text, shipped
specs); ``plan`` (restore rules compiled into lazy view plans). See docs/LANGUAGE.md.
"""

from jax_ucp._src.language import views
from jax_ucp._src.language.kinds import (
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
from jax_ucp._src.language.ops import OPS, Op, op_from_obj
from jax_ucp._src.language.plan import (
    TensorInfo,
    ViewPlan,
    apply_restore_plan,
    apply_spec_to_tree,
    compile_restore_plan,
    describe_plan,
    flatten_nested,
    saved_infos,
    unflatten_nested,
)
from jax_ucp._src.language.settings import padded_vocab_size
from jax_ucp._src.language.spec import (
    DEFAULT_ROOTS,
    ImportMatch,
    ImportRule,
    RestoreRule,
    Root,
    Spec,
    optax_chain_roots,
    spec_from_dict,
    spec_to_dict,
)
from jax_ucp._src.language.toml_io import (
    dump_spec,
    list_specs,
    load_spec,
    spec_from_toml,
    spec_to_toml,
)

__all__ = [
    "DEFAULT_ROOTS",
    "KINDS",
    "OPS",
    "QKV",
    "Averaged",
    "Expert",
    "ImportMatch",
    "ImportRule",
    "Kind",
    "Op",
    "Partitioned",
    "PipelineTied",
    "Replicated",
    "RestoreRule",
    "Root",
    "Spec",
    "SubParams",
    "SwiGLU",
    "TensorInfo",
    "ViewPlan",
    "Vocab",
    "apply_restore_plan",
    "apply_spec_to_tree",
    "compile_restore_plan",
    "describe_plan",
    "dump_spec",
    "expert_global_index",
    "flatten_nested",
    "head_split",
    "kind_from_obj",
    "list_specs",
    "load_spec",
    "merge",
    "op_from_obj",
    "optax_chain_roots",
    "padded_vocab_size",
    "saved_infos",
    "spec_from_dict",
    "spec_from_toml",
    "spec_to_dict",
    "spec_to_toml",
    "split",
    "split_parts",
    "unflatten_nested",
]
