"""Every ```python block in README.md and docs/*.md runs as written.

Each file runs in a fresh Python process (8 CPU devices, XLA_FLAGS as in the docs) whose blocks
run in order, sharing one namespace, like cells of a notebook. The working directory is a fresh
temporary directory, so nothing a snippet writes by a relative path lands in the repository; in
it ``tests`` links to the repository's tests/ because the docs name the committed fixtures
relative to the repository root (``tests/fixtures/...``). TMPDIR is a temporary directory too.

A failing block is reported with its file and line (tracebacks point into the Markdown file);
the blocks after it still run. Blocks known to fail are listed in XFAIL: they are expected
failures, not strict ones (xfail(strict=False): once fixed they simply pass).
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from ucp_testing import REPO

pytestmark = pytest.mark.timeout(300)

FILES = ["README.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(f"{REPO}/docs/*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```[ \t]*$", re.S | re.M)

# Blocks expected to fail today: {file: {text the block contains: reason}}. Only for files owned
# elsewhere (docs/DEEPSPEED.md, docs/MEGATRON.md, docs/FORMAT.md); a block of any other file is
# fixed, not listed. Empty: every block runs.
XFAIL: dict[str, dict[str, str]] = {}

# Runs in the child: executes the blocks of one file in order in one namespace, recording for
# each whether it raised (with the traceback), and writes the record as JSON.
RUNNER = textwrap.dedent(
    """
    import json, sys, traceback

    doc, blocks_json, out = sys.argv[1:4]
    with open(blocks_json) as f:
        blocks = json.load(f)
    namespace = {"__name__": "__main__"}
    results = []
    for line, source in blocks:
        try:
            # pad so that line numbers in tracebacks are the Markdown file's
            exec(compile("\\n" * (line - 1) + source, doc, "exec"), namespace)
            results.append(None)
        except BaseException:
            results.append(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        with open(out, "w") as f:
            json.dump(results, f)
    """
)


def blocks(name: str) -> list[tuple[int, str]]:
    """(first line of the code, code) of each ```python block of a Markdown file."""
    with open(os.path.join(REPO, name), encoding="utf-8") as f:
        text = f.read()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)]


def test_no_python_block_escapes_the_runner():
    """Only ```python fences at column 0 are run: an indented one (inside a list) or another
    spelling of Python (py, python3, pycon) would silently not be. Excerpts are ```text."""
    for name in FILES:
        with open(os.path.join(REPO, name), encoding="utf-8") as f:
            text = f.read()
        assert not re.search(r"^[ \t]+```\s*py", text, re.M), f"{name}: an indented Python fence"
        other = re.findall(r"^```[ \t]*(py|python3|pycon|ipython)\b", text, re.M)
        assert not other, f"{name}: ```{other[0]} blocks are not run; use ```python or ```text"
    assert blocks("README.md"), "README.md has no Python block left to run"


def test_xfail_entries_name_existing_blocks():
    """An XFAIL entry names a block that exists (an edit that moves the text shows up here)."""
    for name, entries in XFAIL.items():
        sources = [code for _, code in blocks(name)]
        for needle in entries:
            assert any(needle in code for code in sources), f"{name}: no block has {needle!r}"


@pytest.mark.parametrize("name", [f for f in FILES if blocks(f)])
def test_python_blocks_run(tmp_path, name):
    work, scratch = tmp_path / "cwd", tmp_path / "tmp"
    work.mkdir()
    scratch.mkdir()
    os.symlink(os.path.join(REPO, "tests"), work / "tests")
    (tmp_path / "runner.py").write_text(RUNNER)
    (tmp_path / "blocks.json").write_text(json.dumps(blocks(name)))
    out = tmp_path / "results.json"
    env = dict(
        os.environ,
        PYTHONPATH=REPO,
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        JAX_PLATFORMS="cpu",
        TMPDIR=str(scratch),
    )
    doc = os.path.join(REPO, name)
    r = subprocess.run(
        [sys.executable, str(tmp_path / "runner.py"), doc, str(tmp_path / "blocks.json"), str(out)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    results = json.loads(out.read_text()) if out.exists() else []
    assert r.returncode == 0 and len(results) == len(blocks(name)), (
        f"{name}: the runner died (exit {r.returncode}) after {len(results)} blocks:\n"
        f"{r.stderr[-4000:]}"
    )
    expected, unexpected = [], []
    for (line, code), error in zip(blocks(name), results):
        if error is None:
            continue
        reason = next((why for text, why in XFAIL.get(name, {}).items() if text in code), None)
        if reason:
            expected.append(f"{name}, block at line {line}: {reason}")
        else:
            unexpected.append(f"{name}, block at line {line}:\n{error}")
    stderr = f"\nstderr:\n{r.stderr[-2000:]}" if r.stderr.strip() else ""
    assert not unexpected, "\n".join(unexpected) + stderr
    if expected:
        pytest.xfail("; ".join(expected))
