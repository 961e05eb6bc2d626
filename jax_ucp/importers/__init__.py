"""Importers of torch checkpoints (DeepSpeed, Megatron); torch files are read without torch."""

from jax_ucp.importers.detect import convert, detect_format  # noqa: F401
