"""``python -m jax_ucp.cli``: what ``convert --processes N`` runs in each process."""

from jax_ucp.cli.commands import app

app()
