"""``restore(src, spec="hf_llama")`` takes the model's head settings from what the source recorded
(the Trainer's or verl's config.json, Megatron's run arguments), as ``optax_from_torch`` does:
one rule (``language.recorded``) for both. Real fixtures, torch-free."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.language.recorded import recorded_settings, spec_with_recorded_settings
from jax_ucp.language import load_spec
from tests.ucp_testing import FIXTURES, assert_bit_exact, mesh

TRAINER = os.path.join(FIXTURES, "hf_trainer", "llama_z2_dp2", "checkpoint-2")  # DeepSpeed inside
VERL = os.path.join(FIXTURES, "verl", "fsdp2")
MEGATRON = os.path.join(FIXTURES, "megatron", "legacy_llama_tp2_synthetic")
DCP = os.path.join(FIXTURES, "torch", "hf_llama_fsdp2")  # no config.json in the folder


def _heads(config_path: str) -> dict:
    with open(config_path) as f:
        config = json.load(f)
    heads = config["num_attention_heads"]
    return {
        "num_attention_heads": heads,
        "num_query_groups": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
    }


def _same(got, want):
    flat_got, flat_want = jax.tree.leaves_with_path(got), jax.tree.leaves_with_path(want)
    assert [p for p, _ in flat_got] == [p for p, _ in flat_want]
    for (path, a), (_, b) in zip(flat_got, flat_want, strict=True):
        assert_bit_exact(np.asarray(a), np.asarray(b), jax.tree_util.keystr(path))


@pytest.mark.parametrize(
    "src, config",
    [
        (TRAINER, os.path.join(TRAINER, "config.json")),
        (VERL, os.path.join(VERL, "global_step_3", "actor", "huggingface", "config.json")),
    ],
    ids=["trainer_deepspeed", "verl_fsdp2"],
)
def test_restore_by_name_takes_the_recorded_config(src, config):
    """TORCH.md's example: the spec by name on the source folder gives what the spec with the
    config's heads given by hand gives, on a mesh."""
    m = mesh((1, 8), ("data", "model"))
    by_name = jax_ucp.restore(src, spec="hf_llama", mesh=m)
    by_hand = jax_ucp.restore(src, spec=load_spec("hf_llama", **_heads(config)))
    _same(by_name, by_hand)
    qkv = by_name["params"]["layers_0"]["attn"]["qkv"]["kernel"]
    heads = _heads(config)
    assert (
        qkv.shape[1]
        == (heads["num_attention_heads"] + 2 * heads["num_query_groups"]) * (heads["head_dim"])
    )


def test_a_deepspeed_folder_gives_the_config_beside_latest(tmp_path):
    """DeepSpeed's own save_checkpoint folder (``latest``, ``global_stepN/``) with the model's
    config.json the run saved beside ``latest``, no Trainer files: the spec by name takes its
    heads, from the folder and from its tag folder."""
    src = tmp_path / "run"
    shutil.copytree(TRAINER, src)
    for trainer_file in ("trainer_state.json", "model.safetensors"):
        (src / trainer_file).unlink()
    assert "trainer" not in jax_ucp.inspect(str(src)).source
    by_hand = jax_ucp.restore(
        str(src), spec=load_spec("hf_llama", **_heads(str(src / "config.json")))
    )
    for where in (src, src / (src / "latest").read_text().strip()):
        _same(jax_ucp.restore(str(where), spec="hf_llama"), by_hand)
    (src / "config.json").unlink()
    with pytest.raises(jax_ucp.UCPError, match="num_attention_heads"):
        jax_ucp.restore(str(src), spec="hf_llama")


def test_converted_checkpoint_keeps_the_recorded_config(tmp_path):
    """A converted Trainer folder records its config.json in the manifest: the restore of the
    UCP checkpoint by spec name reads the same heads."""
    ucp = jax_ucp.convert(TRAINER, tmp_path / "ucp")
    by_name = jax_ucp.restore(ucp, spec="hf_llama")
    heads = _heads(os.path.join(TRAINER, "config.json"))
    _same(by_name, jax_ucp.restore(TRAINER, spec=load_spec("hf_llama", **heads)))


def test_settings_the_spec_has_are_kept():
    """The caller's settings win: a Spec object is used as given, and a spec's own settings are
    not overridden by the record."""
    source = jax_ucp.inspect(TRAINER).source
    own = load_spec("hf_llama", num_attention_heads=8)
    assert spec_with_recorded_settings(own, source) is own
    notes: list[str] = []
    loaded = spec_with_recorded_settings("hf_llama", source, notes)
    assert {k: loaded.settings[k] for k in ("num_attention_heads", "num_query_groups")} == {
        "num_attention_heads": 4,
        "num_query_groups": 2,
    }
    assert loaded.settings["head_dim"] == 8
    assert notes == [
        "spec 'hf_llama' with the recorded config.json's settings "
        "{'num_attention_heads': 4, 'num_query_groups': 2, 'head_dim': 8}"
    ]
    assert spec_with_recorded_settings(None, source) is None


def test_megatron_run_arguments():
    """A Megatron source records its run arguments (source.settings): their heads, canonical."""
    source = jax_ucp.inspect(MEGATRON).source
    settings, origin = recorded_settings(source)
    assert settings == {"num_attention_heads": 4, "num_query_groups": 2, "head_dim": 8}
    assert origin == "Megatron's recorded run arguments"
    mha = dict(source, settings={**source["settings"], "group_query_attention": False})
    assert recorded_settings(mha)[0]["num_query_groups"] == 4  # Megatron's unused default
    bad = dict(source, settings={**source["settings"], "num_attention_heads": 0})
    with pytest.raises(jax_ucp.LanguageError, match="num_attention_heads = 0; expected a posit"):
        recorded_settings(bad)


def test_a_bad_recorded_config_is_named():
    source = {"trainer": {"model_config": {"num_attention_heads": "four", "hidden_size": 32}}}
    with pytest.raises(jax_ucp.LanguageError, match=r"source\.trainer\.model_config"):
        spec_with_recorded_settings("hf_llama", source)


def test_nothing_recorded_names_the_public_load_spec():
    """A DCP folder records no config: the error says how to give the heads, with public names."""
    with pytest.raises(jax_ucp.LanguageError) as e:
        jax_ucp.restore(DCP, spec="hf_llama")
    text = str(e.value)
    assert "unknown setting 'num_attention_heads'" in text
    assert "jax_ucp.language.load_spec(" in text
    assert "_src" not in text
