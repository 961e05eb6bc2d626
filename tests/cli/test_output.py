"""What the CLI prints: tensor names holding terminal escapes (or Rich markup) are printed
escaped by every command, in tables, progress bars and the one error line."""

from __future__ import annotations

import os

import numpy as np
import pytest
from safetensors.numpy import save_file
from typer.testing import CliRunner

import jax_ucp
from jax_ucp._src.cli.output import printable
from jax_ucp.cli import app
from tests.ucp_testing import assert_one_error_line as _assert_one_error_line

runner = CliRunner()


# what a terminal obeys: C0 controls (but the line feed between lines), DEL, C1 controls (0x9b
# is CSI), line/paragraph separators, bidi marks, embeddings, overrides and isolates
_OBEYED = {chr(c) for c in [*range(0x20), *range(0x7F, 0xA0)]} - {"\n"}
_OBEYED |= set("\u2028\u2029\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e")
_OBEYED |= set("\u2066\u2067\u2068\u2069")


_HOSTILE = {
    "title\x1b]0;pwned\x07": "title\\x1b]0;pwned\\x07",  # OSC: sets the window title
    "clear\x1b[2J": "clear\\x1b[2J",  # CSI: clears the screen
    "csi1\x9b31m": "csi1\\x9b31m",  # C1 CSI
    "bidi\u202eevil": "bidi\\u202eevil",  # right-to-left override
    "nl\nx\r": "nl\\nx\\r",
    "bell\x07tab\t": "bell\\x07tab\\t",
}


_MARKUP = "mark[bold]up[/bold]"  # Rich markup: shown as it is, never interpreted


def _raw_controls(text: str) -> list[str]:
    return sorted({c for c in text if c in _OBEYED})


def test_printable_escapes_every_control_and_keeps_other_text():
    for c in sorted(_OBEYED | {"\n", "\ud800"}):
        out = printable(f"a{c}b")
        assert not _raw_controls(out) and "\ud800" not in out, repr(c)
        assert out.startswith("a\\") and out.endswith("b"), (repr(c), out)
    for text in ("params/w", "é中文🙂", "back\\slash", _MARKUP, "a b"):
        assert printable(text) == text


def _hostile_checkpoints(tmp_path):
    """Two checkpoints whose tensors and saved values carry terminal escapes; B differs in one
    tensor and has a tensor A lacks."""
    names = [*_HOSTILE, _MARKUP]
    a = {n: np.full(3, i, np.float32) for i, n in enumerate(names)}
    b = dict(a)
    b["clear\x1b[2J"] = np.full(3, 9, np.float32)
    b["only\x1b[2Jin_b"] = np.ones(2, np.float32)
    jax_ucp.save(tmp_path / "a", {"params": a, "note\x1b]0;v\x07": "val\x1b[2J"})
    jax_ucp.save(tmp_path / "b", {"params": b, "note\x1b]0;v\x07": "val\x1b[2J"})
    return str(tmp_path / "a"), str(tmp_path / "b")


@pytest.mark.timeout(240)
def test_names_with_terminal_escapes_are_printed_escaped_by_every_command(tmp_path):
    a, b = _hostile_checkpoints(tmp_path)
    env = {"COLUMNS": "250"}
    outputs = {}
    outputs["inspect"] = runner.invoke(app, ["inspect", a], env=env)
    outputs["plan"] = runner.invoke(app, ["plan", a, "--mesh", "x=3"], env=env)
    outputs["diff"] = runner.invoke(app, ["diff", a, b], env=env)
    outputs["verify"] = runner.invoke(app, ["verify", a], env=env)
    outputs["export"] = runner.invoke(
        app, ["export", a, str(tmp_path / "st"), "--to", "torch-dcp"], env=env
    )
    assert outputs["diff"].exit_code == 1  # they differ
    for command, r in outputs.items():
        if command != "diff":
            assert r.exit_code == 0, (command, r.output)
        assert not _raw_controls(r.output), (command, _raw_controls(r.output), r.output)
    for command in ("inspect", "plan"):
        for escaped in _HOSTILE.values():
            assert f"params/{escaped}" in outputs[command].output, (command, escaped)
        assert f"params/{_MARKUP}" in outputs[command].output, command
    assert "note\\x1b]0;v\\x07" in outputs["inspect"].output  # a saved value's name
    assert "val\\x1b[2J" in outputs["inspect"].output  # and its value
    assert "≠ params/clear\\x1b[2J: 3 of 3 elements differ" in outputs["diff"].output
    assert "+ params/only\\x1b[2Jin_b (only in" in outputs["diff"].output
    label = outputs["export"].output.splitlines()[0]  # the progress bar: the last tensor's name
    assert "━" in label and any(f"params.{e}" in label for e in _HOSTILE.values()), label

    # verify's failure lines and the one error line name the tensor, escaped
    (shard,) = [
        os.path.join(d, f)
        for d, _, fs in os.walk(os.path.join(a, "arrays"))
        for f in fs
        if "clear" in d and f != "zarr.json"
    ]
    data = bytearray(open(shard, "rb").read())
    data[3] ^= 0x10
    open(shard, "wb").write(bytes(data))
    r = runner.invoke(app, ["verify", a], env=env)
    assert r.exit_code == 1 and not _raw_controls(r.output), r.output
    assert "✗" in r.output and "clear\\x1b[2J" in r.output
    r = runner.invoke(app, ["export", a, str(tmp_path / "st2")], env=env)
    assert r.exit_code == 1 and not _raw_controls(r.output), r.output
    assert "clear\\x1b[2J" in _assert_one_error_line(r.output)


@pytest.mark.timeout(240)
def test_an_import_and_an_error_print_hostile_names_escaped(tmp_path):
    """A safetensors file whose tensor names carry escapes: the import's progress bar and
    ``✓`` line show them escaped; an error naming a path with escapes is one escaped line."""
    src = tmp_path / "model.safetensors"
    save_file({n: np.ones(2, np.float32) for n in _HOSTILE}, str(src))
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "out"), "--from", "safetensors"])
    assert r.exit_code == 0, r.output
    assert not _raw_controls(r.output), (_raw_controls(r.output), r.output)
    r = runner.invoke(app, ["inspect", str(tmp_path / "out")], env={"COLUMNS": "250"})
    assert r.exit_code == 0 and not _raw_controls(r.output)
    assert "params/title\\x1b]0;pwned\\x07" in r.output
    odd = tmp_path / "ckpt\x1b]0;pwned\x07"
    odd.mkdir()
    r = runner.invoke(app, ["inspect", str(odd)])
    assert r.exit_code == 1 and not _raw_controls(r.output), r.output
    assert "ckpt\\x1b]0;pwned\\x07" in _assert_one_error_line(r.output)
