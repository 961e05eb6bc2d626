"""DeepSpeed pipeline parallelism (``PipelineModule``) and DeepSpeed MoE (expert parallel): real
runs of DeepSpeed 0.19.8 on CPU, 2 processes each (``tools/fixtures/ds_pipe_moe_train.py``, made
by ``tools/fixtures/make_deepspeed_fixtures.py --pipe-moe``).

Truth: ``live.npz``, the run's live state right after the save (module weights, fp32 masters and
Adam moments as DeepSpeed's ``safe_get_full_*`` gather them, the optimizer step), bit for bit.
Plus the silent-loss rule: every file of the tag folder is read, or the import is refused
naming it.
"""

from __future__ import annotations

import os
import shutil
import sys

import ml_dtypes
import numpy as np
import pytest

import jax_ucp
from jax_ucp.conversion import ImportOptions
from jax_ucp.errors import SourceError
from tests.ucp_testing import (
    REPO,
    assert_destination_untouched,
    copy_deepspeed_fixture,
    run_torchrun,
)

FIXTURES = os.path.join(REPO, "tests", "fixtures", "deepspeed")
PIPE = ["pipe_pp2_z1_fp32", "pipe_pp2_z1_bf16", "pipe_pp2_dp2_z1_bf16"]
MOE_ZERO = ["moe_ep2_z2_fp32", "moe_ep2_z2_bf16", "moe_ep2_z1_bf16"]
EXPERT = "h.{layer}.moe.deepspeed_moe.experts.deepspeed_experts.{expert}.{key}"


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if b.dtype == np.dtype("V2"):  # bfloat16 as np.savez stores it
        b = b.view(ml_dtypes.bfloat16)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def check_against_live(tree: dict, live_path: str, *, weights_only: bool = False) -> int:
    """Every live tensor equals the import's bit for bit (and the import holds nothing else);
    returns the number of tensors compared."""
    live = np.load(live_path)
    model = tree.get("model_params", tree["params"])
    where = {"param": model, "fp32": tree["params"]}
    if not weights_only:
        where.update(exp_avg=tree["opt_state"]["mu"], exp_avg_sq=tree["opt_state"]["nu"])
        assert int(tree["opt_state"]["count"]) == int(live["step"]) == 2
    names = {k.split("/", 1)[1] for k in live.files if k != "step"}
    for state, subtree in where.items():
        assert set(subtree) == names, state
    compared = 0
    for key in live.files:
        state, _, name = key.partition("/")
        if state in where:
            assert same_bits(where[state][name], live[key]), key
            compared += 1
    return compared


# --------------------------------------------------------------------------- pipeline


@pytest.mark.timeout(120)
@pytest.mark.parametrize("run", PIPE)
def test_pipeline_imports_by_auto_detection_bit_exact(tmp_path, run):
    """2 pipeline stages (ZeRO-1, fp32 and bf16; bf16 also over 2 data-parallel ranks), no
    universal_checkpoint_info: detected and imported without a spec; masters, moments, step and
    the bf16 layer-file weights equal the run's live state."""
    dest = str(tmp_path / "u")
    jax_ucp.convert(os.path.join(FIXTURES, run, "ckpt"), dest)
    tree = jax_ucp.restore(dest)
    assert check_against_live(tree, os.path.join(FIXTURES, run, "live.npz")) == 4 * 17
    assert ("model_params" in tree) == run.endswith("bf16")
    source = jax_ucp.inspect(dest).source
    dp = 2 if "_dp2_" in run else 1
    assert (source["layout"], source["pp"], source["tp"], source["dp_world_size"]) == (
        "pipeline",
        2,
        1,
        dp,
    )
    assert source["ds_version"] == "0.19.8"
    # stage 0 holds layers 0-1, stage 1 layers 2-3, each under the engine's names
    assert "0.wte.weight" in tree["params"] and "3.lm_head.weight" in tree["params"]
    layer_files = sorted(
        f for f in os.listdir(os.path.join(FIXTURES, run, "ckpt", "global_step2")) if "layer" in f
    )
    suffix = "-model_00-model_states.pt" if run == "pipe_pp2_z1_bf16" else "-model_states.pt"
    assert layer_files == [f"layer_0{i}{suffix}" for i in range(4)]


@pytest.mark.timeout(120)
def test_pipeline_weights_only(tmp_path):
    """``weights_only`` (refused before as if tensor-parallel): the weights alone."""
    run = "pipe_pp2_z1_bf16"
    dest = str(tmp_path / "u")
    jax_ucp.convert(
        os.path.join(FIXTURES, run, "ckpt"), dest, importing=ImportOptions(weights_only=True)
    )
    tree = jax_ucp.restore(dest)
    assert sorted(tree) == ["model_params", "params"]
    check_against_live(tree, os.path.join(FIXTURES, run, "live.npz"), weights_only=True)


@pytest.mark.timeout(120)
def test_pipeline_two_saves_of_one_layer_are_refused(tmp_path):
    """``layer_00-model_states.pt`` beside ``layer_00-model_00-model_states.pt``: two saves
    mixed; refused naming both, nothing written."""
    src = copy_deepspeed_fixture(tmp_path, "pipe_pp2_z1_fp32")
    tag = os.path.join(src, "global_step2")
    bf16_tag = os.path.join(FIXTURES, "pipe_pp2_z1_bf16", "ckpt", "global_step2")
    shutil.copy(os.path.join(bf16_tag, "layer_00-model_00-model_states.pt"), tag)
    with pytest.raises(
        SourceError,
        match=r"layer 0 on TP rank 0: layer_00-model_00-model_states\.pt and layer_00-model_states\.pt",
    ):
        jax_ucp.convert(src, str(tmp_path / "out"))
    assert_destination_untouched(str(tmp_path / "out"))


# --------------------------------------------------------------------------- MoE


@pytest.mark.timeout(120)
@pytest.mark.parametrize("run", MOE_ZERO)
def test_moe_zero2_imports_experts_by_global_index(tmp_path, run):
    """Expert parallel 2 at ZeRO-2 (refused before as "rank files out of order"): each DP rank's
    expert group holds its own expert under local index 0; imported under the global index,
    with masters, moments and step, bit-exact vs the live state."""
    dest = str(tmp_path / "u")
    jax_ucp.convert(os.path.join(FIXTURES, run, "ckpt"), dest)
    tree = jax_ucp.restore(dest)
    assert check_against_live(tree, os.path.join(FIXTURES, run, "live.npz")) == 4 * 27
    for layer in (0, 1):
        for expert in (0, 1):
            name = EXPERT.format(layer=layer, expert=expert, key="fc1.weight")
            assert tree["params"][name].shape == (16, 8)
    # the two experts of a layer are different tensors (not one rank's read twice)
    e0, e1 = (tree["params"][EXPERT.format(layer=0, expert=e, key="fc1.weight")] for e in (0, 1))
    assert not np.array_equal(e0, e1)
    manifest = jax_ucp.inspect(dest)
    source = manifest.source
    assert (source["layout"], source["ep_size"], source["num_experts"]) == ("moe", 2, [2, 2])
    assert source["zero_stage"] == int(run.split("_z")[1][0])
    # expert 1 comes from DP rank 1's file, expert 0 from DP rank 0's
    entry = {tuple(e.key): e for e in manifest.tensors}[
        ("opt_state", "mu", EXPERT.format(layer=1, expert=1, key="fc2.bias"))
    ]
    prefix = "bf16_" if run.endswith("bf16") else ""
    assert entry.provenance["files"] == [f"{prefix}zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    if run.endswith("bf16"):  # the model copies are the expert files' own tensors
        entry = {tuple(e.key): e for e in manifest.tensors}[
            ("model_params", EXPERT.format(layer=0, expert=1, key="fc1.weight"))
        ]
        assert entry.provenance["tensors"] == [
            "layer_0_expert_1_mp_rank_00_model_states.pt:"
            + EXPERT.format(layer=0, expert=1, key="fc1.weight")
        ]


@pytest.mark.timeout(120)
def test_moe_zero0_imports_every_weight_and_the_moments(tmp_path):
    """ZeRO-0 MoE (before: refused, and with weights_only 11 of 27 weights, exit 0): all 27
    weights, the 16 expert tensors included, and Adam's moments from the expert-parallel ranks'
    torch optimizer state (by index, mapped as DeepSpeed's MoE param groups order them),
    bit-exact vs the live state; the dense replicas on rank 1 are checked and skipped."""
    run = "moe_ep2_z0_fp32"
    src = os.path.join(FIXTURES, run, "ckpt")
    dest = str(tmp_path / "u")
    jax_ucp.convert(src, dest)
    tree = jax_ucp.restore(dest)
    assert check_against_live(tree, os.path.join(FIXTURES, run, "live.npz")) == 4 * 27
    assert len([n for n in tree["params"] if "deepspeed_experts" in n]) == 16
    manifest = jax_ucp.inspect(dest)
    skipped = manifest.source["skipped"]
    assert skipped["expp_rank_1_mp_rank_00_optim_states.pt:optimizer.state.0.exp_avg"] == (
        "replica of expp_rank_0_mp_rank_00_optim_states.pt:optimizer.state.0 (bit-identical)"
    )
    entry = {tuple(e.key): e for e in manifest.tensors}[
        ("opt_state", "nu", EXPERT.format(layer=1, expert=1, key="fc2.bias"))
    ]
    assert entry.provenance["tensors"] == [
        "expp_rank_1_mp_rank_00_optim_states.pt:optimizer.state.18.exp_avg_sq"
    ]
    # weights_only: the weights alone, every optimizer tensor listed as skipped
    jax_ucp.convert(src, str(tmp_path / "w"), importing=ImportOptions(weights_only=True))
    weights = jax_ucp.restore(str(tmp_path / "w"))
    assert sorted(weights) == ["params"]
    check_against_live(weights, os.path.join(FIXTURES, run, "live.npz"), weights_only=True)
    skipped = jax_ucp.inspect(str(tmp_path / "w")).source["skipped"]
    for rank in (0, 1):
        key = f"expp_rank_{rank}_mp_rank_00_optim_states.pt:optimizer.state.11.exp_avg"
        assert skipped[key].startswith("weights_only: ZeRO-0 optimizer state")


def _altered_optimizer(monkeypatch, file: str, alter) -> None:
    """``load_deepspeed_file`` as the importer sees it, with ``alter(optimizer)`` applied to the
    torch optimizer state of ``file`` (a hostile or differently built checkpoint)."""
    from jax_ucp._src.importers.deepspeed import files as deepspeed_files

    load = deepspeed_files.load_deepspeed_file

    def altered(folder, path, **kwargs):
        state = load(folder, path, **kwargs)
        if os.path.basename(path) == file:
            alter(state["optimizer"])
        return state

    monkeypatch.setattr(deepspeed_files, "load_deepspeed_file", altered)


@pytest.mark.timeout(120)
def test_moe_zero0_moments_whose_order_is_unknown_are_refused(tmp_path, monkeypatch):
    """The index -> name mapping is refused rather than guessed: a moment whose shape is not
    its parameter's (another parameter order), or other param groups than DeepSpeed's MoE split
    (weight-decay groups), name the file; nothing is written."""
    src = os.path.join(FIXTURES, "moe_ep2_z0_fp32", "ckpt")
    file = "expp_rank_1_mp_rank_00_optim_states.pt"

    def swap(optimizer):  # h.0.ln.weight (8,) <-> h.0.moe...gate.wg.weight (2, 8)
        state = optimizer["state"]
        state[1], state[3] = state[3], state[1]

    _altered_optimizer(monkeypatch, file, swap)
    with pytest.raises(
        SourceError,
        match=rf"{file}:optimizer\.state\.1\.exp_avg: shape \(2, 8\) but parameter "
        r"'h\.0\.ln\.weight' \(at this index\) has shape \(8,\)",
    ):
        jax_ucp.convert(src, str(tmp_path / "out"))
    assert_destination_untouched(str(tmp_path / "out"))

    def decay_groups(optimizer):
        dense = optimizer["param_groups"][0]
        optimizer["param_groups"].insert(1, dict(dense, params=dense["params"][5:]))
        dense["params"] = dense["params"][:5]

    _altered_optimizer(monkeypatch, file, decay_groups)
    with pytest.raises(SourceError, match=rf"{file}: 2 dense and 1 expert param groups"):
        jax_ucp.convert(src, str(tmp_path / "out"))
    assert_destination_untouched(str(tmp_path / "out"))


@pytest.mark.timeout(120)
def test_moe_zero0_replicas_that_disagree_are_refused(tmp_path, monkeypatch):
    """The dense parameters' Adam state is a data-parallel replica on every expert-parallel
    rank: a rank holding another value is files from different saves."""
    src = os.path.join(FIXTURES, "moe_ep2_z0_fp32", "ckpt")
    file = "expp_rank_1_mp_rank_00_optim_states.pt"

    def stale(optimizer):
        entry = optimizer["state"][0]
        entry["exp_avg"] = entry["exp_avg"] * 2

    _altered_optimizer(monkeypatch, file, stale)
    with pytest.raises(
        SourceError,
        match=rf"{file}:optimizer\.state\.0\.exp_avg: 'wte\.weight' differs",
    ):
        jax_ucp.convert(src, str(tmp_path / "out"))
    assert_destination_untouched(str(tmp_path / "out"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("run", ["moe_ep2_z0_fp32", "moe_ep2_z2_fp32"])
def test_moe_missing_expert_file_is_named(tmp_path, run):
    src = copy_deepspeed_fixture(tmp_path, run)
    os.remove(os.path.join(src, "global_step2", "layer_1_expert_1_mp_rank_00_model_states.pt"))
    with pytest.raises(
        SourceError,
        match=r"layer_1_expert_1_mp_rank_00_model_states\.pt:.*expert 1 of MoE layer 1 \(2 experts\)",
    ):
        jax_ucp.convert(src, str(tmp_path / "out"), importing=ImportOptions(weights_only=True))
    assert_destination_untouched(str(tmp_path / "out"))


@pytest.mark.timeout(120)
def test_moe_missing_expert_parallel_optimizer_file_is_named(tmp_path):
    src = copy_deepspeed_fixture(tmp_path, "moe_ep2_z0_fp32")
    os.remove(os.path.join(src, "global_step2", "expp_rank_1_mp_rank_00_optim_states.pt"))
    with pytest.raises(
        SourceError,
        match=r"expp_rank_1_mp_rank_00_optim_states\.pt:.*expert-parallel rank 1 \(expert parallel size 2\)",
    ):
        jax_ucp.convert(src, str(tmp_path / "out"), importing=ImportOptions(weights_only=True))
    assert_destination_untouched(str(tmp_path / "out"))


# --------------------------------------------------------------------------- silent loss


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "run, stray",
    [
        ("z2_fp32_dp2", "notes.txt"),  # not a DeepSpeed file
        ("z0_fp32_dp2", "expp_rank_0_mp_rank_00_optim_states.pt"),  # another layout's file
        ("pipe_pp2_z1_fp32", "zero_pp_rank_1_mp_rank_01_optim_states.pt.bak"),
    ],
)
def test_a_file_the_import_would_not_read_is_refused(tmp_path, run, stray):
    """Every entry of the tag folder is read, or the import (weights_only too) is refused
    naming it: nothing is imported while part of the checkpoint is silently ignored."""
    src = copy_deepspeed_fixture(tmp_path, run)
    tag = os.path.join(src, "global_step2")
    donor = os.path.join(FIXTURES, "moe_ep2_z0_fp32", "ckpt", "global_step2", stray)
    if os.path.exists(donor):
        shutil.copy(donor, tag)
    else:
        with open(os.path.join(tag, stray), "w") as f:
            f.write("left here\n")
    # (ZeRO-0 without weights_only is refused before, for its optimizer state)
    for weights_only in (True,) if run.startswith("z0") else (False, True):
        with pytest.raises(
            SourceError,
            match=rf"not read 1 of the folder's entries: \['{stray}'\]",
        ):
            jax_ucp.convert(
                src, str(tmp_path / "out"), importing=ImportOptions(weights_only=weights_only)
            )
        assert_destination_untouched(str(tmp_path / "out"))


# --------------------------------------------------------------------------- live runs


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("run", PIPE + MOE_ZERO + ["moe_ep2_z0_fp32"])
def test_a_fresh_deepspeed_run_imports_bit_exact(tmp_path, run):
    """Trains the fixture's configuration again with DeepSpeed (2 processes, CPU) and imports
    the new checkpoint against that run's own live state."""
    pytest.importorskip("deepspeed")
    sys.path.insert(0, os.path.join(REPO, "tools", "fixtures"))
    import make_deepspeed_fixtures as make

    work = tmp_path / "run"
    processes = make.PIPE_MOE_PROCESSES.get(run, 2)
    run_torchrun(
        make.PIPE_MOE_TRAIN, "--out", str(work), *make.PIPE_MOE[run], processes=processes,
        env={"PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    dest = str(tmp_path / "u")
    jax_ucp.convert(str(work / "ckpt"), dest)
    tree = jax_ucp.restore(dest)
    live = {}
    for rank in range(processes):
        live.update(np.load(work / f"live_rank{rank}.npz"))
    np.savez(tmp_path / "live.npz", **live)
    assert check_against_live(tree, str(tmp_path / "live.npz"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("run", ["moe_ep2_z0_fp32", "z0_fp32_dp2", "pipe_pp2_z1_bf16"])
def test_the_tag_folder_itself_is_a_source(tmp_path, run):
    """``global_step2/`` handed over directly (no ``latest`` beside it): a ZeRO-0 folder holds no
    ZeRO optimizer file, and was refused as "no DeepSpeed checkpoint here"."""
    tag = os.path.join(FIXTURES, run, "ckpt", "global_step2")
    dest = str(tmp_path / "u")
    jax_ucp.convert(tag, dest, importing=ImportOptions(weights_only=run == "z0_fp32_dp2"))
    whole = str(tmp_path / "whole")
    jax_ucp.convert(
        os.path.dirname(tag), whole, importing=ImportOptions(weights_only=run == "z0_fp32_dp2")
    )
    got, want = jax_ucp.restore(dest), jax_ucp.restore(whole)
    assert sorted(got["params"]) == sorted(want["params"])
    for name, value in want["params"].items():
        assert same_bits(got["params"][name], value), name
