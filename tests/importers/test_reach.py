"""What real users hold beyond the plain layouts: frozen parameters, ZeRO-0, weights only,
Hugging Face Trainer output directories (fixtures written by DeepSpeed 0.19.8 itself)."""

from __future__ import annotations

import os
import shutil

import ml_dtypes
import numpy as np
import pytest
from typer.testing import CliRunner

import jax_ucp
from jax_ucp._src.store.storage import LocalDirectory
from jax_ucp.cli import app
from jax_ucp.conversion import ImportOptions, MegatronOptions
from tests.ucp_testing import REPO

pytestmark = pytest.mark.timeout(120)
DS = os.path.join(REPO, "tests", "fixtures", "deepspeed")
MEGATRON = os.path.join(REPO, "tests", "fixtures", "megatron")


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def _ref(fixture: str, name: str = "ref_zero_to_fp32.npz") -> dict[str, np.ndarray]:
    return dict(np.load(os.path.join(DS, fixture, name)))


@pytest.mark.parametrize("fixture", ["z2_bf16_dp2_frozen", "z3_bf16_dp2_frozen"])
def test_frozen_parameters_import_as_zero_to_fp32_does(tmp_path, fixture):
    """requires_grad=False parameters (a frozen embedding and a bias): their weights come in
    under params (DeepSpeed's zero_to_fp32 gives the same bytes), marked frozen, no moments."""
    ckpt = jax_ucp.convert(os.path.join(DS, fixture, "ckpt"), str(tmp_path / "ucp"))
    got = jax_ucp.restore(ckpt)
    ref = _ref(fixture)
    assert set(got["params"]) == set(ref)
    for name, value in ref.items():
        assert _bits(got["params"][name]) == _bits(value), name
    frozen = {e.key[-1] for e in jax_ucp.inspect(ckpt).tensors if e.frozen}
    assert frozen == {"wpe.weight", "h.0.ln_1.bias"}
    assert got["params"]["wpe.weight"].dtype == ml_dtypes.bfloat16  # never trained: no master
    assert frozen.isdisjoint(got["opt_state"]["mu"]) and frozen.isdisjoint(got["opt_state"]["nu"])
    assert len(got["opt_state"]["mu"]) == len(ref) - 2


def test_frozen_flag_is_strict_in_the_manifest(tmp_path):
    import json

    ckpt = jax_ucp.convert(os.path.join(DS, "z2_bf16_dp2_frozen", "ckpt"), str(tmp_path / "ucp"))
    path = os.path.join(ckpt, "ucp.json")
    manifest = json.load(open(path))
    entry = next(e for e in manifest["entries"] if e.get("frozen"))
    entry["frozen"] = "true"
    json.dump(manifest, open(path, "w"))
    with pytest.raises(
        jax_ucp.UCPError, match=r"'params/wpe.weight'\).frozen: expected bool, found 'true'"
    ):
        jax_ucp.inspect(ckpt)


def test_zero1_fp32_run_records_no_frozen_parameters(tmp_path):
    """DeepSpeed 0.19.8 at ZeRO-1 fp32 saves no frozen_param_shapes at all (zero_to_fp32 gives
    the trained parameters only): the import says the same, nothing invented."""
    ckpt = jax_ucp.convert(os.path.join(DS, "z1_fp32_dp2_frozen", "ckpt"), str(tmp_path / "u"))
    got = jax_ucp.restore(ckpt)
    assert set(got["params"]) == set(_ref("z1_fp32_dp2_frozen"))
    assert "wpe.weight" not in got["params"]


def test_zero0_is_named_and_imports_weights_only(tmp_path):
    src = os.path.join(DS, "z0_fp32_dp2", "ckpt")
    with pytest.raises(jax_ucp.UCPError, match=r"ZeRO stage 0 checkpoint.*--weights-only"):
        jax_ucp.convert(src, str(tmp_path / "refused"))
    assert not (tmp_path / "refused").exists()
    ckpt = jax_ucp.convert(src, str(tmp_path / "ucp"), importing=ImportOptions(weights_only=True))
    got = jax_ucp.restore(ckpt)
    assert sorted(got) == ["params"]
    ref = _ref("z0_fp32_dp2", "ref_module.npz")
    assert set(got["params"]) == set(ref)
    for name, value in ref.items():
        assert _bits(got["params"][name]) == _bits(value), name
    skipped = jax_ucp.inspect(ckpt).source["skipped"]
    assert skipped["mp_rank_00_model_states.pt:optimizer.state.0.exp_avg"].startswith(
        "weights_only"
    )


def test_weights_only_deepspeed(tmp_path):
    src = os.path.join(DS, "z2_bf16_dp2", "ckpt")
    full = jax_ucp.restore(jax_ucp.convert(src, str(tmp_path / "full")))
    ckpt = jax_ucp.convert(
        src, str(tmp_path / "weights"), importing=ImportOptions(weights_only=True)
    )
    got = jax_ucp.restore(ckpt)
    assert sorted(got) == ["model_params", "params"]
    for name, value in full["params"].items():
        assert _bits(got["params"][name]) == _bits(value), name
    files = [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
    state = "optimizer_state_dict.base_optimizer_state.state.0"
    assert jax_ucp.inspect(ckpt).source["skipped"] == {
        f"{f}:{state}.{name}": f"weights_only: {why}"
        for f in files
        for name, why in (
            ("exp_avg", "Adam moment"),
            ("exp_avg_sq", "Adam moment"),
            ("step", "optimizer step"),
        )
    }


DP_RESHARDABLE = {
    # megatron-core release/name: (TP, PP, DP, buckets per rank, model dtype)
    "0.16.1/gpt_distopt_dp_reshardable": (1, 1, 2, 1, "float32"),
    "0.16.1/llama_distopt_bf16_tp2dp2_buckets": (2, 1, 2, 3, "bfloat16"),
    "0.16.1/gpt_distopt_tp2pp2_dp_reshardable": (2, 2, 1, 2, "float32"),
    "0.15.3/llama_distopt_bf16_tp2dp2_buckets": (2, 1, 2, 3, "bfloat16"),
}


@pytest.mark.parametrize("name", sorted(DP_RESHARDABLE))
def test_megatron_dp_reshardable_imports_with_its_optimizer_state(tmp_path, name):
    """Megatron-LM's default distributed-optimizer layout, dp_reshardable, written by
    megatron-core 0.16.1 itself: GPT TP1 DP2 fp32 (one bucket); Llama (GQA, SwiGLU) TP2 DP2
    bf16 with 3000-element --overlap-grad-reduce buckets (three per rank); GPT TP2 PP2 DP1 with
    pipeline-tied embeddings (their own buckets); and by 0.15.3: the same Llama run. The flat bucket vectors carry no names; the
    re-derived layout gives masters and Adam moments equal, bit for bit, to the same run's
    optimizer state as megatron-core's own model sharding places it (``<name>.truth.npz``, read
    by torch DCP; for the first fixture a fully_reshardable save of the same run)."""
    from jax_ucp._src.importers.megatron import dcp as megatron_dcp

    tp, pp, _dp, buckets, dtype = DP_RESHARDABLE[name]
    src = os.path.join(MEGATRON, "mcore_versions", name)
    original = megatron_dcp.open_dcp(LocalDirectory(str(src)))
    optimizer = [n for n in original.tensors if n.startswith("optimizer.")]
    assert len(optimizer) == 3 * tp * pp * buckets  # what the fixture is meant to cover
    ckpt = jax_ucp.convert(src, str(tmp_path / "ucp"), importing=MegatronOptions(vocab_size=61))
    got = jax_ucp.restore(ckpt)
    model = [n for n in original.tensors if not n.startswith("optimizer.")]
    assert sorted(got["params"]) == sorted(model) and int(got["opt_state"]["count"]) == 2
    truth = np.load(src + ".truth.npz")
    assert len(truth.files) in (2 * len(model), 3 * len(model))
    trees = {"exp_avg": got["opt_state"]["mu"], "exp_avg_sq": got["opt_state"]["nu"]}
    for key in truth.files:
        state, _, tensor = key[len("optimizer.state.") :].partition(".")
        want = truth[key]
        if tensor.endswith(("word_embeddings.weight", "output_layer.weight")):
            want = want[:61]
        have = trees.get(state, got["params"])[tensor]
        assert _bits(have) == _bits(want), key
    for tensor in model:
        want = original.read(tensor)
        if tensor.endswith(("word_embeddings.weight", "output_layer.weight")):
            want = want[:61]
        where = got["model_params"] if dtype == "bfloat16" else got["params"]
        assert _bits(where[tensor]) == _bits(want), tensor
    source = jax_ucp.inspect(ckpt).source
    assert source["optimizer_layout"] == "dp_reshardable"
    # and the weights alone, as for any layout
    weights = jax_ucp.convert(
        src, str(tmp_path / "w"), importing=MegatronOptions(vocab_size=61, weights_only=True)
    )
    assert "opt_state" not in jax_ucp.restore(weights)


def test_megatron_dp_reshardable_bucket_sizes_are_checked(tmp_path, monkeypatch):
    """A parameter list that does not fill the recorded buckets exactly (here: one layer's
    tensors dropped, as a wrong TP/PP guess would) is refused, naming the bucket and sizes."""
    from jax_ucp._src.importers.megatron import rank_states

    real = rank_states.bucket_layout
    monkeypatch.setattr(
        rank_states,
        "bucket_layout",
        lambda params, shared, numels, where: real(params[1:], shared, numels, where),
    )
    src = os.path.join(MEGATRON, "mcore_versions", "0.16.1", "llama_distopt_bf16_tp2dp2_buckets")
    with pytest.raises(
        jax_ucp.UCPError, match=r"bucket \d+ would end .* recorded|fill \d+ buckets"
    ):
        jax_ucp.convert(src, str(tmp_path / "ucp"), importing=MegatronOptions(vocab_size=61))
    assert not (tmp_path / "ucp").exists()


def test_megatron_dp_reshardable_with_a_wrong_layout_is_refused(tmp_path, monkeypatch):
    """If the derived layout does not fit (another version, another DDP config), the check
    against the model weights refuses the import; nothing is written."""
    from jax_ucp._src.importers.megatron import rank_states

    real = rank_states.bucket_layout
    monkeypatch.setattr(
        rank_states,
        "bucket_layout",
        lambda params, shared, numels, where: real(list(reversed(params)), shared, numels, where),
    )
    src = os.path.join(MEGATRON, "mcore_versions", "0.16.1", "gpt_distopt_dp_reshardable")
    with pytest.raises(
        jax_ucp.UCPError, match=r"does not equal the model weight|would end .* recorded"
    ):
        jax_ucp.convert(src, str(tmp_path / "ucp"), importing=MegatronOptions(vocab_size=61))
    assert not (tmp_path / "ucp").exists()


def test_cli_weights_only(tmp_path):
    command = ["convert", os.path.join(DS, "z0_fp32_dp2", "ckpt"), str(tmp_path / "o")]
    r = CliRunner().invoke(app, [*command, "--from", "deepspeed"])
    assert r.exit_code == 1 and "--weights-only" in r.output
    r = CliRunner().invoke(
        app,
        [*command, "--from", "deepspeed", "--weights-only"],
    )
    assert r.exit_code == 0, r.output


def test_trainer_output_directory_lists_its_checkpoints(tmp_path):
    out = tmp_path / "trainer_out"
    for step in (500, 1500, 1000):
        shutil.copytree(os.path.join(DS, "z2_fp32_dp2", "ckpt"), out / f"checkpoint-{step}")
    (out / "runs").mkdir()
    message = r"Trainer output directory with 3 checkpoints: checkpoint-500, checkpoint-1000, checkpoint-1500"
    with pytest.raises(jax_ucp.UCPError, match=message):
        jax_ucp.convert(str(out), str(tmp_path / "ucp"))
    from jax_ucp.conversion import convert

    with pytest.raises(jax_ucp.UCPError, match=message):
        convert(str(out), str(tmp_path / "ucp"), format="deepspeed")
    jax_ucp.convert(str(out / "checkpoint-1000"), str(tmp_path / "ucp"))  # as the error says


@pytest.mark.parametrize(
    "fixture, tied", [("gpt_pp2", True), ("llama_pp2", True), ("gpt_tp2", False)]
)
def test_megatron_torch_dist_records_tied_embeddings(tmp_path, fixture, tied):
    """megatron-core stores a tied output layer only as the word embedding: the manifest says
    which (as for legacy checkpoints), so a restore spec can tie the flax head to it."""
    ckpt = jax_ucp.convert(os.path.join(MEGATRON, fixture), str(tmp_path / "ucp"))
    want = ["embedding.word_embeddings.weight"] if tied else []
    assert jax_ucp.inspect(ckpt).source["tied_embeddings"] == want


def test_deepspeed_records_shared_and_frozen_params(tmp_path):
    ckpt = jax_ucp.convert(os.path.join(DS, "z3_bf16_dp2_frozen", "ckpt"), str(tmp_path / "u"))
    source = jax_ucp.inspect(ckpt).source
    assert source["frozen_params"] == ["h.0.ln_1.bias", "wpe.weight"]
    assert source["shared_params"] == {}
