"""Every ```python block in README.md and docs/*.md runs as written, alone.

Each block runs by itself in a fresh Python process (8 CPU devices, XLA_FLAGS as in the docs),
as a reader copies one into a file or a notebook cell: its imports and data are its own. The
working directory is a fresh temporary directory holding nothing of the repository, so a block
reaches data only through the installed package (``jax_ucp.samples``) or by writing its own;
TMPDIR is a temporary directory too. A failing block is reported with its file and line
(tracebacks point into the Markdown file).

A ```python block with a ``<!-- docs-test: ... -->`` comment above it is an excerpt (names
defined by the prose around it, placeholder paths): tests/test_docs_examples.py runs it with the
fixtures its comment names, or counts it as not run.

Blocks known to fail are listed in XFAIL: expected failures, not strict ones (once fixed they
simply pass).
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.test_docs_examples import MARKER
from tests.ucp_testing import REPO

pytestmark = pytest.mark.timeout(300)

FILES = ["README.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(f"{REPO}/docs/*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```[ \t]*$", re.S | re.M)

# Blocks expected to fail today: {file: {text the block contains: reason}}. Only for files owned
# elsewhere (docs/DEEPSPEED.md, docs/MEGATRON.md, docs/FORMAT.md); a block of any other file is
# fixed, not listed. Empty: every block runs.
XFAIL: dict[str, dict[str, str]] = {}

# Runs in the child: executes one block (line numbers padded to the Markdown file's).
RUNNER = textwrap.dedent(
    """
    import sys

    doc, line, source = sys.argv[1], int(sys.argv[2]), open(sys.argv[3]).read()
    exec(compile("\\n" * (line - 1) + source, doc, "exec"), {"__name__": "__main__"})
    """
)


def blocks(name: str) -> list[tuple[int, str]]:
    """(first line of the code, code) of each ```python block of a Markdown file that runs
    alone (no docs-test comment above it)."""
    with open(os.path.join(REPO, name), encoding="utf-8") as f:
        text = f.read()
    return [
        (text.count("\n", 0, m.start(1)) + 1, m.group(1))
        for m in FENCE.finditer(text)
        if not MARKER.search(text, max(0, m.start() - 2000), m.start())
    ]


def test_no_python_block_escapes_the_runner():
    """Only ```python fences at column 0 are run: an indented one (inside a list) or another
    spelling of Python (py, python3, pycon) would silently not be. Excerpts are ```python with a
    docs-test comment (tests/test_docs_examples.py runs them)."""
    for name in FILES:
        with open(os.path.join(REPO, name), encoding="utf-8") as f:
            text = f.read()
        assert not re.search(r"^[ \t]+```\s*py", text, re.M), f"{name}: an indented Python fence"
        other = re.findall(r"^```[ \t]*(py|python3|pycon|ipython)\b", text, re.M)
        assert not other, f"{name}: ```{other[0]} blocks are not run; use ```python"
    assert blocks("README.md"), "README.md has no Python block left to run"


def test_xfail_entries_name_existing_blocks():
    """An XFAIL entry names a block that exists (an edit that moves the text shows up here)."""
    for name, entries in XFAIL.items():
        sources = [code for _, code in blocks(name)]
        for needle in entries:
            assert any(needle in code for code in sources), f"{name}: no block has {needle!r}"


def test_no_block_names_a_repository_path():
    """A block copied out of the repository cannot open tests/fixtures/...: data comes from
    ``jax_ucp.samples`` or is written by the block."""
    for name in FILES:
        for line, code in blocks(name):
            assert not re.search(r"""["'](\./)?(tests|examples|notebooks|benchmarks)/""", code), (
                f"{name}, block at line {line} names a path in the repository"
            )


# (file, index of the block in it): stable while the prose around the blocks changes
ALL_BLOCKS = [(name, i) for name in FILES for i in range(len(blocks(name)))]


@pytest.mark.parametrize("name, index", ALL_BLOCKS, ids=[f"{n}#{i + 1}" for n, i in ALL_BLOCKS])
def test_python_block_runs_alone(tmp_path, name, index):
    line, source = blocks(name)[index]
    work, scratch = tmp_path / "cwd", tmp_path / "tmp"
    work.mkdir()
    scratch.mkdir()
    (tmp_path / "runner.py").write_text(RUNNER)
    (tmp_path / "block.py").write_text(source)
    # As pasted: nothing injected (no XLA_FLAGS; a block that needs 8 devices sets them itself).
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=REPO, JAX_PLATFORMS="cpu", TMPDIR=str(scratch))
    r = subprocess.run(
        [sys.executable, str(tmp_path / "runner.py"), os.path.join(REPO, name), str(line)]
        + [str(tmp_path / "block.py")],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    if r.returncode == 0:
        return
    reason = next((why for text, why in XFAIL.get(name, {}).items() if text in source), None)
    if reason:
        pytest.xfail(f"{name}, block at line {line}: {reason}")
    raise AssertionError(f"{name}, block at line {line} fails alone:\n{r.stderr[-4000:]}")
