"""torch's file formats, read without torch and without executing pickled code: ``torch.save``
archives (:mod:`~jax_ucp.torchfiles.unpickler`), torch distributed checkpoints
(:mod:`~jax_ucp.torchfiles.dcp_reader`), and torch's dtypes as its files name them
(:mod:`~jax_ucp.torchfiles.dtypes`). Below the importers and exporters, which share it."""

from jax_ucp.torchfiles import dcp_reader, dtypes, sharded, unpickler

__all__ = ["dcp_reader", "dtypes", "sharded", "unpickler"]
