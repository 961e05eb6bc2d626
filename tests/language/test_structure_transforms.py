"""Structure changes absorbed at restore through the UCP language (issue 5), on a real flax GPT
with optax AdamW state: scanned [L, …] ⇄ per-layer, pipeline [S, L/S, …] onto another stage
count, fused QKV ⇄ separate q/k/v. Saved sharded on one mesh, restored as lazy views onto
another; bit-exact against an independent numpy oracle; optimizer moments follow the parameter
rules automatically; the converted model computes the same function.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from tests.ucp_testing import REPO

sys.path.insert(0, os.path.join(REPO, "examples"))

import elastic_model as M

import jax_ucp
from jax_ucp.errors import LanguageError
from jax_ucp.language import RestoreRule, Spec

L_, D, H = 4, 16, 4
BASE = dict(vocab=32, d_model=D, n_layers=L_, n_heads=H, d_ff=32, seq_len=8)


def cfg(layout="layers", stages=1, fused=True):
    return M.GPTConfig(**BASE, layout=layout, stages=stages, fused_qkv=fused)


TX = optax.adamw(1e-3)


# ----------------------------------------------------------------------------- numpy oracle


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a)).reshape(-1).view(np.uint8)


def flat(tree) -> dict:
    return {M._path_str(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def expected(saved_flat: dict, src, dst) -> dict:
    """What restoring a flat {params, opt_state} of ``src`` into ``dst`` must give: plain numpy
    stack / split / reshape (``elastic_model.convert_flat``), independent of the UCP language."""
    return M.convert_flat(saved_flat, src, dst)


# -------------------------------------------------------------------------------- helpers


def make_state(c, mesh, seed=0):
    """{params, opt_state (moments filled with distinct random values), step} on ``mesh``."""
    rng = np.random.default_rng(seed)
    fill = lambda x, scale: jnp.asarray(rng.standard_normal(x.shape).astype(np.float32) * scale)
    # random values of the model's parameter shapes (no per-op compiles of an eager flax init)
    params = jax.tree.map(lambda x: fill(x, 0.2), jax.eval_shape(lambda: M.init_params(c, seed)))
    opt = TX.init(params)
    opt = (
        opt[0]._replace(
            count=jnp.int32(7),
            mu=jax.tree.map(lambda x: fill(x, 1e-2), opt[0].mu),
            nu=jax.tree.map(lambda x: jnp.abs(fill(x, 1e-4)), opt[0].nu),
        ),
    ) + tuple(opt[1:])
    state = {"params": params, "opt_state": opt}
    sh = M.state_shardings(jax.eval_shape(lambda: state), mesh)
    return {**jax.device_put(state, sh), "step": 7}


def target_for(c, mesh):
    return {**M.abstract_state(c, TX, mesh), "step": 0}


def check_restored(out, target, want: dict):
    got = flat({"params": out["params"], "opt_state": out["opt_state"]})
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        assert got[k].dtype == w.dtype and got[k].shape == w.shape, k
        assert np.array_equal(bits(got[k]), bits(w)), k
    for a, t in zip(jax.tree.leaves(out), jax.tree.leaves(target)):
        if hasattr(t, "sharding"):
            assert a.sharding == t.sharding
    assert out["step"] == 7


_FWD = {}


def logits(c, params):
    if c not in _FWD:
        _FWD[c] = jax.jit(M.GPT(c).apply)
    tokens = jnp.asarray(M.batch_at(0, 0, 2, BASE["seq_len"] - 1, BASE["vocab"]))
    return np.asarray(_FWD[c]({"params": params}, tokens))


def convert(tmp_path, name, state, src, dst, mesh):
    """Save ``state`` (model src), restore it into model dst on ``mesh`` through layout_spec."""
    path = tmp_path / name
    jax_ucp.save(path, state)
    target = target_for(dst, mesh)
    out = jax_ucp.restore(path, target=target, spec=M.layout_spec(src, dst))
    want = expected(flat({"params": state["params"], "opt_state": state["opt_state"]}), src, dst)
    check_restored(out, target, want)
    return out


@pytest.fixture(scope="module")
def meshes():
    return M.make_mesh((2, 2, 2)), M.make_mesh((1, 2, 2), jax.devices()[:4])


# ---------------------------------------------------------------------------------- tests


def test_scanned_to_per_layer_and_back_inside_checkpoint_manager(tmp_path, meshes):
    """Training with scanned layers, resumed as a per-layer model on 4 devices, and back."""
    m8, m4 = meshes
    src, dst = cfg("scanned"), cfg("layers")
    state = make_state(src, m8)
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(7, args=ocp.args.Composite(state=jax_ucp.UCPSave(state)))
        mngr.wait_until_finished()
        target = target_for(dst, m4)
        out = mngr.restore(
            7,
            args=ocp.args.Composite(
                state=jax_ucp.UCPRestore(target=target, spec=M.layout_spec(src, dst))
            ),
        ).state
    saved = flat({"params": state["params"], "opt_state": state["opt_state"]})
    check_restored(out, target, expected(saved, src, dst))
    # the rule written for params/layers/... moved the moments too
    np.testing.assert_array_equal(
        np.asarray(out["opt_state"][0].mu["layers_3"]["fc1"]["kernel"]),
        np.asarray(state["opt_state"][0].mu["layers"]["fc1"]["kernel"])[3],
    )
    np.testing.assert_allclose(
        logits(dst, out["params"]), logits(src, state["params"]), rtol=2e-5, atol=2e-5
    )
    back = convert(tmp_path, "back", out, dst, src, m8)
    for k, v in saved.items():  # round trip: bit-exact with the original
        assert np.array_equal(bits(flat(back)[k]), bits(v)), k


@pytest.mark.parametrize("new_stages", [4, 1])
def test_pipeline_stages_regrouped(tmp_path, meshes, new_stages):
    m8, m4 = meshes
    src, dst = cfg("pipeline", stages=2), cfg("pipeline", stages=new_stages)
    state = make_state(src, m8)
    assert state["params"]["stages"]["layers"]["fc1"]["kernel"].shape == (2, 2, D, 32)
    out = convert(tmp_path, "pp", state, src, dst, m4)
    assert out["params"]["stages"]["layers"]["fc1"]["kernel"].shape == (
        new_stages,
        L_ // new_stages,
        D,
        32,
    )
    assert out["opt_state"][0].nu["stages"]["layers"]["fc1"]["kernel"].shape == (
        new_stages,
        L_ // new_stages,
        D,
        32,
    )
    np.testing.assert_allclose(
        logits(dst, out["params"]), logits(src, state["params"]), rtol=2e-5, atol=2e-5
    )


def test_pipeline_to_per_layer_and_separate_qkv(tmp_path, meshes):
    m8, m4 = meshes
    src, dst = cfg("pipeline", stages=2), cfg("layers", fused=False)
    state = make_state(src, m8)
    out = convert(tmp_path, "pp2layers", state, src, dst, m4)
    np.testing.assert_allclose(
        logits(dst, out["params"]), logits(src, state["params"]), rtol=2e-5, atol=2e-5
    )


def test_layer_count_not_divisible_by_new_stage_count_is_a_clear_error(tmp_path, meshes):
    m8, _ = meshes
    src = cfg("pipeline", stages=2)
    path = tmp_path / "pp"
    jax_ucp.save(path, make_state(src, m8))
    spec = M.layout_spec(
        src, dict(layout="pipeline", stages=3, fused_qkv=True, n_heads=H, d_model=D)
    )
    # named after the parameter, not one of the optimizer moments that mirror it
    with pytest.raises(
        LanguageError,
        match=r"on params/stages/layers/.*cannot regroup 4 layers .*into 3 "
        r"pipeline stages: 4 is not divisible by 3",
    ):
        jax_ucp.restore(path, spec=spec)
    # the same when a user writes the rule by hand, and onto a scanned layout from per-layer
    hand = Spec(
        settings={"pp": 3},
        restore=[
            RestoreRule(r"stages/layers/.*", ops=[{"op": "regroup_stages", "stages": "pp"}]),
            RestoreRule(r".*"),
        ],
    )
    with pytest.raises(LanguageError, match="4 is not divisible by 3"):
        jax_ucp.restore(path, spec=hand)
    layers = tmp_path / "layers"
    jax_ucp.save(layers, make_state(cfg("layers"), m8))
    with pytest.raises(LanguageError, match=r"cannot group 4 layers into 3 pipeline stages"):
        jax_ucp.restore(
            layers,
            spec=M.layout_spec(
                cfg("layers"),
                dict(layout="pipeline", stages=3, fused_qkv=True, n_heads=H, d_model=D),
            ),
        )


def test_fused_qkv_to_separate_and_back(tmp_path, meshes):
    m8, m4 = meshes
    src, dst = cfg("layers", fused=True), cfg("layers", fused=False)
    state = make_state(src, m8)
    out = convert(tmp_path, "split", state, src, dst, m4)
    qkv = np.asarray(state["opt_state"][0].nu["layers_1"]["attn"]["qkv"]["kernel"])
    np.testing.assert_array_equal(
        np.asarray(out["opt_state"][0].nu["layers_1"]["attn"]["k"]["kernel"]), qkv[:, D : 2 * D]
    )
    np.testing.assert_allclose(
        logits(dst, out["params"]), logits(src, state["params"]), rtol=2e-5, atol=2e-5
    )
    back = convert(tmp_path, "merge", out, dst, src, m8)
    saved = flat({"params": state["params"], "opt_state": state["opt_state"]})
    got = flat(back)
    for k, v in saved.items():
        assert np.array_equal(bits(got[k]), bits(v)), k


def test_scanned_fused_to_per_layer_separate_and_back(tmp_path, meshes):
    """Both changes in one restore (unstack + split_qkv), and their inverse (merge_qkv + stack)."""
    m8, m4 = meshes
    src, dst = cfg("scanned", fused=True), cfg("layers", fused=False)
    state = make_state(src, m8)
    out = convert(tmp_path, "fwd", state, src, dst, m4)
    back = convert(tmp_path, "inv", out, dst, src, m8)
    saved = flat({"params": state["params"], "opt_state": state["opt_state"]})
    for k, v in saved.items():
        assert np.array_equal(bits(flat(back)[k]), bits(v)), k


def _file_bytes_read() -> int:
    import tensorstore as ts

    for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read"):
        return int(m["values"][0]["value"])
    return 0


def test_transformed_restore_reads_only_the_needed_slices(tmp_path):
    """The spec's views are lazy: restoring layer 3 of a scanned [8, …] checkpoint into the
    per-layer model reads about 1/8 of the stacked tensor, not all of it."""
    src = M.GPTConfig(
        vocab=32, d_model=64, n_layers=8, n_heads=4, d_ff=256, seq_len=8, layout="scanned"
    )
    dst = M.GPTConfig(
        vocab=32, d_model=64, n_layers=8, n_heads=4, d_ff=256, seq_len=8, layout="layers"
    )
    params = jax.tree.map(
        lambda x: np.full(x.shape, 0.5, x.dtype), jax.eval_shape(lambda: M.init_params(src))
    )
    jax_ucp.save(tmp_path / "c", {"params": params}, inner_chunk_bytes=4096)
    m = M.make_mesh((2, 2, 2))
    ab = M.abstract_state(dst, optax.sgd(1.0), m)["params"]
    before = _file_bytes_read()
    out = jax_ucp.restore(
        tmp_path / "c",
        target={"params": {"layers_3": {"fc1": ab["layers_3"]["fc1"]}}},
        spec=M.layout_spec(src, dst),
    )
    read = _file_bytes_read() - before
    layer = 64 * 256 * 4 + 256 * 4  # one layer's fc1 kernel + bias
    assert (
        out["params"]["layers_3"]["fc1"]["kernel"].sharding
        == ab["layers_3"]["fc1"]["kernel"].sharding
    )
    np.testing.assert_array_equal(np.asarray(out["params"]["layers_3"]["fc1"]["kernel"]), 0.5)
    assert layer <= read < 1.5 * layer, (read, layer, 8 * layer)
