"""Exporting needs no JAX: ``import jax_ucp.exporters`` and an export of a saved checkpoint to
the torch-free formats run in a process that never imports ``jax`` (the restore engine and the
UCP source below them are JAX-free; ``tests/test_layers.py`` checks their imports)."""

from __future__ import annotations

import numpy as np

import jax_ucp
from tests.ucp_testing import run_python

JAX_PACKAGES = ("jax", "jaxlib", "orbax", "flax", "optax")


def _loaded_jax_check() -> str:
    return (
        f"loaded = sorted(m for m in sys.modules if m.split('.')[0] in {JAX_PACKAGES!r})\n"
        "assert not loaded, loaded\n"
        "print('no jax')\n"
    )


def test_importing_the_exporters_loads_no_jax():
    p = run_python("import sys\nimport jax_ucp.exporters\n" + _loaded_jax_check())
    assert "no jax" in p.stdout


def test_exports_run_without_jax(tmp_path):
    """One export to each torch-free format, in one process."""
    w = np.arange(24, dtype=np.float32).reshape(6, 4)
    b = np.ones(4, np.float32)
    tree = {
        "params": {"w": w, "b": b},
        "opt_state": {"mu": {"w": w, "b": b}, "nu": {"w": w * w, "b": b}, "count": np.int32(3)},
    }
    ckpt = jax_ucp.save(str(tmp_path / "ck"), tree)
    code = "import sys\nimport jax_ucp.exporters\n"
    for fmt in ("safetensors", "torch-dcp", "deepspeed-universal"):
        dst = str(tmp_path / fmt)
        code += f"jax_ucp._src.exporters.export({ckpt!r}, {dst!r}, jax_ucp._src.exporters.options_for({fmt!r}))\n"
    p = run_python(code + _loaded_jax_check())
    assert "no jax" in p.stdout
