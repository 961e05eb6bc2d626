"""The notebooks under notebooks/ run top to bottom in a fresh kernel (nbclient), are committed
without outputs, and leave nothing behind in the temp dir."""

import os

import nbformat
import pytest
from nbclient import NotebookClient
from ucp_testing import REPO

pytestmark = pytest.mark.timeout(300)

NOTEBOOKS = sorted(f for f in os.listdir(os.path.join(REPO, "notebooks")) if f.endswith(".ipynb"))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_and_cleans_up(name, tmp_path, monkeypatch):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setenv("PYTHONPATH", REPO)
    monkeypatch.setenv("TMPDIR", str(scratch))
    nb = nbformat.read(os.path.join(REPO, "notebooks", name), as_version=4)
    NotebookClient(
        nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": REPO}}
    ).execute()
    errors = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors, errors
    assert list(scratch.iterdir()) == [], "the notebook left files in the temp dir"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_committed_without_outputs(name):
    nb = nbformat.read(os.path.join(REPO, "notebooks", name), as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None, name
