"""jax_ucp.samples: the checkpoints the docs and notebooks run on are byte copies of test fixtures."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jax_ucp.errors import RequestError
from tests.ucp_testing import REPO


@pytest.mark.timeout(120)
def test_shipped_samples_are_the_test_fixtures_byte_for_byte():
    """jax_ucp.samples (what the docs and notebooks run on) are copies of real fixtures."""
    import json

    from jax_ucp import samples

    fixtures = os.path.join(REPO, "tests", "fixtures")
    copies = {
        "megatron_llama_tp2": os.path.join(fixtures, "megatron", "llama_tp2"),
        "deepspeed_z2_bf16_dp2": os.path.join(fixtures, "deepspeed", "z2_bf16_dp2", "ckpt"),
        "hf_trainer_llama": os.path.join(fixtures, "hf_trainer", "trainer_fp32", "checkpoint-3"),
    }
    assert sorted(copies) == sorted(samples.NAMES)
    for name, fixture in copies.items():
        ours = {
            os.path.relpath(os.path.join(d, f), samples.path(name))
            for d, _, files in os.walk(samples.path(name))
            for f in files
        }
        theirs = {
            os.path.relpath(os.path.join(d, f), fixture)
            for d, _, files in os.walk(fixture)
            for f in files
        }
        assert ours == theirs, name
        for rel in ours:
            with (
                open(os.path.join(samples.path(name), rel), "rb") as a,
                open(os.path.join(fixture, rel), "rb") as b,
            ):
                assert a.read() == b.read(), (name, rel)
    with open(os.path.join(fixtures, "megatron", "fixtures.json")) as f:
        assert samples.settings("megatron_llama_tp2") == json.load(f)["llama_tp2"]
    with open(os.path.join(fixtures, "deepspeed", "z2_bf16_dp2", "run.json")) as f:
        assert samples.settings("deepspeed_z2_bf16_dp2") == json.load(f)
    ref = np.load(os.path.join(fixtures, "megatron", "llama_tp2.logits.npz"))
    got = samples.reference("megatron_llama_tp2")
    assert sorted(got) == sorted(ref.files)
    for k in ref.files:
        np.testing.assert_array_equal(got[k], ref[k])
    truth = np.load(os.path.join(fixtures, "hf_trainer", "trainer_fp32.truth.npz"))
    got = samples.reference("hf_trainer_llama")
    for mine, theirs in (("tokens", "next_tokens"), ("losses", "next_losses"), ("lrs", "next_lrs")):
        np.testing.assert_array_equal(got[mine], truth[theirs])
    names = [k.split("/", 1)[1] for k in truth.files if k.startswith("param/")]
    norms = [n for n in names if n.endswith("norm.weight")]  # the Trainer's no-decay group
    order = samples.settings("hf_trainer_llama")["parameter_order"]
    assert order == [n for n in names if n not in norms] + norms
    with pytest.raises(RequestError, match="ships no reference"):
        samples.reference("deepspeed_z2_bf16_dp2")
    with pytest.raises(
        RequestError, match="no sample named 'gpt5' \\(samples: megatron_llama_tp2, "
    ):
        samples.path("gpt5")
