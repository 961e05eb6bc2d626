"""An imported Adam state lands wherever the target's optax chain keeps it: a real Hugging Face
Trainer + DeepSpeed checkpoint (``tests/fixtures/hf_trainer/``) restored through the shipped
``hf_llama`` spec into TransformerLM params and ``optax.chain(clip_by_global_norm, adamw)`` (and
deeper wrappers), moments and step bit-exact; two Adam states in the target are refused."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import optax
import pytest

import jax_ucp
from jax_ucp._src.restoring.adam_state import RequestError, adam_states
from jax_ucp.language import load_spec
from jax_ucp.models import LMConfig, TransformerLM
from tests.ucp_testing import REPO

pytestmark = pytest.mark.timeout(300)
SRC = os.path.join(REPO, "tests", "fixtures", "hf_trainer", "llama_z2_dp2", "checkpoint-2")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return jax_ucp.convert(SRC, str(tmp_path_factory.mktemp("adam") / "ucp"))


@pytest.fixture(scope="module")
def model():
    with open(os.path.join(SRC, "config.json")) as f:
        cfg = LMConfig.from_hf_llama(json.load(f))
    tokens = np.zeros((1, 4), np.int32)
    params = jax.eval_shape(lambda: TransformerLM(cfg).init(jax.random.key(0), tokens))["params"]
    return cfg, params


def _bits(a) -> bytes:
    return np.ascontiguousarray(np.asarray(a)).tobytes()


def _adam_of(state):
    """The ScaleByAdamState inside an optax state, by type."""
    found = [
        s
        for s in jax.tree_util.tree_leaves(
            state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState)
        )
        if isinstance(s, optax.ScaleByAdamState)
    ]
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1)),
        lambda: optax.chain(
            optax.clip_by_global_norm(1.0),
            optax.masked(optax.adamw(1e-3), lambda p: jax.tree.map(lambda _: True, p)),
        ),
        lambda: optax.adamw(1e-3),
    ],
    ids=["chain_clip_adamw", "chain_clip_masked", "adamw"],
)
def test_adam_moments_follow_the_chain_bit_exact(imported, model, make_tx):
    """The moments and step land in the target's ScaleByAdamState (wherever the chain keeps it),
    bit-exact to what the same spec makes of them without a target (``opt_state/0``)."""
    cfg, params = model
    spec = load_spec("hf_llama", **cfg.head_settings)
    tx = make_tx()
    opt_state = jax.eval_shape(tx.init, params)
    got = jax_ucp.restore(imported, target={"params": params, "opt_state": opt_state}, spec=spec)
    plain = jax_ucp.restore(imported, spec=spec)
    adam = _adam_of(got["opt_state"])
    assert int(adam.count) == 2
    for moment in ("mu", "nu"):
        want = jax.tree_util.tree_leaves_with_path(plain["opt_state"]["0"][moment])
        have = dict(jax.tree_util.tree_leaves_with_path(getattr(adam, moment)))
        assert len(want) == len(have) > 0
        for path, value in want:
            key = tuple(jax.tree_util.DictKey(p.key) for p in path)
            assert _bits(have[key]) == _bits(value), (moment, path)
    # and the state is one optax accepts: a step runs
    grads = jax.tree.map(lambda p: np.ones(p.shape, p.dtype), params)
    real = jax.tree.map(np.asarray, got["params"])
    updates, _ = tx.update(grads, got["opt_state"], real)
    assert jax.tree.structure(updates) == jax.tree.structure(real)


def test_adam_state_found_inside_inject_hyperparams(model):
    """inject_hyperparams keeps the Adam state under inner_state (its own count and
    hyperparams are not the Adam state's)."""
    _, params = model
    tx = optax.chain(
        optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3)
    )
    found = adam_states({"opt_state": jax.eval_shape(tx.init, params)})
    assert found == [("opt_state", "1", "inner_state", "0")]


def test_two_adam_states_in_the_target_are_refused(imported, model):
    """A target holding two Adam states (a multi_transform of two adamw) is ambiguous: an error
    naming both places, not moments in the wrong one."""
    cfg, params = model
    labels = jax.tree.map(lambda _: "a", params)
    labels["wte"] = jax.tree.map(lambda _: "b", params["wte"])
    tx = optax.multi_transform({"a": optax.adamw(1e-3), "b": optax.adamw(1e-4)}, labels)
    opt_state = jax.eval_shape(tx.init, params)
    found = adam_states({"opt_state": opt_state})
    assert len(found) == 2
    with pytest.raises(RequestError, match="2 Adam states") as e:
        jax_ucp.restore(
            imported,
            target={"params": params, "opt_state": opt_state},
            spec=load_spec("hf_llama", **cfg.head_settings),
        )
    for prefix in found:
        assert "/".join(prefix) in str(e.value)
