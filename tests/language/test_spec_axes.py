"""Every shipped spec that builds a JAX tree names the logical axes of every tensor it makes, so
``restore(mesh=, rules=)`` with the docs' rules shards any imported model and its optimizer
moments: each spec walked (in each of its layouts) over the fixtures it applies to, written by
the frameworks (Megatron, Megatron-DeepSpeed, torchtitan, the Trainer with DeepSpeed) and, for
the Hugging Face families, over the names and shapes transformers itself saves
(fixtures/hf_families/names.json, tools/fixtures/make_hf_family_names.py; of a multimodal model
its text model, as the import names it). A tensor of two or
more dimensions without ``axes`` fails, naming it."""

from __future__ import annotations

import itertools
import json
import os
import re

import pytest

from jax_ucp._src.importers.safetensors_weights import text_model
from jax_ucp._src.language.plan import TensorInfo, compile_restore_plan
from jax_ucp._src.language.recorded import spec_with_recorded_settings
from jax_ucp._src.models.transformer import hf_model
from jax_ucp._src.restoring import sources
from jax_ucp._src.restoring.sources import import_open
from jax_ucp._src.store import storage_for
from jax_ucp.language import list_specs, load_spec
from tests.ucp_testing import FIXTURES

pytestmark = pytest.mark.timeout(120)

#: specs that go the other way (the flax tree -> torch names): no JAX tree, no axes
EXPORT_SPECS = {"flax_gpt2_to_hf", "flax_llama_to_hf"}

#: layout settings a spec's rules depend on (``when``): every combination is walked
LAYOUTS = {"qkv_layout": ("fused", "split"), "mlp_layout": ("fused", "split")}

#: the head settings of the fixtures' models (fixtures.json / run.json / config.json), which
#: the split layouts need and not every source records
GPT = dict(num_attention_heads=4, num_query_groups=4, head_dim=8)
LLAMA = dict(num_attention_heads=4, num_query_groups=2, head_dim=8)
MOE = dict(LLAMA, num_experts=4)
SMALL_GPT = dict(num_attention_heads=2, num_query_groups=2, head_dim=8)  # hidden 16
BRIDGE = dict(num_attention_heads=4, num_query_groups=2, head_dim=4)  # its run_config.yaml

#: spec -> the sources it applies to (under tests/fixtures), with their model's settings
SOURCES = {
    "megatron_gpt": [
        ("megatron/gpt_tp2", GPT),  # torch_dist, stacked [L, ...]
        ("megatron/gpt_distopt_dp2", GPT),  # distributed optimizer: fp32 masters, moments
        ("megatron/legacy_gpt_tp2pp2_synthetic", GPT),  # legacy per-layer names
        ("megatron_fsdp_dtensor/gpt_dp2", SMALL_GPT),
    ],
    "llama": [
        ("megatron/llama_distopt_bf16_tp2dp2", LLAMA),
        ("megatron/legacy_llama_tp2_synthetic", LLAMA),
        ("megatron_bridge/llama_tp1dp2", BRIDGE),
    ],
    "mixtral": [
        ("megatron/moe_ep2", MOE),  # stacked experts
        ("megatron/moe_grouped_ep2", MOE),  # grouped GEMM
        ("megatron/legacy_moe_ep2_synthetic", MOE),  # sequential, per expert
        ("megatron/legacy_moe_grouped_ep2_synthetic", MOE),
    ],
    "megatron_lm_gpt": [
        ("megatron/legacy_gpt_lm_names_tp2_synthetic", GPT),
        # Megatron-DeepSpeed (z1_bf16_dp2's TinyGPT: 2 heads)
        ("deepspeed/megatron_ds_tp2_dp2_z1_bf16_synthetic/ckpt", SMALL_GPT),
    ],
    "torchtitan_llama": [("torch/torchtitan_llama3", LLAMA)],
    "hf_llama": [("hf_trainer/llama_z2_dp2/checkpoint-2", {})],  # Trainer + DeepSpeed ZeRO-2
}


def _unnamed(available) -> list[str]:
    """The tensors of two or more dimensions that carry no logical axis names."""
    return sorted(av.name for av in available.values() if len(av.shape) > 1 and not av.logical_axes)


def _layouts(spec) -> list[dict]:
    keys = [k for k in LAYOUTS if k in spec.settings]
    return [dict(zip(keys, v)) for v in itertools.product(*(LAYOUTS[k] for k in keys))]


def test_every_shipped_spec_is_walked():
    assert set(SOURCES) | set(_HF_SPECS) == set(list_specs()) - EXPORT_SPECS


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_a_framework_spec_names_every_tensor_over_its_fixtures(name):
    """Each source imported once; every layout of the spec restores every tensor (weights,
    fp32 masters, moments) with names."""
    walked = 0
    for rel, settings in SOURCES[name]:
        found = sources.opening(storage_for(os.path.join(FIXTURES, rel)))
        assert found.importer is not None
        with import_open.opened_import(found.storage, found.importer) as imported:
            base = spec_with_recorded_settings(name, imported.source).with_settings(**settings)
            for layout in _layouts(base):
                available = imported.with_spec(base.with_settings(**layout)).available
                assert not _unnamed(available), (rel, layout, _unnamed(available))
                walked += sum(len(av.shape) > 1 for av in available.values())
    assert walked


with open(os.path.join(FIXTURES, "hf_families", "names.json")) as _f:
    HF_FAMILIES = json.load(_f)
_HF_SPECS = {hf_model(e["config"])[1] for e in HF_FAMILIES.values()}


@pytest.mark.parametrize("family", sorted(HF_FAMILIES))
def test_a_hugging_face_family_spec_names_every_tensor(family):
    """The family's spec over the names and shapes transformers saved, and their moments; a
    tied model also with an untied output layer (synthetic: the embedding's shape)."""
    entry = HF_FAMILIES[family]
    cfg, name = hf_model(entry["config"])
    named, _ = text_model(entry["config"], list(entry["tensors"]))  # a multimodal one's text
    tensors = {n: entry["tensors"][saved] for n, saved in named.items()}
    key = next(k for k in tensors if k.endswith(("embed_tokens.weight", "wte.weight")))
    head = re.sub(r"(model\.embed_tokens|transformer\.wte|wte)\.weight$", "lm_head.weight", key)
    tensors.setdefault(head, tensors[key])  # Kimi K2.5's: language_model.lm_head.weight
    saved = {}
    for key, shape in tensors.items():
        for root in (("params",), ("opt_state", "mu")):
            saved[(*root, key)] = TensorInfo(shape, "float32")
    plans = compile_restore_plan(load_spec(name, **cfg.head_settings), saved)
    unnamed = sorted(
        "/".join(k) for k, p in plans.items() if len(p.shape) > 1 and not p.logical_axes
    )
    assert not unnamed, unnamed
    assert any(k[0] == "opt_state" and p.logical_axes for k, p in plans.items())  # moments


def test_mixtral_dense_layers_beside_moe_ones_are_named_synthetic():
    """No MoE fixture has a dense layer: one is added (synthetic, layer 2: the SwiGLU MLP of
    the fixture's sizes) to the real legacy MoE checkpoint's tensors."""
    found = sources.opening(
        storage_for(os.path.join(FIXTURES, "megatron/legacy_moe_ep2_synthetic"))
    )
    assert found.importer is not None
    with import_open.opened_import(found.storage, found.importer) as imported:
        saved = {k: TensorInfo(*v) for k, v in imported.saved.items()}
    hidden, ffn = 32, 16  # fixtures.json
    dense = {"linear_fc1": (2 * ffn, hidden), "linear_fc2": (hidden, ffn)}
    for part, shape in dense.items():
        saved[("params", f"decoder.layers.2.mlp.{part}.weight")] = TensorInfo(shape, "float32")
    spec = load_spec("mixtral", **MOE)
    for layout in _layouts(spec):
        plans = compile_restore_plan(spec.with_settings(**layout), saved)
        made = [k for k in plans if k[:2] == ("params", "layers_2")]
        assert len(made) == 2 + (layout["mlp_layout"] == "split")
        assert all(plans[k].logical_axes for k in made), made
