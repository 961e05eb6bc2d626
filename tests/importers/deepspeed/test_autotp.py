"""DeepSpeed AutoTP (``tensor_parallel.autotp_size``) ZeRO-1/2 training checkpoints: real runs of
a tiny Hugging Face Llama on DeepSpeed 0.19.8 (``tools/fixtures/make_deepspeed_fixtures.py
--autotp``), merged by the affine maps of their ``universal_checkpoint_info``.

Truth: ``live.npz`` (the engine's own TP-gathered model weights right after the save) and
``ref_universal.npz`` (DeepSpeed's ``ds_to_universal`` merge of the fp32 masters and Adam
moments by the same maps), bit for bit.
"""

from __future__ import annotations

import copy
import json
import os

import ml_dtypes
import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.importers.deepspeed import affine as deepspeed_affine
from jax_ucp._src.importers.deepspeed.files import load_deepspeed_file
from jax_ucp._src.store.storage import LocalDirectory
from jax_ucp.errors import SourceError
from tests.ucp_testing import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures", "deepspeed")
RUNS = ["autotp_tp2_dp1_z1_fp32", "autotp_tp2_dp2_z2_bf16"]


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if b.dtype == np.dtype("V2"):  # bfloat16 as np.savez stores it
        b = b.view(ml_dtypes.bfloat16)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def check_against_the_run(base: str, dest) -> tuple[dict, dict]:
    """Imports the run at ``base`` into ``dest`` and checks it bit for bit against DeepSpeed's
    ``ds_to_universal`` (masters, moments, step) and the engine's live weights; returns the
    restored tree and the manifest."""
    jax_ucp.convert(os.path.join(base, "ckpt"), dest)
    tree = jax_ucp.restore(dest)
    ref = np.load(os.path.join(base, "ref_universal.npz"))
    where = {"fp32": tree["params"], "exp_avg": tree["opt_state"]["mu"]}
    where["exp_avg_sq"] = tree["opt_state"]["nu"]
    states = 0
    for key in ref.files:
        name, state = key.rsplit("/", 1)
        if state == "step":
            assert int(tree["opt_state"]["count"]) == int(ref[key]) == 2
        else:
            assert same_bits(where[state][name], ref[key]), key
            states += 1
    assert states == 3 * len(tree["params"]) == 3 * 21
    live = np.load(os.path.join(base, "live.npz"))
    model = tree.get("model_params", tree["params"])
    assert sorted(live.files) == sorted(model)
    assert [k for k in live.files if not same_bits(model[k], live[k])] == []
    with open(os.path.join(dest, "ucp.json")) as f:
        manifest = json.load(f)
    assert (manifest["source"]["tp"], manifest["source"]["layout"]) == (2, "megatron-deepspeed")
    return tree, manifest


@pytest.mark.timeout(120)
@pytest.mark.parametrize("run", RUNS)
def test_autotp_imports_bit_exact(run, tmp_path):
    _, manifest = check_against_the_run(os.path.join(FIXTURES, run), tmp_path / "u")
    q = "model.layers.0.self_attn.q_proj.weight"
    entry = next(e for e in manifest["entries"] if e["key"] == ["params", q])
    assert entry["provenance"]["kind"] == {
        "kind": "affine_map",
        "pattern": f"^{q}$".replace(".", r"\."),
    }


def _maps(run="autotp_tp2_dp1_z1_fp32"):
    states = load_deepspeed_file(
        LocalDirectory(os.path.join(FIXTURES, run, "ckpt", "global_step2")),
        "mp_rank_00_model_states.pt",
    )
    return copy.deepcopy(dict(states["universal_checkpoint_info"]))


Q = r"^model\.layers\.0\.self_attn\.q_proj\.weight$"


@pytest.mark.timeout(30)
def test_affine_rebuild_checks_every_piece():
    info = _maps()
    (amap,) = [m for m in deepspeed_affine.parse_affine_maps(info, "f", 2) if m.pattern == Q]
    shards = [np.arange(128, dtype=np.float32) + 1000 * r for r in range(2)]
    full = deepspeed_affine.rebuild(amap, shards, "fp32", "q")
    assert same_bits(full, np.concatenate(shards).reshape(16, 16))

    bad = copy.deepcopy(info)
    bad["affine_map"]["params"][Q]["ranks"][1]["pieces"][0]["source"][0] = 200
    with pytest.raises(SourceError, match=r"rank 1: piece \[8, 16\] at source 200 .*outside"):
        deepspeed_affine.parse_affine_maps(bad, "f", 2)

    bad = copy.deepcopy(info)
    bad["affine_map"]["params"][Q]["ranks"][1]["pieces"][0]["source"][0] = 0
    (amap,) = [m for m in deepspeed_affine.parse_affine_maps(bad, "f", 2) if m.pattern == Q]
    with pytest.raises(SourceError, match=r"q: affine_map .* TP rank 1 at offset 0 overlaps"):
        deepspeed_affine.rebuild(amap, shards, "fp32", "q")

    bad = copy.deepcopy(info)
    bad["affine_map"]["params"][Q]["ranks"][0]["pieces"][0]["source"][1] = [0, 1]
    with pytest.raises(SourceError, match=r"source strides \[0, 1\] .* twice"):
        deepspeed_affine.parse_affine_maps(bad, "f", 2)

    bad = copy.deepcopy(info)
    bad["affine_map"]["version"] = 2
    with pytest.raises(SourceError, match=r"affine_map version 2;.*up to 1"):
        deepspeed_affine.parse_affine_maps(bad, "f", 2)


@pytest.mark.timeout(30)
def test_affine_replicated_pieces_must_agree_and_scaled_moments_refused():
    info = _maps()
    norm = r"^model\.norm\.weight$"
    (amap,) = [m for m in deepspeed_affine.parse_affine_maps(info, "f", 2) if m.pattern == norm]
    same = np.arange(16, dtype=np.float32)
    assert same_bits(deepspeed_affine.rebuild(amap, [same, same.copy()], "fp32", "n"), same)
    other = same.copy()
    other[3] = np.nextafter(other[3], np.float32(100))
    with pytest.raises(SourceError, match=r"n: TP ranks \[0, 1\] hold different exp_avg"):
        deepspeed_affine.rebuild(amap, [same, other], "exp_avg", "n")
    scaled = copy.deepcopy(info)
    for rank in scaled["affine_map"]["params"][norm]["ranks"].values():
        rank["pieces"][0]["scale"] = 0.5
    (amap,) = [m for m in deepspeed_affine.parse_affine_maps(scaled, "f", 2) if m.pattern == norm]
    assert same_bits(
        deepspeed_affine.rebuild(amap, [same, same.copy()], "fp32", "n"), same / np.float32(0.5)
    )
    with pytest.raises(
        SourceError,
        match=r"n: exp_avg_sq through a scaled affine-map piece .*weights_only",
    ):
        deepspeed_affine.rebuild(amap, [same, same.copy()], "exp_avg_sq", "n")


@pytest.mark.timeout(30)
def test_affine_uncovered_elements_named():
    info = _maps()
    bad = copy.deepcopy(info)
    rank1 = bad["affine_map"]["params"][Q]["ranks"][1]
    rank1["shard_shape"] = [4, 16]
    rank1["pieces"][0]["shape"] = [4, 16]
    (amap,) = [m for m in deepspeed_affine.parse_affine_maps(bad, "f", 2) if m.pattern == Q]
    shards = [np.zeros(128, np.float32), np.zeros(64, np.float32)]
    with pytest.raises(
        SourceError,
        match=r"64 element\(s\) of \[16, 16\] uncovered.*offset 192",
    ):
        deepspeed_affine.rebuild(amap, shards, "fp32", "q")


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "layout", ["qkv_uneven", "split_dim1", "segmented", "blocks", "scaled_bias"]
)
def test_affine_rebuild_matches_deepspeeds_own(layout):
    """Maps built by DeepSpeed's own affine.py (uneven fused QKV over 3 ranks, a dim-1 split,
    replicated segments, non-adjacent blocks, a pre-divided bias), shards by its ``extract``:
    the rebuild equals DeepSpeed's ``rebuild`` bit for bit (``deepspeed_affine_synthetic/``)."""
    affine = os.path.join(os.path.dirname(FIXTURES), "deepspeed_affine_synthetic")
    with open(os.path.join(affine, "maps.json")) as f:
        stored = json.load(f)[layout]
    arrays = np.load(os.path.join(affine, "shards.npz"))
    tp = len(stored["ranks"])
    info = {"affine_map": {"version": 1, "params": {layout: stored}}}
    (amap,) = deepspeed_affine.parse_affine_maps(info, "f", tp)
    shards = [arrays[f"{layout}/shard{rank}"] for rank in range(tp)]
    rebuilt = deepspeed_affine.rebuild(amap, shards, "fp32", layout)
    assert same_bits(rebuilt, arrays[f"{layout}/rebuilt"])
    assert same_bits(rebuilt, arrays[f"{layout}/full"])  # a scale of 0.5 divides out exactly
