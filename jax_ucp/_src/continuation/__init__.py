"""How a torch run continues in optax: each framework's recorded optimizer, schedule and clipping
read into one :class:`~jax_ucp._src.continuation.recipe.Recipe`."""
