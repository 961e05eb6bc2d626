"""Count ``match=`` patterns in tests/ that pin whole sentences.

A test of an error should match its class and what the message names (the tensor, the file,
expected vs found), not its wording: a pattern holding a run of 4 or more plain prose words
("is not the shard file") breaks on every rewording. This counts them, per directory.

    python3 tools/match_audit.py [--list] [PATHS...]   # default: tests/
"""

from __future__ import annotations

import ast
import re
import sys
from collections import Counter
from pathlib import Path

# 4+ plain words ("a", "not", "shard", "file,"), separated by single spaces
PROSE = re.compile(r"(?<![\w'/.\\-])(?:[A-Za-z]+[,;:]? ){3,}[A-Za-z]+(?![\w'/.(\\-])")


def patterns(path: Path):
    """(line, source text) of every ``match=`` keyword argument in a Python file."""
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "match":
                    yield kw.value.lineno, ast.get_source_segment(source, kw.value) or ""


def is_prose(text: str) -> bool:
    """Whether a pattern's source text (regex escapes dropped) holds 4+ prose words in a row."""
    return bool(PROSE.search(re.sub(r"\\.", "_", text)))


def main(argv: list[str]) -> int:
    listing = "--list" in argv
    roots = [Path(a) for a in argv if not a.startswith("--")] or [Path("tests")]
    total, prose = Counter(), Counter()
    for root in roots:
        for path in sorted(root.rglob("*.py") if root.is_dir() else [root]):
            for line, text in patterns(path):
                where = str(path.parent)
                total[where] += 1
                if is_prose(text):
                    prose[where] += 1
                    if listing:
                        print(f"{path}:{line}: {text}")
    for where in sorted(total):
        print(f"{where:40} {prose[where]:4} of {total[where]:4} pin prose")
    print(f"{'total':40} {sum(prose.values()):4} of {sum(total.values()):4} pin prose")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
