"""A torch DCP folder whose save is still running (or was killed) has its rank files but no
``.metadata``, which rank 0 writes last: restore, verify and inspect said "no ucp.json here ...
not a jax_ucp checkpoint" (issue 56); they name it an incomplete torch DCP checkpoint."""

from __future__ import annotations

import os
import shutil

import pytest
from typer.testing import CliRunner

import jax_ucp
from jax_ucp.cli import app
from jax_ucp.errors import CheckpointError
from tests.ucp_testing import REPO

DCP = os.path.join(
    REPO,
    "tests",
    "fixtures",
    "hf_trainer",
    "trainer_fsdp_synthetic_layout",
    "checkpoint-3",
    "pytorch_model_fsdp_0",
)


@pytest.mark.timeout(60)
def test_a_dcp_folder_without_metadata_is_named_an_incomplete_dcp_checkpoint(tmp_path):
    partial = tmp_path / "dcp"
    shutil.copytree(DCP, partial)
    os.remove(partial / ".metadata")
    message = r"dcp: an incomplete torch DCP checkpoint: 1 rank file\(s\) \(__0_0\.distcp\)"
    for call in (jax_ucp.restore, jax_ucp.verify, jax_ucp.inspect):
        with pytest.raises(CheckpointError, match=message):
            call(partial)
    r = CliRunner().invoke(app, ["verify", str(partial)], env={"COLUMNS": "300"})
    assert r.exit_code == 1 and "incomplete torch DCP checkpoint" in r.output, r.output
