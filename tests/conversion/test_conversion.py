"""convert: the destination never lies in, over or inside the source."""

from __future__ import annotations

import os
import shutil

import pytest

import jax_ucp
from tests.ucp_testing import REPO


@pytest.mark.timeout(120)
def test_convert_never_writes_into_or_over_its_source(tmp_path):
    src = tmp_path / "ds"
    shutil.copytree(os.path.join(REPO, "tests/fixtures/deepspeed/z2_bf16_dp2/ckpt"), src)
    before = sorted(p for p, _, _ in os.walk(src))
    for dest in (src, src / "global_step2" / "out", tmp_path):
        with pytest.raises(jax_ucp.UCPError, match="is, contains or lies inside the source"):
            jax_ucp.convert(src, dest, force=True)
    assert sorted(p for p, _, _ in os.walk(src)) == before
