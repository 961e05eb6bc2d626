"""``export``: a jax_ucp checkpoint written in another framework's format, one options
class per format (docs/EXPORT.md). Importing it loads no JAX.

The code is in ``jax_ucp._src``."""

from jax_ucp._src.exporters import DeepSpeedUniversalExport as DeepSpeedUniversalExport
from jax_ucp._src.exporters import MegatronExport as MegatronExport
from jax_ucp._src.exporters import OrbaxExport as OrbaxExport
from jax_ucp._src.exporters import SafetensorsExport as SafetensorsExport
from jax_ucp._src.exporters import TorchDcpExport as TorchDcpExport
from jax_ucp._src.exporters import export as export

__all__ = [
    "DeepSpeedUniversalExport",
    "MegatronExport",
    "OrbaxExport",
    "SafetensorsExport",
    "TorchDcpExport",
    "export",
]
