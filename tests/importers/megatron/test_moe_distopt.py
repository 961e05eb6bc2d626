"""MoE with megatron-core's distributed optimizer (a ChainedOptimizer: the dense parameters'
optimizer, then the experts' with their own grad buffer), written by megatron-core 0.16.1 itself
on CPU (tools/fixtures/make_megatron_fixtures.py, ``moe_distopt_ep2`` / ``moe_distopt_dp2``,
SequentialMLP experts of the local spec, SwiGLU, 4 experts, two Adam steps):

* ``moe_distopt_ep2_dp_reshardable``: EP2 over 2 ranks (dense DP2, expert DP1); flat bucket
  vectors ``chained_0.optimizer.distributed.dp_group_idx_0.*`` (dense) and
  ``chained_1.optimizer.distributed.dp_group_idx_{0,1}.*`` (EP rank 0's experts 0-1, EP rank
  1's experts 2-3);
* ``moe_distopt_ep2_fully_reshardable``: the same run, model-space
  ``chained_N.optimizer.state.*`` tensors, the step in ``common.pt['optimizer'][N]``;
* ``moe_distopt_tp2ep2_dp_reshardable``: TP2 x EP2 over 4 ranks (expert TP2);
* ``moe_distopt_dp2_dp_reshardable``: EP1, DP2: megatron-core keeps the experts in the dense
  grad buffer (one optimizer, no ``chained_`` prefix), between each layer's router and the next
  layer;
* ``moe_grouped_distopt_ep2_dp_reshardable`` / ``moe_grouped_distopt_dp2_dp_reshardable``: the
  same two runs with grouped-GEMM experts (the legacy GroupedMLP, ``moe_grouped_gemm``): saved
  under SequentialMLP's names, but in the grad buffer as one ``weight1`` ``[h, E_local * 2 ffn]``
  and one ``weight2`` ``[E_local * ffn, h]`` per layer, each expert's block transposed;
* ``moe_grouped_distopt_ep2_fully_reshardable``: the grouped EP2 run, model-space;
* ``moe_grouped_distopt_tp2ep2_dp_reshardable``: grouped experts over TP2 x EP2 (expert TP2).

Masters and moments bit-exact against the run's live optimizer state (every DP shard of every
member gathered, placed by megatron-core's own model ``sharded_state_dict``, read by torch DCP:
``<name>.truth.npz``)."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.importers.megatron import MegatronImportError
from jax_ucp._src.importers.megatron import dcp as megatron_dcp
from jax_ucp._src.store.storage import LocalDirectory
from jax_ucp._src.torchfiles import torch_zip
from jax_ucp.conversion import ImportOptions, MegatronOptions
from tests.importers.megatron.test_dcp import ExtraFile, read_layout, write_layout
from tests.megatron_testing import (
    assert_bit_equal,
    assert_untouched,
    copy_megatron_fixture,
    load_reference,
)
from tests.ucp_testing import REPO

ROOT = os.path.join(REPO, "tests", "fixtures", "megatron", "mcore_versions", "0.16.1")
VOCAB = 61
FIXTURES = {
    # name: (layout, optimizer tensors in .metadata, truth)
    "moe_distopt_ep2_dp_reshardable": ("dp_reshardable", 9, "moe_distopt_ep2_dp_reshardable"),
    # the same seeded run saved fully_reshardable: its live state was bit-identical to the
    # dp_reshardable run's (checked when generated), so that truth serves
    "moe_distopt_ep2_fully_reshardable": ("per_parameter", 30, "moe_distopt_ep2_dp_reshardable"),
    "moe_distopt_dp2_dp_reshardable": ("dp_reshardable", 3, "moe_distopt_dp2_dp_reshardable"),
    # TP2 x EP2 over 4 ranks: dense TP2 DP2; experts split over expert TP2 too, the expert
    # optimizer's ranks etp_rank + 2 * ep_rank (dp_group_idx_0..3)
    "moe_distopt_tp2ep2_dp_reshardable": (
        "dp_reshardable",
        18,
        "moe_distopt_tp2ep2_dp_reshardable",
    ),
    # grouped-GEMM experts: EP2 (ChainedOptimizer, the experts' buffers per EP rank) and EP1
    # (the experts in the dense buffer, after the router)
    "moe_grouped_distopt_ep2_dp_reshardable": (
        "dp_reshardable",
        9,
        "moe_grouped_distopt_ep2_dp_reshardable",
    ),
    "moe_grouped_distopt_dp2_dp_reshardable": (
        "dp_reshardable",
        3,
        "moe_grouped_distopt_dp2_dp_reshardable",
    ),
    # the grouped EP2 run saved fully_reshardable (model-space chained_N.optimizer.state.*):
    # its live state was bit-identical to the dp_reshardable run's (compared when generated)
    "moe_grouped_distopt_ep2_fully_reshardable": (
        "per_parameter",
        30,
        "moe_grouped_distopt_ep2_dp_reshardable",
    ),
    # grouped experts over TP2 x EP2 (4 ranks; expert TP2: each rank's weight1 holds its gate
    # and up rows of every local expert; the expert optimizer's ranks etp_rank + 2 * ep_rank)
    "moe_grouped_distopt_tp2ep2_dp_reshardable": (
        "dp_reshardable",
        18,
        "moe_grouped_distopt_tp2ep2_dp_reshardable",
    ),
}


def _stripped(name: str, value: np.ndarray) -> np.ndarray:
    vocab = name.endswith("word_embeddings.weight") or name.endswith("output_layer.weight")
    return value[:VOCAB] if vocab else value


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_moe_distributed_optimizer_imports_bit_exact(tmp_path, name):
    layout, count, truth_of = FIXTURES[name]
    src = os.path.join(ROOT, name)
    original = megatron_dcp.open_dcp(LocalDirectory(str(src)))
    model = [n for n in original.tensors if "optimizer." not in n]
    optimizer = [n for n in original.tensors if "optimizer." in n]
    assert len(optimizer) == count  # what the fixture is meant to cover
    assert any(".mlp.experts.experts.linear_fc1.weight" in n for n in model)
    ckpt = jax_ucp.convert(src, str(tmp_path / "ucp"), importing=MegatronOptions(vocab_size=VOCAB))
    source = jax_ucp.inspect(ckpt).source
    assert source["optimizer_layout"] == layout
    # a float32 run: the masters are params/, every model weight named as skipped for them;
    # no optimizer tensor is skipped
    assert sorted(source["skipped"]) == sorted(model)
    got = jax_ucp.restore(ckpt)
    assert sorted(got) == ["opt_state", "params"]
    assert int(got["opt_state"]["count"]) == 2
    truth = np.load(os.path.join(ROOT, truth_of + ".truth.npz"))
    assert len(truth.files) == 3 * len(model)
    trees = {
        "param": got["params"],
        "exp_avg": got["opt_state"]["mu"],
        "exp_avg_sq": got["opt_state"]["nu"],
    }
    for key in truth.files:
        state, _, param = key[len("optimizer.state.") :].partition(".")
        have = trees[state][param]
        assert have.tobytes() == _stripped(param, truth[key]).tobytes(), key
    for param in model:  # fp32 masters equal the saved weights
        want = _stripped(param, original.read(param))
        assert got["params"][param].tobytes() == want.tobytes(), param


@pytest.mark.timeout(120)
def test_moe_model_weights_match_torch_consolidation(tmp_path):
    """The weights of the EP2 run with weights_only, against torch's own DCP consolidation;
    every optimizer tensor of both ChainedOptimizer members listed in source.skipped."""
    name = "moe_distopt_ep2_dp_reshardable"
    src = os.path.join(ROOT, name)
    ckpt = jax_ucp.convert(
        src, str(tmp_path / "ucp"), importing=MegatronOptions(vocab_size=VOCAB, weights_only=True)
    )
    got = jax_ucp.restore(ckpt)
    ref = np.load(src + ".consolidated.npz")
    model = {k: ref[k] for k in ref.files if "optimizer." not in k and k != "__bfloat16_keys__"}
    assert sorted(got) == ["params"] and sorted(got["params"]) == sorted(model)
    for key, value in model.items():
        assert got["params"][key].tobytes() == _stripped(key, value).tobytes(), key
    skipped = jax_ucp.inspect(ckpt).source["skipped"]
    assert sorted(skipped) == sorted(n for n in ref.files if n.startswith("chained_"))
    assert all(why.startswith("weights_only: optimizer state") for why in skipped.values())


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "name", ["moe_distopt_ep2_dp_reshardable", "moe_grouped_distopt_ep2_dp_reshardable"]
)
def test_moe_expert_state_of_swapped_expert_ranks_is_refused(tmp_path, name):
    """The expert optimizer's buffers are placed by expert-parallel rank: with EP rank 0's and
    EP rank 1's buffers swapped (same sizes) the experts' masters no longer equal their
    weights, and the import is refused naming the tensor, nothing written."""
    src = tmp_path / "moe"
    shutil.copytree(os.path.join(ROOT, name), src)
    meta = (src / ".metadata").read_bytes()
    a, b = (f"chained_1.optimizer.distributed.dp_group_idx_{i}".encode() for i in (0, 1))
    assert a in meta and b in meta
    swapped = meta.replace(a, b"\0" * len(a)).replace(b, a).replace(b"\0" * len(a), b)
    (src / ".metadata").write_bytes(swapped)
    with pytest.raises(
        MegatronImportError,
        match=r"'decoder\.layers\.mlp\.experts\.experts\.linear_fc2\.weight': the fp32 master.*dp_reshardable.*model weight",
    ):
        jax_ucp.convert(
            str(src), str(tmp_path / "out"), importing=MegatronOptions(vocab_size=VOCAB)
        )
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "name",
    [
        "moe_grouped_distopt_ep2_dp_reshardable",
        "moe_grouped_distopt_dp2_dp_reshardable",
        "moe_grouped_distopt_tp2ep2_dp_reshardable",
    ],
)
def test_grouped_experts_weights_only(tmp_path, name):
    """weights_only on the grouped-GEMM runs: the model weights as saved (a float32 run: equal
    to the live fp32 masters), every optimizer tensor listed in source.skipped."""
    src = os.path.join(ROOT, name)
    ckpt = jax_ucp.convert(
        src, str(tmp_path / "ucp"), importing=MegatronOptions(vocab_size=VOCAB, weights_only=True)
    )
    got = jax_ucp.restore(ckpt)
    truth = np.load(src + ".truth.npz")
    masters = {
        k[len("optimizer.state.param.") :]: truth[k]
        for k in truth.files
        if k.startswith("optimizer.state.param.")
    }
    assert sorted(got) == ["params"] and sorted(got["params"]) == sorted(masters)
    for key, value in masters.items():
        assert got["params"][key].tobytes() == _stripped(key, value).tobytes(), key
    skipped = jax_ucp.inspect(ckpt).source["skipped"]
    optimizer = [
        n for n in megatron_dcp.open_dcp(LocalDirectory(str(src))).tensors if "optimizer." in n
    ]
    assert sorted(skipped) == sorted(optimizer)
    assert all(why.startswith("weights_only: optimizer state") for why in skipped.values())


@pytest.mark.timeout(120)
def test_grouped_experts_are_not_read_as_sequential(monkeypatch, tmp_path):
    """Read as SequentialMLP's grad buffer (expert by expert, not transposed), the grouped run's
    buffers still fit every recorded bucket size (all sizes are multiples of 64), but the
    masters do not equal the weights: the import is refused, naming the expert tensor and the
    orders tried, nothing written. (The grouped layout is what makes it import.)"""
    from jax_ucp._src.importers.megatron import rank_states

    real = rank_states.RankStates.__init__

    def sequential_only(self, *args, grouped=False, **kwargs):
        real(self, *args, grouped=False, **kwargs)

    monkeypatch.setattr(rank_states.RankStates, "__init__", sequential_only)
    with pytest.raises(
        MegatronImportError,
        match=r"tensor 'decoder\.layers\.mlp\.experts\.experts\.linear_fc2\.weight': the fp32 "
        r"master found in the dp_reshardable state .* does not equal the model weight in "
        r"megatron-core's parameter order \(tried 1: .*, each with SequentialMLP and GroupedMLP "
        r"experts\)",
    ):
        jax_ucp.convert(
            os.path.join(ROOT, "moe_grouped_distopt_ep2_dp_reshardable"),
            str(tmp_path / "out"),
            importing=MegatronOptions(vocab_size=VOCAB),
        )
    assert not (tmp_path / "out").exists()


# ChainedOptimizer states of other layouts (synthetic, built on the real moe_ep2 fixture).


_DTYPE = "dtype_(torch.float32, torch.float32)"


_GROUPS = [{"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-08, "weight_decay": 0.0, "step": 2.0}]


def _chained_moe(tmp_path, layout: str):
    """Synthetic: the real ``moe_ep2`` torch_dist fixture (megatron-core 0.16.1) with the state
    megatron-core's ChainedOptimizer saves for a MoE model with the distributed optimizer added:
    optimizer 0 for the dense parameters, optimizer 1 for the experts (their own grad buffer),
    ``common.pt['optimizer']`` keyed by optimizer index. ``dp_reshardable``: flat bucket vectors
    under ``chained_N.optimizer.distributed.*`` and per-rank objects; ``fully_reshardable``:
    model-space ``optimizer.state.{param,exp_avg,exp_avg_sq}.<name>`` (no prefix)."""
    src = copy_megatron_fixture("moe_ep2", tmp_path)
    tensors, objects = read_layout(src)
    model = dict(tensors)
    extra = ExtraFile(src)
    rng = np.random.default_rng(0)
    added = []
    if layout == "dp_reshardable":
        for index, numel in ((0, 6208), (1, 6144)):
            prefix = f"chained_{index}.optimizer.distributed.dp_group_idx_0"
            for state in ("param", "exp_avg", "exp_avg_sq"):
                name = f"{prefix}.gbuf_idx_0.{_DTYPE}.bucket_idx_0.{state}"
                tensors[name] = extra.tensor(rng.standard_normal(numel, np.float32))
                added.append(name)
            objects[f"{prefix}.optimizer/shard_0_1"] = extra.object([{"param_groups": _GROUPS}])
            for what in ("per_bucket_numel", "per_bucket_numel_unpadded"):
                objects[f"{prefix}.{what}/shard_0_1"] = extra.object([[{("f", "f"): [numel]}]])
    else:
        for name, t in model.items():
            for state in ("param", "exp_avg", "exp_avg_sq"):
                key = f"optimizer.state.{state}.{name}"
                value = rng.standard_normal(t["shape"]).astype(np.float32)
                tensors[key] = extra.tensor(value)
                added.append(key)
    write_layout(src, tensors, objects)
    common = {
        "optimizer": {
            index: {
                "param_state_sharding_type": layout,
                **({"optimizer": {"param_groups": _GROUPS}} if layout != "dp_reshardable" else {}),
            }
            for index in (0, 1)
        }
    }
    torch_zip.save_file(str(src / "common.pt"), common)
    return src, added


@pytest.mark.timeout(60)
def test_synthetic_moe_chained_optimizer_of_another_layout_is_refused(tmp_path):
    """A MoE run's ChainedOptimizer state (dense and expert parameters each with their own
    optimizer) is imported when its buckets are megatron-core's layout (real fixtures:
    the tests above); synthetic buckets of other sizes are refused naming
    the bucket, the recorded size and the way out, nothing written. Before: dp_reshardable
    exited 0 with the flat bucket buffers written as weights under params/ and the Adam state
    dropped."""
    src, _ = _chained_moe(tmp_path, "dp_reshardable")
    dest = tmp_path / "out"
    with pytest.raises(
        MegatronImportError,
        match=r"\.metadata \(model-parallel rank 0\): bucket 0 would end after "
        r"'embedding\.word_embeddings\.weight' at element 7488, but megatron-core recorded 6208 "
        r".*convert\(\.\.\., importing=ImportOptions\(weights_only=True\)\) / jax-ucp convert --weights-only",
    ):
        jax_ucp.convert(str(src), str(dest), importing=MegatronOptions(vocab_size=61))
    assert_untouched(dest)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", ["dp_reshardable", "fully_reshardable"])
def test_synthetic_moe_chained_optimizer_weights_only_lists_every_optimizer_tensor(
    tmp_path, layout
):
    """weights_only=True: the model weights exactly as saved, nothing else under params/, and
    every optimizer tensor named in source.skipped with its reason."""
    src, added = _chained_moe(tmp_path, layout)
    ckpt = jax_ucp.convert(
        str(src), str(tmp_path / "ucp"), importing=ImportOptions(weights_only=True)
    )
    got = jax_ucp.restore(ckpt)
    ref = load_reference("moe_ep2")
    assert sorted(got) == ["params"] and sorted(got["params"]) == sorted(ref)
    for name, want in ref.items():
        assert_bit_equal(got["params"][name], want, name)
    skipped = jax_ucp.inspect(ckpt).source["skipped"]
    assert sorted(skipped) == sorted(added)
    assert all(why.startswith("weights_only: optimizer state") for why in skipped.values())
