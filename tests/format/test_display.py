"""How a checkpoint and its plan show in a notebook: ``to_rows()`` (pandas-ready, every row),
HTML / Markdown / pretty tables (the saved mesh on top, rows capped), and ``--json`` of
``jax-ucp inspect`` / ``plan`` round-tripping through ``json.loads``; on a jax_ucp save with
flax-style logical axes and on a checkpoint imported from torch."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from typer.testing import CliRunner

import jax_ucp
from jax_ucp._src.format import display
from jax_ucp.cli import app
from tests.ucp_testing import REPO, mesh

runner = CliRunner()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A state saved on fsdp=2 × tp=4 with logical axes."""
    path = str(tmp_path_factory.mktemp("display") / "ckpt")
    m = mesh((2, 4), ("fsdp", "tp"))
    w = jax.device_put(np.ones((8, 16), np.float32), NamedSharding(m, P("fsdp", "tp")))
    b = jax.device_put(np.zeros(16, np.float32), NamedSharding(m, P("tp")))
    tree = {"params": {"w": w, "b": b}, "step": 3}
    axes = {"params": {"w": ("embed", "mlp"), "b": ("mlp",)}, "step": None}
    jax_ucp.save(path, tree, logical_axes=axes)
    return path


def test_manifest_rows_and_tables_show_mesh_axes_and_specs(saved):
    m = jax_ucp.inspect(saved)
    rows = m.to_rows()
    by_name = {r["name"]: r for r in rows}
    assert by_name["params/w"]["logical_axes"] == ("embed", "mlp")
    assert by_name["params/w"]["saved_spec"] == ("fsdp", "tp")
    assert by_name["params/w"]["saved_mesh"] == "fsdp=2 × tp=4"
    assert by_name["step"] == {"name": "step", "value": 3, "role": "other"}
    assert m.saved_meshes == ["fsdp=2 × tp=4"]
    page = m._repr_html_()
    assert "<table>" in page and "saved mesh: fsdp=2 × tp=4" in page
    assert "(embed, mlp)" in page and "(fsdp, tp)" in page
    assert "| params/w | (8, 16) | float32 |" in m._repr_markdown_()
    assert len(repr(m)) < 200 and "2 tensors" in repr(m)
    assert "params/w" in m.tensors[0]._repr_html_() or "params/b" in m.tensors[0]._repr_html_()


def test_a_large_table_is_capped_and_says_how_many_more():
    rows = [{"name": f"t{i}", "shape": (1,)} for i in range(display.MAX_ROWS + 7)]
    assert "… and 7 more" in display.html_table("t", [], rows, ("name", "shape"))
    assert "… and 7 more" in display.text_table("t", [], rows, ("name", "shape"))
    assert display.markdown_table("t", [], rows, ("name",)).count("| t") == display.MAX_ROWS


def test_plan_rows_and_tables_show_the_new_spec_and_replication(saved):
    plan = jax_ucp.plan(saved, mesh=jax_ucp.abstract_mesh([("data", 4)]))
    rows = {r["name"]: r for r in plan.to_rows()}
    assert rows["params/w"]["replicated"] and rows["params/w"]["bytes_per_device"] == 512
    page = plan._repr_html_()
    assert "replicated on every device (2)" in page and "<table>" in page
    good = jax_ucp.plan(saved, mesh=jax_ucp.abstract_mesh([("data", 4)]), rules=[("mlp", "data")])
    rows = {r["name"]: r for r in good.to_rows()}
    assert rows["params/w"]["spec"] == (None, "data") and not rows["params/w"]["replicated"]
    assert rows["params/w"]["bytes_per_device"] == 128


def test_cli_inspect_and_plan_json_round_trip(saved):
    r = runner.invoke(app, ["inspect", saved, "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["saved_meshes"] == ["fsdp=2 × tp=4"]
    w = next(t for t in data["tensors"] if t["name"] == "params/w")
    assert w["logical_axes"] == ["embed", "mlp"] and w["saved_spec"] == ["fsdp", "tp"]
    r = runner.invoke(app, ["plan", saved, "--mesh", "data=4", "--rules", "mlp=data", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["mesh"] == {"data": 4}
    w = next(t for t in data["tensors"] if t["name"] == "params/w")
    assert w["spec"] == [None, "data"] and w["bytes_per_device"] == 128


def test_cli_inspect_at_80_columns_keeps_the_saved_spec_and_logical_axes(saved):
    r = runner.invoke(app, ["inspect", saved], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    assert "saved mesh: fsdp=2 × tp=4" in r.output
    assert "(fsdp, tp)" in r.output and "(embed, mlp)" in r.output, r.output


def test_an_imported_checkpoint_shows_the_same_way(tmp_path):
    src = os.path.join(REPO, "tests", "fixtures", "torch", "plain_state_dict.pt")
    m = jax_ucp.inspect(jax_ucp.convert(src, tmp_path / "ucp"))
    rows = m.to_rows()
    assert rows and all(r["source"] for r in rows if "shape" in r)
    assert any(line.startswith("imported from") for line in m.summary_lines())
    assert "<table>" in m._repr_html_()
