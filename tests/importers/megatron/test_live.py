"""Opt-in (``-m torch``): regenerate fixtures with megatron-core and compare live against torch.

Needs torch 2.13 (CPU), megatron-core. Slow (~1-3 min on 2 cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jax_ucp._src.store.storage import LocalDirectory
from jax_ucp.conversion import MegatronOptions
from tests.megatron_testing import FIX, LEGACY, TORCH_DIST, VOCAB, assert_bit_equal, load_reference
from tests.ucp_testing import REPO

pytestmark = pytest.mark.torch

ROOT = Path(REPO)
SCRIPT = ROOT / "tools" / "fixtures" / "make_megatron_fixtures.py"


def _script():
    sys.path.insert(0, str(SCRIPT.parent))
    import make_megatron_fixtures as m

    return m


def assert_regenerated(got: np.ndarray, want: np.ndarray, key: str, what: str, run: str) -> None:
    """A regenerated fixture tensor equals the committed one bit for bit, except the fp32
    masters of a bf16 run: those regenerate only to within one rounding (seen on three days: at
    most 2**-26 apart, or 1 ulp of values near 1, while the moments and weights were
    bit-identical; cause not pinned down, torch CPU kernels are the suspect). Every import is
    still compared bit for bit against the regeneration it read. Seen since on the fp32 MoE
    runs too (the embedding's master, within the same bound, with the code of 94bd6ba as well),
    so the bound applies to the masters of every run; moments and weights stay bit-exact."""
    if not key.startswith("optimizer.state.param."):
        assert_bit_equal(got, want, what)
        return
    assert got.dtype == want.dtype and got.shape == want.shape, what
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    bound = np.maximum(2.0**-25, np.spacing(np.abs(want)).astype(np.float64))
    assert (diff <= bound).all(), f"{what}: {diff.max()} apart"


@pytest.mark.parametrize("name", TORCH_DIST)
def test_committed_references_equal_live_torch_consolidation(name):
    pytest.importorskip("torch")
    live = _script().consolidate(FIX / name)
    ref = load_reference(name)
    assert set(live) == set(ref)
    for k in ref:
        assert_bit_equal(live[k], ref[k], k)


@pytest.mark.parametrize("name", LEGACY)
def test_legacy_reader_equals_torch_load(name):
    """Every tensor our restricted reader yields equals torch.load of the same file."""
    torch = pytest.importorskip("torch")
    from jax_ucp._src.importers.megatron import legacy as lg

    ck = lg.open_legacy(LocalDirectory(str(FIX / name)))
    for rf in ck.ranks.values():
        sd = torch.load(rf.path, map_location="cpu", weights_only=False)
        want = lg.flatten_state_dict(sd["model"])
        assert set(want) == set(rf.model)
        for k, v in want.items():
            if isinstance(v, torch.Tensor):
                assert_bit_equal(rf.model[k], _script()._to_np(v), f"{rf.path}:{k}")
        assert vars(sd["args"])["num_layers"] == ck.args["num_layers"]


def test_regenerate_and_import_live(tmp_path):
    """megatron-core writes fresh checkpoints; importing them equals torch's live consolidation,
    and regeneration is deterministic (equals the committed references)."""
    pytest.importorskip("megatron.core")
    names = ["gpt_tp2", "llama_distopt_bf16_tp2dp2", "legacy_llama_tp2_synthetic"]
    out = tmp_path / "fx"
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *names],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    import jax_ucp
    from jax_ucp.conversion import convert

    m = _script()
    for name in names[:2]:
        live = m.consolidate(out / name)
        committed = load_reference(name)
        for k in committed:
            assert_regenerated(live[k], committed[k], k, f"regenerated {name}:{k}", name)
        d = convert(
            out / name,
            tmp_path / f"ucp_{name}",
            format="megatron",
            importing=MegatronOptions(vocab_size=VOCAB),
        )
        got = jax_ucp.restore(d)
        opt = any(k.startswith("optimizer.") for k in live)
        for k, v in got["params"].items():
            want = live[f"optimizer.state.param.{k}" if opt else k]
            assert_bit_equal(
                v,
                want[:VOCAB]
                if k.endswith(("word_embeddings.weight", "output_layer.weight"))
                else want,
                k,
            )
    leg = load_reference(names[2])
    regenerated = np.load(out / f"{names[2]}.consolidated.npz")
    for k in leg:
        assert np.array_equal(
            np.asarray(regenerated[k]).view(np.uint8), np.asarray(leg[k]).view(np.uint8)
        ), k


def test_dp_reshardable_with_buckets_live(tmp_path):
    """megatron-core 0.16 writes Megatron-LM's default layout, dp_reshardable, with
    --overlap-grad-reduce buckets (TP2 DP2 bf16 Llama) and, from the same run, the optimizer
    state placed by its own model sharding; the import equals that truth bit for bit, and the
    run equals the committed fixture's."""
    mcore = pytest.importorskip("megatron.core")
    if not mcore.__version__.startswith("0.16"):
        pytest.skip(f"dp_reshardable fixtures are megatron-core 0.16's (found {mcore.__version__})")
    import jax_ucp

    name = "llama_distopt_bf16_tp2dp2"
    out = tmp_path / "fx"
    env = dict(
        os.environ,
        MCORE_DISTOPT_SHARDING="dp_reshardable",
        MCORE_DISTOPT_TRUTH="1",
        MCORE_DDP_BUCKET_SIZE="3000",
    )
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), name],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = jax_ucp.restore(
        jax_ucp.convert(
            str(out / name), str(tmp_path / "ucp"), importing=MegatronOptions(vocab_size=VOCAB)
        )
    )
    truth = np.load(out / f"{name}.truth.npz")
    committed = np.load(
        FIX / "mcore_versions" / "0.16.1" / "llama_distopt_bf16_tp2dp2_buckets.truth.npz"
    )
    trees = {"exp_avg": got["opt_state"]["mu"], "exp_avg_sq": got["opt_state"]["nu"]}
    for key in truth.files:
        assert_regenerated(truth[key], committed[key], key, f"regenerated truth {key}", name)
        state, _, tensor = key[len("optimizer.state.") :].partition(".")
        want = truth[key]
        if tensor.endswith(("word_embeddings.weight", "output_layer.weight")):
            want = want[:VOCAB]
        assert_bit_equal(trees.get(state, got["params"])[tensor], want, key)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["moe_distopt_ep2", "moe_grouped_distopt_ep2"])
def test_moe_distributed_optimizer_live(tmp_path, name):
    """megatron-core 0.16 runs a MoE model (SequentialMLP or grouped-GEMM experts, EP2: dense
    DP2, expert DP1) with the distributed optimizer (a ChainedOptimizer) and saves it
    dp_reshardable with the live state placed by its own model sharding; the import equals that
    truth bit for bit, and the run equals the committed fixture's."""
    mcore = pytest.importorskip("megatron.core")
    if not mcore.__version__.startswith("0.16"):
        pytest.skip(f"the MoE fixtures are megatron-core 0.16's (found {mcore.__version__})")
    import jax_ucp

    out = tmp_path / "fx"
    env = dict(os.environ, MCORE_DISTOPT_SHARDING="dp_reshardable", MCORE_DISTOPT_TRUTH="1")
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), name],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = jax_ucp.restore(
        jax_ucp.convert(
            str(out / name), str(tmp_path / "ucp"), importing=MegatronOptions(vocab_size=VOCAB)
        )
    )
    truth = np.load(out / f"{name}.truth.npz")
    committed = np.load(FIX / "mcore_versions" / "0.16.1" / f"{name}_dp_reshardable.truth.npz")
    assert sorted(truth.files) == sorted(committed.files)
    trees = {"exp_avg": got["opt_state"]["mu"], "exp_avg_sq": got["opt_state"]["nu"]}
    for key in truth.files:
        assert_regenerated(truth[key], committed[key], key, f"regenerated truth {key}", name)
        state, _, tensor = key[len("optimizer.state.") :].partition(".")
        want = truth[key]
        if tensor.endswith(("word_embeddings.weight", "output_layer.weight")):
            want = want[:VOCAB]
        assert_bit_equal(trees.get(state, got["params"])[tensor], want, key)
