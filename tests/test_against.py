"""``verify(ckpt, against=src)`` / ``jax-ucp verify CKPT --against SRC``: every tensor an
import copied one for one compared bit for bit with what the source framework's own loader
reads; a changed byte in the source is reported and exits 1; tensors the import built are
listed as not compared, never counted as equal."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

import jax_ucp
from jax_ucp.cli import app
from tests.ucp_testing import REPO

runner = CliRunner()
FIX = os.path.join(REPO, "tests", "fixtures")


def test_safetensors_import_against_safetensors_own_reader(tmp_path):
    from safetensors.numpy import save_file

    src = tmp_path / "model.safetensors"
    save_file(
        {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, np.int64)}, str(src)
    )
    out = jax_ucp.convert(src, tmp_path / "ucp")
    assert jax_ucp.verify(out, against=src) == []
    r = runner.invoke(app, ["verify", str(out), "--against", str(src)])
    assert r.exit_code == 0, r.output
    # the source changed after the import (one element): reported, exit 1
    save_file(
        {"a": np.arange(12, dtype=np.float32).reshape(3, 4) + (np.arange(12) == 7).reshape(3, 4),
         "b": np.ones(5, np.int64)},
        str(src),
    )  # fmt: skip
    bad = jax_ucp.verify(out, against=src)
    assert [name for name, _ in bad] == ["params/a"], bad
    assert "1 of 12 elements" in bad[0][1]
    r = runner.invoke(app, ["verify", str(out), "--against", str(src)])
    assert r.exit_code == 1 and "differs from the source" in r.output


@pytest.mark.torch
@pytest.mark.parametrize("kind", ["fsdp2_fp32", "plain_state_dict.pt"])
def test_torch_imports_against_torch_own_loaders(tmp_path, kind):
    """torch DCP through dcp.load, torch.save files through torch.load(weights_only=True):
    every weight and moment equal; a flipped element of the source is named."""
    import torch

    src = tmp_path / kind
    (shutil.copytree if os.path.isdir(os.path.join(FIX, "torch", kind)) else shutil.copy)(
        os.path.join(FIX, "torch", kind), src
    )
    out = jax_ucp.convert(src, tmp_path / "ucp")
    result = jax_ucp.verify(out, against=src)
    assert result == [], result
    if kind.endswith(".pt"):
        sd = torch.load(src, weights_only=True)
        name = next(iter(sd))
        sd[name].view(-1)[0] += 1
        torch.save(sd, src)
        bad = jax_ucp.verify(out, against=src)
        assert len(bad) == 1 and name in bad[0][1], bad


def test_deepspeed_tensors_built_by_the_import_are_not_counted_equal(tmp_path):
    src = os.path.join(FIX, "deepspeed", "z2_fp32_dp2", "ckpt")
    out = jax_ucp.convert(src, tmp_path / "ucp")
    with pytest.raises(jax_ucp.UCPError, match=r"no tensor .* could be compared"):
        jax_ucp.verify(out, against=src)
