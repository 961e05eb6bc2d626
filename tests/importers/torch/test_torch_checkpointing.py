"""A torch_checkpointing 0.1.1 checkpoint written by the package's own CheckpointManager
(tools/fixtures/make_torch_checkpointing_fixture.py: FSDP2 over 2 gloo ranks, 3 AdamW steps,
a DefaultResharder per item; its CUDA-only metadata all-gather replaced by a CPU one, hence
``synthetic_layout``): detected, weights, moments and step assembled from the ranks' DTensor
shards (one uneven) bit-exact against the run's live state; hostile variants refused."""

from __future__ import annotations

import os
import pickle
import shutil

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.importers.registry import detect_format
from jax_ucp._src.torchfiles import allow_list, pickle_format, sharded, torch_zip
from jax_ucp.conversion import ImportOptions
from tests.ucp_testing import (
    REPO,
    assert_bit_exact,
    assert_destination_untouched,
    rewrite_zip_member,
)

pytestmark = pytest.mark.timeout(120)
FIXTURES = os.path.join(REPO, "tests", "fixtures", "torch_checkpointing")
SRC = os.path.join(FIXTURES, "tc_fsdp2_synthetic_layout", "step-3")
TRUTH = np.load(os.path.join(FIXTURES, "tc_fsdp2_synthetic_layout.truth.npz"))
NAMES = [k[len("param/") :] for k in TRUTH.files if k.startswith("param/")]


def test_detected_and_imported_bit_exact_from_the_ranks_shards(tmp_path):
    assert detect_format(SRC) == "torch"
    out = jax_ucp.convert(SRC, tmp_path / "ucp")
    got = jax_ucp.restore(out)
    assert sorted(got["params"]) == sorted(NAMES)
    for name in NAMES:
        assert_bit_exact(got["params"][name], TRUTH[f"param/{name}"], name)
        assert_bit_exact(got["opt_state"]["mu"][name], TRUTH[f"exp_avg/{name}"], name)
        assert_bit_exact(got["opt_state"]["nu"][name], TRUTH[f"exp_avg_sq/{name}"], name)
    assert int(got["opt_state"]["count"]) == int(TRUTH["step"]) == 3
    assert got["params"]["3.weight"].shape == (3, 6)  # 2 rows on rank 0, 1 on rank 1
    source = jax_ucp.inspect(out).source
    assert (source["framework"], source["world_size"]) == ("torch_checkpointing", 2)
    assert source["recorded"] == {"train_state": {"step": 3}}
    (group,) = source["optimizer"]["param_groups"]
    assert (group["lr"], group["weight_decay"], group["params"][0]) == (0.01, 0.1, "0.weight")


def test_weights_only_skips_the_optimizer(tmp_path):
    out = jax_ucp.convert(SRC, tmp_path / "ucp", importing=ImportOptions(weights_only=True))
    assert sorted(jax_ucp.restore(out)) == ["params"]
    skipped = jax_ucp.inspect(out).source["skipped"]
    assert (
        skipped["optimizer:state.0.weight.exp_avg"] == "weights_only: optimizer state not imported"
    )


def test_a_missing_rank_file_is_named(tmp_path):
    src = shutil.copytree(SRC, tmp_path / "ck")
    os.remove(src / "optimizer_1.pt")
    with pytest.raises(jax_ucp.UCPError, match=r"optimizer_1\.pt is missing \(world size 2"):
        jax_ucp.convert(src, tmp_path / "refused")
    assert_destination_untouched(tmp_path / "refused")


def test_shards_that_contradict_the_placements_are_refused(tmp_path):
    """rank 0's and rank 1's model files swapped: '3.weight' holds 1 row where its Shard(0)
    placement gives rank 0 two."""
    src = shutil.copytree(SRC, tmp_path / "ck")
    os.rename(src / "model_0.pt", src / "tmp.pt")
    os.rename(src / "model_1.pt", src / "model_0.pt")
    os.rename(src / "tmp.pt", src / "model_1.pt")
    with pytest.raises(jax_ucp.UCPError, match=r"'model:3\.(weight|bias)' on rank 0 is \[1"):
        jax_ucp.convert(src, tmp_path / "refused")
    assert_destination_untouched(tmp_path / "refused")


def test_metadata_pickling_a_callable_is_refused_unexecuted(tmp_path):
    src = shutil.copytree(SRC, tmp_path / "ck")
    with open(src / "metadata.pkl", "wb") as f:
        f.write(pickle.dumps({"metadata": {}, "version": "2.0", "world_size": os.getpid}))
    with pytest.raises(jax_ucp.UCPError, match=r"metadata\.pkl.*posix.getpid.*not in the allow"):
        jax_ucp.convert(src, tmp_path / "refused")


def test_a_dtensor_file_loads_only_with_the_dtensor_classes():
    path = os.path.join(SRC, "model_1.pt")
    with pytest.raises(allow_list.TorchFileError, match=r"_rebuild_wrapper_subclass"):
        torch_zip.load_torch_file(path)
    state = torch_zip.load_torch_file(path, allow_list.SHARDED_TENSOR_CLASSES)
    shard = state["3.weight"]
    assert isinstance(shard, allow_list.WrapperTensor)
    (piece,) = sharded.local_pieces(shard, mesh_size=2)
    assert (piece.array.shape, shard.shape, piece.offsets) == ((1, 6), (3, 6), (2, 0))


def test_metadata_linked_out_of_the_folder_is_refused(tmp_path):
    """metadata.pkl says where every shard lies: one linked in from elsewhere is not read."""
    src = shutil.copytree(SRC, tmp_path / "ck")
    shutil.move(src / "metadata.pkl", tmp_path / "elsewhere.pkl")
    os.symlink(tmp_path / "elsewhere.pkl", src / "metadata.pkl")
    with pytest.raises(jax_ucp.UCPError, match=r"metadata\.pkl"):
        jax_ucp.convert(src, tmp_path / "refused")
    assert_destination_untouched(tmp_path / "refused")


def test_two_names_for_one_rank_file_are_refused_naming_both(tmp_path):
    """``model_01.pt`` beside ``model_1.pt``: both are the model's rank 1; the import read
    ``model_1.pt`` and left the other out unsaid."""
    src = shutil.copytree(SRC, tmp_path / "ck")
    shutil.copy(src / "model_0.pt", src / "model_01.pt")
    with pytest.raises(jax_ucp.UCPError, match=r"'model_01\.pt' and 'model_1\.pt' both name"):
        jax_ucp.convert(src, tmp_path / "refused")
    assert_destination_untouched(tmp_path / "refused")


def _edit_metadata(src, change) -> None:
    """metadata.pkl re-pickled (plain data) after ``change(its entries)``."""
    path = os.path.join(src, "metadata.pkl")
    with open(path, "rb") as f:
        raw = pickle_format.restricted_loads(f.read(), where=path)
    for groups in raw["metadata"]["model"]["nested_path_to_metadata"].values():
        for group in groups:
            change(group["sharding_metadata"]["data"])
    with open(path, "wb") as f:
        f.write(pickle.dumps(raw, protocol=2))


def test_a_storage_type_renamed_in_one_rank_file_is_refused(tmp_path):
    """``FloatStorage`` renamed ``IntStorage`` in model_1.pt's data.pkl: its shards' bytes would
    be read as int32 (and cast into the float32 tensor); the storage type, the DTensor's dtype
    and metadata.pkl's disagree: refused naming the file and the tensor."""
    src = shutil.copytree(SRC, tmp_path / "ck")
    rewrite_zip_member(
        src / "model_1.pt", "/data.pkl", lambda b: b.replace(b"FloatStorage", b"IntStorage")
    )
    with pytest.raises(
        jax_ucp.UCPError, match=r"'model:[0-9.a-z]+' in rank 1's file \(model_1\.pt\).*int32"
    ):
        jax_ucp.convert(src, tmp_path / "refused")
    assert_destination_untouched(tmp_path / "refused")


def test_a_metadata_dtype_the_files_do_not_hold_is_refused(tmp_path):
    """metadata.pkl edited to say bfloat16 where the rank files hold float32: the import took
    the files' float32 without a word."""
    src = shutil.copytree(SRC, tmp_path / "ck")
    _edit_metadata(src, lambda data: data.update(dtype="torch.bfloat16"))
    with pytest.raises(
        jax_ucp.UCPError, match=r"metadata\.pkl records bfloat16, its storage says float32"
    ):
        jax_ucp.convert(src, tmp_path / "refused")
    assert_destination_untouched(tmp_path / "refused")


def test_a_shard_dim_beyond_the_tensor_is_a_source_error(tmp_path):
    """``Shard(dim=1)`` for the 1-D biases: a raw IndexError before; now the error names the
    checkpoint and the tensor."""
    src = shutil.copytree(SRC, tmp_path / "ck")

    def shard_dim_1(data):
        data["placements"] = [{"dim": 1, "type": "Shard"} for _ in data["placements"]]

    _edit_metadata(src, shard_dim_1)
    with pytest.raises(jax_ucp.SourceError, match=r"ck: model:2\.weight: Shard\(1\) .* 1-D"):
        jax_ucp.convert(src, tmp_path / "refused")
    assert_destination_untouched(tmp_path / "refused")


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda data: data.pop("global_shape"), r"malformed sharding metadata \(KeyError"),
        (lambda data: data.update(global_shape=["six"]), r"malformed sharding metadata \(Value"),
        (lambda data: data.update(placements=[]), r"0 placements for a 1-D mesh"),
        (lambda data: data.update(placements=[{"type": "Shard", "dim": "0"}]), r"Shard dim '0'"),
    ],
    ids=["no shape", "shape not a number", "no placement", "dim not an int"],
)
def test_malformed_sharding_metadata_is_a_source_error(tmp_path, change, says):
    """metadata.pkl is plain data from the user: a key missing or a value of the wrong kind
    was a raw KeyError / ValueError / IndexError."""
    src = shutil.copytree(SRC, tmp_path / "ck")
    _edit_metadata(src, change)
    with pytest.raises(jax_ucp.SourceError, match=says):
        jax_ucp.convert(src, tmp_path / "refused")
    assert_destination_untouched(tmp_path / "refused")


@pytest.mark.parametrize("name", ["model_0.pt", "optimizer_1.pt"])
def test_a_rank_file_linked_out_of_the_folder_is_refused(tmp_path, name):
    """A rank file that is a link to a copy elsewhere (the same bytes): refused naming it, not
    read; before: read through the link (found by tests/hostile)."""
    src = shutil.copytree(SRC, tmp_path / "ck")
    shutil.move(src / name, tmp_path / "elsewhere.pt")
    os.symlink(tmp_path / "elsewhere.pt", src / name)
    with pytest.raises(jax_ucp.UnsafeFileError, match=rf"{name}.*outside"):
        jax_ucp.convert(src, tmp_path / "refused")
    assert_destination_untouched(tmp_path / "refused")
