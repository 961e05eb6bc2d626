"""``python -m jax_ucp.cli``: what ``convert --processes N`` runs in each process."""

from jax_ucp._src.cli.commands import app as _app

__all__: list[str] = []

_app()
