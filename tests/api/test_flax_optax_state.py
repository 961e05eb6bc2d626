"""A flax/optax state through save and restore: moments sharded like their parameters, optax
states usable by ``tx.update`` as saved, a rule that cannot apply named."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jax_ucp
from tests.ucp_testing import assert_bit_exact, mesh


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        h = nn.Dense(16, kernel_init=init, use_bias=False, name="up")(x)
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed"))
        return nn.Dense(8, kernel_init=init, use_bias=False, name="down")(h)


def _flax_state():
    """What flax users write: boxed params, optimizer state from the unboxed ones."""
    params = MLP().init(jax.random.key(0), jnp.ones((2, 8)))["params"]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    opt_state = tx.init(nn.meta.unbox(params))
    return tx, params, opt_state


RULES = [("embed", "fsdp"), ("mlp", "tp")]


def test_moments_are_sharded_like_their_parameters_by_tree_structure(tmp_path):
    _tx, params, opt_state = _flax_state()
    jax_ucp.save(tmp_path / "c", {"params": params, "opt_state": opt_state})
    m = {e.name: e for e in jax_ucp.inspect(tmp_path / "c").tensors}
    assert m["opt_state/1/0/mu/up/kernel"].logical_axes == ("embed", "mlp")
    assert m["opt_state/1/0/nu/down/kernel"].logical_axes == ("mlp", "embed")
    new = mesh((2, 2), ("fsdp", "tp"))
    out = jax_ucp.restore(tmp_path / "c", mesh=new, rules=RULES)
    assert out["params"]["up"]["kernel"].sharding.spec == P("fsdp", "tp")
    mu = out["opt_state"][1][0].mu
    assert mu["up"]["kernel"].sharding.spec == P("fsdp", "tp")
    assert mu["down"]["kernel"].sharding.spec == P("tp", "fsdp")


@pytest.mark.parametrize("how", ["host", "mesh", "rules", "manager"])
def test_restore_without_target_gives_a_state_tx_update_accepts(tmp_path, how):
    import orbax.checkpoint as ocp

    tx, params, opt_state = _flax_state()
    params = nn.meta.unbox(params)
    state = {"params": params, "opt_state": opt_state, "step": 3}
    new = mesh((2, 2), ("fsdp", "tp"))
    if how == "manager":
        with ocp.CheckpointManager(tmp_path / "run") as mngr:
            mngr.save(3, args=ocp.args.Composite(state=jax_ucp.UCPSave(state)))
            mngr.wait_until_finished()
            args = ocp.args.Composite(state=jax_ucp.UCPRestore(mesh=new, strict=False))
            out = mngr.restore(3, args=args).state
    else:
        jax_ucp.save(tmp_path / "c", state)
        kwargs = {"host": {}, "mesh": {"mesh": new}, "rules": {"mesh": new, "rules": RULES}}[how]
        kwargs |= {"strict": False} if kwargs else {}  # unboxed params: no names, no specs
        out = jax_ucp.restore(tmp_path / "c", **kwargs)
    assert type(out["opt_state"]) is tuple
    assert type(out["opt_state"][1][0]).__name__ == "ScaleByAdamState"
    assert type(out["opt_state"][0]).__name__ == "EmptyState"  # no leaves, still rebuilt
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    updates, _ = tx.update(grads, out["opt_state"], out["params"])
    want, _ = tx.update(grads, opt_state, params)
    for a, b in zip(jax.tree_util.tree_leaves(updates), jax.tree_util.tree_leaves(want)):
        assert_bit_exact(np.asarray(a), np.asarray(b))
    assert out["step"] == 3


def test_a_rule_naming_a_missing_mesh_axis_is_an_error(tmp_path):
    _, params, _ = _flax_state()
    jax_ucp.save(tmp_path / "c", {"params": params})
    new = mesh((2, 2), ("fsdp", "tp"))
    with pytest.raises(
        jax_ucp.RequestError, match=r"\('mlp', 'model'\).*'model'.*\('fsdp', 'tp'\)"
    ):
        jax_ucp.restore(tmp_path / "c", mesh=new, rules=[("embed", "fsdp"), ("mlp", "model")])
