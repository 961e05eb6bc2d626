"""What ``jax_ucp.plan`` and ``jax_ucp.diff`` return, and ``pictures`` (where each slice lands).

The code is in ``jax_ucp._src``."""

from jax_ucp._src.restoring import pictures as pictures
from jax_ucp._src.restoring.checks import CheckpointDiff as CheckpointDiff
from jax_ucp._src.restoring.checks import TensorDiff as TensorDiff
from jax_ucp._src.restoring.checks import ValueDiff as ValueDiff
from jax_ucp._src.restoring.plan import RestorePlan as RestorePlan
from jax_ucp._src.restoring.plan import TensorPlan as TensorPlan

__all__ = [
    "CheckpointDiff",
    "RestorePlan",
    "TensorDiff",
    "TensorPlan",
    "ValueDiff",
    "pictures",
]
