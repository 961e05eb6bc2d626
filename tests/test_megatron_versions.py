"""Checkpoints written by older megatron-core releases (0.13.1, 0.15.3; tools/fixtures/
make_megatron_fixtures.py run in a virtualenv of each release): their ``.metadata`` pickles
megatron-core's own ``MCoreSavePlan`` (0.13, 0.14) or ``MCoreMetadata`` (0.15) classes, read as
inert stand-ins; every weight and moment bit-exact against torch's DCP consolidation."""

from __future__ import annotations

import os

import numpy as np
import pytest

import jax_ucp

pytestmark = pytest.mark.timeout(120)
ROOT = os.path.join(os.path.dirname(__file__), "fixtures", "megatron", "mcore_versions")
VOCAB = 61  # the fixtures' tokenizer vocab (padded to 64 in the checkpoint)
CASES = [("0.13.1", "gpt_tp2"), ("0.15.3", "gpt_tp2"), ("0.15.3", "gpt_distopt_dp2")]


def _reference(version: str, name: str) -> dict[str, np.ndarray]:
    """torch's DCP consolidation of the fixture; a model-only run's weights equal megatron-core
    0.16's from the same seed bit for bit (checked when made), so gpt_tp2 uses that one."""
    own = os.path.join(ROOT, version, f"{name}.consolidated.npz")
    z = np.load(
        own if os.path.exists(own) else os.path.join(ROOT, "..", f"{name}.consolidated.npz")
    )
    assert not z["__bfloat16_keys__"].size  # fp32 fixtures
    return {k: z[k] for k in z.files if k != "__bfloat16_keys__"}


def _stripped(name: str, value: np.ndarray) -> np.ndarray:
    vocab = name.endswith("word_embeddings.weight") or name.endswith("output_layer.weight")
    return value[:VOCAB] if vocab else value


@pytest.mark.parametrize("version, name", CASES)
def test_older_megatron_core_checkpoints_import_bit_exact(tmp_path, version, name):
    ckpt = jax_ucp.convert(
        os.path.join(ROOT, version, name), str(tmp_path / "ucp"), vocab_size=VOCAB
    )
    got = jax_ucp.restore(ckpt)
    ref = _reference(version, name)
    model = {k: v for k, v in ref.items() if not k.startswith("optimizer.")}
    assert set(got["params"]) == set(model)
    for key, value in model.items():
        assert got["params"][key].tobytes() == _stripped(key, value).tobytes(), key
    moments = {k: v for k, v in ref.items() if k.startswith("optimizer.state.exp_avg")}
    if not moments:
        assert "opt_state" not in got
    for key, value in moments.items():
        state, _, param = key[len("optimizer.state.") :].partition(".")
        tree = got["opt_state"]["mu" if state == "exp_avg" else "nu"]
        assert tree[param].tobytes() == _stripped(param, value).tobytes(), key


def test_megatron_core_013_dp_zero_gather_scatter_is_refused_not_dropped(tmp_path):
    """0.13's dp_zero_gather_scatter keeps the optimizer state as pickled bucket objects: an
    error naming the layout and the way out, never weights imported without saying so."""
    src = os.path.join(ROOT, "0.13.1", "gpt_distopt_dp_zero_gather_scatter")
    with pytest.raises(jax_ucp.UCPError, match=r"'dp_zero_gather_scatter'.*weights_only"):
        jax_ucp.convert(src, str(tmp_path / "refused"), vocab_size=VOCAB)
    assert not (tmp_path / "refused").exists()
    ckpt = jax_ucp.convert(src, str(tmp_path / "ucp"), vocab_size=VOCAB, weights_only=True)
    got = jax_ucp.restore(ckpt)
    assert sorted(got) == ["params"] and len(got["params"]) == 17
    skipped = jax_ucp.inspect(ckpt).source["skipped"]["optimizer"]
    assert "2 optimizer objects" in skipped and "dp_zero_gather_scatter" in skipped
