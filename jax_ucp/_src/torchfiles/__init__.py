"""torch's file formats without torch, one module per format, reader and writer side by side:
pickles (:mod:`~jax_ucp._src.torchfiles.pickle_format`, read with nothing executed: what they
may name is :mod:`~jax_ucp._src.torchfiles.allow_list`), ``torch.save`` zip archives
(:mod:`~jax_ucp._src.torchfiles.torch_zip`), torch distributed checkpoints
(:mod:`~jax_ucp._src.torchfiles.dcp`), and torch's dtypes as its files name them
(:mod:`~jax_ucp._src.torchfiles.dtypes`). Below the importers and exporters, which share it."""

from jax_ucp._src.torchfiles import allow_list, dcp, dtypes, pickle_format, sharded, torch_zip

__all__ = ["allow_list", "dcp", "dtypes", "pickle_format", "sharded", "torch_zip"]
