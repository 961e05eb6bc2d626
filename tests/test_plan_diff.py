"""Plan a restore before allocating (jax_ucp.plan / jax-ucp plan) and compare two checkpoints
(jax_ucp.diff / jax-ucp diff)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from typer.testing import CliRunner
from ucp_testing import mesh

import jax_ucp
from jax_ucp.cli import app

runner = CliRunner()


def _saved(tmp_path):
    m = mesh((2, 4), ("data", "model"))
    w = jax.device_put(np.ones((8, 16), np.float32), NamedSharding(m, P("data", "model")))
    v = jax.device_put(np.ones((6, 4), np.float32), NamedSharding(m, P("data")))
    jax_ucp.save(
        tmp_path / "c",
        {"w": w, "v": v, "b": np.zeros(16, np.float32), "step": 3},
        logical_axes={"w": ("embed", "mlp"), "v": ("odd", None), "b": ("mlp",), "step": None},
    )
    return tmp_path / "c"


def test_plan_with_rules_counts_bytes_per_device_and_process(tmp_path):
    path = _saved(tmp_path)
    target = mesh((4, 2), ("fsdp", "tp"))
    result = jax_ucp.plan(
        path, mesh=target, rules=[("embed", "fsdp"), ("mlp", "tp"), ("odd", "fsdp")]
    )
    by = {t.name: t for t in result.tensors}
    assert by["w"].partition_spec == P("fsdp", "tp") and by["w"].bytes_per_device == 2 * 8 * 4
    assert by["b"].partition_spec == P("tp") and by["b"].bytes_per_device == 8 * 4
    assert by["v"].partition_spec == P(None, None) and by["v"].dropped == ("fsdp",)  # 6 % 4
    assert result.not_divisible == ["v"] and result.replicated == ["v"]
    assert set(result.device_bytes.values()) == {64 + 32 + 96}
    assert result.process_read_bytes == {0: 8 * 16 * 4 + 16 * 4 + 6 * 4 * 4}
    restored = jax_ucp.restore(
        path, mesh=target, rules=[("embed", "fsdp"), ("mlp", "tp"), ("odd", "fsdp")]
    )
    assert restored["w"].sharding.spec == by["w"].partition_spec  # the plan is what restore does


def test_plan_cli(tmp_path):
    path = _saved(tmp_path)
    r = runner.invoke(
        app,
        ["plan", str(path), "--mesh", "fsdp=4,tp=2", "--rules", "embed=fsdp,mlp=tp,odd=fsdp"],
        env={"COLUMNS": "120"},
    )
    assert r.exit_code == 0, r.output
    assert "(fsdp, tp)" in r.output and "could not be split as asked (1): v" in r.output
    r = runner.invoke(
        app,
        ["plan", str(path), "--mesh", "fsdp=4,tp=2", "--rules", "embed=nope"],
        env={"COLUMNS": "200"},
    )
    assert r.exit_code == 1 and "'nope'" in r.output


def test_diff_finds_every_kind_of_difference(tmp_path):
    a = {"w": np.arange(6, dtype=np.float32), "same": np.ones(3), "s": 1, "gone": np.ones(1)}
    b = {"w": np.arange(6, dtype=np.float32), "same": np.ones(3), "s": 2, "new": np.ones(1)}
    b["w"][2] = 2.5
    jax_ucp.save(tmp_path / "a", a)
    jax_ucp.save(tmp_path / "b", b)
    d = jax_ucp.diff(tmp_path / "a", tmp_path / "b")
    assert not d.identical and d.same == 1
    (t,) = d.tensors
    assert (t.name, t.differing, t.max_abs) == ("w", 1, 0.5) and abs(t.max_rel - 0.2) < 1e-12
    assert d.values == [("s", 1, 2)] and d.only_in_a == ["gone"] and d.only_in_b == ["new"]
    r = runner.invoke(
        app, ["diff", str(tmp_path / "a"), str(tmp_path / "b")], env={"COLUMNS": "200"}
    )
    assert r.exit_code == 1 and "≠ w: 1 elements differ" in r.output and "+ new" in r.output
    jax_ucp.save(tmp_path / "c", {"w": np.array([np.nan, -0.0])})
    jax_ucp.save(tmp_path / "d", {"w": np.array([np.nan, -0.0])})
    assert jax_ucp.diff(tmp_path / "c", tmp_path / "d").identical  # bits, NaN equal to itself
    r = runner.invoke(app, ["diff", str(tmp_path / "c"), str(tmp_path / "d")])
    assert r.exit_code == 0 and "identical: 1 leaf" in r.output
