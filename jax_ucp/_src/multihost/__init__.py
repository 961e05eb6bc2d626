"""What several processes need to work as one: a process's identity and the check that a peer on
this host is gone (``liveness``), the exchange of a ``jax.distributed`` job and the outcome of a
step every process agrees on (``agreement``)."""
