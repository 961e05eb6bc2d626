"""The JAX save plan: which shards each process writes, the host copies an async save takes
(and reuses), and their layout; the writing itself is ``jax_ucp._src.writer``'s."""
