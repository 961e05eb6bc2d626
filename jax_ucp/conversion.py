"""``convert``'s options and each import format's own (``importing=``).

The code is in ``jax_ucp._src``."""

from jax_ucp._src.conversion import ConvertOptions as ConvertOptions
from jax_ucp._src.conversion import convert as convert
from jax_ucp._src.importers.deepspeed import DeepSpeedOptions as DeepSpeedOptions
from jax_ucp._src.importers.deepspeed.ucp_info import spec_from_ucp_info as spec_from_ucp_info
from jax_ucp._src.importers.megatron import MegatronOptions as MegatronOptions
from jax_ucp._src.importers.orbax import OrbaxOptions as OrbaxOptions
from jax_ucp._src.importers.plan import ImportOptions as ImportOptions
from jax_ucp._src.importers.torch import TorchOptions as TorchOptions
from jax_ucp._src.importers.verl import VerlOptions as VerlOptions

__all__ = [
    "ConvertOptions",
    "DeepSpeedOptions",
    "ImportOptions",
    "MegatronOptions",
    "OrbaxOptions",
    "TorchOptions",
    "VerlOptions",
    "convert",
    "spec_from_ucp_info",
]
