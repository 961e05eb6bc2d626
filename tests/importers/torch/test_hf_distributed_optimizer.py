"""transformers' own distributed save of a run (tools/fixtures/
make_hf_distributed_optimizer_fixture.py: a tensor-parallel tiny Llama, 2 AdamW steps,
``save_pretrained(distributed_checkpoint=True)`` + ``save_optimizer_distributed`` into
``optimizer/`` beside it): the model's rank-local safetensors and the optimizer's DCP folder are
one import, and ``optax_from_torch`` on the folder gives torch's next step. Torch-free: the
truth holds the next step's gradients and the parameters torch's AdamW gave."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_ucp
from jax_ucp.errors import SourceError
from tests.ucp_testing import REPO, load_truth

SRC = os.path.join(REPO, "tests", "fixtures", "torch", "hf_dist_optimizer_tp2")

pytestmark = pytest.mark.timeout(120)


def _part(truth: dict, kind: str) -> dict[str, np.ndarray]:
    return {k.split("/", 1)[1]: v for k, v in truth.items() if k.startswith(kind + "/")}


def test_the_model_and_its_optimizer_folder_continue_as_torch_steps():
    truth = load_truth(SRC + ".truth.npz")
    run = jax_ucp.optax_from_torch(SRC, schedule=1e-3, clip=None)
    assert run.optimizer == "adamw" and run.step == truth["step"] == 2
    adam = next(s for s in run.opt_state if isinstance(s, optax.ScaleByAdamState))
    for kind, tree in (("param", run.params), ("exp_avg", adam.mu), ("exp_avg_sq", adam.nu)):
        want = _part(truth, kind)
        assert sorted(tree) == sorted(want)
        for name, value in want.items():  # bit for bit what torch held
            np.testing.assert_array_equal(tree[name], value, err_msg=f"{kind} {name}")
    params = jax.tree.map(jnp.asarray, run.params)
    grads = jax.tree.map(jnp.asarray, _part(truth, "grad"))
    updates, _ = jax.jit(run.tx.update)(grads, run.opt_state, params)
    stepped = optax.apply_updates(params, updates)
    for name, value in _part(truth, "next").items():
        np.testing.assert_allclose(
            np.asarray(stepped[name]), value, rtol=0, atol=1e-6, err_msg=name
        )


def test_the_optimizer_folder_alone_says_where_its_model_is():
    with pytest.raises(
        SourceError, match=r"save_optimizer_distributed\).*import \S*hf_dist_optimizer_tp2 "
    ):
        jax_ucp.restore(os.path.join(SRC, "optimizer"))
