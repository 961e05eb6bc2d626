"""Orbax checkpoints in: a ``StandardCheckpointer`` / ``PyTreeCheckpointer`` directory, a
``CheckpointManager`` step, or a manager root (its latest committed step), OCDBT or not.

The tree and each array's name, shape and dtype come from Orbax's own public metadata; the
writer reads one array at a time, so memory is bounded by the largest array, never the whole
tree. Orbax and JAX are imported only when an import is planned: detection (``detect``) reads
file names and one small JSON file.

Modules: ``layout`` (where the step and its items lie, names checked), ``arrays`` (Orbax's
metadata and each array's reader), ``planning`` (the plan and its options), ``zstd_rows``.
"""

from __future__ import annotations

from jax_ucp._src.importers.orbax.planning import OrbaxOptions, detect, plan

__all__ = ["OrbaxOptions", "detect", "plan"]
