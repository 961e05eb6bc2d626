"""``verify(ckpt, against=src)`` / ``jax-ucp verify CKPT --against SRC``: every tensor an
import copied one for one compared bit for bit with what the source framework's own loader
reads; a changed byte in the source is reported and exits 1; tensors the import built are
listed as not compared, never counted as equal."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import numpy as np
import pytest
from typer.testing import CliRunner

import jax_ucp
from jax_ucp.cli import app
from jax_ucp.conversion import ImportOptions, TorchOptions
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
    bad = jax_ucp.verify(out, against=src)  # the file its certificate holds, then the tensor
    assert [name for name, _ in bad] == ["model.safetensors", "params/a"], bad
    assert "1 of 12 elements" in bad[1][1]
    r = runner.invoke(app, ["verify", str(out), "--against", str(src)])
    assert r.exit_code == 1 and "differs from the source" in r.output


def test_safetensors_folder_with_another_config_json_is_refused_naming_it(tmp_path):
    """The config.json a safetensors import read (``source.config``: the heads a spec is
    completed with, what an export writes back) is compared too: a copy of the source with
    another config.json names the file (its certificate) and the setting (the record), also
    where no certificate is recorded."""
    import json

    from safetensors.numpy import save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file({"model.a": np.arange(12, dtype=np.float32).reshape(3, 4)}, src / "model.safetensors")
    config = {"model_type": "llama", "num_attention_heads": 2, "hidden_size": 4}
    (src / "config.json").write_text(json.dumps(config))
    out = jax_ucp.convert(src, tmp_path / "ucp")
    assert jax_ucp.inspect(out).source["config"] == config
    assert list(jax_ucp.verify(out, against=src)) == []
    (src / "config.json").write_text(json.dumps({**config, "num_attention_heads": 4}))
    bad = jax_ucp.verify(out, against=src)
    assert [n for n, _ in bad] == ["config.json", "source.config.num_attention_heads"], bad
    assert "ucp.json records 2, the import of the source planned again records 4" in bad[1][1]
    r = runner.invoke(app, ["verify", str(out), "--against", str(src)], env={"COLUMNS": "300"})
    assert r.exit_code == 1 and "config.json" in r.output, r.output


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
        assert bad.against is not None  # the source's certificate names the file first
        assert list(bad.against.files) == [os.path.basename(src)], bad
        bad = bad[len(bad.against.files) :]
        assert len(bad) == 1 and name in bad[0][1], bad


def test_deepspeed_source_without_deepspeed_names_the_extra(tmp_path, monkeypatch):
    """Without DeepSpeed installed, nothing reads its partitions whole: the proof cannot be
    made here, a project error naming the extra to install (before: "No module named
    'deepspeed'" as a note per tensor), never "OK"."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # an import that fails
    src = os.path.join(FIX, "deepspeed", "z2_fp32_dp2", "ckpt")
    out = jax_ucp.convert(src, tmp_path / "ucp")
    with pytest.raises(jax_ucp.SourceError, match=r"DeepSpeed.*pip install 'jax_ucp\[deepspeed\]'"):
        jax_ucp.verify(out, against=src)
    r = runner.invoke(app, ["verify", str(out), "--against", src], env={"COLUMNS": "300"})
    assert r.exit_code == 1 and "jax_ucp[deepspeed]" in r.output, r.output


def test_torch_source_without_torch_names_the_extra(tmp_path, monkeypatch):
    """A torch.save source compared where torch is not installed: the extra to install is
    named (before: "No module named 'torch'" as the reason nothing could be compared)."""
    monkeypatch.setitem(sys.modules, "torch", None)
    src = os.path.join(FIX, "torch", "plain_state_dict.pt")
    out = jax_ucp.convert(src, tmp_path / "ucp")
    with pytest.raises(jax_ucp.SourceError, match=r"torch.*pip install 'jax_ucp\[hf\]'"):
        jax_ucp.verify(out, against=src)


@pytest.mark.torch
def test_deepspeed_weights_against_zero_to_fp32_and_moments_against_ds_to_universal(
    tmp_path, monkeypatch, caplog
):
    """A ZeRO import's weights equal what DeepSpeed's own zero_to_fp32 consolidates, its
    moments what DeepSpeed's ds_to_universal writes (its temporary folder removed after, and
    the removal logged, as every deletion jax_ucp makes; nothing written beside it: DeepSpeed's
    `latest_universal` went straight into /tmp, found by tests/hostile)."""
    import logging

    pytest.importorskip("deepspeed")
    src = os.path.join(FIX, "deepspeed", "z2_fp32_dp2", "ckpt")
    out = jax_ucp.convert(src, tmp_path / "ucp")
    # a temporary directory of this test's own: another job's folders in the host's /tmp
    # cannot pass for ours
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    with caplog.at_level(logging.INFO, logger="jax_ucp"):
        found = jax_ucp.verify(out, against=src)
    assert list(found) == [] and found.notices == []  # the step too (the import planned again)
    assert found.against is not None and "opt_state/count" in found.against.equal
    assert os.listdir(scratch) == []
    removed = [r.getMessage() for r in caplog.records if "removing" in r.getMessage()]
    assert any(str(scratch / "ucp-against-") in m for m in removed), removed


@pytest.mark.torch
def test_fsdp1_sharded_tensors_no_torch_loader_reads_is_said_and_exits_1(tmp_path):
    """verl's FSDP1 ranks hold ShardedTensors, which torch.load(weights_only=True) refuses and
    torch rebuilds only inside the saving rank's process group: verify says so, never "OK"."""
    src = os.path.join(FIX, "verl", "fsdp1")
    out = jax_ucp.convert(src, tmp_path / "ucp", importing=ImportOptions(weights_only=True))
    with pytest.raises(jax_ucp.UCPError, match=r"no tensor .* could be compared.*ShardedTensor"):
        jax_ucp.verify(out, against=src)
    r = runner.invoke(app, ["verify", str(out), "--against", src], env={"COLUMNS": "300"})
    assert r.exit_code == 1 and "ShardedTensor" in r.output, r.output


# Every importer whose fixture torch's own loaders read: (fixture, convert keywords).
# Every tensor is compared: DeepSpeed's weights through its zero_to_fp32, its moments through
# its ds_to_universal; the optimizer step, which every import builds from the per-parameter
# steps, with the import planned again.
AGAINST = {
    "verl_fsdp2": ("verl/fsdp2", {}),
    "verl_fsdp2_tied": ("verl/fsdp2_tied", {}),
    "torch_checkpointing": ("torch_checkpointing/tc_fsdp2_synthetic_layout/step-3", {}),
    "torchtune_dist_async": ("torchtune/tt_dist_async", {"parameter_order": True}),
    "trainer_ds_z2": ("hf_trainer/trainer_ds_z2/checkpoint-3", {}),
    "trainer_ds_z3": ("hf_trainer/trainer_ds_z3/checkpoint-3", {}),
    "trainer_fsdp": ("hf_trainer/trainer_fsdp_synthetic_layout/checkpoint-3", {}),
    "olmo_core": ("olmo_core/olmo_fp32", {}),
}  # fmt: skip


def _convert(tmp_path, kind):
    rel, kw = AGAINST[kind]
    src = os.path.join(FIX, rel)
    if kw.get("parameter_order"):
        from tests.importers.torch.test_torchtune import ORDER

        kw = {"importing": TorchOptions(parameter_order=ORDER)}
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
        # and ZeRO-2's module copy of it: a source changed whole (the import refuses a module
        # weight that disagrees with its fp32 master as files of different saves)
        file = os.path.join(step, "mp_rank_00_model_states.pt")
        if os.path.isfile(file):
            with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
                sd = torch.load(file, weights_only=True)
            sd["module"]["model.embed_tokens.weight"].view(-1)[0] += 1
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
    assert found.against is not None and found.against.not_compared == {}  # the step too
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
    assert bad.against is not None and bad.against.files  # the certificate: the file, first
    bad = bad[len(bad.against.files) :]
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
    assert list(found) == [] and found.notices == []
    with pytest.raises(jax_ucp.UCPError, match=r"OLMo-core save folder.*Convert one of them"):
        jax_ucp.verify(out, against=os.path.dirname(src))


# --------------------------------------------------------------------------- hostile inputs
# Each builds a Hugging Face safetensors source torch-free (safetensors' numpy API) and a
# checkpoint that lies about it; `verify --against` must say so.

LAYER0 = "model.layers.0.self_attn"


def _hf_source(folder, *, drop=(), **extra) -> dict[str, np.ndarray]:
    """A small Llama-shaped safetensors folder (q_proj and o_proj both [32, 32], each of its
    own values); ``drop``: names left out; ``extra``: more tensors. Returns what it wrote."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {
        f"{LAYER0}.q_proj.weight": rng.standard_normal((32, 32), np.float32),
        f"{LAYER0}.o_proj.weight": rng.standard_normal((32, 32), np.float32),
        "model.layers.1.mlp.up_proj.weight": rng.standard_normal((8, 32), np.float32),
        "model.norm.weight": np.ones(32, np.float32),
        **extra,
    }
    tensors = {k: v for k, v in tensors.items() if k not in drop}
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return tensors


def _edit_manifest(ckpt, change) -> None:
    """``change(manifest dict)`` applied to the checkpoint's ucp.json, written back."""
    import json

    path = os.path.join(ckpt, "ucp.json")
    with open(path) as f:
        manifest = json.load(f)
    change(manifest)
    with open(path, "w") as f:
        json.dump(manifest, f)


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_a_provenance_leading_out_of_the_source_is_an_error(tmp_path, where):
    """A checkpoint of a decoy whose provenance names ``../decoy/model.safetensors`` (or the
    decoy's absolute path): before, --against compared the decoy with itself and passed a
    checkpoint differing from SRC in 1024 of 1024 elements; now an error naming the tensor and
    the path, exit 1."""
    src, decoy = tmp_path / "src", tmp_path / "decoy"
    _hf_source(src)
    wrote = _hf_source(decoy)
    from safetensors.numpy import save_file

    save_file({k: v + 1 for k, v in wrote.items()}, str(decoy / "model.safetensors"))
    out = jax_ucp.convert(decoy, tmp_path / "ucp")
    target = (
        "../decoy/model.safetensors" if where == "relative" else str(decoy / "model.safetensors")
    )

    def lead_out(manifest):
        for entry in manifest["entries"]:
            entry["provenance"]["file"] = target

    _edit_manifest(out, lead_out)
    assert jax_ucp.verify(out) == []  # its digests are fine: only the source can tell
    with pytest.raises(jax_ucp.UnsafeFileError, match=rf"params/.*{target}"):
        jax_ucp.verify(out, against=src)
    r = runner.invoke(app, ["verify", str(out), "--against", str(src)], env={"COLUMNS": "300"})
    assert r.exit_code == 1 and target in r.output and "params/" in r.output, r.output


def test_same_shape_tensors_swapped_in_the_manifest_are_reported(tmp_path):
    """layer 0's q_proj and o_proj ([32, 32] both) swapped in ucp.json, all but their keys:
    plain verify finds every digest fine; before, --against compared each with the source
    tensor the checkpoint claims and passed. Now each is compared with the source tensor of
    its own name, and the provenance that says otherwise is reported: both named, exit 1."""
    src = tmp_path / "src"
    _hf_source(src)
    out = jax_ucp.convert(src, tmp_path / "ucp")
    q, o = f"params/{LAYER0}.q_proj.weight", f"params/{LAYER0}.o_proj.weight"

    def swap(manifest):
        entries = {"/".join(e["key"]): e for e in manifest["entries"]}
        a, b = entries[q], entries[o]
        for field in set(a) | set(b):
            if field not in ("key", "key_types"):
                a[field], b[field] = b.get(field), a.get(field)

    _edit_manifest(out, swap)
    assert jax_ucp.verify(out) == []
    bad = dict(jax_ucp.verify(out, against=src))
    assert set(bad) == {q, o}, bad
    assert "o_proj" in bad[q] and "makes it from" in bad[q] and "elements" in bad[q]
    r = runner.invoke(app, ["verify", str(out), "--against", str(src)], env={"COLUMNS": "300"})
    assert r.exit_code == 1 and q in r.output and o in r.output, r.output


def test_a_source_tensor_the_checkpoint_lacks_is_reported_missing(tmp_path):
    """SRC holds model.layers.1.mlp.up_proj.weight, the checkpoint does not (and its
    source.skipped does not list it): before, exit 0 "read back intact"; now named, exit 1."""
    src = tmp_path / "src"
    dropped = "model.layers.1.mlp.up_proj.weight"
    _hf_source(src, drop=(dropped,))
    out = jax_ucp.convert(src, tmp_path / "ucp")
    _hf_source(src)  # the source as it is: the import dropped one of its tensors
    _edit_manifest(out, lambda m: m["source"].pop("certificate"))  # one vouching for no file
    bad = dict(jax_ucp.verify(out, against=src, accept_uncertified=True))
    assert list(bad) == [f"params/{dropped}"], bad
    assert "missing from the checkpoint" in bad[f"params/{dropped}"]
    r = runner.invoke(
        app,
        ["verify", str(out), "--against", str(src), "--accept-uncertified"],
        env={"COLUMNS": "300"},
    )
    assert r.exit_code == 1 and dropped in r.output, r.output
    assert "1 source tensor missing" in r.output and "failed" not in r.output, r.output


def test_a_tensor_listed_in_source_skipped_is_accounted_for(tmp_path):
    """A weights-only import beside a Trainer's optimizer.pt lists it in source.skipped: the
    verify against the folder passes (every weight compared, the optimizer said skipped)."""
    src = tmp_path / "src"
    _hf_source(src)
    (src / "optimizer.pt").write_bytes(b"not read")
    out = jax_ucp.convert(src, tmp_path / "ucp", importing=ImportOptions(weights_only=True))
    assert jax_ucp.verify(out, against=src) == []


def test_a_checkpoint_tensor_the_source_does_not_hold_is_reported(tmp_path):
    """A tensor of the checkpoint the import of SRC does not make: before, a notice (not
    compared: the file lacks it) and exit 0; now "not in the source", exit 1."""
    src = tmp_path / "src"
    extra = "model.layers.9.mlp.up_proj.weight"
    _hf_source(src, **{extra: np.zeros((2, 2), np.float32)})
    out = jax_ucp.convert(src, tmp_path / "ucp")
    _hf_source(src)  # the source without it
    _edit_manifest(out, lambda m: m["source"].pop("certificate"))  # one vouching for no file
    bad = dict(jax_ucp.verify(out, against=src, accept_uncertified=True))
    assert list(bad) == [f"params/{extra}"], bad
    assert "not in the source" in bad[f"params/{extra}"]
    assert "built from 0 source tensors" not in bad[f"params/{extra}"]
    r = runner.invoke(
        app,
        ["verify", str(out), "--against", str(src), "--accept-uncertified"],
        env={"COLUMNS": "300"},
    )
    assert r.exit_code == 1 and extra in r.output, r.output


@pytest.mark.torch
def test_a_dcp_source_torch_cannot_load_is_not_compared_never_a_raw_exception(tmp_path):
    """A byte of a ``.distcp`` flipped where torch's own ``dcp.load`` finds the zip header
    corrupt: the tensors it cannot load are named as not compared, with torch's reason; before:
    torch's ``CheckpointException`` (a BaseException) escaped verify (found by tests/hostile)."""
    pytest.importorskip("torch")
    src = shutil.copytree(os.path.join(FIX, "torch", "fsdp2_fp32"), tmp_path / "src")
    out = jax_ucp.convert(src, tmp_path / "ucp")
    shard = src / "__1_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[36828] ^= 0x6B
    shard.write_bytes(bytes(raw))
    found = jax_ucp.verify(out, against=src)
    said = [m for _, m in found.notices if "torch DCP's own load of" in m]
    assert said and "fails (RuntimeError: PytorchStreamReader" in said[0], found.notices


@pytest.mark.torch
def test_a_dcp_another_torch_wrote_is_compared_or_named_never_a_bare_unpack_error(tmp_path):
    """torch 2.15's DCP (``dcp_torch215_multishard``): a torch that reads its ``.metadata``
    compares every tensor; one that cannot (2.13's unpickled classes take fewer fields) is
    named with its version, never "too many values to unpack" alone (found by tests/hostile)."""
    torch = pytest.importorskip("torch")
    src = os.path.join(FIX, "torch", "dcp_torch215_multishard")
    out = jax_ucp.convert(src, tmp_path / "ucp")
    try:
        found = jax_ucp.verify(out, against=src)
    except jax_ucp.SourceError as e:
        assert f"torch {torch.__version__}'s own DCP reader cannot read its .metadata" in str(e)
    else:
        assert not found and not found.notices, (list(found), found.notices)


@pytest.mark.torch
@pytest.mark.parametrize("name", ["gpt_tp2", "llama_distopt_bf16_tp2dp2"])
def test_megatron_converted_with_vocab_size_verifies_clean(tmp_path, name):
    """``--vocab-size`` (as MEGATRON.md asks): the import planned again with the recorded vocab
    size, each stripped tensor compared with the source's first rows (before: "made from
    embedding.word_embeddings.weight, the import makes it from embedding.word_embeddings.weight",
    the same name twice, exit 1)."""
    from jax_ucp.conversion import MegatronOptions

    src = os.path.join(FIX, "megatron", name)
    out = jax_ucp.convert(src, tmp_path / "ucp", importing=MegatronOptions(vocab_size=61))
    found = jax_ucp.verify(out, against=src)
    assert list(found) == [], found
    stripped = [e.name for e in jax_ucp.inspect(out).tensors if e.shape[:1] == (61,)]
    assert stripped and set(stripped) <= set(found.against.equal)
    r = runner.invoke(app, ["verify", str(out), "--against", src, "--vocab-size", "61"])
    assert r.exit_code != 0  # verify takes no import options: they are the manifest's
    r = runner.invoke(app, ["verify", str(out), "--against", src])
    assert r.exit_code == 0, r.output


# (where in ucp.json's source record, the value written there): each a setting optax_from_torch
# continues with (DeepSpeed's clipping, rank 0's betas, the scheduler's position)
EDITS = {
    "gradient_clipping": (("optimizer", "config", "gradient_clipping"), 0.0),
    "betas": (("optimizer", "param_groups", 0, "betas"), [0.8, 0.95]),
    "scheduler_position": (("optimizer", "scheduler", "last_batch_iteration"), 5),
}


@pytest.mark.torch
def test_run_settings_edited_in_ucp_json_fail_against_the_intact_source(tmp_path):
    """A converted DeepSpeed run whose ucp.json records clipping 0, other betas or another
    scheduler position: each named with both values against the intact source, exit 1 (before:
    exit 0, while optax_from_torch continued differently); the certificate deleted: a failure
    saying so (before: "no certificate recorded", exit 0), passed only when accepted."""
    src = os.path.join(FIX, "deepspeed", "recipe_z2_bf16_adamw_decay", "ckpt")
    pristine = jax_ucp.convert(src, tmp_path / "ucp")
    for what, (where, value) in EDITS.items():
        out = shutil.copytree(pristine, tmp_path / what)

        def edit(manifest, where=where, value=value):
            node = manifest["source"]
            for part in where[:-1]:
                node = node[part]
            node[where[-1]] = value

        _edit_manifest(out, edit)
        field = "source." + ".".join(map(str, where))
        bad = dict(jax_ucp.verify(out, against=src))
        assert list(bad) == [field], (what, bad)
        assert f"records {value}" in bad[field], bad[field]
        r = runner.invoke(app, ["verify", str(out), "--against", src], env={"COLUMNS": "400"})
        assert r.exit_code == 1 and field in r.output, r.output
    out = shutil.copytree(pristine, tmp_path / "uncertified")
    _edit_manifest(out, lambda m: m["source"].pop("certificate"))
    assert [n for n, _ in jax_ucp.verify(out, against=src)] == ["source.certificate"]
    assert jax_ucp.verify(out, against=src, accept_uncertified=True) == []


def test_a_source_in_an_object_store_or_on_the_hub_is_refused_naming_its_url(tmp_path, bucket_url):
    """``--against s3://…`` / ``gs://…`` / ``hf://…``: a request error naming the URL, before
    the checkpoint is read (before: the URL joined as a path, ``'s3:/bucket/...'``)."""
    from tests.importers.deepspeed.test_object_store import upload

    src = tmp_path / "src"
    _hf_source(src)
    out = jax_ucp.convert(src, tmp_path / "ucp")
    url = upload(str(src), bucket_url)
    assert jax_ucp.convert(url, tmp_path / "remote")  # a source there indeed
    for where in (url, "hf://someone/model"):
        with pytest.raises(jax_ucp.RequestError, match="local files only") as e:
            jax_ucp.verify(out, against=where)
        assert where in str(e.value)
        r = runner.invoke(app, ["verify", str(out), "--against", where], env={"COLUMNS": "400"})
        assert r.exit_code != 0 and where in " ".join(r.output.split()), r.output


@pytest.mark.torch
def test_megatron_distributed_optimizer_buckets_are_compared_masters_moments_and_step(tmp_path):
    """megatron-core's default distributed-optimizer layout (dp_reshardable: flat per-rank
    buckets, TP2 DP2 bf16): every fp32 master, Adam moment and the step compared, each bucket
    read by torch's own dcp.load (before: 19 of 37 "not compared (built by the import)"); one
    byte of an exp_avg_sq bucket changed in the source names the moments it lands in."""
    import io

    import torch

    from jax_ucp._src.against import dcp_reader

    fixture = os.path.join(FIX, "megatron", "mcore_versions", "0.16.1")
    src = str(
        shutil.copytree(
            os.path.join(fixture, "llama_distopt_bf16_tp2dp2_buckets"), tmp_path / "src"
        )
    )
    out = jax_ucp.convert(src, tmp_path / "ucp")
    found = jax_ucp.verify(out, against=src)
    assert list(found) == [] and found.notices == [], (found, found.notices)
    names = [e.name for e in jax_ucp.inspect(out).tensors]
    assert found.against is not None and sorted(found.against.equal) == sorted(names)
    assert {"opt_state/count", *(n for n in names if n.startswith("params/"))} <= set(
        found.against.rebuilt
    )
    meta = dcp_reader(src).read_metadata()
    where = next(s for i, s in meta.storage_data.items() if i.fqn.endswith("exp_avg_sq"))
    path = os.path.join(src, where.relative_path)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    chunk = bytes(data[where.offset : where.offset + where.length])
    raw = torch.load(io.BytesIO(chunk), weights_only=True).numpy().tobytes()
    data[where.offset + chunk.index(raw) + 3] ^= 0x40  # the first element's high byte
    with open(path, "wb") as f:
        f.write(data)
    bad = jax_ucp.verify(out, against=src)
    assert bad.against is not None and list(bad.against.files) == [where.relative_path]
    assert bad.against.different and all(
        n.startswith("opt_state/nu/") for n in bad.against.different
    )


def test_settings_name_each_field_and_pass_over_where_and_who_read_it():
    """The source record compared field by field (param_groups by index, betas whole); the
    source's path, the certificate and the release of the library that read a record
    (``transformers 5.24.0``) are no run setting."""
    from jax_ucp._src.against import settings_differ

    record = {
        "path": "/a",
        "certificate": {"files": {}},
        "optimizer": {"param_groups": [{"betas": [0.9, 0.95], "lr": 0.01}]},
        "parameter_order": "transformers 5.24.0 LlamaForCausalLM, Trainer's rule",
    }
    moved = {**record, "path": "/b", "certificate": None}
    moved["parameter_order"] = "transformers 5.30.1 LlamaForCausalLM, Trainer's rule"
    assert settings_differ(record, moved) == {}
    other = {**moved, "optimizer": {"param_groups": [{"betas": [0.8, 0.95], "lr": 0.01}]}}
    found = settings_differ(record, other)
    assert list(found) == ["source.optimizer.param_groups.0.betas"]
    assert "records [0.9, 0.95]" in found["source.optimizer.param_groups.0.betas"]
    assert "[0.8, 0.95]" in found["source.optimizer.param_groups.0.betas"]
