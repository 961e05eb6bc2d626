"""The ``jax_ucp`` logger reports every commit and every directory jax_ucp removes."""

from __future__ import annotations

import logging
import os

import pytest

import jax_ucp
from jax_ucp._src.store.storage import local
from tests.ucp_testing import copy_deepspeed_fixture

pytestmark = pytest.mark.timeout(120)


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("jax_ucp")]


def test_a_forced_import_logs_its_commit_and_the_replaced_checkpoint(tmp_path, caplog):
    src = copy_deepspeed_fixture(tmp_path, "z1_fp32_dp2")
    dst = str(tmp_path / "out")
    caplog.set_level(logging.INFO, logger="jax_ucp")
    jax_ucp.convert(src, dst)
    assert f"committed {dst}" in _messages(caplog)
    caplog.clear()
    jax_ucp.convert(src, dst, force=True)
    logged = _messages(caplog)
    assert f"committed {dst}, replacing the checkpoint that was there" in logged
    assert f"removing {dst}{local.REPLACED}" in logged  # the old one, once the new is in place


def test_removed_temporaries_are_logged(tmp_path, caplog):
    dst = str(tmp_path / "ckpt")
    dead = f"{dst}{local.TMP_MARK}{os.uname().nodename}.999999999.1"  # no such process
    os.makedirs(dead)
    caplog.set_level(logging.INFO, logger="jax_ucp")
    assert local.remove_stale_temporaries(dst) == [os.path.basename(dead)]
    assert not os.path.exists(dead)
    assert any(
        m.startswith(f"removing {dead} (left by process 999999999") for m in _messages(caplog)
    )


def test_a_failed_import_logs_the_removal_of_its_temporary(tmp_path, caplog, monkeypatch):
    from jax_ucp._src.writer import checkpoint

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "write_stream", broken)
    caplog.set_level(logging.INFO, logger="jax_ucp")
    dst = str(tmp_path / "out")
    items = iter([])
    with pytest.raises(OSError, match="disk full"):
        checkpoint.write_host_checkpoint(dst, items)
    assert any(
        m.startswith(f"removing {dst}{local.TMP_MARK}")
        and m.endswith("(temporary directory of a failed import)")
        for m in _messages(caplog)
    )
    assert not os.path.exists(dst) and os.listdir(tmp_path) == []
