"""The commands that place no arrays start without JAX (issue 51): ``--version``, ``inspect``,
``verify`` (the read engine is JAX-free) and ``latest`` of an NNX + optax checkpoint (and of a
CheckpointManager root), run in a fresh
process, leave ``jax``, ``optax`` and ``flax`` out of ``sys.modules`` (each costs 1-4 s on a
loaded host), and print no notice for flax's and optax's own classes."""

from __future__ import annotations

import subprocess
import sys

import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jax_ucp
from tests.ucp_testing import REPO

# Runs the command line in-process and then says which heavy packages it loaded.
_WRAPPER = """
import sys
from jax_ucp.cli import app
try:
    app(sys.argv[1:])
except SystemExit as e:
    status = e.code
print("LOADED:", sorted(m for m in ("jax", "optax", "flax", "orbax") if m in sys.modules))
sys.exit(status)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "command", [["--version"], ["inspect"], ["verify"], ["latest", "ROOT"], ["verify", "ROOT"]]
)
def test_commands_that_place_no_arrays_do_not_import_jax(tmp_path, command):
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    state = {"model": nnx.state(model), "opt": nnx.state(optimizer), "key": nnx.Rngs(1)()}
    state["plain"] = {"opt_state": optax.adam(1e-3).init({"w": jnp.ones(2)})}
    if command[-1] == "ROOT":  # a CheckpointManager root, as a resumed job holds
        with ocp.CheckpointManager(tmp_path / "run") as mngr:
            mngr.save(1, args=ocp.args.Composite(state=jax_ucp.UCPSave(state)))
            mngr.wait_until_finished()
        args = [command[0], str(tmp_path / "run")]
    else:
        jax_ucp.save(tmp_path / "c", state)
        args = command if command == ["--version"] else [*command, str(tmp_path / "c")]
    r = subprocess.run(
        [sys.executable, "-c", _WRAPPER, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=150,
        env={"PYTHONPATH": REPO, "COLUMNS": "200", "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "LOADED: []" in r.stdout, r.stdout
    assert "allow-list" not in r.stdout and "dicts of their fields" not in r.stdout, r.stdout
