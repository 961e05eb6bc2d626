"""``locate``: the consistency check of a read (``consistent_reads``) on metadata changes."""

from __future__ import annotations

import os

import numpy as np

import jax_ucp
from jax_ucp._src.store.storage import Storage

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")


def test_a_chmod_of_an_idle_checkpoint_is_no_concurrent_save(tmp_path):
    """The consistency check of a read was keyed on the directory's ctime: a ``chmod`` of an
    idle checkpoint during each read made the restore fail with SaveConflictError "being
    replaced by a concurrent save". It is keyed on what a save changes (the manifest)."""
    path = str(tmp_path / "ckpt")
    jax_ucp.save(path, {"a": np.arange(4.0), "b": np.ones(3)})
    modes = [0o755, 0o700]

    def chmod_meanwhile(name: str) -> bool:
        modes.reverse()
        os.chmod(path, modes[0])
        return True

    got = jax_ucp.restore(path, select=chmod_meanwhile)
    np.testing.assert_array_equal(got["a"], np.arange(4.0))
    assert jax_ucp.verify(path, progress=lambda *_: chmod_meanwhile("")) == []


def _storages_made(monkeypatch) -> list[str]:
    """The roots of every ``Storage`` constructed from here on."""
    made: list[str] = []
    real = Storage.__init__

    def counted(self, root):
        made.append(root)
        real(self, root)

    monkeypatch.setattr(Storage, "__init__", counted)
    return made


def test_a_restore_chooses_its_storage_once(tmp_path, monkeypatch):
    """``restore`` calls ``storage_for`` once; below it the ``Storage`` is handed down (it was
    built 10 times in one restore: issue 58)."""
    path = jax_ucp.save(str(tmp_path / "ck"), {"a": np.arange(4.0), "b": np.ones(3)})
    made = _storages_made(monkeypatch)
    np.testing.assert_array_equal(jax_ucp.restore(path)["a"], np.arange(4.0))
    assert made == [path]


def test_a_direct_dcp_restore_chooses_its_storage_once(monkeypatch):
    """A torch DCP folder restored in place: one ``Storage`` of it, the restore's, handed to the
    importers' detection and plan (16 in issue 58: one per question each importer asked), and
    one of its parent, asked once whether the folder is the optimizer's beside a model's
    rank-local safetensors (transformers' ``save_optimizer_distributed``)."""
    made = _storages_made(monkeypatch)
    folder = os.path.join(FIXTURES, "torch", "fsdp2_fp32")
    jax_ucp.restore(folder)
    assert [os.path.realpath(m) for m in made] == [
        os.path.realpath(folder),
        os.path.realpath(os.path.dirname(folder)),
    ]
