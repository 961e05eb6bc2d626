"""jax_ucp's import of transformers does not print DeepSpeed's accelerator warning; other
DeepSpeed records still pass; the torch extra lists what the docs' Trainer examples import."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tomllib

import pytest

from jax_ucp.importers.torch.transformers_import import (
    ACCELERATOR_MESSAGE,
    quiet_deepspeed_accelerator,
)
from tests.ucp_testing import REPO

ROOT = REPO


def test_filter_drops_only_the_accelerator_message_and_only_in_scope(caplog):
    log = logging.getLogger("DeepSpeed")
    with caplog.at_level(logging.WARNING, logger="DeepSpeed"):
        propagate, log.propagate = log.propagate, True
        try:
            with quiet_deepspeed_accelerator():
                log.warning(ACCELERATOR_MESSAGE + " If you have GPU ...")
                log.warning("something else")
            log.warning(ACCELERATOR_MESSAGE + " after")
        finally:
            log.propagate = propagate
    got = [r.getMessage() for r in caplog.records]
    assert got == ["something else", ACCELERATOR_MESSAGE + " after"]


def test_torch_extra_installs_accelerate_for_the_trainer():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["torch"]
    names = {d.split(">")[0].split("=")[0].split("[")[0].strip() for d in extra}
    assert {"torch", "transformers", "accelerate", "safetensors"} <= names


@pytest.mark.torch
def test_import_transformers_then_save_pretrained_prints_no_accelerator_warning(tmp_path):
    """In a fresh process (DeepSpeed detects once per process): our import, then what a user does
    next (``save_pretrained`` imports DeepSpeed); the warning appears without our import."""
    body = (
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "c = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,"
        " num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)\n"
        f"LlamaForCausalLM(c).save_pretrained({str(tmp_path / 'm')!r})\n"
    )
    ours = "from jax_ucp.importers.torch.transformers_import import import_transformers\n"
    ours += "import_transformers()\n"
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("DS_ACCELERATOR", None)

    def stderr(code):
        run = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
        )
        assert run.returncode == 0, run.stderr[-2000:]
        return run.stdout + run.stderr

    assert ACCELERATOR_MESSAGE in stderr(body)  # the warning this guards against exists
    assert ACCELERATOR_MESSAGE not in stderr(ours + body)
