#!/usr/bin/env python3
"""A flax NNX run preempted and resumed on another mesh with jax_ucp, no hand-built target.

An NNX model (params named with ``nnx.with_partitioning``, a BatchNorm, a Dropout holding an
RNG stream) and its ``nnx.Optimizer`` (optax AdamW) train on an fsdp=2 × tp=4 mesh of 8 CPU
devices, saving asynchronously through an Orbax ``CheckpointManager`` + ``jax_ucp.UCPSave``.
The run is preempted at step T, then, each in a FRESH process:

  resume  on 4 devices, fsdp=2 × tp=2: ``jax_ucp.restore(root, step="latest", mesh=, rules=)``
  grow    back to 8 devices, fsdp=4 × tp=2: the same inside the manager (``UCPRestore``)

and the losses continue those of an uninterrupted run (the baseline) to within float rounding
(another mesh sums in another order). Neither resume builds a target: the checkpoint records
each array's logical axes, the rules place them on the new mesh, and what comes back is the
``nnx.State`` that was saved (Params, BatchStats, the RNG stream's typed key, the optimizer's
OptVariables), ready for ``nnx.update``.

  python examples/nnx_resume.py            # ~1 minute on 2 busy cores
  python examples/nnx_resume.py PHASE DIR  # one phase in this process (what the driver runs)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

STEPS, SAVE_EVERY, PREEMPT_AT, GROW_AT = 12, 3, 7, 10
RULES = [("embed", "fsdp"), ("mlp", "tp")]  # logical axis -> mesh axis
# phase -> (devices, mesh shape over ("fsdp", "tp"), first step, last step)
PHASES = {
    "baseline": (8, (2, 4), 0, STEPS),
    "train": (8, (2, 4), 0, PREEMPT_AT),
    "resume": (4, (2, 2), None, GROW_AT),
    "grow": (8, (4, 2), None, STEPS),
}


def run_phase(phase: str, workdir: str) -> None:
    """One phase in this process: train from step 0 or resume, save, write its losses."""
    devices, shape, first, last = PHASES[phase]
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import orbax.checkpoint as ocp
    from flax import nnx

    import jax_ucp

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            init = nnx.initializers.lecun_normal()
            self.up = nnx.Linear(
                16, 64, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs
            )
            self.norm = nnx.BatchNorm(64, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.down = nnx.Linear(
                64, 16, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs
            )

        def __call__(self, x):
            return self.down(self.drop(nnx.relu(self.norm(self.up(x)))))

    auto = (jax.sharding.AxisType.Auto,) * 2  # XLA propagates shardings through the step
    mesh = jax.make_mesh(shape, ("fsdp", "tp"), axis_types=auto)
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        model = Model(nnx.Rngs(0, dropout=1))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    root = os.path.join(workdir, "run")
    manager = ocp.CheckpointManager(
        root, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
    )
    if first is None and phase == "resume":
        # The resume: no target; the recorded logical axes and the rules place every array.
        restored = jax_ucp.restore(root, step="latest", mesh=mesh, rules=RULES)
    elif first is None:  # the same inside the CheckpointManager
        step = jax_ucp.latest_step(root)
        restored = manager.restore(
            step, args=ocp.args.Composite(state=jax_ucp.UCPRestore(mesh=mesh, rules=RULES))
        ).state
    if first is None:
        nnx.update(model, restored["model"])
        nnx.update(optimizer, restored["opt"])
        first = restored["step"]

    losses = {}
    data = np.random.default_rng(0)
    inputs = data.normal(size=(STEPS, 32, 16)).astype(np.float32)
    targets = np.sin(inputs[..., ::-1] * 2).astype(np.float32)
    for step in range(first, last):
        with jax.set_mesh(mesh):
            losses[step] = float(train_step(model, optimizer, inputs[step], targets[step]))
        if phase != "baseline" and (step + 1) % SAVE_EVERY == 0:
            state = {"model": nnx.state(model), "opt": nnx.state(optimizer), "step": step + 1}
            manager.save(step + 1, args=ocp.args.Composite(state=jax_ucp.UCPSave(state)))
    manager.wait_until_finished()
    with open(os.path.join(workdir, f"{phase}.json"), "w") as f:
        kernel = model.up.kernel.get_value()  # placed by its logical axes and the rules
        json.dump(
            {
                "first": first,
                "losses": losses,
                "devices": jax.device_count(),
                "kernel_spec": [str(a) for a in kernel.sharding.spec],
                "mesh": dict(kernel.sharding.mesh.shape),
            },
            f,
        )
    if phase == "train":  # preempted: no cleanup, no final save
        os._exit(0)
    manager.close()


def main(workdir: str | None = None) -> dict:
    """Every phase in its own process; returns the losses and the largest deviation."""
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="nnx_resume_")
    results = {}
    for phase in PHASES:
        subprocess.run([sys.executable, os.path.abspath(__file__), phase, workdir], check=True)
        with open(os.path.join(workdir, f"{phase}.json")) as f:
            results[phase] = json.load(f)
    baseline = results["baseline"]["losses"]
    worst = 0.0
    for phase in ("train", "resume", "grow"):
        r = results[phase]
        for step, loss in r["losses"].items():
            worst = max(worst, abs(loss - baseline[step]))
        print(
            f"{phase:6} on {r['devices']} devices from step {r['first']:2}: "
            + " ".join(f"{loss:.5f}" for loss in r["losses"].values())
        )
    print(f"baseline on 8 devices:            {' '.join(f'{v:.5f}' for v in baseline.values())}")
    print(f"largest deviation from the uninterrupted run: {worst:.2e}")
    if own:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return {"results": results, "worst": worst}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in PHASES:
        run_phase(sys.argv[1], sys.argv[2])
    else:
        main()
