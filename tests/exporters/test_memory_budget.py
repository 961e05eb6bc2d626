"""``export(memory_budget=...)``: the exporters read under the same budget as ``convert``."""

from __future__ import annotations

import os

import pytest

import jax_ucp
from jax_ucp.exporters import SafetensorsExport
from tests.ucp_testing import REPO

FSDP2 = os.path.join(REPO, "tests", "fixtures", "torch", "fsdp2_fp32")


@pytest.mark.timeout(120)
def test_export_under_a_budget_equals_the_default_export(tmp_path):
    ucp = jax_ucp.convert(FSDP2, tmp_path / "ucp")
    small = jax_ucp.export(ucp, tmp_path / "small", SafetensorsExport(memory_budget="4KiB"))
    default = jax_ucp.export(ucp, tmp_path / "default", SafetensorsExport())
    assert small.files == default.files
    for name in default.files:
        with (
            open(os.path.join(default.path, name), "rb") as a,
            open(os.path.join(small.path, name), "rb") as b,
        ):
            assert a.read() == b.read(), name
