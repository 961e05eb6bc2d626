"""End to end: jax_ucp.save a scanned model with its optax state, jax_ucp.restore it through a
UCP-language spec into a per-layer model (and with fused QKV split), bit-exact, moments included."""

import jax
import numpy as np
import optax
import pytest

import jax_ucp
from jax_ucp import language as L


def rnd(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.fixture
def saved(tmp_path):
    Lyr, H = 3, 4
    params = {
        "embed": rnd((7, H), 0),
        "layers": {"qkv": {"kernel": rnd((Lyr, H, 3 * H), 1)}, "norm": {"scale": rnd((Lyr, H), 2)}},
    }
    opt = optax.adam(1e-2)
    state = opt.init(params)
    grads = jax.tree_util.tree_map(lambda x: np.ones_like(x), params)
    _, state = opt.update(grads, state, params)  # non-trivial moments
    tree = {"params": params, "opt_state": state}
    path = tmp_path / "ckpt"
    jax_ucp.save(str(path), tree)
    return path, tree


SPEC = L.Spec(
    settings={"num_heads": 2, "head_dim": 2},
    restore=[
        L.RestoreRule(
            r"layers/qkv/kernel",
            "layers_{i}/attn/{part}/kernel",
            ops=["unstack", {"op": "split_qkv", "axis": 1}],
        ),
        L.RestoreRule(r"layers/(?P<r>.*)", "layers_{i}/{r}", ops=["unstack"]),
        L.RestoreRule(r"embed"),
    ],
)


def test_restore_through_spec_is_bit_exact_for_params_and_moments(saved):
    path, tree = saved
    out = jax_ucp.restore(str(path), spec=SPEC)
    qkv = tree["params"]["layers"]["qkv"]["kernel"]
    for i in range(3):
        parts = L.split_parts(L.QKV(dim=1), qkv[i], settings=SPEC.settings)
        for p in "qkv":
            np.testing.assert_array_equal(
                out["params"][f"layers_{i}"]["attn"][p]["kernel"], parts[p]
            )
        for m in ("mu", "nu"):
            mom = getattr(tree["opt_state"][0], m)
            np.testing.assert_array_equal(
                out["opt_state"]["0"][m][f"layers_{i}"]["norm"]["scale"],
                np.asarray(mom["layers"]["norm"]["scale"][i]),
            )
            mparts = L.split_parts(
                L.QKV(dim=1), np.asarray(mom["layers"]["qkv"]["kernel"][i]), settings=SPEC.settings
            )
            np.testing.assert_array_equal(
                out["opt_state"]["0"][m][f"layers_{i}"]["attn"]["k"]["kernel"], mparts["k"]
            )
    assert int(out["opt_state"]["0"]["count"]) == 1


def test_restore_with_a_bad_spec_names_the_problem(saved):
    path, _ = saved
    bad = L.Spec(
        restore=[
            L.RestoreRule(r"layers/(?P<r>.*)", "x/{r}", ops=[{"op": "group_stages", "stages": 2}]),
            L.RestoreRule("embed"),
        ]
    )
    with pytest.raises(jax_ucp.LanguageError, match="cannot group 3 layers into 2 pipeline stages"):
        jax_ucp.restore(str(path), spec=bad)
