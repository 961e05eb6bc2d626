"""``verify EXPORTED --against CKPT``: an export (safetensors, DeepSpeed universal, by spec too,
megatron-core torch_dist, torch DCP with the optimizer) compared tensor by tensor (weights,
masters, moments, the step) with the jax_ucp checkpoint it was written from; one byte of one
exported tensor flipped fails it (a value that differs, or the reader's own check), naming it."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

import jax_ucp
from jax_ucp._src.cli import app
from jax_ucp._src.exporters import (
    DeepSpeedUniversalExport,
    MegatronExport,
    SafetensorsExport,
    TorchDcpExport,
)
from jax_ucp._src.importers.megatron import MegatronOptions
from jax_ucp.errors import UCPError
from jax_ucp.language import dump_spec
from tests.exporters.test_export import DS
from tests.importers.deepspeed.test_nextstep import GPT_SPEC
from tests.megatron_testing import FIX, VOCAB

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def deepspeed(tmp_path_factory):
    """A DeepSpeed ZeRO-2 run imported (torch names), and its flax tree saved from JAX."""
    root = tmp_path_factory.mktemp("verify_export")
    ucp = jax_ucp.convert(os.path.join(DS, "z2_fp32_dp2", "ckpt"), root / "ucp")
    flax = jax_ucp.save(str(root / "flax"), jax_ucp.restore(ucp, spec=GPT_SPEC))
    return root, ucp, flax


def _flip(folder, value: np.ndarray) -> str:
    """One byte in the middle of ``value``'s bytes, found in the export's files, flipped."""
    data = np.ascontiguousarray(value).tobytes()
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                raw = f.read()
            at = raw.find(data)
            if at >= 0 and len(data) >= 8:
                with open(path, "r+b") as f:
                    f.seek(at + len(data) // 2)
                    f.write(bytes([raw[at + len(data) // 2] ^ 0x10]))
                return path
    raise AssertionError(f"{folder}: the tensor's bytes are in no file")


def _fails(exported, ckpt, spec=None) -> str:
    """What verify says of a damaged export: the problems, or the reader's error."""
    try:
        found = jax_ucp.verify(exported, against=ckpt, spec=spec)
    except UCPError as e:
        return str(e)
    assert found, "a flipped byte passed"
    return "; ".join(why for _, why in found)


@pytest.mark.parametrize(
    "kind", ["deepspeed", "deepspeed_by_spec", "safetensors", "safetensors_by_spec", "dcp"]
)
def test_an_export_verifies_against_its_checkpoint_and_a_flipped_byte_fails(deepspeed, kind):
    root, ucp, flax = deepspeed
    by_spec = kind.endswith("by_spec")
    ckpt, spec = (flax, GPT_SPEC) if by_spec else (ucp, None)
    options = {
        "deepspeed": DeepSpeedUniversalExport,
        "safetensors": SafetensorsExport,
        "dcp": lambda spec: TorchDcpExport(optimizer="optim", param_groups={"lr": 1e-3}),
    }[kind.removesuffix("_by_spec")](spec=spec)
    dst = root / kind
    shutil.rmtree(dst, ignore_errors=True)
    jax_ucp.export(ckpt, dst, options)
    found = jax_ucp.verify(dst, against=ckpt, spec=spec)
    assert not found, found
    weights_only = kind.startswith("safetensors")
    assert len(found.exported.equal) == (30 if weights_only else 91)
    assert len(found.exported.not_exported) == (60 if weights_only else 0)
    # one byte of a moment (of a weight, for safetensors) flipped in the exported files
    tree = jax_ucp.restore(ucp)
    name = "h.0.attn_qkv.weight"
    value = tree["params"][name] if weights_only else tree["opt_state"]["mu"][name]
    _flip(dst, np.asarray(value, np.float32))
    said = _fails(dst, ckpt, spec)
    assert "1 of" in said or "CRC" in said or "crc" in said, said


def test_megatron_export_verifies_and_a_flipped_byte_fails(tmp_path):
    """megatron-core torch_dist at TP 2 (vocab rows padded with zeros): every weight, master,
    moment and the step equal; a flipped master byte named."""
    src = FIX / "llama_distopt_bf16_tp2dp2"
    ucp = jax_ucp.convert(src, tmp_path / "ucp", importing=MegatronOptions(vocab_size=VOCAB))
    jax_ucp.export(ucp, tmp_path / "meg", MegatronExport(tp=2))
    found = jax_ucp.verify(tmp_path / "meg", against=ucp)
    assert not found and len(found.exported.equal) == 37, found
    master = jax_ucp.restore(ucp)["params"]["decoder.final_layernorm.weight"]
    _flip(tmp_path / "meg", np.asarray(master))
    said = _fails(tmp_path / "meg", ucp)
    assert "decoder.final_layernorm.weight" in said and ("1 of" in said or "CRC" in said), said


def test_cli_verify_export_exits_1_on_a_flipped_byte(deepspeed, tmp_path):
    """``jax-ucp verify EXPORTED --against CKPT --spec S``: 0 and the count; 1 once damaged."""
    _, ucp, flax = deepspeed
    dst = tmp_path / "hf"
    jax_ucp.export(flax, dst, SafetensorsExport(spec=GPT_SPEC))
    dump_spec(GPT_SPEC, tmp_path / "spec.toml")
    runner = CliRunner()
    args = ["verify", str(dst), "--against", str(flax), "--spec", str(tmp_path / "spec.toml")]
    r = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "30 of 30 safetensors tensors equal" in r.output, r.output
    _flip(dst, np.asarray(jax_ucp.restore(ucp)["params"]["wte.weight"]))
    r = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert r.exit_code == 1 and "wte.weight" in r.output, r.output
    with pytest.raises(UCPError, match="give against="):
        jax_ucp.verify(flax, spec=GPT_SPEC)
