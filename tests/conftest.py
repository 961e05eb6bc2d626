"""8 CPU devices for every test (set before jax is imported) and a quick hypothesis profile."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis
import pytest

hypothesis.settings.register_profile(
    "ci",
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[
        hypothesis.HealthCheck.too_slow,
        hypothesis.HealthCheck.function_scoped_fixture,
    ],
)
hypothesis.settings.register_profile("thorough", max_examples=200, deadline=None)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def ckpt(tmp_path):
    """A small saved checkpoint (params/w 8x8, params/b, step) for the bad-input tests to damage."""
    import numpy as np

    import jax_ucp

    path = tmp_path / "c"
    jax_ucp.save(
        path,
        {
            "params": {
                "w": np.arange(64, dtype=np.float32).reshape(8, 8),
                "b": np.ones(8, np.float32),
            },
            "step": 1,
        },
    )
    return path
