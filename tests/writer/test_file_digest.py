"""``file_digest``: the digests an export records are taken while writing, whatever the writer does."""

from __future__ import annotations

import os

import numpy as np


def test_digests_taken_while_writing_survive_seeks_back_holes_and_truncation(tmp_path):
    """``DigestingFile`` against a plain read of the file it wrote: appends across blocks, a
    patch of an earlier block and of the current one, a write past the end, a truncation."""
    from jax_ucp._src.writer import file_digest

    block = file_digest.BLOCK
    rng = np.random.default_rng(0)
    scripts = {
        "in order": [("write", 3 * block + 17)],
        "patched back": [
            ("write", 2 * block + 5),
            ("seek", 10),
            ("write", 30),
            ("seek", -1),
            ("write", block),
        ],
        "patched current": [("write", 100), ("seek", 3), ("write", 4), ("seek", -1), ("write", 50)],
        "hole": [("write", 10), ("seek", block + 3), ("write", 20)],
        "truncated": [("write", 2 * block), ("truncate", block + 1), ("seek", -1), ("write", 9)],
        "empty": [],
    }
    for name, script in scripts.items():
        path = str(tmp_path / name.replace(" ", "_"))
        with open(path, "wb") as raw:
            f = file_digest.DigestingFile(raw, path)
            for op, arg in script:
                if op == "write":
                    f.write(rng.integers(0, 256, arg, dtype=np.uint8).tobytes())
                elif op == "seek":
                    f.seek(0, 2) if arg < 0 else f.seek(arg)
                else:
                    f.truncate(arg)
            got = f.finish()
        assert got == file_digest.digest_file(path), name
        assert got.size == os.path.getsize(path), name
