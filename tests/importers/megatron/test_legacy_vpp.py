"""Megatron-LM legacy checkpoints with a virtual pipeline: ``model0``, ``model1`` in each
``mp_rank_TT_PPP/model_optim_rng.pt``.

Fixtures ``legacy_gpt_vpp2pp2_synthetic`` and ``legacy_gpt_vpp2pp2_distopt_synthetic`` (``tools/fixtures/make_megatron_legacy_vpp_synthetic.py``):
megatron-core 0.16.1's real GPT model chunks (PP=2, VP=2, 4 layers) saved the way Megatron-LM's
``checkpointing.py`` does (Megatron-LM itself cannot be installed here, hence synthetic). Truth:
the chunks' live ``state_dict()`` with each layer renamed to megatron-core's own global
``layer_number`` (``.truth.npz``), and for the distributed-optimizer run each parameter's fp32
master and Adam moments read from the live DistributedOptimizer after two steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.importers.megatron import legacy as megatron_legacy
from jax_ucp._src.store.storage import LocalDirectory
from jax_ucp.conversion import ImportOptions, convert
from jax_ucp.errors import SourceError
from tests.ucp_testing import REPO

FIX = Path(REPO) / "tests" / "fixtures" / "megatron"
NAME = "legacy_gpt_vpp2pp2_synthetic"


def _check_truth(out: Path) -> dict:
    params = jax_ucp.restore(out)["params"]
    truth = np.load(FIX / f"{NAME}.truth.npz")
    assert sorted(params) == sorted(truth.files)
    for key in truth.files:
        got = np.asarray(params[key])
        assert got.dtype == truth[key].dtype and got.tobytes() == truth[key].tobytes(), key
    with open(Path(out) / "ucp.json") as f:
        return json.load(f)["source"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("weights_only", [False, True])
def test_vpp_legacy_imports_every_layer_in_place(tmp_path, weights_only):
    source = _check_truth(
        convert(
            FIX / NAME,
            tmp_path / "o",
            format="megatron",
            importing=ImportOptions(weights_only=weights_only),
        )
    )
    assert (source["pp"], source["virtual_pipeline"], source["tp"]) == (2, 2, 1)
    assert sorted(source["skipped"]) == [
        f"mp_rank_00_00{p}/model_optim_rng.pt:rng_state.0.torch_rng_state" for p in (0, 1)
    ]
    with open(tmp_path / "o" / "ucp.json") as f:
        entries = {tuple(e["key"]): e for e in json.load(f)["entries"]}
    # global layer 2 is layer 0 of chunk 1 on pipeline rank 0
    entry = entries[("params", "decoder.layers.2.mlp.linear_fc1.weight")]
    assert entry["provenance"]["tensors"] == [
        "mp_rank_00_000/model_optim_rng.pt:model1.decoder.layers.0.mlp.linear_fc1.weight"
    ]


@pytest.mark.timeout(120)
def test_vpp_chunk_layers_are_global_layers():
    """Chunk v of pipeline rank p is virtual stage v * PP + p: global layer v * 2 + p."""
    checkpoint = megatron_legacy.open_legacy(LocalDirectory(str(FIX / NAME)))
    assert (checkpoint.grid.pp, checkpoint.grid.vpp) == (4, 2)
    where = {
        stage: (
            checkpoint.ranks[(stage, 0)].name.split("/")[0],
            checkpoint.ranks[(stage, 0)].model_key,
        )
        for stage in range(4)
    }
    assert where == {
        0: ("mp_rank_00_000", "model0"),
        1: ("mp_rank_00_001", "model0"),
        2: ("mp_rank_00_000", "model1"),
        3: ("mp_rank_00_001", "model1"),
    }
    assert "embedding.word_embeddings.weight" in checkpoint.ranks[(0, 0)].model
    assert "output_layer.weight" in checkpoint.ranks[(3, 0)].model


DISTOPT = "legacy_gpt_vpp2pp2_distopt_synthetic"


@pytest.mark.timeout(120)
def test_vpp_distributed_optimizer_bit_exact(tmp_path):
    """megatron-core's DistributedOptimizer over both model chunks (one flat buffer per chunk in
    distrib_optim.pt): fp32 masters, both moments and the step equal the live optimizer's."""
    out = convert(FIX / DISTOPT, tmp_path / "o", format="megatron")
    tree = jax_ucp.restore(out)
    truth = np.load(FIX / f"{DISTOPT}.truth.npz")
    where = {"param": tree["params"], "exp_avg": tree["opt_state"]["mu"]}
    where["exp_avg_sq"] = tree["opt_state"]["nu"]
    checked = 0
    for key in truth.files:
        state, _, name = key.rpartition("/")
        got = np.asarray(where[state or "param"][name])
        assert got.dtype == truth[key].dtype and got.tobytes() == truth[key].tobytes(), key
        checked += 1
    assert checked == 4 * len(tree["params"]) == 4 * 53  # weights + master + 2 moments
    assert int(tree["opt_state"]["count"]) == 2
    with open(Path(out) / "ucp.json") as f:
        manifest = json.load(f)
    assert (manifest["source"]["pp"], manifest["source"]["virtual_pipeline"]) == (2, 2)
    entries = {tuple(e["key"]): e for e in manifest["entries"]}
    # global layer 3 is chunk 1 of pipeline rank 1: its state is in buffer 1 of that rank's file
    entry = entries[("opt_state", "mu", "decoder.layers.3.mlp.linear_fc2.weight")]
    (flat,) = entry["provenance"]["tensors"]
    assert flat.startswith("mp_rank_00_001/distrib_optim.pt:1.") and flat.endswith(".exp_avg")


@pytest.mark.timeout(120)
def test_vpp_distributed_optimizer_weights_only(tmp_path):
    source = _check_truth(convert(FIX / NAME, tmp_path / "plain", format="megatron"))
    assert set(jax_ucp.restore(tmp_path / "plain")) == {"params"}
    out = convert(
        FIX / DISTOPT, tmp_path / "w", format="megatron", importing=ImportOptions(weights_only=True)
    )
    tree = jax_ucp.restore(out)
    assert set(tree) == {"params"}
    with open(Path(out) / "ucp.json") as f:
        skipped = json.load(f)["source"]["skipped"]
    buffers = [n for n in skipped if "distrib_optim.pt:" in n]
    assert len(buffers) == 2 * 2 * 3  # 2 rank files x 2 chunk buffers x param/exp_avg/exp_avg_sq
    assert all(skipped[n] == f"weights_only: optimizer state ({n.split(':')[0]})" for n in buffers)
    assert source["pp"] == 2


@pytest.mark.timeout(30)
def test_vpp_model_chunks_must_be_numbered_from_zero():
    where = Path("x/model_optim_rng.pt")
    assert megatron_legacy.model_chunks({"model": {}, "args": None}, where) == []
    assert megatron_legacy.model_chunks({"model1": {}, "model0": {}}, where) == ["model0", "model1"]
    with pytest.raises(
        SourceError,
        match=r"x/model_optim_rng\.pt: model chunks \['model0', 'model2'\]; a virtual-pipeline "
        r"rank file holds model0 \.\. model<N-1>",
    ):
        megatron_legacy.model_chunks({"model0": {}, "model2": {}}, where)
    with pytest.raises(SourceError, match=r"\['model0'\] beside model;"):
        megatron_legacy.model_chunks({"model0": {}, "model": {}}, where)
