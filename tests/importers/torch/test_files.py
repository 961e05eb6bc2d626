"""torch.save checkpoints written by torch 2.13 (tools/fixtures/make_torch_fixtures.py): a plain
state-dict .pt, HF pytorch_model.bin single and sharded with its index, a Lightning .ckpt
dictionary, Accelerate's full-state folder; imported torch-free, bit-exact to the run's live
state; hostile and inconsistent inputs built by the tests."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.importers import registry
from jax_ucp._src.torchfiles import pickle_format, torch_zip
from jax_ucp.conversion import ImportOptions, TorchOptions
from jax_ucp.errors import SourceError
from tests.importers.torch.test_dcp import FIX, assert_matches_run
from tests.ucp_testing import (
    assert_bit_exact,
    assert_convert_refused,
    assert_destination_untouched,
    copy_fixture,
    hf_torch_folder,
    move_out,
)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    "name",
    [
        "plain_state_dict.pt",
        "hf_bin",
        "hf_bin_sharded",
        "lightning.ckpt",
        "accelerate_full",
        "lightning_trainer.ckpt",
    ],
)
def test_real_torch_save_files_import_bit_exact(tmp_path, name):
    src = os.path.join(FIX, name)
    assert registry.detect_format(src) == "torch"
    out = jax_ucp.convert(src, tmp_path / "ucp")
    restored = jax_ucp.restore(out)
    if name == "lightning.ckpt":  # the LightningModule holds the model as `self.model`
        assert_matches_run(restored, name, prefix="model.")
    elif (
        name == "lightning_trainer.ckpt" or name == "accelerate_full"
    ):  # Lightning's own: the run's names include `model.`
        assert_matches_run(restored, name)
    else:  # weights only: the live parameters
        assert set(restored) == {"params"}
        want = {k: v for k, v in _truth(name).items() if k.startswith("param/")}
        for key, value in want.items():
            assert (restored["params"][key[len("param/") :]] == value).all(), key


@pytest.mark.parametrize(
    "name, as_name",
    [("plain_state_dict.pt", "model_final.pth"), ("lightning_trainer.ckpt", "s.pt")],
)
def test_a_folder_holding_one_torch_save_file_is_that_file(tmp_path, name, as_name):
    """The folder is read as the file it holds (any of torch's suffixes), the optimizer too;
    one rank's file of Megatron (``mp_rank_00/model_optim_rng.pt``) is not a model."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(os.path.join(FIX, name), run / as_name)
    (run / "notes.txt").write_text("a side file")
    assert registry.detect_format(str(run)) == "torch"
    restored = jax_ucp.restore(str(run))
    if name == "lightning_trainer.ckpt":
        assert_matches_run(restored, name)
    else:
        want = {k: v for k, v in _truth(name).items() if k.startswith("param/")}
        assert sorted(restored["params"]) == sorted(k[len("param/") :] for k in want)
        for key, value in want.items():
            assert_bit_exact(restored["params"][key[len("param/") :]], value, key)
    shutil.copy(run / as_name, run / "second.pt")
    with pytest.raises(jax_ucp.SourceError, match=r"s\.pt, second\.pt|model_final\.pth, notes"):
        registry.detect_format(str(run))
    rank = tmp_path / "mp_rank_00"
    rank.mkdir()
    shutil.copy(os.path.join(FIX, name), rank / "model_optim_rng.pt")
    with pytest.raises(jax_ucp.SourceError, match="cannot tell the checkpoint format"):
        registry.detect_format(str(rank))


def test_a_folder_whose_one_torch_save_file_is_a_link(tmp_path):
    """A Hugging Face cache snapshot's one ``.pt`` (a link into its repo's blobs) imports; one
    linked out of any checkpoint is claimed and refused naming the link, not left unclaimed."""
    repo = tmp_path / "models--org--run"
    data = open(os.path.join(FIX, "plain_state_dict.pt"), "rb").read()
    blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True)
    blob.write_bytes(data)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "run.pt").symlink_to(os.path.relpath(blob, snapshot))
    restored = jax_ucp.restore(str(snapshot))
    for key, value in _truth("plain_state_dict.pt").items():
        if key.startswith("param/"):
            assert_bit_exact(restored["params"][key[len("param/") :]], value, key)
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.pt").symlink_to(blob)
    with pytest.raises(jax_ucp.SourceError, match=r"run\.pt' resolves to .*outside the checkpoint"):
        jax_ucp.convert(str(out), str(tmp_path / "ucp"))


def _truth(name):
    from tests.importers.torch.test_dcp import truth

    return truth(name)


def test_lightning_trainer_checkpoint_entries_are_recorded(tmp_path):
    """Lightning 2.6.6's own Trainer.save_checkpoint: everything beside state_dict and
    optimizer_states (loops, callbacks, schedulers, versions) is listed, nothing refused."""
    out = jax_ucp.convert(os.path.join(FIX, "lightning_trainer.ckpt"), tmp_path / "ucp")
    source = jax_ucp.inspect(out).source
    assert sorted(e.split(":", 1)[1] for e in source["other_entries"]) == [
        "callbacks",
        "epoch",
        "global_step",
        "loops",
        "lr_schedulers",
        "pytorch-lightning_version",
    ]
    assert source["optimizer"]["state"] == ["exp_avg", "exp_avg_sq", "step"]


def test_accelerate_save_state_on_cpu_imports_weights_only(tmp_path):
    """Accelerate 1.15's own save_state (2 CPU processes: DDP, model.safetensors +
    optimizer.bin keyed by index + random_states_N.pkl): the optimizer cannot be matched to
    safetensors' sorted names, so it is refused naming parameter_order= and weights_only; the
    weights import bit-exact."""
    src = os.path.join(FIX, "accelerate_save_state")
    assert_convert_refused(
        src,
        tmp_path / "refused",
        r"accelerate_save_state/optimizer\.bin: the optimizer numbers \d+ parameters by "
        r"index .*safetensors keeps no parameter order.*parameter_order=.*weights_only=True",
    )
    out = jax_ucp.convert(src, tmp_path / "ucp", importing=ImportOptions(weights_only=True))
    restored = jax_ucp.restore(out)
    params = {k: v for k, v in _truth("accelerate_save_state").items() if k.startswith("param/")}
    assert sorted(restored) == ["params"]
    assert sorted(restored["params"]) == sorted(k[len("param/") :] for k in params)
    for key, value in params.items():
        assert_bit_exact(restored["params"][key[len("param/") :]], value, key)
    assert jax_ucp.inspect(out).source["skipped"] == {
        "optimizer.bin": "weights_only: Accelerate save_state's torch optimizer state"
    }


def test_lightning_keeps_module_names_and_records_what_it_skips(tmp_path):
    out = jax_ucp.convert(os.path.join(FIX, "lightning.ckpt"), tmp_path / "ucp")
    source = jax_ucp.inspect(out).source
    assert source["optimizer_keys"] == "parameter indices, in state-dict order"
    assert source["optimizer"]["param_groups"][0]["params"][0] == "model.tok_embeddings.weight"
    assert "lightning.ckpt:global_step" in source["other_entries"]
    # Lightning's own prefix (the LightningModule attribute) is part of the torch name
    restored = jax_ucp.restore(out)
    assert "model.tok_embeddings.weight" in restored["params"]


def test_ddp_and_compile_prefixes_are_removed_and_recorded(tmp_path):
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(2, np.float32)]
    weights = {
        "module._orig_mod.layer.weight": torch_zip.TensorSlot(0, (2, 3), arrays[0].dtype),
        "module._orig_mod.layer.bias": torch_zip.TensorSlot(1, (2,), arrays[1].dtype),
    }
    torch_zip.save_file(str(tmp_path / "ddp.pt"), weights, arrays)
    out = jax_ucp.convert(tmp_path / "ddp.pt", tmp_path / "ucp")
    restored = jax_ucp.restore(out)
    assert sorted(restored["params"]) == ["layer.bias", "layer.weight"]
    assert (restored["params"]["layer.weight"] == arrays[0]).all()
    source = jax_ucp.inspect(out).source
    assert source["wrappers_removed"] == {"module.": 2, "_orig_mod.": 2}


def test_optimizer_indices_that_do_not_match_the_model_are_an_error(tmp_path):
    src = tmp_path / "acc"
    shutil.copytree(os.path.join(FIX, "accelerate_full"), src)
    # a model file with one tensor fewer: index i no longer names the i-th parameter
    from jax_ucp._src.torchfiles import torch_zip

    sd = torch_zip.load_torch_file(src / "pytorch_model_fsdp.bin")
    names = list(sd)[1:]
    arrays = [np.array(sd[n]) for n in names]  # copies: the file is replaced below
    del sd
    torch_zip.save_file(
        str(src / "new.bin"),
        {
            n: torch_zip.TensorSlot(i, a.shape, a.dtype)
            for i, (n, a) in enumerate(zip(names, arrays))
        },
        arrays,
    )
    os.replace(src / "new.bin", src / "pytorch_model_fsdp.bin")
    dst = tmp_path / "out"
    with pytest.raises(
        SourceError,
        match=r"optimizer\.bin:.*12 parameters.*11 distinct floating tensors",
    ):
        jax_ucp.convert(src, dst)
    assert_destination_untouched(dst)
    # the weights alone still import, the optimizer listed as skipped
    out = jax_ucp.convert(src, dst, importing=ImportOptions(weights_only=True))
    skipped = jax_ucp.inspect(out).source["skipped"]
    assert skipped["optimizer.bin:state.0.exp_avg"] == "weights_only: optimizer state not imported"


def test_sharded_index_naming_another_file_is_an_error(tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(os.path.join(FIX, "hf_bin_sharded"), src)
    index = json.loads((src / "pytorch_model.bin.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "pytorch_model-00002-of-00002.bin"
    (src / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(SourceError, match=r"another file.*\['tok_embeddings"):
        jax_ucp.convert(src, tmp_path / "out")


def test_sharded_index_escaping_its_folder_is_refused(tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(os.path.join(FIX, "hf_bin_sharded"), src)
    index = {"weight_map": {"x": "../../etc/passwd"}}
    (src / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(
        SourceError,
        match=r"weight_map entry 'x' names '\.\./\.\./etc/passwd'",
    ):
        jax_ucp.convert(src, tmp_path / "out")


def test_sharded_index_naming_a_tensor_twice_is_refused(tmp_path):
    """The index is read as the safetensors one is (one reader): a repeated key in its JSON
    (which of the two files is meant cannot be told) is refused, naming the key."""
    src = tmp_path / "hf"
    shutil.copytree(os.path.join(FIX, "hf_bin_sharded"), src)
    index = json.loads((src / "pytorch_model.bin.index.json").read_text())
    first, file = next(iter(index["weight_map"].items()))
    text = json.dumps(index).replace('"weight_map": {', f'"weight_map": {{"{first}": "{file}", ', 1)
    (src / "pytorch_model.bin.index.json").write_text(text)
    with pytest.raises(SourceError, match=rf"names '{first}' twice"):
        jax_ucp.convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_pickled_code_in_a_bin_file_is_refused_without_running_it(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    marker = tmp_path / "ran"
    obj = pickle_format.Call(pickle_format.Global("os", "system"), (f"touch {marker}",))
    torch_zip.save_file(str(src / "pytorch_model.bin"), {"w": obj})
    with pytest.raises(SourceError, match=r"refusing to load global 'os\.system'"):
        jax_ucp.convert(src, tmp_path / "out")
    assert not marker.exists()


def _trainer_style_optimizer(src, with_names: bool) -> None:
    """accelerate_full's optimizer.bin re-written as Hugging Face's Trainer groups parameters:
    weight-decayed ones (2-D) first, then norms, numbered group after group as torch does."""
    from jax_ucp._src.torchfiles import torch_zip

    model = list(torch_zip.load_torch_file(src / "pytorch_model_fsdp.bin"))
    opt = torch_zip.load_torch_file(src / "optimizer.bin")
    (group,) = opt["param_groups"]
    by_name = {model[i]: opt["state"][i] for i in group["params"]}
    decay = [n for n in model if by_name[n]["exp_avg"].ndim == 2]
    norms = [n for n in model if by_name[n]["exp_avg"].ndim == 1]
    arrays, state, groups = [], {}, []
    for names, wd in ((decay, 0.1), (norms, 0.0)):
        hps = {k: v for k, v in group.items() if k != "params"}
        g = {**hps, "weight_decay": wd, "params": []}
        if with_names:
            g["param_names"] = list(names)
        for name in names:
            index = len(state)
            per = {}
            for k, v in by_name[name].items():
                per[k] = torch_zip.TensorSlot(len(arrays), v.shape, v.dtype)
                arrays.append(np.array(v))
            state[index] = per
            g["params"].append(index)
        groups.append(g)
    del opt
    torch_zip.save_file(str(src / "new.bin"), {"state": state, "param_groups": groups}, arrays)
    os.replace(src / "new.bin", src / "optimizer.bin")


def test_several_optimizer_groups_without_names_are_refused(tmp_path):
    """Index i of a two-group optimizer (the Trainer's decay / no-decay split) is not the i-th
    tensor of the model state dict: refused, never mapped by position."""
    src = tmp_path / "trainer"
    shutil.copytree(os.path.join(FIX, "accelerate_full"), src)
    _trainer_style_optimizer(src, with_names=False)
    dst = tmp_path / "out"
    with pytest.raises(
        SourceError,
        match=r"optimizer\.bin: the optimizer numbers 12 parameters by index over 2 groups "
        r"without their names \(group 0: 9 parameters \(indices 0, 1, 2, 3, \.\.\.\), "
        r"weight_decay 0\.1; group 1: 3 parameters .*weight_decay 0\.0\); torch's own "
        r"numbering, group after group.*group 0's 9, then group 1's 3.*weights_only=True",
    ):
        jax_ucp.convert(src, dst)
    assert_destination_untouched(dst)


def test_optimizer_groups_with_param_names_import_bit_exact(tmp_path):
    """With param_names in its groups (torch >= 2.5, optimizer built from named_parameters) the
    same two-group optimizer maps by name: moments bit-exact to the run, both groups recorded."""
    src = tmp_path / "trainer"
    shutil.copytree(os.path.join(FIX, "accelerate_full"), src)
    _trainer_style_optimizer(src, with_names=True)
    out = jax_ucp.convert(src, tmp_path / "out")
    assert_matches_run(jax_ucp.restore(out), "accelerate_full")
    source = jax_ucp.inspect(out).source
    assert source["optimizer_keys"] == "parameter indices, named by the groups' param_names"
    groups = source["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert all("param_names" not in g for g in groups)
    assert groups[1]["params"] == [n for n in groups[1]["params"] if "norm" in n]


def _model_parallel_ckpt(path) -> tuple[list[list[str]], dict]:
    """A Lightning ``ModelParallelStrategy(save_distributed_checkpoint=False)`` ``.ckpt``:
    the full model state dict and, in ``optimizer_states``, the optimizer's full state dict
    re-keyed by FSDP's ``rekey_optim_state_dict(PARAM_ID, model)`` as Lightning does (indices
    of model.parameters(), each group's sorted); a decay / no-decay AdamW trained 2 steps.
    Returns each group's names, as the groups were built, and the run's live state."""
    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    named = list(model.named_parameters())
    decayed = [n for n, p in named if p.ndim > 1]
    groups = [decayed, [n for n, _ in named if n not in decayed]]
    params = dict(named)
    opt = torch.optim.AdamW(
        [
            {"params": [params[n] for n in groups[0]], "weight_decay": 0.1},
            {"params": [params[n] for n in groups[1]], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )
    for _ in range(2):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    full = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    rekeyed = FullyShardedDataParallel.rekey_optim_state_dict(
        full, OptimStateKeyType.PARAM_ID, model
    )
    torch.save(
        {
            "state_dict": model.state_dict(),
            "optimizer_states": [rekeyed],
            "epoch": 0,
            "global_step": 2,
            "pytorch-lightning_version": "2.6.6",
        },
        path,
    )
    live: dict[str, Any] = {"step": 2}
    for name, p in named:
        live[f"param/{name}"] = p.detach().numpy().copy()
        live[f"exp_avg/{name}"] = opt.state[p]["exp_avg"].numpy().copy()
        live[f"exp_avg_sq/{name}"] = opt.state[p]["exp_avg_sq"].numpy().copy()
    return groups, live


@pytest.mark.torch
def test_model_parallel_ckpt_refusal_gives_the_order_that_imports_exactly(tmp_path):
    """Two unnamed groups re-keyed by model.parameters(): the refusal says what the file holds
    (each group's size, indices and weight decay; indices not run group after group) and
    advises the names group after group; following it imports exactly, while
    model.named_parameters()'s order is refused on a shape."""
    from tests.importers.torch.test_hf_trainer import assert_matches_run as matches_live

    src = str(tmp_path / "consolidated.ckpt")
    groups, live = _model_parallel_ckpt(src)
    with pytest.raises(SourceError) as refused:
        jax_ucp.convert(src, tmp_path / "refused")
    message = str(refused.value)
    assert (
        "2 groups without their names (group 0: 2 parameters (indices 0, 4), weight_decay 0.1"
        in message
    )
    assert "group 1: 4 parameters (indices 1, 2, 3, 5), weight_decay 0.0" in message
    assert "do not run group after group" in message
    assert "[n for group in name_groups for n in group]" in message
    assert_destination_untouched(tmp_path / "refused")
    by_model = [k.split("/", 1)[1] for k in live if k.startswith("param/")]
    with pytest.raises(SourceError, match=r"has shape"):
        jax_ucp.convert(
            src, tmp_path / "by_model", importing=TorchOptions(parameter_order=by_model)
        )
    order = [n for group in groups for n in group]
    out = jax_ucp.convert(src, tmp_path / "ucp", importing=TorchOptions(parameter_order=order))
    matches_live(jax_ucp.restore(out), live)
    source = jax_ucp.inspect(out).source
    assert source["optimizer_keys"] == "parameter indices, named by parameter_order"
    assert [g["weight_decay"] for g in source["optimizer"]["param_groups"]] == [0.1, 0.0]


# Inputs a careless or hostile user hands over, built here torch-free: each imports exactly or is
# refused naming the file, the key and the cause (never an internal "please report").


def test_folder_builder_is_a_torch_savehf_torch_folder(tmp_path):
    """The builder above writes what the torch importer detects as such."""
    from jax_ucp._src.importers import registry

    src, _ = hf_torch_folder(tmp_path, {"a": (4,)}, ["a"])
    assert registry.detect_format(str(src)) == "torch"
    assert os.path.getsize(src / "optimizer.bin") > 0


# Nothing outside the checkpoint is read, and no tensor borrows another's bytes.


@pytest.mark.timeout(60)
def test_bin_shard_linked_outside_and_index_nul_are_refused(tmp_path):
    """``pytorch_model.bin.index.json`` shards: one linked elsewhere, or named with a NUL."""
    src = copy_fixture(tmp_path, "torch/hf_bin_sharded", name="hf_bin_sharded")
    move_out(src / "pytorch_model-00002-of-00002.bin", tmp_path / "elsewhere")
    with pytest.raises(
        jax_ucp.UCPError,
        match=r"pytorch_model\.bin\.index\.json: weight_map entry '.*': file name "
        r"'pytorch_model-00002-of-00002\.bin' resolves to \S+/elsewhere/.*outside the checkpoint",
    ):
        jax_ucp.convert(src, tmp_path / "out")
    index = src / "pytorch_model.bin.index.json"
    data = json.loads(index.read_text())
    name = sorted(data["weight_map"])[0]
    data["weight_map"][name] = "pytorch\0model.bin"
    index.write_text(json.dumps(data))
    with pytest.raises(
        jax_ucp.UCPError, match=rf"weight_map entry '{name}': file name .* holds a NUL character"
    ):
        jax_ucp.convert(src, tmp_path / "out")
    single = copy_fixture(tmp_path, "torch/hf_bin", name="hf_bin")
    move_out(single / "pytorch_model.bin", tmp_path / "elsewhere2")
    assert_convert_refused(single, tmp_path / "out", r"'pytorch_model\.bin' resolves to .*outside")
