"""torch's file formats, read without torch and without executing pickled code: ``torch.save``
archives (:mod:`~jax_ucp._src.torchfiles.unpickler`), torch distributed checkpoints
(:mod:`~jax_ucp._src.torchfiles.dcp_reader`), and torch's dtypes as its files name them
(:mod:`~jax_ucp._src.torchfiles.dtypes`). Below the importers and exporters, which share it."""

from jax_ucp._src.torchfiles import dcp_reader, dtypes, sharded, unpickler

__all__ = ["dcp_reader", "dtypes", "sharded", "unpickler"]
