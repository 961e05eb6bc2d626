"""``verify(ckpt, against=src, logits=True)`` / ``jax-ucp verify CKPT --against SRC --logits``:
one batch through the source loaded by transformers' ``from_pretrained`` and through the
converted weights in ``TransformerLM``; a real Trainer checkpoint (tools/fixtures/
make_hf_trainer_checkpoints.py) agrees within a tiny difference, one weight element changed in
the source fails with the difference shown and exit 1; a model TransformerLM does not compute,
and a machine without transformers, are refused naming why."""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

import jax_ucp
from jax_ucp._src.logits import compare_logits
from jax_ucp.cli import app
from tests.ucp_testing import REPO

runner = CliRunner()
TRAINER = os.path.join(REPO, "tests", "fixtures", "hf_trainer")
SRC = os.path.join(TRAINER, "trainer_fp32", "checkpoint-3")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return jax_ucp.convert(SRC, tmp_path_factory.mktemp("logits") / "ucp")


@pytest.mark.torch
def test_trainer_checkpoint_gives_the_sources_logits(converted):
    """The Trainer's checkpoint-3 (its config.json names LlamaForCausalLM) and its conversion:
    the logits agree far within the stated tolerance, said on the command line."""
    found = jax_ucp.verify(converted, against=SRC, logits=True)
    assert found == [] and found.logits is not None and found.logits.ok
    assert 0 <= found.logits.max_abs_diff < 1e-5
    assert found.logits.tree == "params" and found.logits.batch == (2, 16)
    r = runner.invoke(
        app, ["verify", converted, "--against", SRC, "--logits"], env={"COLUMNS": "300"}
    )
    assert r.exit_code == 0, r.output
    assert "logits of one batch [2, 16]: max |diff|" in r.output
    assert "<= tolerance 0.0001" in r.output and "LlamaForCausalLM" in r.output


@pytest.mark.torch
def test_one_weight_element_changed_fails_with_the_difference(converted, tmp_path):
    """The source's final norm weight changed in one element after the import: the tensor is
    reported different, the logits move beyond the tolerance, the difference is shown and the
    command exits 1."""
    from safetensors.numpy import load_file, save_file

    src = shutil.copytree(SRC, tmp_path / "changed")
    weights = load_file(str(src / "model.safetensors"))
    weights["model.norm.weight"][0] += 1.0
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    found = jax_ucp.verify(converted, against=src, logits=True)
    assert found.logits is not None and not found.logits.ok
    assert found.logits.max_abs_diff > 1e-2
    names = [n for n, _ in found]
    assert "params/model.norm.weight" in names and names[-1] == "logits"
    r = runner.invoke(
        app, ["verify", converted, "--against", str(src), "--logits"], env={"COLUMNS": "300"}
    )
    assert r.exit_code == 1, r.output
    assert f"max |diff| {found.logits.max_abs_diff:.3g} > tolerance 0.0001" in r.output
    assert "the logits differ beyond the tolerance" in r.output
    # a tolerance the user states is the one applied
    loose = jax_ucp.verify(converted, against=src, logits=True, logits_tolerance=1e3)
    assert loose.logits is not None and loose.logits.ok and loose.logits.tolerance == 1e3


@pytest.mark.torch
def test_tied_embeddings_give_the_sources_logits(tmp_path):
    """The Trainer's tied-embedding run (no lm_head.weight saved: TransformerLM attends with
    the embedding)."""
    src = os.path.join(TRAINER, "trainer_tied", "checkpoint-3")
    found = jax_ucp.verify(jax_ucp.convert(src, tmp_path / "ucp"), against=src, logits=True)
    assert found == [] and found.logits is not None and found.logits.max_abs_diff < 1e-5


def _config_folder(tmp_path, **changes) -> str:
    folder = tmp_path / "src"
    folder.mkdir(parents=True)
    with open(os.path.join(SRC, "config.json")) as f:
        config = json.load(f)
    with open(folder / "config.json", "w") as f:
        json.dump({**config, **changes}, f)
    return str(folder)


def test_a_model_transformerlm_does_not_compute_is_refused(tmp_path):
    """A BERT config.json, custom code, a Llama config with biases, no config.json: refused
    naming what was found, before anything is loaded (no torch needed)."""
    ckpt = str(tmp_path / "never-read")
    gpt2 = _config_folder(tmp_path, model_type="bert")
    with pytest.raises(
        jax_ucp.UCPError, match=r"--logits supports.*llama.*found 'bert' in .*config\.json"
    ):
        compare_logits(ckpt, gpt2)
    os.remove(os.path.join(gpt2, "config.json"))
    with pytest.raises(jax_ucp.UCPError, match=r"src: no config\.json.*model_type: llama"):
        compare_logits(ckpt, gpt2)
    custom = _config_folder(tmp_path / "c", auto_map={"AutoModel": "x.Y"})
    with pytest.raises(jax_ucp.UCPError, match=r"found custom code \(auto_map\)"):
        compare_logits(ckpt, custom)
    biased = _config_folder(tmp_path / "b", attention_bias=True)
    with pytest.raises(jax_ucp.UCPError, match=r"--logits supports.*attention_bias True"):
        compare_logits(ckpt, biased)


def test_without_transformers_the_extra_to_install_is_named(tmp_path, monkeypatch):
    """No transformers (an import that fails): refused naming the jax_ucp[hf] extra."""
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(jax_ucp.UCPError, match=r"from_pretrained.*pip install 'jax_ucp\[hf\]'"):
        compare_logits(str(tmp_path / "never-read"), _config_folder(tmp_path))


def test_logits_needs_against(tmp_path):
    out = jax_ucp.save(str(tmp_path / "c"), {"w": np.zeros(2, np.float32)})
    with pytest.raises(jax_ucp.UCPError, match=r"logits=True.*against="):
        jax_ucp.verify(out, logits=True)
    r = runner.invoke(app, ["verify", out, "--logits"])
    assert r.exit_code != 0 and "--against" in r.output


@pytest.mark.torch
def test_a_config_declaring_a_bigger_model_than_the_checkpoint_is_refused(converted, tmp_path):
    """A hostile copy of the source whose config.json declares a million layers: refused
    naming both sizes before from_pretrained would allocate the declared model."""
    src = tmp_path / "src"
    shutil.copytree(SRC, src)
    with open(src / "config.json") as f:
        config = json.load(f)
    config["num_hidden_layers"] = 10**6
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        jax_ucp.UCPError, match=r"config\.json declares a model of [\d,]+ parameters.*holds"
    ):
        compare_logits(converted, str(src))


@pytest.mark.parametrize("tolerance", ["abc", True, -1.0, float("nan"), float("inf")])
def test_a_tolerance_that_is_no_number_or_proves_nothing_is_refused(tmp_path, tolerance):
    """Text, a bool (before: True taken as 1.0), a negative, NaN or infinite tolerance: a
    RequestError naming the option before anything is read (before: 'abc' a raw ValueError)."""
    out = jax_ucp.save(str(tmp_path / "c"), {"w": np.zeros(2, np.float32)})
    with pytest.raises(jax_ucp.RequestError, match=r"logits_tolerance"):
        jax_ucp.verify(
            out, against=_config_folder(tmp_path), logits=True, logits_tolerance=tolerance
        )
    with pytest.raises(jax_ucp.RequestError, match=r"logits_tolerance"):
        compare_logits(out, _config_folder(tmp_path / "again"), tolerance=tolerance)


@pytest.mark.parametrize("value", ["nan", "-1", "inf"])
def test_the_command_line_refuses_a_tolerance_naming_the_option(tmp_path, value):
    out = jax_ucp.save(str(tmp_path / "c"), {"w": np.zeros(2, np.float32)})
    r = runner.invoke(
        app,
        [
            "verify",
            out,
            "--against",
            _config_folder(tmp_path),
            "--logits",
            "--logits-tolerance",
            value,
        ],
        env={"COLUMNS": "300"},
    )
    assert r.exit_code == 1 and "--logits-tolerance" in r.output, r.output


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_attention_heads", 0),
        ("intermediate_size", 0),
        ("vocab_size", "64"),
        ("num_hidden_layers", 2.5),
        ("vocab_size", 10**30),
        ("num_key_value_heads", 3),  # does not divide the 4 heads
        ("rms_norm_eps", float("nan")),
        ("num_attention_heads", True),
    ],
)
def test_absurd_config_numbers_are_refused_naming_the_field_and_file(tmp_path, field, value):
    """config.json declaring 0 heads (before: a raw ZeroDivisionError), negative or text sizes,
    sizes past int32, a head count that does not divide: a SourceError naming the field and
    the file, before torch or the checkpoint is touched."""
    folder = _config_folder(tmp_path, **{field: value})
    named = rf"config\.json: {field}|{field} .*config\.json|config\.json.*{field}"
    if isinstance(value, float) and value != value:  # no JSON reader of ours takes NaN
        named = r"config\.json: not valid JSON \(NaN"
    with pytest.raises(jax_ucp.SourceError, match=named):
        compare_logits(str(tmp_path / "never-read"), folder)


@pytest.mark.parametrize(
    "changes, says",
    [
        ({"hidden_size": 34, "head_dim": None}, r"hidden_size 34 is not a multiple of num_att"),
        ({"rms_norm_eps": 0}, r"rms_norm_eps 0: expected a finite number > 0"),
    ],
)
def test_what_the_model_reader_would_default_is_refused_naming_field_and_file(
    tmp_path, changes, says
):
    """A width the heads do not divide (no head_dim), which the family reader would take as a
    value of its own (head_dim floored), and an eps of 0, which the reader refuses: refused,
    naming the field."""
    folder = _config_folder(tmp_path, **changes)
    with pytest.raises(jax_ucp.SourceError, match=rf"config\.json: {says}"):
        compare_logits(str(tmp_path / "never-read"), folder)
