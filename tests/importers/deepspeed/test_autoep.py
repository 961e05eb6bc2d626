"""DeepSpeed AutoEP (``expert_parallel``): real runs of DeepSpeed 0.19.8 on CPU, a tiny HF OLMoE
with EP 2 (``tools/fixtures/make_deepspeed_autoep_fixture.py``): ZeRO-1 fp32, ZeRO-2 bf16 and
ZeRO-3 fp32 over 2 processes, ZeRO-2 fp32 and ZeRO-3 bf16 over 4 (2 expert-data-parallel ranks
per EP rank); the fused ``experts.w1/w2/w3`` come back stacked ``[num_experts, ...]``.

Truth: ``live.npz``, the run's live state right after the save (every EP rank's local experts
placed at their global index by the layer's own placement), bit for bit; every source tensor
accounted for. Refused by name: a missing expert file, expert files swapped, a placement or
affine map other than the contiguous one, a ZeRO-3 rank's records naming another EP rank.
"""

from __future__ import annotations

import os
import shutil
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ucp
from jax_ucp._src.importers.deepspeed import files as deepspeed_files
from jax_ucp._src.store.storage import LocalDirectory
from jax_ucp._src.torchfiles import torch_zip
from jax_ucp.conversion import ImportOptions
from jax_ucp.errors import SourceError
from tests.importers.deepspeed.test_pipe_moe import check_against_live, same_bits
from tests.ucp_testing import (
    REPO,
    assert_destination_untouched,
    copy_deepspeed_fixture,
    run_torchrun,
)

pytestmark = pytest.mark.timeout(120)
FIXTURES = os.path.join(REPO, "tests", "fixtures", "deepspeed")
RUNS = ["autoep_ep2_z1_fp32", "autoep_ep2_z2_bf16", "autoep_ep2_edp2_z2_fp32"]
RUNS += ["autoep_ep2_z3_fp32", "autoep_ep2_edp2_z3_bf16", "autoep_ep2_z0_fp32"]
W1 = "model.layers.{}.mlp.experts.w1"
MODEL = "global_step2/mp_rank_00_model_states.pt"


@pytest.mark.parametrize("run", RUNS)
def test_autoep_imports_stacked_experts_bit_exact(tmp_path, run):
    """Before: refused as a DeepSpeed MoE folder ("not a parameter of expert 0"; ZeRO-0 and
    ZeRO-3: by name). Now every weight, master, moment and the step equal the live run's; the
    fused expert tensors stacked [4, ...] from both EP ranks' partitions (ZeRO-0: optimizer
    files), every expert file's tensor (ZeRO 0/1/2) accounted for."""
    dest = str(tmp_path / "u")
    jax_ucp.convert(os.path.join(FIXTURES, run, "ckpt"), dest)
    tree = jax_ucp.restore(dest)
    assert check_against_live(tree, os.path.join(FIXTURES, run, "live.npz")) == 4 * 27
    assert tree["params"][W1.format(1)].shape == (4, 8, 16)
    manifest = jax_ucp.inspect(dest)
    source = manifest.source
    assert (source["layout"], source["ep_size"], source["num_experts"]) == ("autoep", 2, [4, 4])
    entries = {tuple(e.key): e for e in manifest.tensors}
    mu = entries[("opt_state", "mu", W1.format(0))].provenance or {}
    experts = [f"layer_1_expert_{g}_mp_rank_00_model_states.pt" for g in range(4)]
    if "_z0_" in run:  # EP rank r's torch optimizer state holds its local experts (index 21 on)
        files = [f"expp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
        assert mu["tensors"] == [f"{f}:optimizer.state.21.exp_avg" for f in files]
        params = entries[("params", W1.format(1))].provenance or {}
        assert params["tensors"] == [f"{f}:{W1.format(1)}.{g}" for g, f in enumerate(experts)]
        return
    assert {r % 2 for r in mu["dp_ranks"]} == {0, 1}  # both EP ranks' partitions (DP r: r % 2)
    if "_z3_" in run:  # no expert files: the model copy is cast from the masters
        assert source["zero_stage"] == 3 and mu["pattern"] == "zero3-flat+autoep-stack"
    elif run.endswith("bf16"):  # the model copy is the expert files' own weights
        model = entries[("model_params", W1.format(1))].provenance or {}
        assert model["tensors"] == [f"{f}:{W1.format(1)}.{g}" for g, f in enumerate(experts)]
    else:  # fp32: the same values as the masters (checked), listed as skipped
        assert f"{experts[3]}:{W1.format(1)}.3" in source["skipped"]


@pytest.mark.parametrize("run", RUNS)
def test_autoep_restores_onto_a_2x4_mesh(tmp_path, run):
    """Restored straight from the DeepSpeed folder onto a 2 x 4 mesh (experts over 'a'), and
    through convert: the same bits as the live run, on the asked shardings."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    src = os.path.join(FIXTURES, run, "ckpt")

    def spec(x):
        dims = [None] * x.ndim
        if x.ndim == 3:  # stacked experts: one EP shard per 'a', the last dim over 'b'
            dims[0], dims[-1] = "a", "b"
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P(*dims)))

    target = jax.tree.map(spec, jax.eval_shape(lambda: jax_ucp.restore(src)))
    jax_ucp.convert(src, str(tmp_path / "u"))
    live = np.load(os.path.join(FIXTURES, run, "live.npz"))
    for tree in (
        jax_ucp.restore(src, target=target),
        jax_ucp.restore(tmp_path / "u", target=target),
    ):
        for layer in (0, 1):
            got = tree["opt_state"]["nu"][W1.format(layer)]
            assert got.sharding == NamedSharding(mesh, P("a", None, "b"))
            assert same_bits(np.asarray(got), live[f"exp_avg_sq/{W1.format(layer)}"])
            model = tree.get("model_params", tree["params"])[W1.format(layer)]
            assert same_bits(np.asarray(model), live[f"param/{W1.format(layer)}"])


def _rewrite_model_states(src: str, edit, model: str = MODEL) -> None:
    """``edit(states)`` on an AutoEP model states file, written back torch-free (it holds
    plain containers and tensors only)."""
    path = os.path.join(src, model)
    arrays: list = []

    def nodes(x):
        if isinstance(x, np.ndarray):
            arrays.append(np.array(x))
            return torch_zip.TensorSlot(len(arrays) - 1, x.shape, x.dtype)
        if isinstance(x, dict):
            return {k: nodes(v) for k, v in x.items()}
        return type(x)(map(nodes, x)) if isinstance(x, (list, tuple)) else x

    states = nodes(
        deepspeed_files.load_deepspeed_file(
            LocalDirectory(os.path.dirname(path)), os.path.basename(path)
        )
    )
    edit(states)
    os.unlink(path)
    torch_zip.save_file(path, states, arrays)


def _record(states, layer=1):
    return states["ds_autoep_layers"][layer]


def _swap_experts(states):
    ranks = _record(states)["expert_placement"]["ranks"]
    ranks[0]["experts"], ranks[1]["experts"] = ranks[1]["experts"], ranks[0]["experts"]


def _shift_map(states):
    piece = _record(states)["affine_maps"]["params"][W1.format(1)]["ranks"][1]["pieces"][0]
    piece["source"][0] -= 128


HOSTILE = {
    "unchanged": (lambda states: None, None),
    "placement swapped": (_swap_experts, r"ds_autoep_layers\[1\]: expert_placement .*contiguous"),
    "affine map off": (_shift_map, r"affine_maps.params\['model.layers.1.mlp.experts.w1'\] is not"),
    "format unknown": (
        lambda states: _record(states).update(checkpoint_format="per_rank_files"),
        r"checkpoint_format 'per_rank_files', expected 'per_expert_files'",
    ),
    "placement version 2": (
        lambda states: _record(states)["expert_placement"].update(version=2),
        r"expert_placement .*'version': 2",
    ),
    "folded with AutoTP": (
        lambda states: states.update(folding={"version": 1}),
        r"AutoEP folded with AutoTP",
    ),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_autoep_records_are_checked(tmp_path, case):
    """The model states' AutoEP records: rewritten unchanged, bit-exact still; a placement or
    affine map other than the contiguous one the expert files are named by, an unknown format
    or placement version, AutoTP folding metadata: refused by name, nothing written."""
    edit, match = HOSTILE[case]
    src = copy_deepspeed_fixture(tmp_path, "autoep_ep2_z1_fp32")
    _rewrite_model_states(src, edit)
    dest = str(tmp_path / "u")
    if match is None:
        jax_ucp.convert(src, dest)
        live = os.path.join(FIXTURES, "autoep_ep2_z1_fp32", "live.npz")
        assert check_against_live(jax_ucp.restore(dest), live) == 4 * 27
        return
    with pytest.raises(SourceError, match=match):
        jax_ucp.convert(src, dest)
    assert_destination_untouched(dest)


def test_autoep_expert_files_missing_or_swapped_are_refused(tmp_path):
    """A missing expert file, an expert file under another expert's name (DeepSpeed's zip
    archive keeps the name it was saved as), a second file of one expert: refused naming the
    file; nothing written."""
    src = copy_deepspeed_fixture(tmp_path, "autoep_ep2_z2_bf16")
    tag, name = os.path.join(src, "global_step2"), "layer_{}_expert_{}_mp_rank_00_model_states.pt"
    path = lambda *layer_expert: os.path.join(tag, name.format(*layer_expert))
    dest = str(tmp_path / "u")
    os.replace(path(0, 1), tmp_path / "one")
    os.replace(path(0, 2), path(0, 1))
    with pytest.raises(SourceError, match=r"expert_1_mp_rank_00_model_states.pt: this file was"):
        jax_ucp.convert(src, dest)  # ... saved as 'layer_0_expert_2_...'
    os.replace(path(0, 1), path(0, 2))
    with pytest.raises(SourceError, match=r"layer_0_expert_1_.*: missing file of expert 1 of"):
        jax_ucp.convert(src, dest)
    os.replace(tmp_path / "one", path(0, 1))
    shutil.copy(path(0, 1), path("00", 1))
    with pytest.raises(SourceError, match=r"layer_00_expert_1_mp_rank_00_model_states.pt"):
        jax_ucp.convert(src, dest)  # a second file of expert 1: not read, refused
    assert_destination_untouched(dest)


ZERO3 = "global_step2/zero_pp_rank_{}_mp_rank_00_model_states.pt"
ZERO3_HOSTILE = {
    "rank 1 says EP rank 0": (1, lambda states: _record(states).update(ep_rank=0), r"rank_1_.*EP"),
    "rank 0 per-expert files": (
        0,
        lambda states: _record(states, 0).update(checkpoint_format="per_expert_files"),
        r"checkpoint_format 'per_expert_files', expected 'zero3_partitioned'",
    ),
    "expert group split otherwise": (
        3,
        lambda states: _record(states).update(expert_data_parallel_rank=0),
        r"zero_pp_rank_3_.*expert-data-parallel rank 1 of 2",
    ),
}


@pytest.mark.parametrize("case", ZERO3_HOSTILE)
def test_autoep_zero3_records_of_every_rank_are_checked(tmp_path, case):
    """ZeRO-3 holds no expert files: which experts a rank's partitions are is said by that
    rank's own model states (EP rank r % ep, expert-data-parallel rank r // ep, DeepSpeed's
    expert-then-data topology), checked for every rank; another EP rank or data-parallel rank
    there, or rank 0 recording per-expert files: refused by name, nothing written."""
    rank, edit, match = ZERO3_HOSTILE[case]
    src = copy_deepspeed_fixture(tmp_path, "autoep_ep2_edp2_z3_bf16")
    _rewrite_model_states(src, edit, ZERO3.format(rank))
    with pytest.raises(SourceError, match=match):
        jax_ucp.convert(src, str(tmp_path / "u"))
    assert_destination_untouched(str(tmp_path / "u"))


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("run", RUNS)
def test_a_fresh_autoep_run_imports_bit_exact(tmp_path, run):
    """Trains the fixture's configuration again with DeepSpeed's AutoEP (CPU) and imports the
    new checkpoint against that run's own live state."""
    pytest.importorskip("deepspeed")
    sys.path.insert(0, os.path.join(REPO, "tools", "fixtures"))
    import make_deepspeed_autoep_fixture as make  # pyright: ignore[reportMissingImports]

    stage, dtype, processes = make.RUNS[run]
    work = tmp_path / "run"
    script = os.path.join(REPO, "tools", "fixtures", "make_deepspeed_autoep_fixture.py")
    run_torchrun(script, "--train", str(work), str(stage), dtype, processes=processes)
    dest = str(tmp_path / "u")
    jax_ucp.convert(str(work / "ckpt"), dest)
    live = {}
    for rank in range(processes):
        live.update(np.load(work / f"live_rank{rank}.npz"))
    np.savez(tmp_path / "live.npz", **live)
    assert check_against_live(jax_ucp.restore(dest), str(tmp_path / "live.npz")) == 4 * 27


def test_autoep_zero3_partition_groups_are_checked(tmp_path, monkeypatch):
    """Which ranks partition an expert sub-group is read from every optimizer file's
    ``ds_zero_partition_groups`` and must be DeepSpeed's expert-then-data topology: DP rank 2
    recording its experts partitioned over ranks [2, 3] is refused naming the file."""
    file = "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"
    read = deepspeed_files.load_deepspeed_file

    def altered(folder, path, **kwargs):
        state = read(folder, path, **kwargs)
        if os.path.basename(path) == file:
            groups = state["optimizer_state_dict"]["ds_zero_partition_groups"]
            groups[1]["partition_ranks"] = [2, 3]
        return state

    monkeypatch.setattr(deepspeed_files, "load_deepspeed_file", altered)
    dest = str(tmp_path / "u")
    with pytest.raises(SourceError, match=rf"{file}: ds_zero_partition_groups .*rank 2 of EP"):
        jax_ucp.convert(os.path.join(FIXTURES, "autoep_ep2_edp2_z3_bf16", "ckpt"), dest)
    assert_destination_untouched(dest)


def test_autoep_zero0_weights_only_and_its_optimizer_files_checked(tmp_path, monkeypatch):
    """ZeRO-0: weights_only takes the module's and expert files' weights (the live run's, bit
    for bit) and lists the optimizer state as skipped; EP rank 1's optimizer file gone, or its
    expert moments in another order (w1 and w2 swapped): refused by name, nothing written."""
    src = copy_deepspeed_fixture(tmp_path, "autoep_ep2_z0_fp32")
    dest = str(tmp_path / "u")
    jax_ucp.convert(src, dest, importing=ImportOptions(weights_only=True))
    live = os.path.join(FIXTURES, "autoep_ep2_z0_fp32", "live.npz")
    assert check_against_live(jax_ucp.restore(dest), live, weights_only=True) == 2 * 27
    skipped = jax_ucp.inspect(dest).source["skipped"]
    assert "expp_rank_1_mp_rank_00_optim_states.pt:optimizer.state.26.exp_avg_sq" in skipped
    file = "expp_rank_1_mp_rank_00_optim_states.pt"
    read = deepspeed_files.load_deepspeed_file

    def swapped(folder, path, **kwargs):  # index 21: layer 0's w1 (2, 8, 16), 22: its w2 (2, 16, 8)
        state = read(folder, path, **kwargs)
        if os.path.basename(path) == file:
            inner = state["optimizer"]["state"]
            inner[21], inner[22] = inner[22], inner[21]
        return state

    dest = str(tmp_path / "v")
    monkeypatch.setattr(deepspeed_files, "load_deepspeed_file", swapped)
    with pytest.raises(SourceError, match=rf"{file}:optimizer\.state\.21\.exp_avg: shape"):
        jax_ucp.convert(src, dest)
    monkeypatch.undo()
    os.unlink(os.path.join(src, "global_step2", file))
    with pytest.raises(SourceError, match=rf"{file}: missing optimizer file of expert-parallel"):
        jax_ucp.convert(src, dest)
    assert_destination_untouched(dest)


@pytest.mark.parametrize(
    "run",
    ["autoep_ep2_z1_fp32", "autoep_ep2_edp2_z3_bf16", "autoep_ep2_z0_fp32", "z1_fp32_dp2"]
    + ["moe_ep2_z0_fp32", "pipe_pp2_z1_fp32", "pipe_pp2_dp2_z1_bf16"],
)
def test_each_file_is_parsed_once_per_import(tmp_path, monkeypatch, run):
    """Before: AutoEP's detection parsed the model states file, then the importer parsed it
    again (every DeepSpeed training import); a pipeline import parsed ``mp_rank_00/01`` (no
    tensors: their module is None) again when the folder was checked after planning. Now each
    file of the tag folder is parsed once: counted by wrapping the one reader of DeepSpeed's
    torch files."""
    parsed: list[str] = []
    read = deepspeed_files.load_deepspeed_file

    def counting(folder, path, **kwargs):
        parsed.append(os.path.basename(path))
        return read(folder, path, **kwargs)

    monkeypatch.setattr(deepspeed_files, "load_deepspeed_file", counting)
    jax_ucp.convert(os.path.join(FIXTURES, run, "ckpt"), str(tmp_path / "u"))
    assert parsed and sorted(parsed) == sorted(set(parsed))
    assert len(set(parsed)) == len(os.listdir(os.path.join(FIXTURES, run, "ckpt", "global_step2")))
