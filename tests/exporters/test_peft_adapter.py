"""export(SafetensorsExport(adapter=True)) of a checkpoint imported from a LoRA / DoRA adapter:
the adapter folder peft loads, its tensors and adapter_config.json those the source wrote.
Fixtures: tests/fixtures/torchtune/tt_lora (torchtune 0.6.1, tools/fixtures/
make_torchtune_lora_fixture.py) and tests/fixtures/hf_trainer/trainer_dora (Trainer + peft 0.21.2,
tools/fixtures/make_hf_trainer_checkpoints.py)."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
from safetensors.numpy import load_file
from typer.testing import CliRunner

import jax_ucp
from jax_ucp._src.exporters import SafetensorsExport
from jax_ucp.cli import app
from jax_ucp.conversion import TorchOptions
from jax_ucp.errors import RequestError
from tests.ucp_testing import REPO, assert_bit_exact

TT_LORA = os.path.join(REPO, "tests", "fixtures", "torchtune", "tt_lora")
TRAINER = os.path.join(REPO, "tests", "fixtures", "hf_trainer")
#: each fixture: (the adapter folder peft wrote, the base model's config.json, its seed)
SOURCES = {
    "tt_lora": (os.path.join(TT_LORA, "epoch_0"), os.path.join(TT_LORA, "epoch_0", "config.json")),
    "trainer_dora": (
        os.path.join(TRAINER, "trainer_dora", "checkpoint-3"),
        os.path.join(TRAINER, "trainer_fp32", "checkpoint-3", "config.json"),  # the same Llama
    ),
}


def _import(kind: str, dst) -> str:
    if kind == "tt_lora":
        return jax_ucp.convert(TT_LORA, dst)
    folder, config = SOURCES[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the rebuilt order's notice, tested with the importer
        return jax_ucp.convert(folder, dst, importing=TorchOptions(model_config=config))


def _assert_as_source(folder: str, written: str) -> None:
    """The exported adapter's tensors bit for bit, and its adapter_config.json, the source's."""
    want, got = (
        load_file(os.path.join(folder, "adapter_model.safetensors")),
        load_file(os.path.join(written, "adapter_model.safetensors")),
    )
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert_bit_exact(got[name], value, name)
    with (
        open(os.path.join(folder, "adapter_config.json")) as f,
        open(os.path.join(written, "adapter_config.json")) as g,
    ):
        assert json.load(g) == json.load(f)


def test_a_torchtune_lora_import_exports_back_as_its_peft_adapter(tmp_path):
    """torchtune's LoRA run: the adapter folder (API and ``--adapter``) equals the peft copy
    torchtune wrote beside it; a config without what peft needs, or not saying DoRA when the tensors are, is refused."""
    ckpt = _import("tt_lora", tmp_path / "ucp")
    out = jax_ucp.export(ckpt, tmp_path / "adapter", SafetensorsExport(adapter=True))
    assert out.files == ["adapter_model.safetensors", "adapter_config.json"]
    _assert_as_source(SOURCES["tt_lora"][0], out.path)
    cli = CliRunner().invoke(app, ["export", ckpt, str(tmp_path / "by_cli"), "--adapter"])
    assert cli.exit_code == 0, cli.output
    _assert_as_source(SOURCES["tt_lora"][0], str(tmp_path / "by_cli"))
    with pytest.raises(RequestError, match=r"config= has no r, lora_alpha, target_modules"):
        jax_ucp.export(
            ckpt, tmp_path / "no", SafetensorsExport(adapter=True, config={"peft_type": "LORA"})
        )
    full = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "k_proj", "v_proj"],
    }
    with pytest.raises(RequestError, match=r"use_dora: .* expected a DoRA magnitude"):
        jax_ucp.export(
            ckpt,
            tmp_path / "no",
            SafetensorsExport(adapter=True, config={**full, "use_dora": True}),
        )
    assert not os.path.exists(tmp_path / "no")


def test_a_checkpoint_not_imported_from_an_adapter_is_refused(tmp_path):
    """No source.lora (a model saved from JAX): refused naming the fields peft needs."""
    ckpt = jax_ucp.save(tmp_path / "ucp", {"params": {"w": np.ones(2)}})
    with pytest.raises(RequestError, match=r"source\.lora has no peft_type, r, lora_alpha"):
        jax_ucp.export(ckpt, tmp_path / "no", SafetensorsExport(adapter=True))


@pytest.mark.torch
@pytest.mark.parametrize("kind", ["trainer_dora", "tt_lora"])
def test_peft_loads_the_exported_adapter_as_the_source(tmp_path, kind):
    """peft.PeftModel.from_pretrained over the base model the fixture's run built (seed 0, its
    config): every tensor of the model the exported folder gives is the one the source folder
    gives, bit for bit, and so are the logits."""
    folder, config = SOURCES[kind]
    ckpt = _import(kind, tmp_path / "ucp")
    out = jax_ucp.export(ckpt, tmp_path / "adapter", SafetensorsExport(adapter=True))
    _assert_as_source(folder, out.path)  # without peft too (CI's torch stage)
    peft = pytest.importorskip("peft")
    import torch
    import transformers

    def adapted(path: str):
        torch.manual_seed(0)  # the base model as the fixture's generator built it
        base = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(config))
        return peft.PeftModel.from_pretrained(base, path).eval()

    want, got = adapted(folder), adapted(out.path)
    want_sd, got_sd = want.state_dict(), got.state_dict()
    assert sorted(got_sd) == sorted(want_sd)
    assert any("lora_B" in n for n in got_sd)
    for name, value in want_sd.items():
        assert torch.equal(got_sd[name], value), name
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)


#: a LoRA adapter as peft saves it (q_proj, v_proj of one layer, r=4, lm_head in
#: modules_to_save), and the adapter_config.json it loads with
_MODULES = {"q_proj": 8, "v_proj": 6}
_CONFIG = {
    "peft_type": "LORA",
    "r": 4,
    "lora_alpha": 8,
    "target_modules": ["q_proj", "v_proj"],
    "modules_to_save": ["lm_head"],
    "use_dora": False,
    "rank_pattern": {},
    "lora_bias": False,
    "peft_version": "0.21.2",
}


def _adapter_synthetic(rank: int = 4, dora: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {"base_model.model.lm_head.weight": rng.standard_normal((10, 8), np.float32)}
    for module, rows in _MODULES.items():
        at = f"base_model.model.model.layers.0.self_attn.{module}"
        out[f"{at}.lora_A.weight"] = rng.standard_normal((rank, 8), np.float32)
        out[f"{at}.lora_B.weight"] = rng.standard_normal((rows, rank), np.float32)
        if dora:
            out[f"{at}.lora_magnitude_vector"] = rng.standard_normal(rows).astype(np.float32)
    return out


@pytest.fixture(scope="module")
def saved_adapter(tmp_path_factory):
    """The synthetic adapter saved from JAX (no source.lora: each test gives config=)."""
    return jax_ucp.save(tmp_path_factory.mktemp("a") / "ucp", {"params": _adapter_synthetic()})


def test_a_config_that_matches_the_tensors_is_written_as_given(saved_adapter, tmp_path):
    """The tensors under peft's names, the config as given: a list, a regex peft fullmatches,
    a rank_pattern naming a module of that rank (first match, as peft)."""
    for i, extra in enumerate(
        [{}, {"target_modules": r"model\.layers\.\d+\.self_attn\.(q|v)_proj"},
         {"rank_pattern": {"v_proj": 4}, "target_modules": ".*(q|v)_proj"}]
    ):  # fmt: skip
        config = {**_CONFIG, **extra}
        out = jax_ucp.export(
            saved_adapter, tmp_path / str(i), SafetensorsExport(adapter=True, config=config)
        )
        got = load_file(os.path.join(out.path, "adapter_model.safetensors"))
        for name, value in _adapter_synthetic().items():
            assert_bit_exact(got[name], value, name)
        with open(os.path.join(out.path, "adapter_config.json")) as f:
            assert json.load(f) == config


Q = "base_model.model.model.layers.0.self_attn.q_proj"
#: a config edit, and the refusal naming the field, the tensor, expected and found
_REFUSED = {
    "peft_type LOHA": ({"peft_type": "LOHA"}, r"peft_type: expected one of \['LORA'\].*'LOHA'"),
    "r a string": ({"r": "4"}, r"r: expected a positive integer, found '4'"),
    "r zero": ({"r": 0}, r"r: expected a positive integer, found 0"),
    "r another rank": (
        {"r": 8},
        rf"r: tensor '{Q}.lora_A.weight': expected lora_A of 8 rows \(r=8\), found \[4, 8\]",
    ),
    "lora_alpha a string": ({"lora_alpha": "8"}, r"lora_alpha: expected a finite number"),
    "lora_alpha NaN": ({"lora_alpha": float("nan")}, r"lora_alpha: expected a finite number"),
    "target_modules short": (
        {"target_modules": ["q_proj"]},
        r"target_modules: tensor '.*v_proj.lora_A.weight': expected a name selecting module "
        r"'model.layers.0.self_attn.v_proj', found \['q_proj'\]",
    ),
    "target_modules extra": (
        {"target_modules": ["q_proj", "v_proj", "o_proj"]},
        r"target_modules: expected each name a module of the tensors \('o_proj' is none\)",
    ),
    "target_modules not a list": ({"target_modules": 5}, r"target_modules: expected a list"),
    "target_modules regex missing one": (
        {"target_modules": ".*q_proj"},
        r"target_modules: tensor '.*v_proj.lora_A.weight': expected a name selecting",
    ),
    "target_modules nested repetition": (
        {"target_modules": "(a+)+$"},
        r"target_modules pattern '\(a\+\)\+\$' is not evaluated here \('\+' on a group",
    ),
    "target_modules lookahead": (
        {"target_modules": "(?!vision).*proj"},
        r"target_modules pattern .* is not evaluated here \('\(\?' at 0",
    ),
    "target_modules backreference": ({"target_modules": r"(q)\1"}, r"the escape '\\\\1'"),
    "target_modules a bad range": (
        {"target_modules": "[z-a]"},
        r"'\[z-a\]' is not evaluated here \(bad",
    ),
    "target_modules too costly": (
        {"target_modules": ".*" * 12 + "x"},
        r"target_modules patterns .* may try .* paths over 2 module names",
    ),
    "rank_pattern another rank": (
        {"rank_pattern": {"q_proj": 2}},
        rf"rank_pattern: tensor '{Q}.lora_A.weight': expected lora_A of 2 rows \(rank_pattern=2\)",
    ),
    "rank_pattern a string rank": ({"rank_pattern": {"q_proj": "2"}}, r"rank_pattern: expected"),
    "use_dora without magnitudes": (
        {"use_dora": True},
        rf"use_dora: tensor '{Q}.lora_A.weight': expected a DoRA magnitude of .* iff use_dora, "
        r"found True",
    ),
    "use_dora a string": ({"use_dora": "yes"}, r"use_dora: expected true or false, found 'yes'"),
    "use_rslora a number": ({"use_rslora": 1}, r"use_rslora: expected true or false, found 1"),
    "modules_to_save none": (
        {"modules_to_save": None},
        r"modules_to_save: expected a module of 'base_model.model.lm_head.weight'",
    ),
    "modules_to_save a string": ({"modules_to_save": "lm_head"}, r"modules_to_save: expected null"),
    "modules_to_save unused": (
        {"modules_to_save": ["lm_head", "score"]},
        r"modules_to_save: expected each name a module of the tensors \('score' is none\)",
    ),
    "modules_to_save a target": (
        {"modules_to_save": ["lm_head", "q_proj"]},
        r"modules_to_save: tensor '.*q_proj.lora_A.weight': expected no name of module",
    ),
    "exclude_modules a target": (
        {"exclude_modules": ["v_proj"]},
        r"exclude_modules: tensor '.*v_proj.lora_A.weight': expected no name selecting",
    ),
    "lora_bias": ({"lora_bias": True}, r"lora_bias: expected unset .* found True"),
    "layers_to_transform": ({"layers_to_transform": [0]}, r"layers_to_transform: expected unset"),
    "a field unknown": ({"frob_config": {"a": 1}}, r"frob_config: expected unset"),
    "bias all": ({"bias": "all"}, r"bias: expected 'none'"),
}


@pytest.mark.parametrize("case", sorted(_REFUSED))
def test_a_config_the_tensors_contradict_is_refused_by_name(saved_adapter, tmp_path, case):
    """What peft would load otherwise than trained (a rank, a module left untargeted and its
    tensors dropped, a magnitude absent) or what this export cannot write: refused naming
    the field, the tensor and expected vs found, nothing left at the target."""
    edit, message = _REFUSED[case]
    with pytest.raises(RequestError, match=message):
        jax_ucp.export(
            saved_adapter,
            tmp_path / "out",
            SafetensorsExport(adapter=True, config={**_CONFIG, **edit}),
        )
    assert os.listdir(tmp_path) == []


def _tensors(arrays: dict[str, np.ndarray]) -> list:
    from jax_ucp._src.exporters.source import Tensor

    return [Tensor(n, tuple(a.shape), a.dtype) for n, a in arrays.items()]


def test_tensors_of_an_adapter_peft_would_not_load_are_refused():
    """A lora_B missing, a DoRA magnitude of another length than lora_B's rows or missing on
    one module, a lora_A of one row short: refused naming the tensor."""
    from jax_ucp._src.exporters.peft_adapter import adapter_config

    dora = {**_CONFIG, "use_dora": True}
    cases = [
        ({k: v for k, v in _adapter_synthetic().items() if k != f"{Q}.lora_B.weight"}, _CONFIG,
         r"target_modules: tensor '.*q_proj.lora_A.weight': expected .*lora_A and lora_B, found \['A'\]"),
        ({**_adapter_synthetic(dora=True), f"{Q}.lora_magnitude_vector": np.ones(3, np.float32)},
         dora, rf"use_dora: tensor '{Q}.lora_magnitude_vector': expected a magnitude of shape \[8\], found \[3\]"),
        ({k: v for k, v in _adapter_synthetic(dora=True).items() if k != f"{Q}.lora_magnitude_vector"},
         dora, r"use_dora: tensor '.*q_proj.lora_A.weight': expected a DoRA magnitude"),
        ({**_adapter_synthetic(), f"{Q}.lora_A.weight": np.ones((3, 8), np.float32)}, _CONFIG,
         r"r: tensor '.*q_proj.lora_A.weight': expected lora_A of 4 rows \(r=4\), found \[3, 8\]"),
        ({**_adapter_synthetic(), f"{Q}.lora_B.weight": np.ones((8, 3), np.float32)}, _CONFIG,
         r"r: tensor '.*q_proj.lora_B.weight': expected lora_B of 4 columns \(r=4\), found \[8, 3\]"),
    ]  # fmt: skip
    for arrays, config, message in cases:
        with pytest.raises(RequestError, match=message):
            adapter_config(_tensors(arrays), config, None)
    assert adapter_config(_tensors(_adapter_synthetic(dora=True)), dora, None) == dora


def test_peft_patterns_outside_the_bounded_subset_are_refused():
    """The regex subset: what peft configs use is counted, nested repetition, lookarounds,
    backreferences and unbalanced groups are refused before any match runs."""
    from jax_ucp._src.exporters.peft_match import paths

    assert paths(r"model\.layers\.\d+\.self_attn\.(q|k|v)_proj", 40) == 41 * 3
    assert paths(r"(?:.*\.)?(q_proj|[a-z_]+)", 40) == (1 + 41) * (1 + 41)
    for bad in ("(a+)+", "(a|b)*", "(?=x)", r"\1", "a)", "(a", "[a", "*a", "x" * 300, "[[a]]"):
        with pytest.raises(ValueError):
            paths(bad, 40)


PREFIX = os.path.join(TRAINER, "trainer_prefix")


@pytest.mark.torch
def test_a_prefix_tuning_adapter_exports_as_peft_loads_it(tmp_path):
    """The Trainer + peft prefix-tuning checkpoint's import exports as the adapter peft wrote
    (prompt_embeddings bit for bit, adapter_config.json as recorded); with peft, PeftModel.
    from_pretrained over the run's base (saved beside by its save_pretrained) gives the same
    prompt encoder and logits as the source folder; a config whose shape the tensor
    contradicts is refused."""
    folder = os.path.join(PREFIX, "checkpoint-3")
    ckpt = jax_ucp.convert(folder, tmp_path / "ucp")
    out = jax_ucp.export(ckpt, tmp_path / "adapter", SafetensorsExport(adapter=True))
    _assert_as_source(folder, out.path)
    with open(os.path.join(folder, "adapter_config.json")) as f:
        config = {**json.load(f), "num_layers": 3}
    with pytest.raises(RequestError, match=r"one tensor prompt_embeddings \[3, 96\]"):
        jax_ucp.export(ckpt, tmp_path / "no", SafetensorsExport(adapter=True, config=config))
    peft = pytest.importorskip("peft")
    import torch
    import transformers

    def adapted(path: str):
        base = transformers.LlamaForCausalLM.from_pretrained(os.path.join(PREFIX, "base"))
        return peft.PeftModel.from_pretrained(base, path).eval()

    want, got = adapted(folder), adapted(out.path)
    want_sd, got_sd = want.state_dict(), got.state_dict()
    assert sorted(got_sd) == sorted(want_sd)
    for name, value in want_sd.items():
        assert torch.equal(got_sd[name], value), name
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(got(input_ids=ids).logits, want(input_ids=ids).logits)
