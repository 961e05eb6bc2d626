"""The errors jax_ucp raises: one small tree under ``UCPError`` (docs/api.md#errors), and
the warnings it gives.

The code is in ``jax_ucp._src``."""

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

__all__ = [
    "CheckpointError",
    "LanguageError",
    "MultiProcessError",
    "OptimizerOrderWarning",
    "RequestError",
    "ResumeWarning",
    "SaveConflictError",
    "SourceError",
    "UCPError",
    "UnsafeFileError",
]
