"""jax_ucp.diff / jax-ucp diff: bitwise comparison of two checkpoints, tensor by tensor."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from typer.testing import CliRunner

import jax_ucp
from jax_ucp._src.restoring import checks as diff_lib
from jax_ucp._src.restoring.sources import ucp_source
from jax_ucp.cli import app

runner = CliRunner()


def _pair(tmp_path, a, b):
    jax_ucp.save(tmp_path / "a", a)
    jax_ucp.save(tmp_path / "b", b)
    return tmp_path / "a", tmp_path / "b"


def test_every_kind_of_difference(tmp_path):
    a = {
        "w": np.arange(6, dtype=np.float32),
        "same": np.ones(3),
        "shape": np.ones(3, np.float32),
        "dtype": np.ones(3, np.float32),
        "s": 1,
        "gone": np.ones(1),
    }
    b = dict(a, s=2, shape=np.ones(4, np.float32), dtype=np.ones(3, np.float16))
    del b["gone"]
    b["new"] = np.ones(1)
    b["w"] = a["w"].copy()
    b["w"][2] = 2.5
    d = jax_ucp.diff(*_pair(tmp_path, a, b))
    assert not d.identical and d.same == 1
    by = {t.name: t for t in d.tensors}
    w = by["w"]
    assert (w.differing, w.size, w.max_abs) == (1, 6, 0.5) and w.max_rel == 0.5 / 2.5
    assert not by["shape"].compared and by["shape"].shape == ((3,), (4,))
    assert by["dtype"].dtype == ("float32", "float16") and by["dtype"].max_abs is None
    assert d.values == [diff_lib.ValueDiff("s", 1, 2)]
    assert d.only_in_a == ["gone"] and d.only_in_b == ["new"]


def test_bits_not_values(tmp_path):
    x = np.array([np.nan, -0.0, 1.0], np.float32)
    assert jax_ucp.diff(
        *_pair(tmp_path, {"x": x, "f": float("nan")}, {"x": x.copy(), "f": float("nan")})
    ).identical
    d = jax_ucp.diff(*_pair(tmp_path / "z", {"x": x, "f": -0.0}, {"x": np.abs(x), "f": 0.0}))
    (t,) = d.tensors  # -0.0 vs 0.0: one element differs in bits, by nothing numerically
    assert (t.differing, t.max_abs, t.max_rel) == (1, 0.0, 0.0)
    assert d.values == [diff_lib.ValueDiff("f", -0.0, 0.0)]


def test_nan_inf_bfloat16_ints_and_bools(tmp_path):
    a = {
        "nan": np.array([1.0, 2.0], np.float32),
        "inf": np.array([1.0, np.inf], np.float32),
        "bf16": np.array([1, 2, 3], ml_dtypes.bfloat16),
        "int": np.array([5, -7], np.int32),
        "bool": np.array([True, False]),
    }
    b = {
        "nan": np.array([1.0, np.nan], np.float32),
        "inf": np.array([1.0, 3.0], np.float32),
        "bf16": np.array([1, 2, 4], ml_dtypes.bfloat16),
        "int": np.array([5, 3], np.int32),
        "bool": np.array([True, True]),
    }
    by = {t.name: t for t in jax_ucp.diff(*_pair(tmp_path, a, b)).tensors}
    assert np.isnan(by["nan"].max_abs) and np.isnan(by["nan"].max_rel)
    assert by["inf"].max_abs == np.inf and by["inf"].max_rel == np.inf
    assert (by["bf16"].max_abs, by["bf16"].max_rel) == (1.0, 0.25)
    assert (by["int"].max_abs, by["int"].max_rel) == (10.0, 10 / 7)
    assert (by["bool"].differing, by["bool"].max_abs, by["bool"].max_rel) == (1, 1.0, 1.0)


def test_streamed_one_tensor_at_a_time_in_blocks(tmp_path, monkeypatch):
    a = {f"t{i}": np.full((50, 7), i, np.float32) for i in range(4)}
    b = {k: v.copy() for k, v in a.items()}
    b["t3"][49, 6] = 100.0  # in the last block
    pa, pb = _pair(tmp_path, a, b)
    monkeypatch.setattr(diff_lib, "BLOCK", 64)  # 350 elements: 6 blocks
    live, peak, real_read = [0], [0], ucp_source.read

    def counting_read(root, manifest, requests, **kw):
        assert len(requests) == 1  # one tensor per read, never a whole checkpoint
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        return real_read(root, manifest, requests, **kw)

    monkeypatch.setattr(ucp_source, "read", counting_read)
    monkeypatch.setattr(diff_lib, "compare_tensor", _release(diff_lib.compare_tensor, live))
    seen = []
    d = jax_ucp.diff(pa, pb, progress=lambda name, done, total: seen.append((name, done, total)))
    (t,) = d.tensors
    assert (t.name, t.differing, t.max_abs) == ("t3", 1, 97.0)
    assert peak[0] == 2  # one tensor of each checkpoint at a time
    assert seen[-1] == ("t3", 4, 4)


def _release(compare, live):
    def wrapped(*args):
        try:
            return compare(*args)
        finally:
            live[0] = 0

    return wrapped


def test_corrupt_checkpoint_is_an_error_naming_the_tensor(tmp_path):
    pa, pb = _pair(tmp_path, {"w": np.ones(4, np.float32)}, {"w": np.ones(4, np.float32)})
    shard = pb / "arrays" / "w" / "c" / "0"
    data = bytearray(shard.read_bytes())
    data[2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(jax_ucp.CheckpointError, match=r"'w'.*crc32c"):
        jax_ucp.diff(pa, pb)
    r = runner.invoke(app, ["diff", str(pa), str(pb)], env={"COLUMNS": "300"})
    assert r.exit_code == 1 and "error:" in r.output and "crc32c" in r.output


def test_cli(tmp_path):
    a = {"w": np.arange(6, dtype=np.float32), "s": 1, "gone": np.ones(1), "x": np.ones(2)}
    b = {"w": np.arange(6, dtype=np.float32), "s": 2, "new": np.ones(1), "x": np.ones(3)}
    b["w"][2] = 2.5
    pa, pb = _pair(tmp_path, a, b)
    r = runner.invoke(app, ["diff", str(pa), str(pb)], env={"COLUMNS": "200"})
    assert r.exit_code == 1, r.output
    lines = r.output.splitlines()
    assert "≠ w: 1 of 6 elements differ, max abs 0.5, max rel 0.2" in lines
    assert "≠ x: shape 2 vs 3" in lines and "≠ s: 1 vs 2" in lines
    assert f"- gone (only in {pa})" in lines and f"+ new (only in {pb})" in lines
    assert "2 tensors and 1 value differ; 1 only in A, 1 only in B; 0 leaves identical" in lines
    jax_ucp.save(tmp_path / "c", {"w": np.array([np.nan, -0.0]), "n": 3})
    jax_ucp.save(tmp_path / "d", {"w": np.array([np.nan, -0.0]), "n": 3})
    r = runner.invoke(app, ["diff", str(tmp_path / "c"), str(tmp_path / "d")])
    assert r.exit_code == 0 and r.output.strip() == "identical: 2 leaves"
    r = runner.invoke(app, ["diff", str(tmp_path / "c"), str(tmp_path / "nope")])
    assert r.exit_code == 1 and "nope" in r.output
