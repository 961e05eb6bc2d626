"""The shipped notebooks run top to bottom (executed with nbclient in a fresh kernel)."""

import os

import nbformat
import pytest
from nbclient import NotebookClient
from ucp_testing import REPO

NOTEBOOKS = sorted(f for f in os.listdir(os.path.join(REPO, "examples")) if f.endswith(".ipynb"))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setenv("PYTHONPATH", REPO)
    nb = nbformat.read(os.path.join(REPO, "examples", name), as_version=4)
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    errors = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors, errors
