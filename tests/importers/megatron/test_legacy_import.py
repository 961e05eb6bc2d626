"""Megatron-LM legacy imports (mp_rank_* files): a rank that does not fit, state the importer
cannot place, refused or listed in ``source.skipped``; nothing committed after a refusal."""

from __future__ import annotations

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.importers.megatron import MegatronImportError
from jax_ucp._src.torchfiles import pickle_format, torch_zip
from jax_ucp.conversion import MegatronOptions
from jax_ucp.errors import SourceError
from tests.megatron_testing import (
    FIX,
    assert_bit_equal,
    assert_megatron_refused,
    assert_untouched,
    copy_megatron_fixture,
)

LEGACY_LLAMA = "legacy_llama_tp2_synthetic"  # TP=2, each rank's real megatron-core weights


def _rewrite_rank(path, edit, top=None) -> None:
    """Re-writes a legacy ``model_optim_rng.pt`` (torch-free) after ``edit(model)``: the run
    arguments, version, iteration and model state dict kept, the RNG state left out; ``top``:
    more top-level entries (nested dicts of arrays and values)."""
    from jax_ucp._src.importers.megatron import legacy as megatron_legacy
    from jax_ucp._src.torchfiles import torch_zip

    saved = torch_zip.load_torch_file(str(path), megatron_legacy.LEGACY_CLASSES)
    # copies: the loaded arrays are memory-mapped views of the file rewritten below
    model = {k: np.array(v) if isinstance(v, np.ndarray) else v for k, v in saved["model"].items()}
    edit(model)
    arrays = []

    def slots(value):
        if isinstance(value, np.ndarray):
            arrays.append(value)
            return torch_zip.TensorSlot(len(arrays) - 1, value.shape, value.dtype)
        if isinstance(value, dict):
            return {k: slots(v) for k, v in value.items()}
        if isinstance(value, list):
            return [slots(v) for v in value]
        return value

    state = slots(model)
    args = {
        k: v
        for k, v in vars(saved["args"]).items()
        if k != "args" and isinstance(v, (int, float, str, bool, type(None)))
    }
    obj = {
        "args": pickle_format.New(pickle_format.Global("argparse", "Namespace"), args),
        "checkpoint_version": saved["checkpoint_version"],
        "iteration": saved["iteration"],
        "model": state,
        **slots(top or {}),
    }
    torch_zip.save_file(str(path), obj, arrays)


def _set(name, value):
    return lambda model: model.__setitem__(name, value(model[name]))


LEGACY_HOLES = {
    "unchanged": (lambda model: None, None),
    "tensor_missing_on_rank_1": (
        lambda model: model.pop("decoder.layers.0.mlp.linear_fc2.weight"),
        r"mp_rank_01/model_optim_rng\.pt and \S+/mp_rank_00/model_optim_rng\.pt hold different "
        r"tensor names \(e\.g\. \['decoder\.layers\.0\.mlp\.linear_fc2\.weight'\]\)",
    ),
    "row_split_shape": (
        _set("decoder.layers.0.self_attention.linear_proj.weight", lambda v: v[:31]),
        r"tensor 'decoder\.layers\.0\.self_attention\.linear_proj\.weight': \S+/mp_rank_01/"
        r"model_optim_rng\.pt holds \[31, 16\] float32, \S+/mp_rank_00/model_optim_rng\.pt "
        r"holds \[32, 16\] float32; every tensor-parallel rank holds an equal share",
    ),
    "vocab_rows_uneven": (
        _set("embedding.word_embeddings.weight", lambda v: v[:31]),
        r"tensor 'embedding\.word_embeddings\.weight': \S+/mp_rank_01/model_optim_rng\.pt holds "
        r"\[31, 32\] float32, .* holds \[32, 32\] float32; every tensor-parallel rank",
    ),
    "dtype_on_one_rank": (
        _set("decoder.layers.0.mlp.linear_fc2.weight", lambda v: v.astype(np.float16)),
        r"tensor 'decoder\.layers\.0\.mlp\.linear_fc2\.weight': \S+/mp_rank_01/"
        r"model_optim_rng\.pt holds \[32, 24\] float16, .* holds \[32, 24\] float32",
    ),
    "not_a_tensor": (
        _set("decoder.layers.0.mlp.linear_fc2.weight", lambda v: 3),
        r"tensor 'decoder\.layers\.0\.mlp\.linear_fc2\.weight' in \S+/mp_rank_01/"
        r"model_optim_rng\.pt: a int, expected a tensor",
    ),
    "replicated_norm_differs": (
        _set("decoder.final_layernorm.weight", lambda v: v + 1),
        r"decoder\.final_layernorm\.weight: replicated fragments disagree across TP ranks",
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(LEGACY_HOLES))
def test_legacy_rank_that_does_not_fit_is_a_clear_error(tmp_path, case):
    """Legacy TP=2 checkpoint whose rank 1 lacks a tensor, holds a share of another shape (a
    row-parallel weight, the vocab-parallel embedding) or dtype, a non-tensor, or a replicated
    norm that differs: an error naming the tensor and both rank files, nothing written. Before,
    uneven vocab rows and a float16 share on one rank were imported with exit 0 (the rows
    concatenated to the wrong size, the dtypes promoted). Unchanged, the re-written rank
    imports bit-exact (the test's writer is faithful)."""
    edit, error = LEGACY_HOLES[case]
    src = copy_megatron_fixture(LEGACY_LLAMA, tmp_path)
    _rewrite_rank(src / "iter_0000007" / "mp_rank_01" / "model_optim_rng.pt", edit)
    dest = tmp_path / "out"
    if error is None:
        got = jax_ucp.restore(
            jax_ucp.convert(str(src), str(dest), importing=MegatronOptions(vocab_size=61))
        )["params"]
        original = FIX / LEGACY_LLAMA
        ref = jax_ucp.restore(
            jax_ucp.convert(
                str(original), str(tmp_path / "ref"), importing=MegatronOptions(vocab_size=61)
            )
        )
        assert sorted(got) == sorted(ref["params"]) and len(got) == 15
        for name, want in ref["params"].items():
            assert_bit_equal(got[name], want, name)
        return
    with pytest.raises(MegatronImportError, match=error):
        jax_ucp.convert(str(src), str(dest), importing=MegatronOptions(vocab_size=61))
    assert_untouched(dest)


def _legacy_with(tmp_path, edit, top):
    """The legacy Llama TP=2 fixture with both rank files re-written (``edit``, ``top``)."""
    src = copy_megatron_fixture(LEGACY_LLAMA, tmp_path)
    for rank in ("mp_rank_00", "mp_rank_01"):
        _rewrite_rank(src / "iter_0000007" / rank / "model_optim_rng.pt", edit, top)
    return src


@pytest.mark.timeout(60)
def test_legacy_non_distributed_optimizer_state_is_refused_or_listed(tmp_path):
    """Megatron-LM without --use-distributed-optimizer keeps Adam's state in
    model_optim_rng.pt, which is not read: refused, naming the file and the way out (before, the
    weights were imported with exit 0 and the state dropped with a note). weights_only: the
    weights imported bit-exact, every optimizer tensor of both ranks listed in source.skipped."""
    moments = {"exp_avg": np.ones(4, np.float32), "exp_avg_sq": np.ones(4, np.float32)}
    optimizer = {
        "optimizer": {"state": {0: moments}, "param_groups": [{"step": 2, "lr": 0.1}]},
        "fp32_from_fp16_params": {"0": np.zeros(4, np.float32)},
    }
    src = _legacy_with(tmp_path, lambda model: None, {"optimizer": optimizer})
    dest = tmp_path / "out"
    with pytest.raises(
        MegatronImportError,
        match=r"iter_0000007: the rank files hold the state of a non-distributed optimizer \(6 "
        r"tensors, e\.g\. 'mp_rank_00/model_optim_rng\.pt:optimizer\.optimizer\.state\.0\."
        r"exp_avg'\), which is not supported \(only the distributed "
        r"optimizer's distrib_optim\.pt is read\)\. To import the model weights without the "
        r"optimizer state: convert\(\.\.\., importing=ImportOptions\(weights_only=True\)\)",
    ):
        jax_ucp.convert(str(src), str(dest), importing=MegatronOptions(vocab_size=61))
    assert_untouched(dest)
    ckpt = jax_ucp.convert(
        str(src), str(dest), importing=MegatronOptions(vocab_size=61, weights_only=True)
    )
    ref = jax_ucp.restore(
        jax_ucp.convert(
            str(FIX / LEGACY_LLAMA), str(tmp_path / "ref"), importing=MegatronOptions(vocab_size=61)
        )
    )
    got = jax_ucp.restore(ckpt)
    assert sorted(got) == ["params"] and sorted(got["params"]) == sorted(ref["params"])
    for name, want in ref["params"].items():
        assert_bit_equal(got["params"][name], want, name)
    skipped = jax_ucp.inspect(ckpt).source["skipped"]
    assert skipped == {
        f"{rank}/model_optim_rng.pt:optimizer.{path}": (
            f"weights_only: optimizer state ({rank}/model_optim_rng.pt)"
        )
        for rank in ("mp_rank_00", "mp_rank_01")
        for path in (
            "optimizer.state.0.exp_avg",
            "optimizer.state.0.exp_avg_sq",
            "fp32_from_fp16_params.0",
        )
    }


@pytest.mark.timeout(60)
def test_legacy_tensor_the_importer_does_not_know_commits_nothing(tmp_path):
    """A tensor in a rank file that the importer neither reads nor knows to skip (here a
    top-level ``grad_norms`` buffer, and a model entry holding a list of tensors): the import is
    refused naming it, nothing written, instead of exiting 0 without it."""

    src = _legacy_with(
        tmp_path,
        lambda model: model.__setitem__("decoder.extra", [np.ones(2, np.float32)]),
        {"grad_norms": np.ones(3, np.float32)},
    )
    with pytest.raises(
        SourceError,
        match=r"4 of the checkpoint's 34 tensors have no place in the import and no reason to be "
        r"left out: 'mp_rank_00/model_optim_rng\.pt:grad_norms', "
        r"'mp_rank_00/model_optim_rng\.pt:model\.decoder\.extra\.0', "
        r"'mp_rank_01/model_optim_rng\.pt:grad_norms', .*Nothing was committed",
    ):
        jax_ucp.convert(str(src), str(tmp_path / "out"), importing=MegatronOptions(vocab_size=61))
    assert_untouched(tmp_path / "out")


@pytest.mark.timeout(60)
def test_legacy_extra_state_tensor_is_listed_not_imported(tmp_path):
    """TransformerEngine's ``_extra_state`` saved as a tensor (FP8 metadata bytes): not a
    weight, so not imported, and listed in source.skipped for each rank with the reason."""
    name = "decoder.layers.0.self_attention.linear_proj._extra_state"
    src = _legacy_with(
        tmp_path, lambda model: model.__setitem__(name, np.arange(8, dtype=np.uint8)), None
    )
    ckpt = jax_ucp.convert(
        str(src), str(tmp_path / "out"), importing=MegatronOptions(vocab_size=61)
    )
    assert name not in jax_ucp.restore(ckpt)["params"]
    skipped = jax_ucp.inspect(ckpt).source["skipped"]
    assert skipped == {
        f"{rank}/model_optim_rng.pt:model.{name}": (
            "TransformerEngine _extra_state (FP8 scaling metadata), not a weight"
        )
        for rank in ("mp_rank_00", "mp_rank_01")
    }


@pytest.mark.timeout(60)
def test_legacy_expert_parallel_distrib_optim_is_refused_or_listed(tmp_path):
    """Legacy MoE with EP=2 and a distributed optimizer: the expert buffers of distrib_optim.pt
    are not read, so the import is refused naming the layout and the way out (before, EP rank
    1's distrib_optim.pt was never opened). weights_only: every tensor of every EP rank's
    distrib_optim.pt listed in source.skipped (EP rank 1's directory included)."""
    src = copy_megatron_fixture("legacy_moe_ep2_synthetic", tmp_path)
    flat = np.zeros(8, np.float32)
    for rank in ("mp_rank_00_000", "mp_rank_00_001"):
        buffer = {"param": torch_zip.TensorSlot(0, flat.shape, flat.dtype), "numel_unpadded": 8}
        torch_zip.save_file(
            str(src / "iter_0000007" / rank / "distrib_optim.pt"),
            {"buckets_coalesced": True, 0: {"f32": buffer}},
            [flat],
        )
    assert_megatron_refused(
        src,
        tmp_path,
        r"iter_0000007: distrib_optim\.pt with expert-parallel experts is not supported\. "
        r"To import the model weights without the optimizer state",
    )
    ckpt = jax_ucp.convert(
        str(src), str(tmp_path / "out"), importing=MegatronOptions(vocab_size=61, weights_only=True)
    )
    skipped = jax_ucp.inspect(ckpt).source["skipped"]
    assert {k: v for k, v in skipped.items() if "distrib_optim" in k} == {
        f"{rank}/distrib_optim.pt:0.f32.param": f"weights_only: optimizer state ({rank}/distrib_optim.pt)"
        for rank in ("mp_rank_00_000", "mp_rank_00_001")
    }
