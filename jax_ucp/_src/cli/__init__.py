"""``jax-ucp``, the command line: the commands (``commands``), the terminal table they print
(``layout``), where they print (``output``) and the ``--processes N`` spawner (``spawn``)."""

from jax_ucp._src.cli.commands import app, main

__all__ = ["app", "main"]
