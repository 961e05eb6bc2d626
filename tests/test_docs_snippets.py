"""Every ```python block in README.md and docs/*.md runs as written (one fresh process per file,
its blocks in order sharing one namespace, from the repository root)."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest
from ucp_testing import REPO

pytestmark = pytest.mark.timeout(300)

FILES = ["README.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(f"{REPO}/docs/*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks(name: str) -> list[str]:
    with open(os.path.join(REPO, name), encoding="utf-8") as f:
        return BLOCK.findall(f.read())


def test_no_python_block_escapes_the_runner():
    """Indented fences (inside lists) are not run: there must be none (excerpts are ```text)."""
    for name in FILES:
        with open(os.path.join(REPO, name), encoding="utf-8") as f:
            assert not re.search(r"^[ \t]+```python", f.read(), re.M), name


@pytest.mark.parametrize("name", [f for f in FILES if _blocks(f)])
def test_python_blocks_run(tmp_path, name):
    script = "\n\n".join(f"# --- block {i + 1}\n{b}" for i, b in enumerate(_blocks(name)))
    (tmp_path / "snippets.py").write_text(script)
    env = dict(
        os.environ,
        PYTHONPATH=REPO,
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        JAX_PLATFORMS="cpu",
        TMPDIR=str(tmp_path),
    )
    # Run from the repository: snippets read the committed fixtures by their relative paths and
    # write into temporary directories (TMPDIR is this test's).
    r = subprocess.run(
        [sys.executable, str(tmp_path / "snippets.py")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, f"{name}:\n{r.stderr[-4000:]}"
