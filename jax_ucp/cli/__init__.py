"""``jax-ucp``, the command line (``jax-ucp --help``).

The code is in ``jax_ucp._src``."""

from jax_ucp._src.cli import app as app
from jax_ucp._src.cli import main as main

__all__ = [
    "app",
    "main",
]
