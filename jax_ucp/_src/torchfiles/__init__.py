"""torch's file formats without torch, reader and writer side by side: pickles
(:mod:`pickle_format`, names allowed by :mod:`allow_list`), ``torch.save`` archives
(:mod:`torch_zip`), distributed checkpoints (:mod:`dcp`) and dtypes (:mod:`dtypes`)."""

from jax_ucp._src.torchfiles import allow_list, dcp, dtypes, pickle_format, sharded, torch_zip

__all__ = ["allow_list", "dcp", "dtypes", "pickle_format", "sharded", "torch_zip"]
