"""A local save, restore and inspect import only what they need (issue 59): the object-store,
safetensors and importer code cost a fresh process ~40 ms more of first save / restore when
they crept onto the path (``restoring.sources.import_open`` in ``restore_entry``,
``object_store`` in ``store.storage``, ...). They are imported where they are used; this keeps
them there."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.ucp_testing import REPO

# A fresh process: a small state saved locally (``save``), or restored (no target) and
# inspected (``restore``), then the jax_ucp modules it loaded.
_CHILD = """
import json, sys
import jax.numpy as jnp
import numpy as np
import jax_ucp
what, path = sys.argv[1:]
if what == "save":
    state = {"w": jnp.arange(6.0).reshape(2, 3), "opt": {"count": np.int32(3), "lr": 1e-3}}
    jax_ucp.save(path, state)
else:
    out = jax_ucp.restore(path)
    assert [e.name for e in jax_ucp.inspect(path).entries] == ["opt/count", "opt/lr", "w"]
    assert np.array_equal(np.asarray(out["w"]), np.arange(6.0).reshape(2, 3)), out
    assert int(out["opt"]["count"]) == 3 and out["opt"]["lr"] == 1e-3, out
print("MODULES " + json.dumps(sorted(m for m in sys.modules if m.startswith("jax_ucp"))))
"""

# Not needed by a local UCP checkpoint's save or restore: object stores, safetensors read in
# place, the importers and what only they use, a CheckpointManager root's step choice.
NOT_NEEDED = (
    "jax_ucp._src.store.storage.object_store",
    "jax_ucp._src.format.safetensors",
    "jax_ucp._src.restoring.sources.import_open",
    "jax_ucp._src.restoring.sources.import_source",
    "jax_ucp._src.restoring.resume",
    "jax_ucp._src.importers",
    "jax_ucp._src.torchfiles",
    "jax_ucp._src.conversion",
    "jax_ucp._src.exporters",
)
# ... nor, by a restore, the save's code
NOT_NEEDED_TO_RESTORE = ("jax_ucp._src.writer", "jax_ucp._src.saving")


def _loaded(what: str, path) -> list[str]:
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, what, str(path)],
        cwd=path.parent,
        capture_output=True,
        text=True,
        timeout=150,
        env={"PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(next(x for x in r.stdout.splitlines() if x.startswith("MODULES "))[8:])


def _among(loaded: list[str], names: tuple[str, ...]) -> list[str]:
    return [m for m in loaded if any(m == n or m.startswith(n + ".") for n in names)]


@pytest.mark.timeout(180)
def test_a_local_save_restore_and_inspect_import_no_object_store_safetensors_or_importer(
    tmp_path,
):
    saved = _loaded("save", tmp_path / "ckpt")
    assert "jax_ucp._src.saving.engine" in saved, saved  # the path itself ran
    assert _among(saved, NOT_NEEDED) == [], "a local save imported them: import them where used"
    restored = _loaded("restore", tmp_path / "ckpt")
    for needed in (
        "restoring.restore_entry",
        "restoring.sources.ucp_source",
        "restoring.inspecting",
    ):
        assert f"jax_ucp._src.{needed}" in restored, restored
    crept = _among(restored, NOT_NEEDED + NOT_NEEDED_TO_RESTORE)
    assert crept == [], "a local restore and inspect imported them: import them where used"
