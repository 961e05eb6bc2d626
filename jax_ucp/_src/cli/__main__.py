"""``python -m jax_ucp._src.cli``: what ``convert --processes N`` runs in each process."""

from jax_ucp._src.cli.commands import app

app()
