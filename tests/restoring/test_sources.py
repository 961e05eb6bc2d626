"""``restore`` opens its source in order: a UCP checkpoint first (``locate.is_ucp``), an import
(safetensors included) only for a path that is none; a UCP path is never probed for one."""

from __future__ import annotations

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.format import safetensors
from jax_ucp._src.importers import registry
from jax_ucp._src.restoring import locate
from jax_ucp._src.store import storage_for


def _never(*args):
    raise AssertionError(f"probed for safetensors: {args}")


def test_a_ucp_checkpoint_is_opened_without_probing_safetensors(tmp_path, monkeypatch):
    w = np.arange(6, dtype=np.float32)
    path = jax_ucp.save(str(tmp_path / "ck"), {"w": w})
    with open(tmp_path / "ck" / "model.safetensors", "wb"):  # a stray file beside ucp.json
        pass
    monkeypatch.setattr(registry, "importer_for", _never)
    monkeypatch.setattr(safetensors, "is_safetensors", _never)
    np.testing.assert_array_equal(jax_ucp.restore(path)["w"], w)
    assert locate.is_ucp(storage_for(path)) and locate.is_ucp(storage_for(tmp_path / "missing"))


def test_a_path_that_is_no_checkpoint_still_says_so(tmp_path):
    (tmp_path / "empty").mkdir()
    assert not locate.is_ucp(storage_for(tmp_path / "empty"))
    with pytest.raises(jax_ucp.CheckpointError, match="not a jax_ucp checkpoint"):
        jax_ucp.restore(tmp_path / "empty")
