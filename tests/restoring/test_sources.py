"""``restore`` opens its source in order: a UCP checkpoint first (``sources.opening``: a manifest
here? asked once), an import (safetensors included) only for a path that is none; a UCP path is
never probed for one; a path no reader claims says what the UCP reader and the detectors found."""

from __future__ import annotations

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.format import safetensors
from jax_ucp._src.importers import registry
from jax_ucp._src.restoring import locate, sources
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
    for where, manifest in ((path, True), (tmp_path / "missing", None)):  # missing: a swap
        storage = storage_for(where)
        assert sources.opening(storage) == sources.Opening(storage, manifest=manifest)


def test_a_path_that_is_no_checkpoint_says_what_each_reader_found(tmp_path):
    """No manifest and no importer claiming it: the UCP reader's error carries the detectors'
    report (``registry.Unclaimed``), not swallowed into "not a jax_ucp checkpoint" alone."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("hi")
    assert not locate.is_ucp(storage_for(tmp_path / "empty"), manifest=False)
    report = r"not a jax_ucp checkpoint.* Nor a source .*cannot tell the checkpoint format; it holds: notes\.txt"
    with pytest.raises(jax_ucp.CheckpointError, match=report):
        jax_ucp.restore(tmp_path / "empty")
