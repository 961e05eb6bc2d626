"""torch DCP by spec: a transformers model's weights imported, restored as the flax tree,
saved from JAX and exported with ``TorchDcpExport(spec=..., select="params")`` load with
``torch.distributed.checkpoint.load`` straight into a fresh model's ``state_dict()``, equal to
the original's bit for bit. Dense families: transformers 5 holds an MoE model's experts fused in
memory (``mlp.experts.down_proj``), under other names than the per-expert ones its files and
the shipped specs use."""

from __future__ import annotations

import pytest

import jax_ucp
from jax_ucp._src.exporters import TorchDcpExport
from jax_ucp.language import load_spec
from tests.models.test_hf_families import _save_tiny

pytestmark = pytest.mark.torch


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_dcp_export_by_spec_loads_into_the_torch_models_state_dict(family, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    src = _save_tiny(family, tmp_path / "src")
    spec = f"hf_{family}" if family != "mistral" else "hf_llama"
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
