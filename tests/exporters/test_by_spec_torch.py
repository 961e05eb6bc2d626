"""Every family the project imports goes back to transformers: a tiny random model written by
transformers' ``save_pretrained`` (tests/models/test_hf_families.py's), converted, restored as
the flax tree with the family's spec, saved from JAX, exported with the same spec name and the
config.json written from the model's ``LMConfig``, then loaded by ``from_pretrained``: the same
state_dict, bit for bit, and the same logits (fp32)."""

from __future__ import annotations

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.exporters import SafetensorsExport
from jax_ucp._src.models.transformer import hf_model
from tests.exporters.test_by_spec import NO_INVERSE
from tests.models.test_hf_families import _GEMMA4_CASES, FAMILIES, MULTIMODAL, _save_tiny

pytestmark = pytest.mark.torch


@pytest.mark.parametrize(
    "family", [*sorted(set(FAMILIES) - NO_INVERSE - set(MULTIMODAL)), "gemma4_text/moe"]
)
@pytest.mark.timeout(300)
def test_the_family_goes_back_to_transformers_with_its_own_names(family, tmp_path):
    import json

    import torch
    from transformers import AutoModelForCausalLM

    family, _, case = family.partition("/")  # a variant: gemma4_text/moe
    src = _save_tiny(family, tmp_path / "src", **(_GEMMA4_CASES[case] if case else {}))
    with open(f"{src}/config.json") as f:
        cfg, spec = hf_model(json.load(f))
    imported = jax_ucp.convert(src, tmp_path / "ucp")
    tree = jax_ucp.restore(imported, spec=spec)  # the heads from the config the import recorded
    ckpt = jax_ucp.save(str(tmp_path / "jax"), {"params": tree["params"]})
    jax_ucp.export(ckpt, tmp_path / "hf", SafetensorsExport(spec=spec, config=cfg))

    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(exported) is type(original)
    want, got = original.state_dict(), exported.state_dict()
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    tokens = torch.arange(16).reshape(2, 8) % cfg.vocab_size
    with torch.no_grad():
        a, b = original(tokens).logits.numpy(), exported(tokens).logits.numpy()
    assert np.abs(a - b).max() <= 1e-5
