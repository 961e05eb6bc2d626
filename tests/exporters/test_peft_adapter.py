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
    full = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj"]}
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
