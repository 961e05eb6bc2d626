"""The UCP language (docs/LANGUAGE.md): specs, their rules and roots, the import kinds and
restore ops, the shipped specs, and restore plans.

The code is in ``jax_ucp._src``."""

from jax_ucp._src.language import QKV as QKV
from jax_ucp._src.language import Averaged as Averaged
from jax_ucp._src.language import Expert as Expert
from jax_ucp._src.language import ImportRule as ImportRule
from jax_ucp._src.language import Kind as Kind
from jax_ucp._src.language import Partitioned as Partitioned
from jax_ucp._src.language import PipelineTied as PipelineTied
from jax_ucp._src.language import Replicated as Replicated
from jax_ucp._src.language import RestoreRule as RestoreRule
from jax_ucp._src.language import Root as Root
from jax_ucp._src.language import Spec as Spec
from jax_ucp._src.language import SubParams as SubParams
from jax_ucp._src.language import SwiGLU as SwiGLU
from jax_ucp._src.language import TensorInfo as TensorInfo
from jax_ucp._src.language import Vocab as Vocab
from jax_ucp._src.language import apply_restore_plan as apply_restore_plan
from jax_ucp._src.language import compile_restore_plan as compile_restore_plan
from jax_ucp._src.language import dump_spec as dump_spec
from jax_ucp._src.language import list_specs as list_specs
from jax_ucp._src.language import load_spec as load_spec
from jax_ucp._src.language import merge as merge
from jax_ucp._src.language import optax_chain_roots as optax_chain_roots
from jax_ucp._src.language import spec_from_toml as spec_from_toml
from jax_ucp._src.language import spec_to_toml as spec_to_toml
from jax_ucp._src.language import split as split
from jax_ucp._src.language import split_parts as split_parts

__all__ = [
    "QKV",
    "Averaged",
    "Expert",
    "ImportRule",
    "Kind",
    "Partitioned",
    "PipelineTied",
    "Replicated",
    "RestoreRule",
    "Root",
    "Spec",
    "SubParams",
    "SwiGLU",
    "TensorInfo",
    "Vocab",
    "apply_restore_plan",
    "compile_restore_plan",
    "dump_spec",
    "list_specs",
    "load_spec",
    "merge",
    "optax_chain_roots",
    "spec_from_toml",
    "spec_to_toml",
    "split",
    "split_parts",
]
