"""Layer 5: Orbax integration and the save/restore/inspect entry points."""

from jax_ucp.handler.api import inspect, restore, save
from jax_ucp.handler.checkpoint_handler import UCPCheckpointHandler, UCPRestore, UCPSave
from jax_ucp.handler.reader import CheckpointError
from jax_ucp.handler.stream import HostItem, UCPStreamSave
