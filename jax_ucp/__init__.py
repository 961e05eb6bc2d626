"""jax_ucp: Universal Checkpointing for JAX on Orbax.

Save distributed (each process writes its own shards), land every tensor as one consolidated
zarr v3 array, restore onto any mesh; import DeepSpeed / Megatron checkpoints.
"""

__version__ = "0.1.0"

from jax_ucp.format import Manifest, ManifestError, TensorEntry, ValueEntry
from jax_ucp.handler import (
    CheckpointError, UCPCheckpointHandler, UCPRestore, UCPSave, inspect, restore, save,
)
from jax_ucp.sharding import ShardingMismatchError


def convert(source, dest, *, spec=None, **kwargs):
  """Imports a torch checkpoint directory (DeepSpeed or Megatron; format detected)."""
  from jax_ucp.importers.detect import convert as _convert
  return _convert(source, dest, spec=spec, **kwargs)
