"""Checkpoints written by older megatron-core releases (0.13.1, 0.14.0, 0.15.3; tools/fixtures/
make_megatron_fixtures.py run in a virtualenv of each release): their ``.metadata`` pickles
megatron-core's own ``MCoreSavePlan`` (0.13, 0.14) or ``MCoreMetadata`` (0.15) classes, read as
inert stand-ins; every weight and moment bit-exact against torch's DCP consolidation."""

from __future__ import annotations

import os

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.importers.megatron import dcp as megatron_dcp
from jax_ucp._src.store.storage import LocalDirectory
from jax_ucp.conversion import MegatronOptions
from tests.ucp_testing import REPO

pytestmark = pytest.mark.timeout(120)
ROOT = os.path.join(REPO, "tests", "fixtures", "megatron", "mcore_versions")
VOCAB = 61  # the fixtures' tokenizer vocab (padded to 64 in the checkpoint)
CASES = [
    ("0.13.1", "gpt_tp2"),
    ("0.14.0", "gpt_tp2"),
    ("0.15.3", "gpt_tp2"),
    ("0.15.3", "gpt_distopt_dp2"),
    # 0.17.1 and 0.18.2 model-only: weights equal 0.16.1's from the same seed bit for bit
    # (torch's consolidation and the CPU forward's logits compared when generated)
    ("0.17.1", "gpt_tp2"),
    ("0.18.2", "gpt_tp2"),
    # 0.19 writes no common.pt; its weights equal 0.16.1's from the same seed bit for bit
    ("0.19.2", "gpt_tp2"),
]


def _reference(version: str, name: str) -> dict[str, np.ndarray]:
    """torch's DCP consolidation of the fixture; a model-only run's weights equal megatron-core
    0.16's from the same seed bit for bit (checked when made), so gpt_tp2 uses that one."""
    own = os.path.join(ROOT, version, f"{name}.consolidated.npz")
    z = np.load(
        own if os.path.exists(own) else os.path.join(ROOT, "..", f"{name}.consolidated.npz")
    )
    assert not z["__bfloat16_keys__"].size  # fp32 fixtures
    return {k: z[k] for k in z.files if k != "__bfloat16_keys__"}


def _stripped(name: str, value: np.ndarray) -> np.ndarray:
    vocab = name.endswith("word_embeddings.weight") or name.endswith("output_layer.weight")
    return value[:VOCAB] if vocab else value


@pytest.mark.parametrize("version, name", CASES)
def test_older_megatron_core_checkpoints_import_bit_exact(tmp_path, version, name):
    ckpt = jax_ucp.convert(
        os.path.join(ROOT, version, name),
        str(tmp_path / "ucp"),
        importing=MegatronOptions(vocab_size=VOCAB),
    )
    got = jax_ucp.restore(ckpt)
    ref = _reference(version, name)
    model = {k: v for k, v in ref.items() if not k.startswith("optimizer.")}
    assert set(got["params"]) == set(model)
    for key, value in model.items():
        assert got["params"][key].tobytes() == _stripped(key, value).tobytes(), key
    moments = {k: v for k, v in ref.items() if k.startswith("optimizer.state.exp_avg")}
    if not moments:
        assert "opt_state" not in got
    for key, value in moments.items():
        state, _, param = key[len("optimizer.state.") :].partition(".")
        tree = got["opt_state"]["mu" if state == "exp_avg" else "nu"]
        assert tree[param].tobytes() == _stripped(param, value).tobytes(), key


OLDER_LAYOUTS = {
    # release/name: (model dtype, layout, optimizer tensors or objects)
    "0.13.1/gpt_distopt_fully_sharded_model_space": ("float32", "flattened", 51),
    "0.14.0/llama_distopt_bf16_tp2dp2_fully_sharded_model_space": ("bfloat16", "flattened", 27),
    "0.13.1/gpt_distopt_dp_zero_gather_scatter": ("float32", "dp_zero_gather_scatter", 1),
    "0.14.0/llama_distopt_bf16_tp2dp2_dp_zero_gather_scatter": (
        "bfloat16",
        "dp_zero_gather_scatter",
        2,
    ),
    # the same Llama run with 3000-element --overlap-grad-reduce buckets (three per rank);
    # 0.16.1 itself refuses to save fully_sharded_model_space ("flattened_range is not supported")
    "0.15.3/llama_distopt_bf16_tp2dp2_buckets_fully_sharded_model_space": (
        "bfloat16",
        "flattened",
        27,
    ),
    "0.15.3/llama_distopt_bf16_tp2dp2_buckets_dp_zero_gather_scatter": (
        "bfloat16",
        "dp_zero_gather_scatter",
        2,
    ),
    "0.16.1/llama_distopt_bf16_tp2dp2_buckets_dp_zero_gather_scatter": (
        "bfloat16",
        "dp_zero_gather_scatter",
        2,
    ),
}


@pytest.mark.parametrize("name", sorted(OLDER_LAYOUTS))
def test_megatron_core_013_to_016_optimizer_layouts_import_bit_exact(tmp_path, name):
    """The older distributed-optimizer layouts, written by megatron-core 0.13 to 0.16 themselves
    (GPT DP2 fp32; Llama with GQA and SwiGLU, TP2 DP2 bf16, one or three buckets per rank):

    * ``fully_sharded_model_space`` (Megatron-LM's default there, --ckpt-fully-parallel-save):
      model-space state whose DP shards are flat ranges, saved N-D flattened
      ([X // x, Y // y, ..., x * y * ...]);
    * ``dp_zero_gather_scatter``: per model-parallel rank one pickled ``param_state`` (the
      buckets' unpadded parts concatenated, as in a legacy distrib_optim.pt), laid out again.

    Masters and moments bit-exact to the same run's optimizer state as megatron-core's own
    model sharding places it (``<name>.truth.npz``, read by torch DCP)."""
    from jax_ucp._src.importers.megatron import dcp as megatron_dcp

    dtype, layout, count = OLDER_LAYOUTS[name]
    src = os.path.join(ROOT, name)
    original = megatron_dcp.open_dcp(LocalDirectory(str(src)))
    model = [n for n in original.tensors if not n.startswith("optimizer.")]
    # what the fixture is meant to cover
    if layout == "dp_zero_gather_scatter":
        states = [n for n in original.objects if ".param_state/" in n]
        assert len(states) == count and not any(
            n.startswith("optimizer.") for n in original.tensors
        )
        ckpt = jax_ucp.convert(
            src, str(tmp_path / "ucp"), importing=MegatronOptions(vocab_size=VOCAB)
        )
        assert jax_ucp.inspect(ckpt).source["optimizer_layout"] == "dp_zero_gather_scatter"
        got = jax_ucp.restore(ckpt)
        _compare_to_truth(src, got, model, original, dtype)
        return
    optimizer = [n for n in original.tensors if n.startswith("optimizer.state.")]
    assert len(optimizer) == count
    # the flattened form, not the parameter's own shape
    assert all(
        len(original.tensors[n].shape) == len(original.tensors[n.split(".", 3)[3]].shape) + 1
        for n in optimizer
    )
    got = jax_ucp.restore(
        jax_ucp.convert(src, str(tmp_path / "ucp"), importing=MegatronOptions(vocab_size=VOCAB))
    )
    _compare_to_truth(src, got, model, original, dtype)


def _compare_to_truth(src, got, model, original, dtype) -> None:
    truth = np.load(src + ".truth.npz")
    assert len(truth.files) == 3 * len(model)
    trees = {"exp_avg": got["opt_state"]["mu"], "exp_avg_sq": got["opt_state"]["nu"]}
    for key in truth.files:
        state, _, param = key[len("optimizer.state.") :].partition(".")
        have = trees.get(state, got["params"])[param]
        assert have.tobytes() == _stripped(param, truth[key]).tobytes(), key
    weights = got["model_params"] if dtype == "bfloat16" else got["params"]
    for param in model:
        assert weights[param].tobytes() == _stripped(param, original.read(param)).tobytes(), param


def test_dp_zero_gather_scatter_with_a_wrong_layout_is_refused(tmp_path, monkeypatch):
    """A derived buffer layout that does not add up to the saved buffer (another version or DDP
    bucket setting) is an error naming the object and the sizes; nothing is written."""
    from jax_ucp._src.importers.megatron import rank_states

    real = rank_states.distrib_optim_layout
    monkeypatch.setattr(
        rank_states,
        "distrib_optim_layout",
        lambda params, shared, size, *rest: real(params[1:], shared, size, *rest),
    )
    src = os.path.join(ROOT, "0.13.1", "gpt_distopt_dp_zero_gather_scatter")
    with pytest.raises(jax_ucp.UCPError, match=r"param_state.*holds \d+ elements.*lay out to"):
        jax_ucp.convert(src, str(tmp_path / "ucp"), importing=MegatronOptions(vocab_size=VOCAB))
    assert not (tmp_path / "ucp").exists()


NEWER = {
    # release/name: (layout in source["optimizer_layout"], model dtype, truth fixture of the same run)
    # Llama TP1 DP2 (SwiGLU fc1 saved as two chunks at TP1) through Megatron-LM's fully
    # parallel save: .metadata in the order the save work was split over DP ranks (0.16-0.18:
    # refused before, "stacked layer tensors are not contiguous")
    "0.16.1/llama_distopt_dp2_fully_parallel_dp_reshardable": (
        "dp_reshardable",
        "float32",
        "0.16.1/llama_distopt_dp2_fully_parallel_dp_reshardable",
    ),
    "0.17.1/llama_distopt_dp2_fully_parallel_dp_reshardable": (
        "dp_reshardable",
        "float32",
        "0.17.1/llama_distopt_dp2_fully_parallel_dp_reshardable",
    ),
    "0.18.2/llama_distopt_dp2_fully_parallel_dp_reshardable": (
        "dp_reshardable",
        "float32",
        "0.18.2/llama_distopt_dp2_fully_parallel_dp_reshardable",
    ),
    # GPT TP1 DP2 fp32, the same seeded run as 0.19.2's (live state checked bit-identical when
    # generated, so 0.19.2's truth serves)
    "0.17.1/gpt_distopt_dp2_fully_reshardable": (
        "per_parameter",
        "float32",
        "0.19.2/gpt_distopt_dp2_dp_zero_gather_scatter",
    ),
    "0.17.1/gpt_distopt_dp2_dp_zero_gather_scatter": (
        "dp_zero_gather_scatter",
        "float32",
        "0.19.2/gpt_distopt_dp2_dp_zero_gather_scatter",
    ),
    "0.18.2/gpt_distopt_dp2_fully_reshardable": (
        "per_parameter",
        "float32",
        "0.19.2/gpt_distopt_dp2_dp_zero_gather_scatter",
    ),
    "0.18.2/gpt_distopt_dp2_dp_zero_gather_scatter": (
        "dp_zero_gather_scatter",
        "float32",
        "0.19.2/gpt_distopt_dp2_dp_zero_gather_scatter",
    ),
    # megatron-core 0.19: no common.pt (the common state is the object common_state/shard_0_1)
    "0.19.2/gpt_distopt_dp2_fully_reshardable": (
        "per_parameter",
        "float32",
        "0.19.2/gpt_distopt_dp2_dp_zero_gather_scatter",
    ),
    "0.19.2/gpt_distopt_dp2_dp_zero_gather_scatter": (
        "dp_zero_gather_scatter",
        "float32",
        "0.19.2/gpt_distopt_dp2_dp_zero_gather_scatter",
    ),
    "0.19.2/llama_distopt_dp2_fully_parallel_dp_reshardable": (
        "dp_reshardable",
        "float32",
        "0.19.2/llama_distopt_dp2_fully_parallel_dp_reshardable",
    ),
    "0.19.2/llama_distopt_bf16_tp2_dp_reshardable": (
        "dp_reshardable",
        "bfloat16",
        "0.19.2/llama_distopt_bf16_tp2_dp_reshardable",
    ),
    "0.19.2/moe_distopt_ep2_dp_reshardable": (
        "dp_reshardable",
        "float32",
        "0.19.2/moe_distopt_ep2_dp_reshardable",
    ),
}


@pytest.mark.parametrize("name", sorted(NEWER))
def test_megatron_core_017_to_019_optimizer_layouts_import_bit_exact(tmp_path, name):
    """Distributed-optimizer checkpoints written by megatron-core 0.17-0.19 themselves (each in
    its own virtualenv, torch 2.13 CPU): masters and moments bit-exact to the run's live
    optimizer state (``<truth>.truth.npz``; runs of one config share a seed and their live
    state, checked bit-identical when generated), the step (2) from 0.19's common_state object
    or the per-rank optimizer objects, model weights as saved."""
    layout, dtype, truth = NEWER[name]
    src = os.path.join(ROOT, name)
    original = megatron_dcp.open_dcp(LocalDirectory(str(src)))
    assert os.path.exists(os.path.join(src, "common.pt")) != name.startswith("0.19")
    model = [n for n in original.tensors if "optimizer." not in n]
    if "fully_parallel" in name:  # what the fixture is meant to cover: not module order
        assert model[0] != "embedding.word_embeddings.weight"
    ckpt = jax_ucp.convert(src, str(tmp_path / "ucp"), importing=MegatronOptions(vocab_size=VOCAB))
    assert jax_ucp.inspect(ckpt).source["optimizer_layout"] == layout
    got = jax_ucp.restore(ckpt)
    assert int(got["opt_state"]["count"]) == 2
    _compare_to_truth(os.path.join(ROOT, truth), got, model, original, dtype)


def test_singleton_local_shards_import_bit_exact(tmp_path):
    """megatron-core's ``singleton_local_shards=True`` (0.16.1, Llama TP1 DP2 dp_reshardable):
    one tensor per layer (``decoder.layers.<i>.*``, not stacked) and a SwiGLU fc1 as two
    tensors ``linear_fc1.weight_w`` / ``_v`` (one [w; v] parameter in the grad buffer). Names
    are kept as saved; masters and moments bit-exact to the run's live state (the same seeded
    run as the fully parallel fixture, its live state checked bit-identical when generated)."""
    import re

    src = os.path.join(ROOT, "0.16.1", "llama_distopt_dp2_singleton_dp_reshardable")
    original = megatron_dcp.open_dcp(LocalDirectory(str(src)))
    model = [n for n in original.tensors if "optimizer." not in n]
    assert "decoder.layers.1.mlp.linear_fc1.weight_v" in model  # what the fixture covers
    ckpt = jax_ucp.convert(src, str(tmp_path / "ucp"), importing=MegatronOptions(vocab_size=VOCAB))
    got = jax_ucp.restore(ckpt)
    assert sorted(got["params"]) == sorted(model) and int(got["opt_state"]["count"]) == 2
    truth = np.load(
        os.path.join(ROOT, "0.16.1", "llama_distopt_dp2_fully_parallel_dp_reshardable.truth.npz")
    )
    trees = {"param": got["params"], "exp_avg": got["opt_state"]["mu"]}
    trees["exp_avg_sq"] = got["opt_state"]["nu"]
    for name in model:
        m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.*?)(_w|_v)?", name)
        for state, tree in trees.items():
            if m is None:
                want = _stripped(name, truth[f"optimizer.state.{state}.{name}"])
            else:
                want = truth[f"optimizer.state.{state}.decoder.layers.{m.group(2)}"]
                want = want[int(m.group(1))]
                if m.group(3):  # SwiGLU halves: [w; v] along the rows
                    want = np.split(want, 2)[m.group(3) == "_v"]
            assert tree[name].tobytes() == want.tobytes(), (state, name)
        weight = _stripped(name, original.read(name))
        assert got["params"][name].tobytes() == weight.tobytes(), name
