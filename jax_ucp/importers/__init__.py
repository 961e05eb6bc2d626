"""Importers of torch checkpoints (DeepSpeed, Megatron); torch files are read without torch.

Each importer reads and checks a checkpoint and returns an ``ImportPlan`` (a lazy stream of
``writer.HostItem``s); ``jax_ucp.conversion`` writes it.
"""

from jax_ucp.importers.detect import detect_format, plan_import
from jax_ucp.importers.plan import ImportPlan
