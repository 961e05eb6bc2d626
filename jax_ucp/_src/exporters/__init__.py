"""Export a jax_ucp checkpoint to formats PyTorch tools and Orbax read (``jax_ucp.export``).

Above the restore engine (it reads through the same strict reader as a restore: digests,
crc32c, casting rules) and below the CLI. Torch-free: every format is written byte by byte
(``safetensors_out``, ``torch_out``, ``deepspeed_out``; ``orbax_out`` through Orbax), each
exporting itself; ``engine`` checks and dispatches, ``options`` holds the typed options per
format, ``source`` the streamed reads, the choice of tensors and the export transaction.
"""

from jax_ucp._src.exporters.engine import export
from jax_ucp._src.exporters.options import (
    FORMATS,
    DeepSpeedUniversalExport,
    Exported,
    OrbaxExport,
    SafetensorsExport,
    TorchDcpExport,
    options_for,
)

__all__ = [
    "FORMATS",
    "DeepSpeedUniversalExport",
    "Exported",
    "OrbaxExport",
    "SafetensorsExport",
    "TorchDcpExport",
    "export",
    "options_for",
]
