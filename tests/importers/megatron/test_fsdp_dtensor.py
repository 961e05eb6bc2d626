"""megatron-core's ``fsdp_dtensor`` layout (Megatron-LM ``--ckpt-format fsdp_dtensor``,
Megatron-FSDP), written by megatron-core 0.19.2's and Megatron-LM's own code on CPU, 2 ranks
(tools/fixtures/make_megatron_fsdp_dtensor_fixture.py: Megatron-FSDP ``optim_grads_params``,
two Adam steps, ``generate_state_dict`` + ``preprocess_fsdp_dtensor_state_dict`` +
``dcp.save``): every parameter and both moments in uneven DP row chunks, compared with torch's
own ``dcp.load`` of the folder (``gpt_dp2.consolidated.npz``)."""

from __future__ import annotations

import os
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ucp
from jax_ucp._src.importers import registry
from jax_ucp.conversion import ImportOptions, MegatronOptions
from tests.importers.megatron.test_dcp import ExtraFile, read_layout, write_layout
from tests.ucp_testing import REPO, assert_bit_exact, mesh

FIX = os.path.join(REPO, "tests", "fixtures", "megatron_fsdp_dtensor")
SRC = os.path.join(FIX, "gpt_dp2")
ITER = os.path.join(SRC, "iter_0000002")
STATE = "optimizer.state.module.module."

pytestmark = pytest.mark.timeout(120)


#: name -> (parameters, the optimizer keys' prefix: one more "module." under Float16Module)
FIXTURES = {"gpt_dp2": (17, STATE), "llama_bf16_dp2": (10, STATE + "module.")}


def reference(name: str = "gpt_dp2") -> dict[str, dict[str, np.ndarray]]:
    """torch's dcp.load of the checkpoint, as the import's tree: params (the model tensors,
    Megatron-FSDP's fp32 main weights, bf16 run too), mu / nu (exp_avg / exp_avg_sq), under the
    unwrapped names."""
    count, state = FIXTURES[name]
    with np.load(os.path.join(FIX, f"{name}.consolidated.npz")) as z:
        saved = {k: z[k] for k in z.files}
    params = {k[len("model.module.") :]: v for k, v in saved.items() if k.startswith("model.")}
    assert len(params) == count and not any(k.startswith("module.") for k in params)
    assert {v.dtype for v in params.values()} == {np.dtype(np.float32)}
    return {
        "params": params,
        "mu": {k: saved[f"{state}{k}.exp_avg"] for k in params},
        "nu": {k: saved[f"{state}{k}.exp_avg_sq"] for k in params},
        "step": {k: saved[f"{state}{k}.step"] for k in params},
    }


def _target(want: dict) -> dict:
    """The tree on a 2 x 4 mesh: rows on "a" and columns on "b" where they divide."""
    m = mesh((2, 4), ("a", "b"))

    def one(x):
        spec = [None] * x.ndim
        if x.ndim and x.shape[0] % 2 == 0:
            spec[0] = "a"
        if x.ndim > 1 and x.shape[-1] % 4 == 0:
            spec[-1] = "b"
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(m, P(*spec)))

    opt_state: dict = {s: {k: one(v) for k, v in want[s].items()} for s in ("mu", "nu")}
    opt_state["count"] = jax.ShapeDtypeStruct((), np.int32)
    return {"params": {k: one(v) for k, v in want["params"].items()}, "opt_state": opt_state}


@pytest.mark.parametrize(
    "name, src",
    [("gpt_dp2", SRC), ("gpt_dp2", ITER), ("llama_bf16_dp2", os.path.join(FIX, "llama_bf16_dp2"))],
)
def test_restores_bit_exact_onto_a_mesh_and_through_convert(tmp_path, name, src):
    """Weights (the optimizer's fp32 parameters), both Adam moments and the step, from the save
    root or its iter folder, straight onto a 2 x 4 mesh and through convert: equal to torch's
    own read of every uneven chunk; the Adam step equals every parameter's saved step. The
    bf16 SwiGLU run's fc1 comes as Megatron-LM saved it, its halves ``weight_w`` / ``weight_v``."""
    # an iter folder alone is plain torch DCP by its file names (detection unpickles nothing):
    # the torch importer refuses it by its keys, pointing here
    fmt = "megatron" if src == ITER else None
    assert registry.detect_format(src) == ("torch" if src == ITER else "megatron")
    want = reference(name)
    target = _target(want)
    direct = jax_ucp.restore(src, target=target, format=fmt)
    ckpt = jax_ucp.convert(src, str(tmp_path / "ucp"), format=fmt)
    converted = jax_ucp.restore(ckpt, target=target)
    for got in (direct, converted):
        for tree, node, where in (
            ("params", got["params"], target["params"]),
            ("mu", got["opt_state"]["mu"], target["opt_state"]["mu"]),
            ("nu", got["opt_state"]["nu"], target["opt_state"]["nu"]),
        ):
            assert sorted(node) == sorted(want[tree])
            for k, v in want[tree].items():
                assert node[k].sharding == where[k].sharding
                assert_bit_exact(node[k], v, f"{tree}/{k}")
        assert int(got["opt_state"]["count"]) == 2
    assert {float(s) for s in want["step"].values()} == {2.0}
    source = jax_ucp.inspect(ckpt).source
    assert source["format"] == "fsdp_dtensor" and source["optimizer_layout"] == "fsdp_dtensor"
    count, state = FIXTURES[name]
    assert source["iteration"] == 2 and source["tensors"] == count
    # every .metadata tensor imported or named: the per-parameter steps, read as the one count
    assert sorted(source["skipped"]) == sorted(f"{state}{k}.step" for k in want["params"])
    # megatron-core's two param groups (no weight decay on norms and biases: wd_mult 0), from
    # the per-parameter group records, with the generator's OptimizerConfig (lr, weight decay)
    groups = source["megatron_optimizer"]["param_groups"]
    assert sorted(g["wd_mult"] for g in groups) == [0.0, 1.0]
    assert {(g["lr"], g["weight_decay"], tuple(g["betas"])) for g in groups} == {
        (0.01, 0.01, (0.9, 0.999))
    }
    if name.startswith("llama"):
        assert {k for k in want["params"] if "linear_fc1" in k} == {
            "decoder.layers.0.mlp.linear_fc1.weight_w",
            "decoder.layers.0.mlp.linear_fc1.weight_v",
        }


def test_weights_only_names_every_optimizer_tensor(tmp_path):
    ckpt = jax_ucp.convert(SRC, str(tmp_path / "ucp"), importing=ImportOptions(weights_only=True))
    got = jax_ucp.restore(ckpt)
    assert sorted(got) == ["params"]
    for k, v in reference()["params"].items():
        assert_bit_exact(got["params"][k], v, k)
    skipped = jax_ucp.inspect(ckpt).source["skipped"]
    assert len(skipped) == 17 * 3 and all("weights_only" in why for why in skipped.values())


def test_vocab_padding_is_stripped_from_weights_and_moments(tmp_path):
    """vocab_size=61: the embedding's and output layer's 64 padded rows cut to 61 in the
    weight and both moments alike, from the chunks holding them."""
    got = jax_ucp.restore(
        jax_ucp.convert(SRC, str(tmp_path / "ucp"), importing=MegatronOptions(vocab_size=61))
    )
    want = reference()
    for k in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert_bit_exact(got["params"][k], want["params"][k][:61], k)
        for m in ("mu", "nu"):
            assert_bit_exact(got["opt_state"][m][k], want[m][k][:61], f"{m}/{k}")


def test_plain_torch_dcp_importer_refuses_it_by_name(tmp_path):
    """Forced through the torch DCP importer it would be wrongly named weights: refused,
    pointing at the Megatron importer."""
    with pytest.raises(jax_ucp.UCPError, match=r"read it as a Megatron checkpoint"):
        jax_ucp.convert(ITER, str(tmp_path / "ucp"))
    assert not (tmp_path / "ucp").exists()


P0 = "decoder.layers.0.mlp.linear_fc1.weight"
ZEROS = np.zeros((32, 16), np.float32)
EDITS = {
    "a moment missing": (
        lambda t, o, x: t.pop(f"{STATE}{P0}.exp_avg_sq"),
        rf"tensor 'model\.module\.{P0}': optimizer state \['exp_avg_sq'\] missing",
    ),
    "an unknown state": (
        lambda t, o, x: t.update({f"{STATE}{P0}.max_exp_avg_sq": x.tensor(ZEROS)}),
        r"unknown optimizer state 'max_exp_avg_sq'",
    ),
    "state of no parameter": (
        lambda t, o, x: t.update({f"{STATE}decoder.gone.weight.exp_avg": x.tensor(ZEROS)}),
        r"optimizer state of 'decoder\.gone\.weight', not a model tensor",
    ),
    "a step missing": (
        lambda t, o, x: t.pop(f"{STATE}{P0}.step"),
        r"an Adam step for 16 of 17 parameters",
    ),
    "steps disagree": (
        lambda t, o, x: t.update({f"{STATE}{P0}.step": x.tensor(np.asarray(3.0, np.float32))}),
        r"parameters disagree on the optimizer step: 2 in .*, 3 in",
    ),
    "a moment of another shape": (
        lambda t, o, x: t.update({f"{STATE}{P0}.exp_avg": x.tensor(np.zeros((2, 2), np.float32))}),
        r"shape \[2, 2\], its parameter's is \[32, 16\]",
    ),
    "another optimizer layout": (
        lambda t, o, x: t.update({"optimizer.optimizer.state.0.exp_avg": x.tensor(ZEROS)}),
        r"'optimizer\.optimizer\.state\.0\.exp_avg' in .*: not fsdp_dtensor's optimizer layout",
    ),
    "virtual pipeline chunks": (
        lambda t, o, x: t.update({"model0.module.x.weight": x.tensor(ZEROS)}),
        r"virtual pipeline chunks of an fsdp_dtensor checkpoint are not supported",
    ),
}


@pytest.mark.parametrize("case", sorted(EDITS))
def test_a_damaged_layout_is_refused_by_name(tmp_path, case):
    edit, why = EDITS[case]
    src = tmp_path / "ck"
    shutil.copytree(ITER, src)
    tensors, objects = read_layout(src)
    edit(tensors, objects, ExtraFile(src))
    write_layout(src, tensors, objects)
    with pytest.raises(jax_ucp.UCPError, match=why):
        jax_ucp.convert(str(src), str(tmp_path / "ucp"), format="megatron")
    assert not (tmp_path / "ucp").exists()
    if case != "virtual pipeline chunks":  # the weights alone are still read, and exactly
        got = jax_ucp.restore(
            jax_ucp.convert(
                str(src),
                str(tmp_path / "w"),
                importing=ImportOptions(weights_only=True),
                format="megatron",
            )
        )
        assert_bit_exact(got["params"][P0], reference()["params"][P0], P0)


@pytest.mark.torch
def test_verify_against_reads_the_source_with_torchs_own_dcp(tmp_path):
    """``verify(against=)`` reads every imported tensor back with torch's DCP reader by its
    .metadata name: all equal (params, mu, nu of the 17 parameters); the step, read from 17
    per-parameter tensors, is not one source tensor: compared with the import planned again."""
    ckpt = jax_ucp.convert(SRC, str(tmp_path / "ucp"))
    result = jax_ucp.verify(ckpt, against=SRC)
    assert list(result) == []
    seen = result.against
    assert seen is not None
    assert len(seen.equal) == 17 * 3 + 1 and not (seen.different or seen.missing)
    assert not seen.not_compared and seen.rebuilt == ["opt_state/count"]


@pytest.mark.parametrize(
    "fixture, folder",
    [
        ("megatron_fsdp_dtensor/gpt_dp2", "iter_0000002"),  # the files say 2
        ("megatron/legacy_llama_tp2_synthetic", "iter_0000007"),  # legacy rank files say 7
    ],
)
def test_an_iteration_folder_copied_under_another_number_is_refused(tmp_path, fixture, folder):
    """``iter_0000002`` copied as ``iter_0000005`` (the tracker saying 5): the folder's name
    and the files' ``iteration`` disagree; refused naming both. Before: iteration 5 recorded
    from the name while the files say 2 (the run's step, continued from, off by 3)."""
    src = tmp_path / "run"
    shutil.copytree(os.path.join(REPO, "tests", "fixtures", fixture), src)
    said = int(folder[len("iter_") :])
    assert jax_ucp.inspect(str(src)).source["iteration"] == said
    os.rename(src / folder, src / "iter_0000005")
    (src / "latest_checkpointed_iteration.txt").write_text("5")
    with pytest.raises(
        jax_ucp.SourceError,
        match=rf"iter_0000005\S*: the folder's name says iteration 5, its files' 'iteration' "
        rf"says {said}",
    ):
        jax_ucp.inspect(str(src))
