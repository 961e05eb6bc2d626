"""How a checkpoint and its plan show in a notebook: ``to_rows()`` (pandas-ready, every row),
HTML / Markdown / pretty tables (the saved mesh on top, rows capped), and ``--json`` of
``jax-ucp inspect`` / ``plan`` round-tripping through ``json.loads``; on a jax_ucp save with
flax-style logical axes and on a checkpoint imported from torch."""

from __future__ import annotations

import io
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


HOSTILE = (
    "\x1b]0;owned\x07\x1b[2J<script>alert(1)</script><img src=x onerror=alert(2)>"
    "<iframe src=javascript:alert(3)></iframe>|`code`[link](javascript:alert(4))*em*_u_$x$\u202e"
)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """A checkpoint whose tensor name carries HTML, Markdown and terminal escapes."""
    path = str(tmp_path_factory.mktemp("hostile") / "ckpt")
    jax_ucp.save(path, {HOSTILE: np.ones(3, np.float32), "ok": np.zeros(2, np.float32)})
    return path


def _displays(path):
    return jax_ucp.inspect(path), jax_ucp.plan(path, mesh=jax_ucp.abstract_mesh([("data", 2)]))


def test_markdown_of_a_hostile_name_renders_as_its_text(hostile):
    """The Markdown repr of a manifest and of a plan, rendered by a CommonMark + tables
    renderer, has no element from the name (no script, img, iframe, link, emphasis, code) and
    shows the name's characters; every row keeps its columns."""
    markdown_it = pytest.importorskip("markdown_it")
    renderer = markdown_it.MarkdownIt("commonmark").enable("table")
    for shown in _displays(hostile):
        text = shown._repr_markdown_()
        page = renderer.render(text)
        for tag in ("<script", "<img", "<iframe", "<a ", "<em>", "<code>", "<strong>alert"):
            assert tag not in page, (tag, text)
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
        assert "[link](javascript:alert(4))" in page and "\\x1b]0;owned\\x07" in page
        rows = [line for line in page.split("<tr>")[1:]]
        assert len(rows) == 3 and all(r.count("<td") in (0, len(shown.table()[3])) for r in rows)
        assert "\x1b" not in text and "\u202e" not in text


def test_pretty_and_html_reprs_show_terminal_escapes_escaped(hostile):
    from IPython.lib.pretty import PrettyPrinter

    for shown in _displays(hostile):
        out = io.StringIO()
        printer = PrettyPrinter(out)
        shown._repr_pretty_(printer, False)
        printer.flush()
        text = out.getvalue()
        assert "\\x1b]0;owned\\x07\\x1b[2J<script>" in text and "\\u202e" in text
        assert not any(c in text for c in "\x1b\x07\u202e")
        page = shown._repr_html_()
        assert "&lt;script&gt;" in page and not any(c in page for c in "\x1b\x07\u202e")


def test_cli_json_is_strict_and_writes_non_finite_values_as_strings(tmp_path):
    """jq and JSON.parse refuse bare NaN / Infinity: ``--json`` writes them as strings."""
    path = str(tmp_path / "ckpt")
    values = {"nan": float("nan"), "inf": float("inf"), "ninf": -float("inf"), "lr": 0.5}
    jax_ucp.save(path, {"w": np.ones(2, np.float32), **values})
    r = runner.invoke(app, ["inspect", path, "--json"])
    assert r.exit_code == 0, r.output

    def refuse(token):
        raise AssertionError(f"bare {token} in --json output")

    data = json.loads(r.output, parse_constant=refuse)
    got = {v["name"]: v["value"] for v in data["values"]}
    assert got == {"nan": "NaN", "inf": "Infinity", "ninf": "-Infinity", "lr": 0.5}
