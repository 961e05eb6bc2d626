"""The notebooks under notebooks/ run top to bottom in a fresh kernel, copied out of the
repository into a temporary directory (nothing in them may find data by a path relative to the
repository), are committed without outputs, and leave nothing behind in the temp dir."""

import os
import shutil
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from tests.ucp_testing import REPO

pytestmark = pytest.mark.timeout(300)

NOTEBOOKS = sorted(f for f in os.listdir(os.path.join(REPO, "notebooks")) if f.endswith(".ipynb"))


def _errors(nb) -> list:
    return [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]


# Run by ``jupyter nbconvert --execute`` (the dev extra's nbconvert) as a user runs it, the others
# by nbclient in this process: every notebook executed once, both ways covered.
BY_NBCONVERT = "import_torch.ipynb"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_out_of_the_repository_and_cleans_up(name, tmp_path, monkeypatch):
    scratch, elsewhere = tmp_path / "tmp", tmp_path / "elsewhere"
    scratch.mkdir()
    elsewhere.mkdir()
    shutil.copy(os.path.join(REPO, "notebooks", name), elsewhere / name)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setenv("TMPDIR", str(scratch))
    if name == BY_NBCONVERT:
        nb = _nbconvert(elsewhere / name, tmp_path / "out")
        printed = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
        assert "max |flax - torch| =" in printed
    else:
        nb = nbformat.read(elsewhere / name, as_version=4)
        NotebookClient(
            nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(elsewhere)}}
        ).execute()
    assert not _errors(nb), _errors(nb)
    assert list(scratch.iterdir()) == [], "the notebook left files in the temp dir"
    assert sorted(os.listdir(elsewhere)) == [name]
    _check_displays(nb, name)


def _nbconvert(path, out_dir):
    """``jupyter nbconvert --to notebook --execute`` of ``path`` (run in its folder); the executed
    notebook, written to ``out_dir``."""
    r = subprocess.run(
        [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute"]
        + ["--output-dir", str(out_dir), "--output", "out.ipynb", path.name],
        cwd=path.parent,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return nbformat.read(out_dir / "out.ipynb", as_version=4)


def _check_displays(nb, name: str) -> None:
    """Every cell that draws a figure (``figure=True``, ``plt.``) produced an image, and every
    cell that displays a checkpoint or a plan produced its HTML table: a figure that silently
    went nowhere (a non-inline backend) or a missing table fails."""
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        kinds = {k for o in cell.get("outputs", []) for k in o.get("data", {})}
        if "figure=True" in cell.source:
            assert "image/png" in kinds, f"{name} cell {i} drew no figure: {cell.source[:80]!r}"
        if "display(" in cell.source:
            assert "text/html" in kinds, f"{name} cell {i} showed no table: {cell.source[:80]!r}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_committed_without_outputs(name):
    nb = nbformat.read(os.path.join(REPO, "notebooks", name), as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None, name
