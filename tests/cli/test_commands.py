"""The jax-ucp command line: inspect, verify (detects corruption), errors, demo."""

import os
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest
import typer.main
from typer.testing import CliRunner

import jax_ucp
from jax_ucp._src.cli import app, demo
from tests.ucp_testing import REPO

runner = CliRunner()


def _ckpt(tmp_path):
    jax_ucp.save(
        tmp_path / "c", {"params": {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}, "step": 2}
    )
    return tmp_path / "c"


def test_inspect_lists_tensors_and_values(tmp_path):
    r = runner.invoke(app, ["inspect", str(_ckpt(tmp_path))], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "params/w" in r.output and "3x4" in r.output and "float32" in r.output
    assert "step" in r.output


def _flip_a_bit(shard) -> None:
    """One bit of ``shard``'s bytes flipped (in its first chunk's data: its crc32c fails)."""
    data = bytearray(shard.read_bytes())
    data[3] ^= 0x10
    shard.write_bytes(bytes(data))


def test_verify_reads_everything_and_flags_corruption(tmp_path):
    path = _ckpt(tmp_path)
    r = runner.invoke(app, ["verify", str(path)])
    assert r.exit_code == 0 and "read back intact" in r.output
    _flip_a_bit(path / "arrays" / "params.w" / "c" / "0" / "0")
    r = runner.invoke(app, ["verify", str(path)], env={"COLUMNS": "300"})
    assert r.exit_code == 1
    assert "params/w" in r.output and "checksum" in r.output


def test_errors_are_one_clear_line(tmp_path):
    r = runner.invoke(app, ["inspect", str(tmp_path / "missing")])
    assert r.exit_code == 1  # a failed operation; 2 is for usage errors
    assert "error:" in r.output and "missing" in r.output and "Traceback" not in r.output
    assert runner.invoke(app, ["inspect"]).exit_code == 2  # usage: missing argument
    (tmp_path / "empty").mkdir()
    r = runner.invoke(
        app, ["convert", str(tmp_path / "empty"), str(tmp_path / "out"), "--from", "deepspeed"]
    )
    assert r.exit_code == 1 and "error:" in r.output
    assert "importing" not in r.output  # no empty progress bar before the error
    assert "no DeepSpeed checkpoint" in " ".join(r.output.split())


def test_demo_runs_bit_exact(tmp_path):
    assert demo.run(str(tmp_path))


def test_version():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"jax_ucp {jax_ucp.__version__}"


def test_force_advice_uses_the_cli_flag(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    from safetensors.numpy import save_file

    save_file({"w": np.ones(3, np.float32)}, str(src / "model.safetensors"))
    out = tmp_path / "out"
    assert (
        runner.invoke(app, ["convert", str(src), str(out), "--from", "safetensors"]).exit_code == 0
    )
    r = runner.invoke(
        app, ["convert", str(src), str(out), "--from", "safetensors"], env={"COLUMNS": "200"}
    )
    assert r.exit_code == 1 and "--force" in r.output and "force=True" not in r.output


def test_inspect_at_80_columns_is_readable(tmp_path):
    tree = {f"params/layer_{i}": np.zeros((4, 8), np.float32) for i in range(5)}
    tree.update(step=1, lr=0.5)
    jax_ucp.save(tmp_path / "c", tree)
    r = runner.invoke(app, ["inspect", str(tmp_path / "c"), "--limit", "3"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert all(len(line) <= 80 for line in lines), r.output
    header = next(line for line in lines if "name" in line)
    for column in ("name", "shape", "dtype", "size", "role"):
        assert column in header.split(), header
    assert "…" not in header
    text = " ".join(r.output.split())
    assert "5 tensors, 2 values" in text and "… and 4 more" in text
    one = runner.invoke(app, ["inspect", str(_ckpt(tmp_path / "x"))], env={"COLUMNS": "80"})
    assert "1 tensor, 1 value," in " ".join(one.output.split())


def test_inspect_of_a_file_or_a_manager_root_says_what_it_is(tmp_path):
    import orbax.checkpoint as ocp

    (tmp_path / "f").write_text("x")
    r = runner.invoke(app, ["inspect", str(tmp_path / "f")], env={"COLUMNS": "200"})
    assert r.exit_code == 1 and "is a file, not a checkpoint directory" in r.output
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        for step in (10, 20):
            mngr.save(step, args=ocp.args.Composite(state=jax_ucp.UCPSave({"x": np.ones(2)})))
        mngr.wait_until_finished()
    r = runner.invoke(app, ["inspect", str(tmp_path / "run")], env={"COLUMNS": "300"})
    assert r.exit_code == 1
    assert "CheckpointManager directory with 2 steps (10, 20)" in r.output
    assert str(tmp_path / "run" / "20" / "state") in r.output
    assert runner.invoke(app, ["inspect", str(tmp_path / "run" / "20")]).exit_code == 0


def test_demo_leaves_nothing_in_the_temp_dir(tmp_path, monkeypatch):
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    assert demo.run()
    assert list(scratch.iterdir()) == []


def test_verify_reports_each_problem_once(tmp_path):
    path = _ckpt(tmp_path)
    shard = path / "arrays" / "params.w" / "c" / "0" / "0"
    _flip_a_bit(shard)
    r = runner.invoke(app, ["verify", str(path)], env={"COLUMNS": "300"})
    assert r.exit_code == 1
    problems = [line for line in r.output.splitlines() if line.startswith("✗")]
    assert len(problems) == 1 and problems[0].count("params/w") == 1, r.output
    assert problems[0].count("checksum") == 1 and r.output.count(str(shard)) == 1
    assert r.output.splitlines()[-1] == "1 tensor of 1 failed"
    (tmp_path / "f").write_text("x")
    r = runner.invoke(app, ["verify", str(tmp_path / "f")], env={"COLUMNS": "300"})
    assert r.exit_code == 1 and "is a file, not a checkpoint directory" in r.output


def test_inspect_wraps_long_names_at_slashes_and_shows_values(tmp_path):
    deep = "params/transformer/layers_0/attention/query_key_value/kernel"
    jax_ucp.save(
        tmp_path / "c",
        {deep: np.zeros((64, 192), np.float32), "lr": 0.25, "name": "x" * 100},
        logical_axes={deep: ("embed", "mlp"), "lr": None, "name": None},
    )
    r = runner.invoke(app, ["inspect", str(tmp_path / "c")], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert all(len(line) <= 80 for line in lines), r.output
    name_lines = [line.split()[0] for line in lines if "attention" in line or "kernel" in line]
    assert "".join(name_lines) == deep and all(n.endswith("/") for n in name_lines[:-1])
    assert any(line.split()[:2] == ["lr", "0.25"] for line in lines)
    assert "'xxxxxxx" in r.output and "…" in r.output  # a long value is cut, not wrapped
    r = runner.invoke(app, ["inspect", str(tmp_path / "c")], env={"COLUMNS": "160"})
    header = next(line for line in r.output.splitlines() if line.startswith("name"))
    assert "logical axes" in header  # room for it when wide
    assert "saved spec" not in header  # numpy arrays have none: the empty column is dropped
    assert "(embed, mlp)" in r.output


@pytest.mark.parametrize("budget", [1, 3 * 4096, None], ids=["one", "three", "default"])
def test_verify_checks_several_tensors_at_once_and_reports_in_order(tmp_path, budget):
    """However many tensors are checked together (the read budget), every damaged one is
    reported once, in manifest order, and progress counts each tensor once, in order."""
    tree = {f"t{i}": np.full((32, 32), i, np.float32) for i in range(12)}  # 4 KiB each
    path = tmp_path / "c"
    jax_ucp.save(path, tree)
    damaged = ["t2", "t3", "t9"]
    for name in damaged:
        shard = path / "arrays" / name / "c" / "0" / "0"
        data = bytearray(shard.read_bytes())
        data[5] ^= 0x01
        shard.write_bytes(bytes(data))
    seen = []
    problems = jax_ucp.verify(
        path, memory_budget=budget, progress=lambda n, d, t: seen.append((n, d, t))
    )
    order = [e.name for e in jax_ucp.inspect(path).tensors]
    assert [name for name, _ in problems] == [n for n in order if n in damaged]
    assert all("checksum" in message for _, message in problems)
    assert seen == [(n, i, 12) for i, n in enumerate(order, 1)]


def _inspect_raising(monkeypatch, error):
    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(jax_ucp, "inspect", broken)


@pytest.mark.timeout(60)
def test_a_refusal_is_one_line_a_bug_is_not_caught_ctrl_c_exits_130(tmp_path, monkeypatch):
    path = str(_ckpt(tmp_path))
    _inspect_raising(monkeypatch, jax_ucp.RequestError(f"{path}: refused as asked"))
    r = runner.invoke(app, ["inspect", path])
    assert (r.exit_code, r.output.strip()) == (1, f"error: {path}: refused as asked")
    _inspect_raising(monkeypatch, TypeError("unsupported operand type(s) for +: 'int' and 'str'"))
    r = runner.invoke(app, ["inspect", path])
    assert r.exit_code == 1 and "error:" not in r.output
    assert isinstance(r.exception, TypeError) and "unsupported operand" in str(r.exception)
    _inspect_raising(monkeypatch, KeyboardInterrupt())
    r = runner.invoke(app, ["inspect", path])
    assert r.exit_code == 130 and "error:" not in r.output


@pytest.mark.timeout(120)
def test_a_bug_prints_its_traceback_from_the_console_script(tmp_path):
    code = (
        "import sys, jax_ucp\n"
        "from jax_ucp.cli import main\n"
        "def broken(*a, **k):\n"
        "    raise TypeError('a bug, not a refusal')\n"
        "jax_ucp.inspect = broken\n"
        "sys.argv = ['jax-ucp', 'inspect', sys.argv[1]]\n"
        "main()\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(_ckpt(tmp_path))],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "COLUMNS": "200", "JAX_PLATFORMS": "cpu"},
    )
    assert r.returncode == 1, r.stderr
    assert "Traceback" in r.stderr and "TypeError: a bug, not a refusal" in r.stderr, r.stderr
    assert "error:" not in r.stdout + r.stderr


MARKUP_NAMES = {"a[/b]": np.arange(6, dtype=np.float32), "[bold]x": np.ones(2, np.int32)}


def _cli(*args, columns=80):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": str(columns)})


def _fits(output: str, columns: int = 80) -> bool:
    return all(len(line) <= columns for line in output.splitlines())


def _commands():
    """Every (sub)command path of the CLI, e.g. ("convert", "torch")."""
    root = typer.main.get_command(app)
    out = []
    for name, cmd in root.commands.items():
        if hasattr(cmd, "commands"):
            out += [(name, sub) for sub in cmd.commands]
        else:
            out.append((name,))
    return out


@pytest.mark.timeout(120)
def test_file_names_are_printed_literally_never_as_markup(tmp_path):
    """A tensor named ``a[/b]`` (a closing tag Rich cannot match) printed as markup raised
    MarkupError; every command prints it as it is."""
    a, b = tmp_path / "a", tmp_path / "b"
    jax_ucp.save(a, {**MARKUP_NAMES, "note[/i]": "v[/x]"})
    jax_ucp.save(b, {**MARKUP_NAMES, "a[/b]": np.zeros(6, np.float32), "note[/i]": "w[/x]"})
    r = _cli("inspect", a)
    assert r.exit_code == 0, r.output
    assert "a[/b]" in r.output and "[bold]x" in r.output and "'v[/x]'" in r.output
    r = _cli("verify", a)
    assert r.exit_code == 0 and "2 tensors" in r.output, r.output
    r = _cli("diff", a, b, columns=200)
    assert r.exit_code == 1, r.output
    assert "≠ a[/b]: 5 of 6 elements differ" in r.output
    assert "≠ note[/i]: 'v[/x]' vs 'w[/x]'" in r.output
    shard = next(p for p in (a / "arrays").iterdir() if p.name.startswith("a")) / "c" / "0"
    data = bytearray(shard.read_bytes())
    data[2] ^= 0x10
    shard.write_bytes(bytes(data))
    r = _cli("verify", a, columns=300)
    assert r.exit_code == 1, r.output
    problem = next(line for line in r.output.splitlines() if line.startswith("✗"))
    assert "a[/b]" in problem and "checksum" in problem


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", _commands(), ids=" ".join)
def test_help_fits_80_columns_without_typer_placeholders(command):
    r = _cli(*command, "--help")
    assert r.exit_code == 0, r.output
    assert _fits(r.output), r.output
    assert "<bool>" not in r.output and "{" not in r.output, r.output
    usage = next(line for line in r.output.splitlines() if "Usage:" in line)
    params = typer.main.get_command(app)
    for name in command:
        params = params.commands[name]
    for p in params.params:
        if p.param_type_name == "argument":
            assert f" {p.name.upper()}" in usage, usage


@pytest.mark.timeout(120)
def test_a_missing_source_is_named_without_errno(tmp_path):
    r = _cli(
        "convert", tmp_path / "nothere", tmp_path / "out", "--from", "safetensors", columns=200
    )
    assert r.exit_code == 1
    assert r.output.strip() == f"error: {tmp_path / 'nothere'}: no such file or directory"
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(120)
def test_a_folder_holding_one_checkpoint_is_not_read_as_it(tmp_path):
    """``inspect <parent>`` used to show its only child without a word; an Orbax step folder
    (step metadata, or a step number as its name) is still read through its one item."""
    jax_ucp.save(tmp_path / "runs" / "only", {"w": np.ones(3, np.float32)})
    message = (
        f"{tmp_path / 'runs'}: no ucp.json here; it is not a checkpoint nor an Orbax step "
        f"directory, but holds one checkpoint: {tmp_path / 'runs' / 'only'} (pass that)."
    )
    with pytest.raises(jax_ucp.CheckpointError, match="^" + _re(message) + "$"):
        jax_ucp.inspect(tmp_path / "runs")
    with pytest.raises(jax_ucp.CheckpointError, match=_re(message)):
        jax_ucp.restore(tmp_path / "runs")
    r = _cli("inspect", tmp_path / "runs", columns=300)
    assert r.exit_code == 1 and r.output.strip() == f"error: {message}"
    jax_ucp.save(tmp_path / "7" / "state", {"w": np.ones(3, np.float32)})
    np.testing.assert_array_equal(jax_ucp.restore(tmp_path / "7")["w"], np.ones(3, np.float32))


@pytest.mark.timeout(120)
def test_restore_of_a_manager_root_lists_its_steps(tmp_path):
    root = tmp_path / "run"
    with ocp.CheckpointManager(root) as mngr:
        for step in (5, 10, 20):
            mngr.save(step, args=ocp.args.Composite(state=jax_ucp.UCPSave({"x": np.ones(2)})))
        mngr.wait_until_finished()
    with pytest.raises(
        jax_ucp.CheckpointError,
        match=_re(
            f"{root}: a CheckpointManager directory, not a checkpoint: 3 step(s) with a UCP "
            f"item (5, 10, 20); pass a step's item, e.g. {root / '20' / 'state'}"
        ),
    ):
        jax_ucp.restore(root)
    assert jax_ucp.restore(root / "20")["x"].tolist() == [1.0, 1.0]


@pytest.mark.timeout(120)
def test_empty_destinations_are_used_without_force_and_advice_is_the_cli_flag(tmp_path):
    """An empty directory the user made holds nothing to lose: save, convert and export use
    it as it is. The CLI advises --force only where --force would work."""
    from safetensors.numpy import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"w": np.arange(4, dtype=np.float32)}, str(hf / "model.safetensors"))
    for name in ("saved", "converted", "exported", "cli_converted", "cli_exported"):
        (tmp_path / name).mkdir()
    jax_ucp.save(tmp_path / "saved", {"params": {"w": np.arange(4, dtype=np.float32)}})
    jax_ucp.convert(hf, tmp_path / "converted")
    jax_ucp.export(tmp_path / "saved", tmp_path / "exported")
    assert _cli("convert", hf, tmp_path / "cli_converted", "--from", "safetensors").exit_code == 0
    assert _cli("export", tmp_path / "saved", tmp_path / "cli_exported").exit_code == 0
    for path in ("saved", "converted", "cli_converted"):
        assert jax_ucp.restore(tmp_path / path)["params"]["w"].tolist() == [0, 1, 2, 3]
    for path in ("exported", "cli_exported"):
        assert (tmp_path / path / "model.safetensors").is_file()

    again = _cli("export", tmp_path / "saved", tmp_path / "exported", columns=300)
    assert again.exit_code == 1
    assert f"{tmp_path / 'exported'} already exists; pass --force to replace it" in again.output
    assert "force=True" not in again.output and "--force / --force" not in again.output
    assert _cli("export", tmp_path / "saved", tmp_path / "exported", "--force").exit_code == 0
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    for args in (
        ("export", tmp_path / "saved", tmp_path / "mine", "--force"),
        ("convert", hf, tmp_path / "mine", "--from", "safetensors", "--force"),
    ):
        r = _cli(*args, columns=400)
        assert r.exit_code == 1, r.output
        assert "refusing to replace it even with --force (nothing was changed)" in r.output
        assert "pass --force" not in r.output and "force=True" not in r.output
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]


@pytest.mark.timeout(120)
def test_inspect_at_80_columns_says_which_columns_it_left_out(tmp_path):
    deep = "params/transformer/layers_0/attention/query_key_value/kernel"
    jax_ucp.save(
        tmp_path / "c",
        {deep: np.zeros((64, 192), np.float32)},
        logical_axes={deep: ("embed", "mlp")},
    )
    r = _cli("inspect", tmp_path / "c")
    assert r.exit_code == 0 and _fits(r.output), r.output
    assert "(embed, mlp)" in r.output, r.output  # what the user asks is kept; role goes first
    note = "not shown at 80 columns: size, role (COLUMNS="
    line = next(line for line in r.output.splitlines() if line.startswith(note))
    assert line.endswith(" shows them)"), line
    wide = int(line[len(note) :].split(" ")[0])
    r = _cli("inspect", tmp_path / "c", columns=wide)
    assert "(embed, mlp)" in r.output and "not shown" not in r.output, r.output


def _re(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.timeout(120)
def test_demo_fits_80_columns_and_says_what_it_left_out():
    r = _cli("demo", columns=80)
    assert r.exit_code == 0, r.output
    assert _fits(r.output), r.output
    lines = r.output.splitlines()
    header = next(line for line in lines if line.startswith("params "))
    assert header.split() == ["params", "shape", "saved", "A", "B", "ok"]
    assert any(
        line.split()[:5] == ["embedding", "512x64", "bf16", "(model,", "data)"] for line in lines
    )
    text = " ".join(r.output.split())
    assert (
        "not listed: opt_state, 18 Adam moments (each with its parameter's specs in all three "
        "layouts) and 1 other tensor(s), all ✓; values data_position/epoch=3, "
        "data_position/offset=12345, step=1000" in text
    )
    assert lines[-1] == "All tensors restored bit-exact."


@pytest.mark.timeout(120)
def test_elastic_resume_report_fits_80_columns_synthetic():
    """The example's report from a made-up result (the real run is tests/api/test_elastic_resume)."""
    import sys

    sys.path.insert(0, os.path.join(REPO, "examples"))
    import elastic_resume as E

    base = {s: 1.0 + s / 64 for s in range(40)}
    variants = {
        n: {
            "losses": {s: base[s] + (0.0 if n == "e" else 2**-20) for s in range(20, 40)},
            "processes": 2 if n == "d" else 1,
            "devices": 4,
            "mesh": list(E.VARIANTS[n][0]),
            "restored_from": 20,
            "continued_steps": 20,
            "bit_exact": True,
            "max_deviation": 0.0 if n == "e" else 2**-20,
            "max_rel_deviation": 0.0 if n == "e" else 2**-21,
            "matches_baseline_bitwise": n == "e",
        }
        for n in E.VARIANTS
    }
    train = {"mesh": [2, 2, 2], "losses": dict.fromkeys(range(24), 1.0)}
    train |= {"matches_baseline_bitwise": True, "killed_at": 24}
    table = E.format_table({"baseline": {"losses": base}, "variants": variants, "train": train})
    assert _fits(table), table
    lines = table.splitlines()
    words = [w for n in E.VARIANTS for w in ("|Δ|", f"({n})")]
    assert lines[0].split() == ["step", "baseline", *words]
    assert lines[2].split() == ["20", "1.3125000", *(["9.54e-07"] * 4), "0.00e+00", "9.54e-07"]
    row = next(line for line in lines if line.startswith("(d)"))
    assert row.split() == [
        "(d)",
        "2×2",
        "2,1,2",
        "20",
        "20",
        "True",
        "9.54e-07",
        "4.8e-07",
        "False",
    ]
    assert f"(d) {E.VARIANTS['d'][3]}" in lines


def test_inspect_and_plan_group_many_tensors_by_name_pattern(tmp_path):
    """Past layout.GROUP_AT tensors the tables show one row per name pattern (digits as *),
    with the count and summed sizes; --all lists each."""
    tree = {f"layer{i}": {"w": np.zeros((4, 4), np.float32)} for i in range(210)}
    jax_ucp.save(tmp_path / "c", tree)
    r = _cli("inspect", tmp_path / "c", columns=120)
    assert r.exit_code == 0, r.output
    assert "210 tensors in 1 name patterns" in r.output and "layer*/w (210)" in r.output
    assert "13.1 KiB" in r.output, r.output  # 210 × 64 B
    r = _cli("plan", tmp_path / "c", "--mesh", "data=2", columns=120)
    assert r.exit_code == 0 and "layer*/w (210)" in r.output, r.output
    r = _cli("inspect", tmp_path / "c", "--all", columns=120)
    assert "layer209/w" in r.output and "name patterns" not in r.output


@pytest.mark.parametrize("form", ["lines", "json"])
def test_convert_takes_the_parameter_order_from_a_file_and_says_what_it_imported(
    tmp_path, monkeypatch, form
):
    """``--parameter-order FILE`` (one name a line, or a JSON list) reaches the torch importer:
    a Trainer checkpoint without transformers imports its optimizer; the summary names
    tensors, moments, the step and what was skipped, and how to restore it."""
    import json

    monkeypatch.setitem(sys.modules, "transformers", None)
    fix = os.path.join(REPO, "tests", "fixtures", "hf_trainer")
    with np.load(os.path.join(fix, "trainer_fp32.truth.npz")) as z:
        names = [k.split("/", 1)[1] for k in z.files if k.startswith("param/")]
        step = int(z["step"])
    norms = [n for n in names if n.endswith("norm.weight")]
    order = [n for n in names if n not in norms] + norms
    listing = tmp_path / "order.txt"
    listing.write_text(json.dumps(order) if form == "json" else "\n".join(order) + "\n")
    src = os.path.join(fix, "trainer_fp32", "checkpoint-3")
    r = _cli("convert", src, tmp_path / "out", "--parameter-order", listing, columns=200)
    assert r.exit_code == 0, r.output
    assert f"{len(names)} parameters, {2 * len(names)} optimizer moments; step {step}" in r.output
    assert "skipped (listed in source.skipped)" in r.output and "jax-ucp inspect" in r.output
    restored = jax_ucp.restore(tmp_path / "out")
    assert sorted(restored["opt_state"]["mu"]) == sorted(names)
    listing.write_text("[1, 2]")
    r = _cli("convert", src, tmp_path / "bad", "--parameter-order", listing)
    assert r.exit_code == 2 and "--parameter-order" in r.output


@pytest.mark.torch
def test_convert_takes_the_model_config_for_an_accelerate_save_state(tmp_path):
    """``--model-config CONFIG.json`` reaches the torch importer: Accelerate's save_state of
    AdamW(model.parameters()) (no names, no config.json) imports its optimizer, the order
    rebuilt from the config's model; every moment equals the run's."""
    fix = os.path.join(REPO, "tests", "fixtures", "accelerate")
    src = os.path.join(fix, "accelerate_plain")
    config = os.path.join(fix, "llama.config.json")
    r = _cli("convert", src, tmp_path / "out", "--model-config", config, columns=200)
    assert r.exit_code == 0, r.output
    restored = jax_ucp.restore(tmp_path / "out")
    with np.load(os.path.join(fix, "accelerate_plain.truth.npz")) as z:
        for key in z.files:
            kind, _, name = key.partition("/")
            if kind == "exp_avg":
                np.testing.assert_array_equal(restored["opt_state"]["mu"][name], z[key])
            elif kind == "exp_avg_sq":
                np.testing.assert_array_equal(restored["opt_state"]["nu"][name], z[key])
        assert int(restored["opt_state"]["count"]) == int(z["step"])
    source = jax_ucp.inspect(tmp_path / "out").source
    assert source["parameter_order"].startswith(config)


@pytest.mark.parametrize("size", ["\u00b2", "\u0662", "\uff12"])
def test_a_mesh_size_in_other_digits_is_a_usage_error(tmp_path, size):
    """``str.isdigit`` passed ``²`` and ``int()`` then raised a raw ValueError; ``٢`` and ``２``
    were taken as 2. A mesh size is ASCII digits."""
    jax_ucp.save(tmp_path / "c", {"w": np.zeros((4, 4), np.float32)})
    r = _cli("plan", tmp_path / "c", "--mesh", f"data={size}", columns=120)
    assert r.exit_code == 2 and "expected axis=size" in r.output, r.output
