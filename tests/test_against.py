"""``verify(ckpt, against=src)`` / ``jax-ucp verify CKPT --against SRC``: every tensor an
import copied one for one compared bit for bit with what the source framework's own loader
reads; a changed byte in the source is reported and exits 1; tensors the import built are
listed as not compared, never counted as equal."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile

import numpy as np
import pytest
from typer.testing import CliRunner

import jax_ucp
from jax_ucp.cli import app
from tests.ucp_testing import REPO

runner = CliRunner()
FIX = os.path.join(REPO, "tests", "fixtures")


def test_safetensors_import_against_safetensors_own_reader(tmp_path):
    from safetensors.numpy import save_file

    src = tmp_path / "model.safetensors"
    save_file(
        {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, np.int64)}, str(src)
    )
    out = jax_ucp.convert(src, tmp_path / "ucp")
    assert jax_ucp.verify(out, against=src) == []
    r = runner.invoke(app, ["verify", str(out), "--against", str(src)])
    assert r.exit_code == 0, r.output
    # the source changed after the import (one element): reported, exit 1
    save_file(
        {"a": np.arange(12, dtype=np.float32).reshape(3, 4) + (np.arange(12) == 7).reshape(3, 4),
         "b": np.ones(5, np.int64)},
        str(src),
    )  # fmt: skip
    bad = jax_ucp.verify(out, against=src)
    assert [name for name, _ in bad] == ["params/a"], bad
    assert "1 of 12 elements" in bad[0][1]
    r = runner.invoke(app, ["verify", str(out), "--against", str(src)])
    assert r.exit_code == 1 and "differs from the source" in r.output


@pytest.mark.torch
@pytest.mark.parametrize("kind", ["fsdp2_fp32", "plain_state_dict.pt"])
def test_torch_imports_against_torch_own_loaders(tmp_path, kind):
    """torch DCP through dcp.load, torch.save files through torch.load(weights_only=True):
    every weight and moment equal; a flipped element of the source is named."""
    import torch

    src = tmp_path / kind
    (shutil.copytree if os.path.isdir(os.path.join(FIX, "torch", kind)) else shutil.copy)(
        os.path.join(FIX, "torch", kind), src
    )
    out = jax_ucp.convert(src, tmp_path / "ucp")
    result = jax_ucp.verify(out, against=src)
    assert result == [], result
    if kind.endswith(".pt"):
        sd = torch.load(src, weights_only=True)
        name = next(iter(sd))
        sd[name].view(-1)[0] += 1
        torch.save(sd, src)
        bad = jax_ucp.verify(out, against=src)
        assert len(bad) == 1 and name in bad[0][1], bad


def test_deepspeed_tensors_built_by_the_import_are_not_counted_equal(tmp_path):
    """Without DeepSpeed installed, nothing reads its partitions whole: nothing compared is an
    error, not "OK"."""
    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("DeepSpeed installed: its zero_to_fp32 reads the weights (test below)")
    src = os.path.join(FIX, "deepspeed", "z2_fp32_dp2", "ckpt")
    out = jax_ucp.convert(src, tmp_path / "ucp")
    with pytest.raises(jax_ucp.UCPError, match=r"no tensor .* could be compared"):
        jax_ucp.verify(out, against=src)


@pytest.mark.torch
def test_deepspeed_weights_against_zero_to_fp32_and_moments_against_ds_to_universal(
    tmp_path, monkeypatch
):
    """A ZeRO import's weights equal what DeepSpeed's own zero_to_fp32 consolidates, its
    moments what DeepSpeed's ds_to_universal writes (its temporary folder removed after, and
    nothing written beside it: DeepSpeed's `latest_universal` went straight into /tmp, found by
    tests/hostile)."""
    pytest.importorskip("deepspeed")
    src = os.path.join(FIX, "deepspeed", "z2_fp32_dp2", "ckpt")
    out = jax_ucp.convert(src, tmp_path / "ucp")
    # a temporary directory of this test's own: another job's folders in the host's /tmp
    # cannot pass for ours
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    found = jax_ucp.verify(out, against=src)
    assert list(found) == []
    assert [n for n, _ in found.notices] == ["opt_state/count"]
    assert os.listdir(scratch) == []


@pytest.mark.torch
def test_fsdp1_sharded_tensors_no_torch_loader_reads_is_said_and_exits_1(tmp_path):
    """verl's FSDP1 ranks hold ShardedTensors, which torch.load(weights_only=True) refuses and
    torch rebuilds only inside the saving rank's process group: verify says so, never "OK"."""
    src = os.path.join(FIX, "verl", "fsdp1")
    out = jax_ucp.convert(src, tmp_path / "ucp", weights_only=True)
    with pytest.raises(jax_ucp.UCPError, match=r"no tensor .* could be compared.*ShardedTensor"):
        jax_ucp.verify(out, against=src)
    r = runner.invoke(app, ["verify", str(out), "--against", src], env={"COLUMNS": "300"})
    assert r.exit_code == 1 and "ShardedTensor" in r.output, r.output


# Every importer whose fixture torch's own loaders read: (fixture, convert keywords, the
# tensors listed as not compared). Only the optimizer step, which every import builds from the
# per-parameter steps, is not compared; DeepSpeed's weights are read through its zero_to_fp32,
# its moments through its ds_to_universal.
AGAINST = {
    "verl_fsdp2": ("verl/fsdp2", {}, "opt_state/count"),
    "verl_fsdp2_tied": ("verl/fsdp2_tied", {}, "opt_state/count"),
    "torch_checkpointing": ("torch_checkpointing/tc_fsdp2_synthetic_layout/step-3", {}, "opt_state/count"),
    "torchtune_dist_async": ("torchtune/tt_dist_async", {"parameter_order": True}, "opt_state/count"),
    "trainer_ds_z2": ("hf_trainer/trainer_ds_z2/checkpoint-3", {}, "opt_state/count"),
    "trainer_ds_z3": ("hf_trainer/trainer_ds_z3/checkpoint-3", {}, "opt_state/count"),
    "trainer_fsdp": ("hf_trainer/trainer_fsdp_synthetic_layout/checkpoint-3", {}, "opt_state/count"),
    "olmo_core": ("olmo_core/olmo_fp32", {}, "opt_state/count"),
}  # fmt: skip


def _convert(tmp_path, kind):
    rel, kw, _ = AGAINST[kind]
    src = os.path.join(FIX, rel)
    if kw.get("parameter_order"):
        from tests.importers.torch.test_torchtune import ORDER

        kw = {"parameter_order": ORDER}
    src = str(shutil.copytree(src, tmp_path / "src"))  # a copy: the tests change it
    return src, jax_ucp.convert(src, tmp_path / "ucp", **kw)


def _flip_source(kind, src) -> str:
    """One element of one weight changed in the source, written back as the framework writes
    it: rank files and DeepSpeed's optimizer states by torch.save, a DCP chunk's byte in its
    ``.distcp`` file. Returns the imported name that must differ."""
    import io

    import torch
    from torch.distributed.tensor import DTensor

    from jax_ucp._src.against import dcp_reader

    if kind.startswith("verl") or kind == "torch_checkpointing":
        file = (
            os.path.join(src, "model_0.pt")
            if kind == "torch_checkpointing"
            else os.path.join(src, "global_step_3", "actor", "model_world_size_2_rank_0.pt")
        )
        sd = torch.load(file, weights_only=True)
        name = next(iter(sd))
        local = sd[name].to_local() if isinstance(sd[name], DTensor) else sd[name]
        local.view(-1)[0] += 1
        torch.save(sd, file)
        return f"params/{name}"
    if kind.startswith("trainer_ds"):
        step = os.path.join(src, "global_step3")
        file = os.path.join(step, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        # DeepSpeed's own classes in its optimizer states, allowed by name
        with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
            sd = torch.load(file, weights_only=True)
        osd = sd["optimizer_state_dict"]
        flat = osd.get("single_partition_of_fp32_groups") or osd.get("fp32_flat_groups")
        flat[0].data.view(-1)[0] += 1  # the first parameter's first element
        torch.save(sd, file)
        return "params/model.embed_tokens.weight"
    folder = src
    if kind == "trainer_fsdp":
        folder = os.path.join(src, "pytorch_model_fsdp_0")
    if kind == "torchtune_dist_async":
        folder = os.path.join(src, "dist_epoch_0")
    meta = dcp_reader(folder).read_metadata()
    index, where = next(  # the first weight's first chunk
        (i, s) for i, s in meta.storage_data.items() if i.fqn.startswith("model.")
    )
    path = os.path.join(folder, where.relative_path)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    chunk = bytes(data[where.offset : where.offset + where.length])
    raw = torch.load(io.BytesIO(chunk), weights_only=True).numpy().tobytes()
    at = where.offset + chunk.index(raw) + 3  # the high byte of the first element
    data[at] ^= 0x40
    with open(path, "wb") as f:
        f.write(data)
    return f"params/{index.fqn.split('.', 1)[1]}"  # the DCP key less its "model." item


@pytest.mark.torch
@pytest.mark.parametrize("kind", sorted(AGAINST))
def test_every_importer_against_its_framework_own_loader(tmp_path, kind):
    """Each importer's fixture verifies clean against torch's own loaders (every weight, and
    every moment torch can read whole, equal bit for bit); one element changed in the source
    afterwards is named and exits 1; a flipped byte in the converted checkpoint exits 1."""
    src, out = _convert(tmp_path, kind)
    found = jax_ucp.verify(out, against=src)
    assert list(found) == [], found
    expected_not_compared = AGAINST[kind][2]
    assert all(n.startswith(expected_not_compared) for n, _ in found.notices), found.notices
    weights = [e.name for e in jax_ucp.inspect(out).tensors if e.name.startswith("params/")]
    assert weights and not any(n.startswith("params/") for n, _ in found.notices)
    r = runner.invoke(app, ["verify", str(out), "--against", src])
    assert r.exit_code == 0, r.output

    # a flipped byte in a copy of the converted checkpoint: its checksum fails, exit 1
    copy = shutil.copytree(out, tmp_path / "flipped")
    shard = next(
        os.path.join(d, f)
        for d, _, files in sorted(os.walk(copy / "arrays"))
        for f in files
        if f != "zarr.json"
    )
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    assert list(jax_ucp.verify(copy, against=src))
    r = runner.invoke(app, ["verify", str(copy), "--against", src])
    assert r.exit_code == 1, r.output

    changed = _flip_source(kind, src)
    bad = jax_ucp.verify(out, against=src)
    tied = {"params/model.embed_tokens.weight", "params/lm_head.weight"}
    assert [n for n, _ in bad] == [changed] or (
        kind.endswith("tied") and {n for n, _ in bad} == tied
    ), bad
    assert "differs from the source" in bad[0][1]
    r = runner.invoke(app, ["verify", str(out), "--against", src])
    assert r.exit_code == 1 and changed in r.output, r.output


@pytest.mark.torch
def test_olmo_core_step_folder_against_dcp_load(tmp_path):
    """OLMo-core's ``stepN/`` (``model_and_optim/`` beside ``train/``): torch DCP's load reads
    the folder the import read; a source path holding no such folder is an error naming it."""
    import torch

    from tests.importers.torch.test_olmo_core import _step_folder

    src = _step_folder(tmp_path, 3)
    torch.save({"global_step": 3, "world_size": 1}, os.path.join(src, "train", "rank0.pt"))
    out = jax_ucp.convert(src, tmp_path / "ucp")
    found = jax_ucp.verify(out, against=src)
    assert list(found) == [] and [n for n, _ in found.notices] == ["opt_state/count"]
    with pytest.raises(jax_ucp.UCPError, match=r"no torch DCP folder in it holds"):
        jax_ucp.verify(out, against=os.path.dirname(src))
