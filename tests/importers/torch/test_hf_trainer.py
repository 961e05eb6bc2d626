"""Hugging Face Trainer ``checkpoint-N/`` and Accelerate ``save_state`` folders written by the
libraries themselves (tools/fixtures/make_hf_trainer_checkpoints.py,
tools/fixtures/make_accelerate_save_state.py): imported by auto-detection with the optimizer,
weights, moments and step bit-exact to the run's live state; refused, naming why, when the
optimizer's indices cannot be mapped soundly."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tomllib
import warnings

import numpy as np
import pytest
from safetensors.numpy import load_file

import jax_ucp
from jax_ucp._src.importers.plan import tensor_names
from jax_ucp._src.store.storage import LocalDirectory
from jax_ucp._src.torchfiles import torch_zip
from jax_ucp.conversion import ImportOptions, TorchOptions
from tests.ucp_testing import (
    REPO,
    assert_bit_exact,
    assert_convert_refused,
    assert_destination_untouched,
    assert_source_refused,
    load_truth,
)

pytestmark = pytest.mark.timeout(300)
HERE = os.path.join(REPO, "tests", "fixtures")
TRAINER = os.path.join(HERE, "hf_trainer")
ACCELERATE = os.path.join(HERE, "accelerate")
STATES = {"exp_avg": "mu", "exp_avg_sq": "nu"}


def test_torch_extra_installs_accelerate_for_the_trainer():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["torch"]
    names = {d.split(">")[0].split("=")[0].split("[")[0].strip() for d in extra}
    assert {"torch", "transformers", "accelerate", "safetensors"} <= names


def assert_matches_run(restored: dict, want: dict) -> None:
    """params, mu, nu and the step equal the run's live state, bit for bit, and nothing else
    is there."""
    params = sorted(k.split("/", 1)[1] for k in want if k.startswith("param/"))
    assert sorted(restored["params"]) == params
    assert sorted(restored["opt_state"]) == ["count", "mu", "nu"]
    for key, value in want.items():
        kind, _, name = key.partition("/")
        if kind == "param":
            assert_bit_exact(restored["params"][name], value, key)
        elif kind in STATES:
            assert_bit_exact(restored["opt_state"][STATES[kind]][name], value, key)
    for tree in ("mu", "nu"):
        assert sorted(restored["opt_state"][tree]) == params
    assert restored["opt_state"]["count"] == np.int32(want["step"])


def assert_accounted(out: str, src: str, optimizer: str) -> None:
    """Every tensor of the folder (safetensors weights, the optimizer file's tensors, the
    Trainer's RNG state as a unit) is imported or in source.skipped, never both."""
    with open(os.path.join(src, "model.safetensors"), "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    found = {f"model.safetensors:{n}" for n in header if n != "__metadata__"}
    found |= {
        f"{optimizer}:{n}"
        for n in tensor_names(torch_zip.load_torch_file(os.path.join(src, optimizer)))
    }
    found |= {n for n in os.listdir(src) if n.startswith("rng_state") and n.endswith(".pth")}
    manifest = jax_ucp.inspect(out)
    imported = {t for e in manifest.tensors for t in (e.provenance or {}).get("tensors", [])}
    skipped = set(manifest.source.get("skipped", {}))
    assert imported & skipped == set()
    assert imported | skipped == found


def trainer_src(kind: str) -> str:
    return os.path.join(TRAINER, kind, "checkpoint-3")


@pytest.mark.torch
@pytest.mark.parametrize(
    "kind", ["trainer_fp32", "trainer_bf16", "trainer_fp32_tf4", "trainer_tied"]
)
def test_trainer_checkpoint_imports_its_optimizer_bit_exact(tmp_path, kind):
    """transformers 5.23's Trainer (decay / no-decay groups, fused AdamW, fp32 and bf16 models)
    and 4.46's (``trainer_fp32_tf4``: its pickled TrainingArguments carry cached properties):
    the indices of optimizer.pt are mapped through the Trainer's grouping of config.json's model
    rebuilt on the meta device; every moment and the step equal the run's."""
    out = jax_ucp.convert(trainer_src(kind), tmp_path / "ucp")
    assert_matches_run(jax_ucp.restore(out), load_truth(os.path.join(TRAINER, f"{kind}.truth.npz")))
    assert_accounted(out, trainer_src(kind), "optimizer.pt")
    source = jax_ucp.inspect(out).source
    assert source["framework"] == "torch_files"
    assert source["parameter_order"].endswith("LlamaForCausalLM, Trainer.get_decay_parameter_names")
    decay, no_decay = source["optimizer"]["param_groups"]
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(n.endswith("norm.weight") for n in no_decay["params"])
    tied = kind == "trainer_tied"  # lm_head is embed_tokens: one parameter, saved once
    assert len(no_decay["params"]) == 5 and len(decay["params"]) == 16 - tied
    args = source["trainer"]["training_args"]
    assert (args["lr_scheduler_type"], args["warmup_steps"], args["max_grad_norm"]) == (
        "linear",
        1,
        1.0,
    )
    assert source["trainer"]["scheduler"] == {
        "last_epoch": 3,
        "base_lrs": [0.01, 0.01],
        "last_lr": [0.005, 0.005],
    }


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


@pytest.mark.torch
def test_trainer_refuses_a_grouping_it_cannot_verify(tmp_path):
    """optimizer.pt whose groups are not the Trainer's grouping of the config's model (one
    parameter moved to the other group), a config naming custom code, and one naming an
    architecture transformers does not ship: each refused naming why; nothing written; the
    weights still import with weights_only."""
    src = _copy(trainer_src("trainer_fp32"), tmp_path / "moved")
    opt = torch_zip.load_torch_file(os.path.join(src, "optimizer.pt"))
    import torch

    raw = torch.load(os.path.join(src, "optimizer.pt"), weights_only=True)
    moved = raw["param_groups"][0]["params"].pop()
    raw["param_groups"][1]["params"].insert(0, moved)
    torch.save(raw, os.path.join(src, "optimizer.pt"))
    assert len(opt["param_groups"][0]["params"]) == 16
    assert_convert_refused(src, tmp_path / "u1", r"sizes \[15, 6\]\) are not the Trainer's group")
    weights = jax_ucp.restore(
        jax_ucp.convert(src, tmp_path / "w1", importing=ImportOptions(weights_only=True))
    )
    assert sorted(weights) == ["params"]
    # same group sizes, two indices traded between the groups: the shapes give it away
    g0, g1 = raw["param_groups"][0]["params"], raw["param_groups"][1]["params"]
    g1.pop(0)
    g0.append(moved)
    g0[-1], g1[0] = g1[0], g0[-1]
    torch.save(raw, os.path.join(src, "optimizer.pt"))
    assert_convert_refused(src, tmp_path / "u2", r"sizes \[16, 5\]\) are not.*exp_avg \[")

    for name, change, why in [
        ("custom", {"auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}, "custom code"),
        ("unknown", {"architectures": ["EvilForCausalLM"]}, "not one transformers"),
        ("huge", {"num_hidden_layers": 10**7}, r"num_hidden_layers asks for 10000000 modules"),
    ]:
        src = _copy(trainer_src("trainer_fp32"), tmp_path / name)
        with open(os.path.join(src, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(src, "config.json"), "w") as f:
            json.dump({**config, **change}, f)
        assert_convert_refused(src, tmp_path / f"u_{name}", why)


def test_trainer_without_transformers_is_refused_naming_why(tmp_path, monkeypatch):
    """Without transformers the Trainer's order cannot be rebuilt: refused, naming transformers
    and parameter_order; the weights import with weights_only, and parameter_order= (the
    Trainer's groups, decay then no-decay) imports the optimizer bit-exact."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    src = trainer_src("trainer_fp32")
    assert_convert_refused(src, tmp_path / "refused", r"without transformers.*parameter_order")
    want = load_truth(os.path.join(TRAINER, "trainer_fp32.truth.npz"))
    names = [k.split("/", 1)[1] for k in want if k.startswith("param/")]
    no_decay = [n for n in names if n.endswith("norm.weight")]
    order = [n for n in names if n not in no_decay] + no_decay
    out = jax_ucp.convert(src, tmp_path / "ucp", importing=TorchOptions(parameter_order=order))
    assert_matches_run(jax_ucp.restore(out), want)
    assert_accounted(out, src, "optimizer.pt")
    assert jax_ucp.inspect(out).source["skipped"]["rng_state.pth"].startswith("the torch run's")


@pytest.mark.parametrize("kind", ["accelerate_named", "accelerate_named_groups"])
def test_accelerate_named_groups_map_by_param_names(tmp_path, kind):
    """Accelerate 1.15 save_state of AdamW(model.named_parameters()) (and of named decay /
    no-decay groups): torch keeps param_names beside the indices; mapped by name, bit-exact."""
    out = jax_ucp.convert(os.path.join(ACCELERATE, kind), tmp_path / "ucp")
    assert_matches_run(
        jax_ucp.restore(out), load_truth(os.path.join(ACCELERATE, f"{kind}.truth.npz"))
    )
    assert jax_ucp.inspect(out).source["optimizer_keys"].endswith("param_names")
    assert_accounted(out, os.path.join(ACCELERATE, kind), "optimizer.bin")


@pytest.mark.parametrize(
    "source, optimizer, gone",
    [
        ("accelerate/accelerate_named", "optimizer.bin", None),
        ("accelerate/accelerate_named", "optimizer.bin", "optimizer.bin "),
        ("hf_trainer/trainer_fp32/checkpoint-3", "optimizer.pt", None),
    ],
)
def test_a_run_folder_whose_optimizer_file_is_gone_is_refused_not_weights_only(
    tmp_path, source, optimizer, gone
):
    """An Accelerate save_state / a Trainer checkpoint-N whose optimizer file was deleted or
    renamed (the scheduler's state still there) imported the weights alone without a word, by
    convert and by a direct restore (harness ``accelerate`` seed 11 #8): a resume would start
    Adam from nothing. Refused naming the scheduler and what is missing; weights_only=True
    takes the weights."""
    src = shutil.copytree(os.path.join(HERE, source), tmp_path / "src")
    if gone is None:
        os.remove(src / optimizer)
    else:
        os.rename(src / optimizer, src / gone)
    said = r"scheduler\.(bin|pt) is here .* but no optimizer state .*weights_only=True"
    assert_source_refused(src, tmp_path / "refused", said)
    out = jax_ucp.convert(src, tmp_path / "weights", importing=ImportOptions(weights_only=True))
    assert not [k for k in jax_ucp.restore(out) if k != "params"]
    weights = jax_ucp.restore(src, importing=ImportOptions(weights_only=True))["params"]
    converted = jax_ucp.restore(out)["params"]
    assert sorted(weights) == sorted(converted)
    for name, value in converted.items():
        assert_bit_exact(weights[name], value, name)


@pytest.mark.parametrize(
    "source, change, says",
    [  # a save_state without a scheduler: its RNG states, or the optimizer's renamed file
        ("torch/accelerate_save_state", "delete", r"random_states_0\.pkl, random_states_1\.pkl"),
        ("torch/accelerate_save_state", "optimizer.bin.bak", r"optimizer\.bin\.bak, random_"),
        ("torch/accelerate_full", "optimizer.bin.old", r"optimizer\.bin\.old here"),
        ("torch/accelerate_full", "delete", None),  # nothing shows it: a weights-only save
    ],
)
def test_a_lost_optimizer_file_is_said_where_the_folder_shows_it(tmp_path, source, change, says):
    """An Accelerate folder whose ``optimizer.bin`` was deleted or renamed, no scheduler
    beside it: imported as weights alone without a word (issue 56), as a weights-only save
    looks. Where the folder shows a run's save (``save_state``'s ``random_states_*.pkl``, a
    name like an optimizer's), convert and a direct restore warn ("... the weights are imported
    alone") and take the weights; where nothing shows it, no word (a legitimate folder)."""
    src = shutil.copytree(os.path.join(HERE, source), tmp_path / "src")
    if change == "delete":
        os.remove(src / "optimizer.bin")
    else:
        os.rename(src / "optimizer.bin", src / change)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = jax_ucp.restore(src)
        out = jax_ucp.convert(src, tmp_path / "weights")
    said = [str(w.message) for w in caught if "imported alone" in str(w.message)]
    assert len(said) == (0 if says is None else 2), said
    assert all(re.search(says or "", w) and "no optimizer state" in w for w in said)
    assert list(restored) == list(jax_ucp.restore(out)) == ["params"]


@pytest.mark.parametrize("kind", ["accelerate_plain", "accelerate_groups"])
def test_accelerate_bare_indices_need_the_parameter_order(tmp_path, kind):
    """AdamW(model.parameters()) or bare decay / no-decay groups: safetensors keeps its names
    sorted, not in the model's order, so the indices are refused naming parameter_order=; given
    the order (the names of model.named_parameters(), group after group) it is bit-exact."""
    src = os.path.join(ACCELERATE, kind)
    assert_convert_refused(
        src, tmp_path / "refused", r"safetensors keeps no parameter order.*parameter"
    )
    want = load_truth(os.path.join(ACCELERATE, f"{kind}.truth.npz"))
    order = [str(n) for n in want.pop("order")]
    if kind == "accelerate_groups":  # the generator's groups: matrices, then vectors
        ndim = {n: want[f"param/{n}"].ndim for n in order}
        order = [n for n in order if ndim[n] >= 2] + [n for n in order if ndim[n] < 2]
    out = jax_ucp.convert(src, tmp_path / "ucp", importing=TorchOptions(parameter_order=order))
    assert_matches_run(jax_ucp.restore(out), want)
    with pytest.raises(jax_ucp.UCPError, match=r"parameter_order names 20 parameters"):
        jax_ucp.convert(src, tmp_path / "short", importing=TorchOptions(parameter_order=order[:-1]))
    swapped = [order[1], order[0], *order[2:]]  # embed_tokens <-> q_proj: shapes differ
    with pytest.raises(jax_ucp.UCPError, match=r"has shape"):
        jax_ucp.convert(src, tmp_path / "swapped", importing=TorchOptions(parameter_order=swapped))


LLAMA_CONFIG = os.path.join(ACCELERATE, "llama.config.json")  # the fixtures' model's config.json


@pytest.mark.torch
@pytest.mark.parametrize("kind", ["accelerate_plain", "accelerate_groups"])
def test_accelerate_bare_indices_import_with_the_model_config(tmp_path, kind):
    """model_config= the model's config.json (Accelerate's save_state keeps none): the order is
    rebuilt as for a Trainer checkpoint (the model on the meta device): one group of
    model.named_parameters() for AdamW(model.parameters()), the decay / no-decay split for the
    bare groups; every moment and the step equal the run's."""
    src = os.path.join(ACCELERATE, kind)
    with pytest.raises(jax_ucp.UCPError, match=r"model_config= its config\.json \(--model-config"):
        jax_ucp.convert(src, tmp_path / "refused")
    out = jax_ucp.convert(src, tmp_path / "ucp", importing=TorchOptions(model_config=LLAMA_CONFIG))
    want = load_truth(os.path.join(ACCELERATE, f"{kind}.truth.npz"))
    want.pop("order")
    assert_matches_run(jax_ucp.restore(out), want)
    assert_accounted(out, src, "optimizer.bin")
    source = jax_ucp.inspect(out).source
    assert source["optimizer_keys"].startswith("parameter indices, in the groups rebuilt from")
    rule = "one group in model.named_parameters() order"
    if kind == "accelerate_groups":
        rule = "Trainer.get_decay_parameter_names"
    assert source["parameter_order"].startswith(LLAMA_CONFIG + ": transformers ")
    assert source["parameter_order"].endswith(rule)


@pytest.mark.torch
def test_trainer_checkpoint_without_its_config_imports_with_the_model_config(tmp_path):
    """A Trainer checkpoint-N/ whose config.json is gone: refused naming model_config=; given
    the config (kept elsewhere), bit-exact as with it."""
    src = _copy(trainer_src("trainer_fp32"), tmp_path / "checkpoint-3")
    config = str(tmp_path / "kept.config.json")
    os.replace(os.path.join(src, "config.json"), config)
    assert_convert_refused(
        src, tmp_path / "refused", r"no config\.json.*model_config= \(--model-config"
    )
    out = jax_ucp.convert(src, tmp_path / "ucp", importing=TorchOptions(model_config=config))
    assert_matches_run(
        jax_ucp.restore(out), load_truth(os.path.join(TRAINER, "trainer_fp32.truth.npz"))
    )
    source = jax_ucp.inspect(out).source
    assert source["parameter_order"].startswith(f"{config}: transformers ")
    assert source["parameter_order"].endswith("Trainer.get_decay_parameter_names")


@pytest.mark.torch
def test_a_model_config_of_another_model_is_refused_naming_the_misfit(tmp_path):
    """A config.json of another shape: no grouping fits; refused naming the config and a
    shape; nothing written."""
    with open(LLAMA_CONFIG) as f:
        config = json.load(f)
    other = tmp_path / "other.config.json"
    other.write_text(json.dumps({**config, "intermediate_size": 40}))
    with pytest.raises(jax_ucp.UCPError, match=r"not one group of model\.named_parameters\(\) "):
        jax_ucp.convert(
            os.path.join(ACCELERATE, "accelerate_plain"),
            tmp_path / "u",
            importing=TorchOptions(model_config=str(other)),
        )
    assert_destination_untouched(tmp_path / "u")


def test_model_config_and_parameter_order_together_or_elsewhere_are_refused(tmp_path):
    """Two sources of one order are refused; so is model_config= for a checkpoint that keys its
    optimizer by name (torch DCP) or another format's."""
    src = os.path.join(ACCELERATE, "accelerate_plain")
    with pytest.raises(jax_ucp.UCPError, match=r"parameter_order= and model_config= both"):
        jax_ucp.convert(
            src,
            tmp_path / "u1",
            importing=TorchOptions(model_config=LLAMA_CONFIG, parameter_order=["a"]),
        )
    dcp = os.path.join(REPO, "tests", "fixtures", "torch", "fsdp2_fp32")
    with pytest.raises(jax_ucp.UCPError, match=r"model_config= orders an index-keyed optimizer"):
        jax_ucp.convert(dcp, tmp_path / "u2", importing=TorchOptions(model_config=LLAMA_CONFIG))
    missing = str(tmp_path / "nowhere.json")
    with pytest.raises(jax_ucp.UCPError, match=r"model_config=.*nowhere\.json: no such file"):
        jax_ucp.convert(src, tmp_path / "u3", importing=TorchOptions(model_config=missing))
    for n in ("u1", "u2", "u3"):
        assert_destination_untouched(tmp_path / n)


def test_trainer_lora_checkpoint_imports_with_the_adapter_order(tmp_path):
    """A Trainer + peft LoRA checkpoint (adapter_model.safetensors + optimizer.pt, no base
    config.json): the order of the trainable parameters is not recorded, so it is refused naming
    parameter_order= and weights_only; with the order (the peft model's trainable
    named_parameters as saved: peft drops the adapter name ``.default``) every moment and the
    step equal the run's; weights_only imports the adapter alone."""
    src = trainer_src("trainer_lora")
    assert_convert_refused(src, tmp_path / "refused", r"peft adapter checkpoint.*parameter_order=")
    want = {
        k.replace(".default.", "."): v
        for k, v in load_truth(os.path.join(TRAINER, "trainer_lora.truth.npz")).items()
        if not k.startswith("next_")
    }
    order = [k.split("/", 1)[1] for k in want if k.startswith("param/")]
    out = jax_ucp.convert(src, tmp_path / "ucp", importing=TorchOptions(parameter_order=order))
    assert_matches_run(jax_ucp.restore(out), want)
    weights = jax_ucp.restore(
        jax_ucp.convert(src, tmp_path / "w", importing=ImportOptions(weights_only=True))
    )
    assert sorted(weights["params"]) == sorted(order)


@pytest.mark.torch
def test_trainer_lora_checkpoint_imports_with_the_base_models_config(tmp_path):
    """model_config= the base model's config.json: the adapter's trainable parameters rebuilt
    from adapter_config.json's target modules over the base model built on the meta device
    (peft is not needed) give the run's moments and step; an adapter config that trains more
    than its targets' lora_A / lora_B is refused naming the field."""
    src = trainer_src("trainer_lora")
    base = os.path.join(trainer_src("trainer_fp32"), "config.json")  # the same tiny Llama
    want = {
        k.replace(".default.", "."): v
        for k, v in load_truth(os.path.join(TRAINER, "trainer_lora.truth.npz")).items()
        if not k.startswith("next_")
    }
    out = jax_ucp.convert(src, tmp_path / "ucp", importing=TorchOptions(model_config=base))
    assert_matches_run(jax_ucp.restore(out), want)
    assert any("peft LoRA r=4 on q_proj, v_proj" in n for n in jax_ucp.inspect(out).source["notes"])
    hostile = _copy(src, tmp_path / "saves_more")
    with open(os.path.join(hostile, "adapter_config.json")) as f:
        adapter = json.load(f)
    adapter["layers_to_transform"] = [0]
    with open(os.path.join(hostile, "adapter_config.json"), "w") as f:
        json.dump(adapter, f)
    assert_convert_refused(
        hostile,
        tmp_path / "refused",
        r"adapter_config\.json: layers_to_transform=\[0\]",
        importing=TorchOptions(model_config=base),
    )


def _peft_saved_name(live: str) -> str:
    """A peft model's live parameter name as its adapter_model.safetensors names it: the
    adapter name dropped, DoRA's magnitude without ``.weight``, a saved module's copy under
    the module's own name."""
    live = live.replace(".lora_magnitude_vector.default.weight", ".lora_magnitude_vector")
    return live.replace(".modules_to_save.default.", ".").replace(".default.", ".")


@pytest.mark.torch
def test_trainer_dora_with_modules_to_save_rebuilds_its_order(tmp_path):
    """A Trainer + peft DoRA checkpoint with modules_to_save=["lm_head"] (peft 0.21.2 itself):
    the trainable parameters rebuilt from adapter_config.json over the base model (each
    target's lora_A, lora_B, lora_magnitude_vector, then the head's trained copy, in module
    order; no parameter_order) give every weight, moment and the step of the run bit for bit."""
    src = trainer_src("trainer_dora")
    base = os.path.join(trainer_src("trainer_fp32"), "config.json")  # the same tiny Llama
    want = {
        _peft_saved_name(k): v
        for k, v in load_truth(os.path.join(TRAINER, "trainer_dora.truth.npz")).items()
        if not k.startswith("next_")
    }
    assert "param/base_model.model.lm_head.weight" in want
    with pytest.warns(UserWarning, match="share a shape"):
        out = jax_ucp.convert(src, tmp_path / "ucp", importing=TorchOptions(model_config=base))
    assert_matches_run(jax_ucp.restore(out), want)
    rule = jax_ucp.inspect(out).source["parameter_order"]
    assert "peft DoRA r=4 on v_proj, q_proj, modules_to_save lm_head" in rule


def _with_base(src: str, dst, base) -> str:
    """The LoRA fixture copied with adapter_config.json's base_model_name_or_path set to ``base``
    (the fixture's run built its base model in memory: it records none)."""
    out = _copy(src, dst)
    with open(os.path.join(out, "adapter_config.json")) as f:
        adapter = json.load(f)
    adapter["base_model_name_or_path"] = base
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(adapter, f)
    return out


def _fake_hub_cache(root, repo_id: str, config: str, commit: str = "c" * 40) -> str:
    """huggingface_hub's cache layout for ``repo_id``: refs/main naming the snapshot, whose
    config.json is a link into blobs/ (as the hub writes it)."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    shutil.copy(config, repo / "blobs" / ("b" * 40))
    os.symlink(os.path.join("..", "..", "blobs", "b" * 40), snapshot / "config.json")
    return str(root)


@pytest.mark.torch
def test_trainer_lora_takes_the_base_config_from_adapter_configs_base_model(tmp_path, monkeypatch):
    """adapter_config.json's base_model_name_or_path naming a local folder, or a Hub repo id
    found in the local Hugging Face cache (HF_HUB_CACHE, then HF_HOME/hub; no network): the
    base model's config.json there rebuilds the adapter's order, the moments and step equal the
    run's, and the manifest's notes say which config.json was used; a name found nowhere (or a
    cache link leading out of its repo) falls back to the refusal, naming what was tried."""
    src = trainer_src("trainer_lora")
    base_config = os.path.join(trainer_src("trainer_fp32"), "config.json")  # the same tiny Llama
    want = {
        k.replace(".default.", "."): v
        for k, v in load_truth(os.path.join(TRAINER, "trainer_lora.truth.npz")).items()
        if not k.startswith("next_")
    }
    local = tmp_path / "base_model"
    local.mkdir()
    shutil.copy(base_config, local / "config.json")
    by_folder = jax_ucp.convert(_with_base(src, tmp_path / "a", str(local)), tmp_path / "u1")
    assert_matches_run(jax_ucp.restore(by_folder), want)
    notes = jax_ucp.inspect(by_folder).source["notes"]
    assert any("peft LoRA r=4" in n and str(local / "config.json") in n for n in notes)

    cache = _fake_hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", base_config)
    for env, value in (("HF_HUB_CACHE", cache), ("HF_HOME", str(tmp_path))):
        monkeypatch.delenv("HF_HUB_CACHE", raising=False)
        monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
        monkeypatch.setenv(env, value)
        hub = _with_base(src, tmp_path / f"b_{env}", "tiny-org/tiny-llama")
        by_cache = jax_ucp.convert(hub, tmp_path / f"u_{env}")
        assert_matches_run(jax_ucp.restore(by_cache), want)
        notes = jax_ucp.inspect(by_cache).source["notes"]
        assert any("'tiny-org/tiny-llama'" in n and "blobs" in n for n in notes), notes

    monkeypatch.setenv("HF_HUB_CACHE", cache)
    missing = _with_base(src, tmp_path / "c", "tiny-org/not-cached")
    assert_convert_refused(
        missing, tmp_path / "refused", r"without the base model's.*not-cached.*no .*snapshots"
    )
    # a snapshot's config.json linking out of its cache repo is not followed
    outside = tmp_path / "elsewhere.json"
    shutil.copy(base_config, outside)
    link = tmp_path / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / ("c" * 40)
    os.remove(link / "config.json")
    os.symlink(outside, link / "config.json")
    assert_convert_refused(
        hub,
        tmp_path / "refused2",
        r"tiny-llama.*(outside|resolves to .*elsewhere\.json).*parameter_order=",
    )


class _Pwn:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


@pytest.mark.torch
def test_a_hostile_training_args_bin_is_neither_run_nor_read(tmp_path, monkeypatch):
    """training_args.bin pickling a call of os.system: the import goes on (the schedule is
    optional), nothing runs, and source.trainer says why the arguments were not read."""
    import torch

    src = _copy(trainer_src("trainer_fp32"), tmp_path / "hostile")
    torch.save({"args": _Pwn()}, os.path.join(src, "training_args.bin"))
    monkeypatch.chdir(tmp_path)
    out = jax_ucp.convert(src, tmp_path / "ucp")
    assert not (tmp_path / "PWNED").exists()
    trainer = jax_ucp.inspect(out).source["trainer"]
    assert "training_args" not in trainer
    assert (
        "os.system" in trainer["training_args_unread"]
        or "posix.system" in (trainer["training_args_unread"])
    )


@pytest.mark.torch
def test_same_shaped_states_named_by_the_trainer_rule_are_said_out_loud(tmp_path):
    """A Trainer subclass with its own ``create_optimizer()`` numbers parameters otherwise: with
    q_proj / o_proj (both [32, 32]) states swapped in ``optimizer.pt``, the Trainer's grouping
    rebuilt from config.json still fits every shape, so nothing in the files can tell. The
    import says so, as the one-group index rule does: one warning, one note in the manifest."""
    torch = pytest.importorskip("torch")
    src = tmp_path / "checkpoint-3"
    shutil.copytree(os.path.join(TRAINER, "trainer_fp32", "checkpoint-3"), src)
    opt = torch.load(src / "optimizer.pt", weights_only=True)
    square = [i for i, s in opt["state"].items() if tuple(s["exp_avg"].shape) == (32, 32)]
    a, b = square[0], square[-1]
    opt["state"][a], opt["state"][b] = opt["state"][b], opt["state"][a]
    torch.save(opt, src / "optimizer.pt")
    with pytest.warns(jax_ucp.OptimizerOrderWarning, match="Trainer's default grouping"):
        jax_ucp.convert(str(src), str(tmp_path / "out"))
    notes = jax_ucp.inspect(str(tmp_path / "out")).source.get("notes", [])
    said = [n for n in notes if "Trainer's default grouping" in n]
    assert len(said) == 1 and "share a shape" in said[0], notes


@pytest.mark.parametrize("name", ["scheduler.pt", "trainer_state.json", "training_args.bin"])
def test_a_trainer_side_file_linking_out_of_the_checkpoint_is_refused(tmp_path, monkeypatch, name):
    """The Trainer's side files are read through ``inside``: one that is a symlink to a file
    elsewhere is refused naming it, its values never land in the new manifest."""
    src = tmp_path / "checkpoint-3"
    shutil.copytree(os.path.join(TRAINER, "trainer_fp32", "checkpoint-3"), src)
    elsewhere = tmp_path / "private"
    elsewhere.mkdir()
    (src / name).rename(elsewhere / name)
    (src / name).symlink_to(elsewhere / name)
    monkeypatch.setitem(sys.modules, "transformers", None)  # as in the torch-free default set
    with np.load(os.path.join(TRAINER, "trainer_fp32.truth.npz")) as z:
        names = [k.split("/", 1)[1] for k in z.files if k.startswith("param/")]
    norms = [n for n in names if n.endswith("norm.weight")]
    order = [n for n in names if n not in norms] + norms  # the Trainer's: decayed, then norms
    with pytest.raises(jax_ucp.UCPError, match=rf"{name}.*outside the checkpoint"):
        jax_ucp.convert(
            str(src), str(tmp_path / "out"), importing=TorchOptions(parameter_order=order)
        )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "change, key",
    [
        (
            {"architectures": ["LlavaForConditionalGeneration"],
             "text_config": {"num_hidden_layers": 1_000_000}},
            r"text_config\.num_hidden_layers asks for 1000000 modules",
        ),
        (
            {"architectures": ["ConvNextModel"], "depths": [1_000_000, 1, 1, 1]},
            r"depths asks for 1000003 modules",
        ),
    ],
)  # fmt: skip
def test_a_config_asking_for_more_modules_than_the_checkpoint_holds_is_refused_first(
    tmp_path, change, key
):
    """A layer count nested in a sub-config or given as a list passes no more than a top-level
    one: each is bounded by the checkpoint's tensor count before transformers builds anything
    (10**6 layers on the meta device grew past 2 GB in minutes)."""
    src = _copy(trainer_src("trainer_fp32"), tmp_path / "src")
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump({**config, **change}, f)
    assert_convert_refused(src, tmp_path / "out", key)


def test_a_cache_snapshot_folder_linked_out_of_the_cache_is_not_followed(tmp_path, monkeypatch):
    """The LoRA base model's ``snapshots/<commit>`` is itself a symlink to a folder outside the
    Hugging Face cache: its config.json was read (the check looked only below the snapshot);
    now the cache folder is not left, and the refusal says where the link led."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # the refusal comes before it
    base_config = os.path.join(trainer_src("trainer_fp32"), "config.json")
    cache = _fake_hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", base_config)
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(base_config, elsewhere / "config.json")
    snapshot = tmp_path / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / ("c" * 40)
    shutil.rmtree(snapshot)
    os.symlink(elsewhere, snapshot)
    src = _with_base(trainer_src("trainer_lora"), tmp_path / "lora", "tiny-org/tiny-llama")
    assert_convert_refused(
        src,
        tmp_path / "refused",
        r"without the base model's config\.json .*the base model's "
        r"snapshot: file name 'models--tiny-org--tiny-llama/snapshots/c{40}' resolves to",
    )


def test_a_checkpoint_folder_renamed_to_another_step_says_so(tmp_path):
    """``checkpoint-3/`` renamed ``checkpoint-7/``: the Trainer's record keeps
    trainer_state.json's global_step 3 (what the Trainer's resume continues from, which every
    Trainer import reads through ``trainer_record``) and a warning names both; before: nothing
    said. The folder under its own name warns nothing."""
    from jax_ucp._src.importers import trainer_files

    src = os.path.join(TRAINER, "trainer_fp32", "checkpoint-3")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert trainer_files.trainer_record(LocalDirectory(src))["global_step"] == 3
    assert not [w for w in seen if "folder's name" in str(w.message)]
    renamed = tmp_path / "checkpoint-7"
    shutil.copytree(src, renamed)
    with pytest.warns(
        UserWarning,
        match=r"checkpoint-7: the folder's name says step 7, trainer_state.json's global_step "
        r"says 3 \(renamed or copied\?\); the Trainer.s resume counts from global_step 3",
    ):
        assert trainer_files.trainer_record(LocalDirectory(str(renamed)))["global_step"] == 3


def _prefix_truth() -> dict[str, np.ndarray]:
    return load_truth(os.path.join(TRAINER, "trainer_prefix.truth.npz"))


@pytest.mark.torch  # no torch needed: the import, restore and optax's first step take ~10 s
def test_trainer_prefix_tuning_checkpoint_continues_with_no_order_given(tmp_path):
    """A Trainer + peft prefix-tuning checkpoint (peft 0.21.2 itself): its one trained tensor,
    the prompt encoder's embedding (saved as prompt_embeddings), imports with its moments and
    step bit for bit, no parameter_order nor base config (the adapter config gives its shape),
    and optax_from_torch takes the run's step 4 on the gradient the Trainer fed (within 1e-6)."""
    import optax

    src = trainer_src("trainer_prefix")
    live = "prompt_encoder.default.embedding.weight"
    truth = _prefix_truth()
    want = {
        k.replace(live, "prompt_embeddings"): v
        for k, v in truth.items()
        if not k.startswith("next_")
    }
    assert_matches_run(jax_ucp.restore(jax_ucp.convert(src, tmp_path / "ucp")), want)
    run = jax_ucp.optax_from_torch(src)
    assert "weight decay 0.1 on 1 of 1 leaves, decoupled (AdamW)" in run.notes
    grads = {"prompt_embeddings": truth[f"next_grad/{live}"]}
    updates, _ = run.tx.update(grads, run.opt_state, run.params)
    got = optax.apply_updates(run.params, updates)["prompt_embeddings"]
    np.testing.assert_allclose(np.asarray(got), truth[f"next_param/{live}"], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        ({"prefix_projection": True}, r"prefix_projection true: its prompt encoder trains"),
        ({"peft_type": "P_TUNING"}, r"peft_type P_TUNING: its prompt encoder trains"),
        ({"num_layers": 3}, r"exp_avg \[3, 64\] vs \[3, 96\]"),
        ({"token_dim": "16"}, r"token_dim='16', expected a positive int"),
    ],
)
def test_a_prompt_adapter_whose_saved_tensor_is_not_what_trains_is_refused(tmp_path, edit, said):
    """A prompt encoder whose parameters are not the saved prompt_embeddings (p-tuning's and
    prefix_projection's MLP), and an adapter config whose shape the file contradicts, are
    refused naming the field."""
    src = _copy(trainer_src("trainer_prefix"), tmp_path / "src")
    path = os.path.join(src, "adapter_config.json")
    with open(path) as f:
        adapter = json.load(f)
    with open(path, "w") as f:
        json.dump({**adapter, **edit}, f)
    assert_convert_refused(src, tmp_path / "refused", said)


@pytest.mark.torch
def test_an_adapter_checkpoint_imports_with_its_base_model_frozen(tmp_path):
    """base_model= the base model's save_pretrained folder (trainer_prefix's run saved it): its
    weights import bit for bit under their own names beside the adapter, without optimizer
    state (source.optimizer.no_state), and optax_from_torch holds them (zero updates on any
    gradient) while the prompt takes the run's step 4 (within 1e-6)."""
    import optax

    src, base = trainer_src("trainer_prefix"), os.path.join(TRAINER, "trainer_prefix", "base")
    options = TorchOptions(base_model=base)
    out = jax_ucp.convert(src, tmp_path / "ucp", importing=options)
    weights = load_file(os.path.join(base, "model.safetensors"))
    got = jax_ucp.restore(out)
    assert sorted(got["params"]) == sorted([*weights, "prompt_embeddings"])
    for name, value in weights.items():
        assert_bit_exact(got["params"][name], value, name)
    source = jax_ucp.inspect(out).source
    assert sorted(source["optimizer"]["no_state"]) == sorted(weights)
    assert source["base_model"] == os.path.abspath(base)
    run = jax_ucp.optax_from_torch(src, options=jax_ucp.RestoreOptions(importing=options))
    truth, live = _prefix_truth(), "prompt_encoder.default.embedding.weight"
    grads = {n: np.ones(np.shape(v), np.float32) for n, v in run.params.items()}
    grads["prompt_embeddings"] = truth[f"next_grad/{live}"]
    updates, _ = run.tx.update(grads, run.opt_state, run.params)
    stepped = optax.apply_updates(run.params, updates)
    for name, value in weights.items():
        assert_bit_exact(stepped[name], value, name)
    np.testing.assert_allclose(
        np.asarray(stepped["prompt_embeddings"]), truth[f"next_param/{live}"], rtol=0, atol=1e-6
    )


@pytest.mark.torch
def test_a_lora_checkpoint_takes_its_order_from_the_base_model_given(tmp_path):
    """base_model= beside a LoRA checkpoint: the base's config.json rebuilds the adapter's
    order (no model_config=), the base's weights frozen beside and left out of the adapter
    export; refused for a full model."""
    base = os.path.join(TRAINER, "trainer_prefix", "base")  # the same tiny Llama config
    options = TorchOptions(base_model=base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the rebuilt order's notice
        lora = jax_ucp.convert(trainer_src("trainer_lora"), tmp_path / "lora", importing=options)
    weights = load_file(os.path.join(base, "model.safetensors"))
    source = jax_ucp.inspect(lora).source
    assert source["parameter_order"].startswith(os.path.join(base, "config.json"))
    assert sorted(source["optimizer"]["no_state"]) == sorted(weights)
    # the adapter export leaves the base out: the folder the Trainer wrote, bit for bit
    from jax_ucp._src.exporters import SafetensorsExport

    out = jax_ucp.export(lora, tmp_path / "adapter", SafetensorsExport(adapter=True))
    written = load_file(os.path.join(out.path, "adapter_model.safetensors"))
    want = load_file(os.path.join(trainer_src("trainer_lora"), "adapter_model.safetensors"))
    assert sorted(written) == sorted(want)
    for name, value in want.items():
        assert_bit_exact(written[name], value, name)
    assert_convert_refused(
        trainer_src("trainer_fp32"),
        tmp_path / "no",
        r"base_model= is for a peft adapter",
        importing=options,
    )


def _other_base(tmp_path, edit_config=None, edit_weights=None) -> str:
    """trainer_prefix's base model folder, its config.json or weights edited."""
    from safetensors.numpy import save_file

    base = _copy(os.path.join(TRAINER, "trainer_prefix", "base"), tmp_path / "base")
    if edit_config:
        with open(os.path.join(base, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(base, "config.json"), "w") as f:
            json.dump({**config, **edit_config}, f)
    if edit_weights:
        path = os.path.join(base, "model.safetensors")
        save_file(edit_weights(load_file(path)), path, metadata={"format": "pt"})
    return base


@pytest.mark.parametrize(
    "kind, config, weights, said",
    [
        (
            "prefix",
            {"hidden_size": 64},
            None,
            r"token_dim=16, but .*config\.json has hidden size 64",
        ),
        (
            "prefix",
            {"num_hidden_layers": 3},
            None,
            r"num_layers=2, but .*config\.json has 3 layers",
        ),
        ("prefix", {"num_key_value_heads": 4}, None, r"token_dim=16, but .*hidden size 32"),
        (
            "lora",
            None,
            lambda w: {
                k: (v.T.copy() if k.endswith("layers.0.self_attn.v_proj.weight") else v)
                for k, v in w.items()
            },
            r"'base_model\.model\.model\.layers\.0\.self_attn\.v_proj\.lora_A\.weight' \[4, 32\] "
            r"\(adapter_model\.safetensors\) does not fit the base's "
            r"'model\.layers\.0\.self_attn\.v_proj\.weight' \[32, 16\]",
        ),
        (
            "lora",
            None,
            lambda w: {k: v for k, v in w.items() if ".layers.1." not in k},
            r"adapts 'model\.layers\.1\.self_attn\.q_proj\.weight', which the base model does not hold",
        ),
    ],
)
def test_a_base_model_that_is_not_the_adapters_is_refused(tmp_path, kind, config, weights, said):
    """base_model= a folder whose config.json or weights disagree with the adapter (another
    hidden size, layer count, key-value heads; a LoRA weight of another shape, or missing) is
    refused naming the field or tensor and both values. Before, each imported: an adapter beside
    weights it can never run with."""
    base = _other_base(tmp_path, config, weights)
    src = trainer_src(f"trainer_{kind}")
    assert_convert_refused(src, tmp_path / "no", said, importing=TorchOptions(base_model=base))


@pytest.mark.torch
def test_a_base_model_missing_its_configs_tensors_is_refused(tmp_path):
    """A base folder whose weights lack a layer its config.json's model has (the prefix adapter
    never names the base's tensors): refused naming the first one missing; the intact base, given
    through a symlink, imports."""
    base = _other_base(
        tmp_path, None, lambda w: {k: v for k, v in w.items() if ".layers.1." not in k}
    )
    src = trainer_src("trainer_prefix")
    assert_convert_refused(
        src,
        tmp_path / "no",
        r"no tensor of 'model\.layers\.1\.[\w.]+' .*though its config\.json's model",
        importing=TorchOptions(base_model=base),
    )
    link = tmp_path / "link"
    link.symlink_to(os.path.join(TRAINER, "trainer_prefix", "base"))
    out = jax_ucp.convert(src, tmp_path / "ok", importing=TorchOptions(base_model=link))
    weights = load_file(os.path.join(TRAINER, "trainer_prefix", "base", "model.safetensors"))
    assert sorted(jax_ucp.restore(out)["params"]) == sorted([*weights, "prompt_embeddings"])
