"""TensorStore reads a ``file`` kvstore natively, past the checks on names a checkpoint gives
(``format.files.inside``) and the harness's file spy: ``store.kvstore_config`` refuses a path
that resolves out of the checkpoint root, and ``store.open_array`` refuses a kvstore path that
is not its own real path (a link or a ``..`` below the resolved root), each a
``CheckpointError`` naming the array and the path, before TensorStore opens anything."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src import store
from jax_ucp.errors import CheckpointError
from tests.hostile.spy import NativeOpens

W = np.arange(12, dtype=np.float32).reshape(3, 4)


@pytest.fixture
def ck(tmp_path):
    """A checkpoint ``ck`` holding ``w``, and ``outside`` beside it holding a copy of its array."""
    root = tmp_path / "ck"
    jax_ucp.save(root, {"w": W})
    shutil.copytree(root / "arrays" / "w", tmp_path / "outside" / "w")
    return root


def test_an_intact_array_opens_and_reads_as_saved(ck):
    kv = store.kvstore_config(str(ck), "arrays/w")
    assert np.array_equal(store.open_array(kv).result().read().result(), W)


@pytest.mark.parametrize("how", ["absolute", "relative"])
def test_an_array_folder_linked_out_is_refused_before_tensorstore_reads_it(ck, how):
    outside = ck.parent / "outside" / "w"
    shutil.rmtree(ck / "arrays" / "w")
    os.symlink(outside if how == "absolute" else "../../outside/w", ck / "arrays" / "w")
    watch = NativeOpens(str(outside))
    with pytest.raises(CheckpointError, match=r"'arrays/w'.*outside the checkpoint"):
        store.kvstore_config(str(ck), "arrays/w")
    link = {"driver": "file", "path": str(ck / "arrays" / "w")}  # a spec built past the seam
    with pytest.raises(CheckpointError, match=r"arrays/w: reached through a link"):
        store.open_array(link)
    assert watch.drain() == []  # nothing of the copy outside was opened
    watch.close()


def test_a_dotdot_in_an_array_name_is_refused(ck):
    with pytest.raises(CheckpointError, match=r"'\.\./outside/w'.*outside the checkpoint"):
        store.kvstore_config(str(ck), "../outside/w")
    dotdot = {"driver": "file", "path": f"{ck}/arrays/../../outside/w/"}
    with pytest.raises(CheckpointError, match=r"outside/w/: reached through a link or a '\.\.'"):
        store.open_array(dotdot)


def test_a_restore_of_a_checkpoint_with_an_array_linked_out_names_it(ck):
    shutil.rmtree(ck / "arrays" / "w")
    os.symlink(ck.parent / "outside" / "w", ck / "arrays" / "w")
    watch = NativeOpens(str(ck.parent / "outside"))
    with pytest.raises(jax_ucp.UCPError, match=r"arrays/w"):
        jax_ucp.restore(ck)
    assert watch.drain() == []
    watch.close()
