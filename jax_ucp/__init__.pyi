# jax_ucp's names for type checkers: at run time each is loaded on first use from the module
# ``jax_ucp._src.lazy_names.PUBLIC`` names (tests/test_public_api.py keeps the two in step).

from jax_ucp._src.api import latest_step as latest_step
from jax_ucp._src.api import save as save
from jax_ucp._src.api import verify as verify
from jax_ucp._src.conversion import convert as convert
from jax_ucp._src.errors import CheckpointError as CheckpointError
from jax_ucp._src.errors import LanguageError as LanguageError
from jax_ucp._src.errors import MultiProcessError as MultiProcessError
from jax_ucp._src.errors import OptimizerOrderWarning as OptimizerOrderWarning
from jax_ucp._src.errors import RequestError as RequestError
from jax_ucp._src.errors import ResumeWarning as ResumeWarning
from jax_ucp._src.errors import SaveConflictError as SaveConflictError
from jax_ucp._src.errors import SourceError as SourceError
from jax_ucp._src.errors import UCPError as UCPError
from jax_ucp._src.errors import UnsafeFileError as UnsafeFileError
from jax_ucp._src.exporters import export as export
from jax_ucp._src.format import Manifest as Manifest
from jax_ucp._src.format import TensorEntry as TensorEntry
from jax_ucp._src.format import ValueEntry as ValueEntry
from jax_ucp._src.optax_torch import TorchOptimizer as TorchOptimizer
from jax_ucp._src.optax_torch import optax_from_torch as optax_from_torch
from jax_ucp._src.orbax.handler import UCPCheckpointHandler as UCPCheckpointHandler
from jax_ucp._src.orbax.handler import UCPRestore as UCPRestore
from jax_ucp._src.orbax.handler import UCPSave as UCPSave
from jax_ucp._src.orbax.v1 import UCPHandler as UCPHandler
from jax_ucp._src.orbax.v1 import orbax_v1_context as orbax_v1_context
from jax_ucp._src.restoring.checks import diff as diff
from jax_ucp._src.restoring.inspecting import inspect as inspect
from jax_ucp._src.restoring.options import RestoreOptions as RestoreOptions
from jax_ucp._src.restoring.plan import abstract_mesh as abstract_mesh
from jax_ucp._src.restoring.plan import plan as plan
from jax_ucp._src.restoring.restore_entry import restore as restore
from jax_ucp._src.sharding.mesh_layout import ReplicationWarning as ReplicationWarning
from jax_ucp._src.store.storage.object_store import (
    set_object_store_options as set_object_store_options,
)
from jax_ucp._src.version import __version__ as __version__
