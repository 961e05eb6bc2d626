"""torch DCP by spec: a transformers model's weights imported, restored as the flax tree,
saved from JAX and exported with ``TorchDcpExport(spec=..., select="params")`` load with
``torch.distributed.checkpoint.load`` straight into a fresh model's ``state_dict()``, equal to
the original's bit for bit. MoE families included: transformers 5 holds their experts fused in
memory (``mlp.experts.gate_up_proj``), not one by one as its files do; the export writes the
model's names (the specs' ``hf_names = "state_dict"`` rules)."""

from __future__ import annotations

import pytest

import jax_ucp
from jax_ucp._src.exporters import TorchDcpExport
from jax_ucp._src.models.transformer import hf_model
from jax_ucp.language import load_spec
from tests.models.test_hf_families import _config, _save_tiny

pytestmark = pytest.mark.torch

#: the MoE families whose spec runs backwards (Kimi K2.5's does not: tests/exporters/test_by_spec)
MOE = [
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v3",
    "ernie4_5_moe",
    "glm4_moe",
    "minimax_m2",
    "gpt_oss",
    "llama4_text",
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["mistral", "phi3", *MOE])
def test_dcp_export_by_spec_loads_into_the_torch_models_state_dict(family, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    src = _save_tiny(family, tmp_path / "src")
    spec = hf_model(_config(family))[1]
    imported = jax_ucp.convert(src, tmp_path / "ucp")
    tree = jax_ucp.restore(imported, spec=spec)
    ckpt = jax_ucp.save(str(tmp_path / "jax"), {"params": tree["params"]})
    heads = load_spec(spec, **_heads(src))
    jax_ucp.export(ckpt, tmp_path / "dcp", TorchDcpExport(spec=heads, select="params"))

    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
    state = fresh.state_dict()
    assert not any(torch.equal(state[k], v) for k, v in original.state_dict().items() if v.ndim > 1)
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    fresh.load_state_dict(state)
    for name, value in original.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def _heads(src) -> dict:
    import json

    from jax_ucp._src.language.settings import hf_head_settings

    with open(f"{src}/config.json") as f:
        return hf_head_settings(json.load(f))
