"""LoRA / peft adapter files (``adapter_model.safetensors``, ``adapter_config.json``) beside a
full model's weights in a Trainer ``checkpoint-N/`` are listed in ``source.skipped`` with why,
not silently ignored, and do not make the folder an adapter checkpoint (the optimizer's order
is the full model's) (issue 60). The folder: tests/fixtures/hf_trainer/trainer_fp32's checkpoint
(written by the Trainer) with trainer_lora's adapter files (written by peft) copied beside, and
an index naming model.safetensors (two .safetensors files without one are refused)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

import jax_ucp
from jax_ucp._src.format import safetensors
from jax_ucp.conversion import ImportOptions
from tests.ucp_testing import REPO, load_truth

TRAINER = os.path.join(REPO, "tests", "fixtures", "hf_trainer")
WHY = "a LoRA / peft adapter beside the full model's weights (the full model imported)"


def _full_with_adapter(tmp_path) -> str:
    src = str(
        shutil.copytree(
            os.path.join(TRAINER, "trainer_fp32", "checkpoint-3"), tmp_path / "checkpoint-3"
        )
    )
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        shutil.copy(os.path.join(TRAINER, "trainer_lora", "checkpoint-3", name), src)
    names = safetensors.SafetensorsFile(os.path.join(src, "model.safetensors")).header
    with open(os.path.join(src, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict.fromkeys(names, "model.safetensors")}, f)
    return src


def _tensor_names(out) -> set[str]:
    manifest = jax_ucp.inspect(out)
    return {t for e in manifest.tensors for t in (e.provenance or {}).get("tensors", [])}


def test_weights_only_lists_the_adapter_beside_the_full_model(tmp_path):
    src = _full_with_adapter(tmp_path)
    out = jax_ucp.convert(src, tmp_path / "ucp", importing=ImportOptions(weights_only=True))
    skipped = jax_ucp.inspect(out).source["skipped"]
    assert skipped["adapter_model.safetensors"] == WHY
    assert skipped["adapter_config.json"] == WHY
    assert not any("lora" in n for n in _tensor_names(out))


@pytest.mark.torch
def test_the_full_models_optimizer_imports_with_the_adapter_listed(tmp_path):
    src = _full_with_adapter(tmp_path)
    out = jax_ucp.convert(src, tmp_path / "ucp")
    source = jax_ucp.inspect(out).source
    assert source["skipped"]["adapter_model.safetensors"] == WHY
    restored = jax_ucp.restore(out)
    want = load_truth(os.path.join(TRAINER, "trainer_fp32.truth.npz"))
    assert sorted(restored["params"]) == sorted(
        k.split("/", 1)[1] for k in want if k.startswith("param/")
    )
    assert sorted(restored["opt_state"]["mu"]) == sorted(restored["params"])
