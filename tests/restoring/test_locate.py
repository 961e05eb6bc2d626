"""``locate``: the consistency check of a read (``consistent_reads``) on metadata changes."""

from __future__ import annotations

import os

import numpy as np

import jax_ucp


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
