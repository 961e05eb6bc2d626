"""Importers of other frameworks' checkpoints, one package per source format (``deepspeed``,
``megatron``, ``orbax``, ``safetensors``, ``torch``); torch files are read without torch.

Each format's package exposes ``detect(path)`` and ``plan(path, options)``; ``registry`` holds
them and picks one for a source. A plan is a checked, lazy stream of ``writer.HostItem``s
(``ImportPlan``) that ``jax_ucp._src.conversion`` writes.
"""

from jax_ucp._src.importers.registry import plan_import

__all__ = [
    "plan_import",
]
