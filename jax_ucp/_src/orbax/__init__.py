"""Orbax integration only: the v0 ``UCPCheckpointHandler`` with its ``UCPSave`` / ``UCPRestore``
args, the v1 ``UCPHandler``, and an import written as a CheckpointManager step."""
