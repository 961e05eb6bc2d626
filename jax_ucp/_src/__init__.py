"""jax_ucp's implementation. Nothing here is public: import from ``jax_ucp`` and its
facades (``jax_ucp._src.language``, ``jax_ucp._src.exporters``, ...); tests of internals import
these modules as JAX's own tests import ``jax._src``."""
