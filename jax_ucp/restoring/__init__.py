"""The read engine: plans which byte ranges each process needs, reads them (from jax_ucp
checkpoints or Hugging Face safetensors in place) and assembles them onto any mesh.

Below the Orbax layer: restore, verify, diff and the exporters all read through it.
"""
