"""The read engine: plans which byte ranges each process needs, reads them (from jax_ucp
checkpoints, or any source convert reads, safetensors included, in place) and assembles them
onto any mesh.

By stage: ``locate`` (where the checkpoint is; reads kept whole across a forced save's swap),
``requests`` (a target tree, or ``select``/``mesh=``, as requests: the only part needing JAX),
``engine`` with ``model`` (the read loop, ``Request``/``Available`` and the cast rules), and
``sources`` (the open stage: a UCP checkpoint's ``ucp_source``, or any other source's import,
its importer detected once, ``import_open``, read by ``import_source``). Besides:
``plan``, ``replicated`` reads, ``checks`` (diff), ``options``.

Below the Orbax layer: restore, verify, diff and the exporters all read through it.
"""
