"""Export a jax_ucp checkpoint to formats PyTorch tools and Orbax read (``jax_ucp.export``), through
the restore engine's strict reader; torch-free, each format module exporting itself, ``engine``
checking and dispatching."""

from jax_ucp._src.exporters.engine import export
from jax_ucp._src.exporters.options import (
    FORMATS,
    DeepSpeedUniversalExport,
    Exported,
    MegatronExport,
    OrbaxExport,
    SafetensorsExport,
    TorchDcpExport,
    options_for,
)

__all__ = [
    "FORMATS",
    "DeepSpeedUniversalExport",
    "Exported",
    "MegatronExport",
    "OrbaxExport",
    "SafetensorsExport",
    "TorchDcpExport",
    "export",
    "options_for",
]
