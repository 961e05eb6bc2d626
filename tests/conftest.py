"""8 CPU devices for every test (set before jax is imported) and a quick hypothesis profile."""

import os
import shutil
import tempfile
from pathlib import Path

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if (
    "JAX_COMPILATION_CACHE_DIR" not in os.environ
    and os.environ.get("UCP_TEST_COMPILE_CACHE", "1") == "1"
):
    # One compilation cache for the test run: both xdist workers and every child process a test
    # starts (the hostile harness, the docs snippets, multi-process runs) share the programs
    # jax compiled once, which is most of what small tests pay for. Inherited through the
    # environment; set once by the controlling process (xdist workers see it already set).
    import atexit

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax_ucp-test-jit-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import hypothesis
import pytest

pytest_plugins = ["tests.object_servers"]  # the S3 / GCS servers, once per process

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

#: CI's torch stages: a wall-clock time (seconds since the epoch) after which no further test
#: starts. Each one not started is skipped, and the skip names this deadline, so the log shows
#: what did not run. A stage that would overrun CI's 90 minutes fails the whole run.
CI_DEADLINE = os.environ.get("UCP_CI_DEADLINE")


def pytest_runtest_setup(item):
    """Skips a test that would start after ``UCP_CI_DEADLINE`` (set by .ci/run only)."""
    import time

    if CI_DEADLINE and time.time() > float(CI_DEADLINE):
        pytest.skip("CI time budget: this stage's deadline (UCP_CI_DEADLINE) passed before it")


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


@pytest.fixture
def tmpfs_path(tmp_path):
    """A fresh directory on tmpfs (/dev/shm) where there is a large one, else ``tmp_path``: the
    memory tests' large checkpoints written and read without disk I/O (RssAnon, what they
    measure, does not count tmpfs pages). A container's default /dev/shm (64 MiB) is not used."""
    if not os.access("/dev/shm", os.W_OK) or shutil.disk_usage("/dev/shm").free < 2 << 30:
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="jax_ucp-test-") as d:
        yield Path(d)
