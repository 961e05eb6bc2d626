"""What a new user meets first (issue 24 items 5, 6, 11): the CLI at 80 columns and with file
names that look like Rich markup, --help placeholders, errors that say what to pass (a missing
source, a manager root, a parent folder, a shipped spec without its settings), empty
destinations used without force, and UCPSave / UCPRestore checked when constructed."""

from __future__ import annotations

import os

import numpy as np
import orbax.checkpoint as ocp
import pytest
import typer.main
from typer.testing import CliRunner

import jax_ucp
from jax_ucp import language as L
from jax_ucp.cli import app
from tests.ucp_testing import REPO

pytestmark = pytest.mark.timeout(120)
runner = CliRunner()
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


def test_a_missing_source_is_named_without_errno(tmp_path):
    r = _cli("convert", "safetensors", tmp_path / "nothere", tmp_path / "out", columns=200)
    assert r.exit_code == 1
    assert r.output.strip() == f"error: {tmp_path / 'nothere'}: no such file or directory"
    assert not (tmp_path / "out").exists()


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
    assert _cli("convert", "safetensors", hf, tmp_path / "cli_converted").exit_code == 0
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
        ("convert", "safetensors", hf, tmp_path / "mine", "--force"),
    ):
        r = _cli(*args, columns=400)
        assert r.exit_code == 1, r.output
        assert "refusing to replace it even with --force (nothing was changed)" in r.output
        assert "pass --force" not in r.output and "force=True" not in r.output
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]


def test_inspect_at_80_columns_says_which_columns_it_left_out(tmp_path):
    deep = "params/transformer/layers_0/attention/query_key_value/kernel"
    jax_ucp.save(
        tmp_path / "c",
        {deep: np.zeros((64, 192), np.float32)},
        logical_axes={deep: ("embed", "mlp")},
    )
    r = _cli("inspect", tmp_path / "c")
    assert r.exit_code == 0 and _fits(r.output), r.output
    note = "not shown at 80 columns: logical axes (COLUMNS="
    line = next(line for line in r.output.splitlines() if line.startswith(note))
    assert line.endswith(" shows it)"), line
    wide = int(line[len(note) :].split(" ")[0])
    r = _cli("inspect", tmp_path / "c", columns=wide)
    assert "(embed, mlp)" in r.output and "not shown" not in r.output, r.output


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"compression": "gzip"}, "UCPSave.compression: expected None or 'zstd', got 'gzip'."),
        (
            {"compression": "zstd", "compression_level": 30},
            "UCPSave.compression_level: expected an int in -131072..22 (zstd's levels), got 30.",
        ),
        (
            {"inner_chunk_bytes": 0},
            "UCPSave.inner_chunk_bytes: must be a positive number of bytes, got 0.",
        ),
        ({"checksum": "md5"}, "UCPSave.checksum: expected 'crc32c' or None, got 'md5'."),
        ({"source": "me"}, "UCPSave.source: expected None or a dict (a JSON object), got str."),
    ],
)
def test_ucpsave_fields_are_checked_when_constructed(kwargs, message):
    with pytest.raises(jax_ucp.UCPError, match="^" + _re(message) + "$"):
        jax_ucp.UCPSave({"w": np.ones(2)}, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mesh": "data=2"}, "UCPRestore.mesh: expected a jax.sharding.Mesh, got str."),
        (
            {"rules": [("embed", "data"), "mlp"]},
            "UCPRestore.rules: expected (logical_name, mesh_axes) pairs, e.g. "
            "[('embed', 'data'), ('mlp', 'model')], got 'mlp'.",
        ),
        (
            {"casting": "lossless"},
            "UCPRestore.casting: expected one of 'no', 'equiv', 'safe', 'same_kind', "
            "'unsafe', got 'lossless'.",
        ),
        (
            {"select": 3},
            "UCPRestore.select: expected a regex string or a predicate on the name, got int.",
        ),
        (
            {"max_read_bytes": -1},
            "UCPRestore.max_read_bytes: must be a positive number of bytes, got -1.",
        ),
        ({"strict": "no"}, "UCPRestore.strict: expected True or False, got 'no'."),
    ],
)
def test_ucprestore_fields_are_checked_when_constructed(kwargs, message):
    with pytest.raises(jax_ucp.UCPError, match="^" + _re(message) + "$"):
        jax_ucp.UCPRestore(**kwargs)


def test_args_passed_as_the_item_are_refused_not_wrapped(tmp_path):
    jax_ucp.save(tmp_path / "c", {"w": np.ones(2, np.float32)})
    handler = jax_ucp.UCPCheckpointHandler()
    with pytest.raises(jax_ucp.UCPError, match=r"^UCPRestore\.target: got a UCPRestore, which"):
        handler.restore(tmp_path / "c", jax_ucp.UCPRestore())
    with pytest.raises(jax_ucp.UCPError, match=r"^UCPSave\.item: got a UCPSave, which is"):
        jax_ucp.UCPSave(jax_ucp.UCPSave({"w": np.ones(2)}))
    with pytest.raises(jax_ucp.UCPError, match=r"restore args are a UCPSave; expected jax_ucp"):
        handler.restore(tmp_path / "c", args=jax_ucp.UCPSave({"w": np.ones(2)}))
    restored = handler.restore(tmp_path / "c", args=jax_ucp.UCPRestore())
    assert restored["w"].tolist() == [1.0, 1.0]


def test_a_shipped_spec_without_settings_says_which_to_pass(tmp_path):
    from safetensors.numpy import save_file

    h, f = 8, 16
    t = {"model.embed_tokens.weight": np.ones((10, h), np.float32)}
    t["model.norm.weight"] = np.ones(h, np.float32)
    t["lm_head.weight"] = np.ones((10, h), np.float32)
    for n in "qkvo":
        t[f"model.layers.0.self_attn.{n}_proj.weight"] = np.ones((h, h), np.float32)
    for n in ("gate", "up"):
        t[f"model.layers.0.mlp.{n}_proj.weight"] = np.ones((f, h), np.float32)
    t["model.layers.0.mlp.down_proj.weight"] = np.ones((h, f), np.float32)
    for n in ("input_layernorm", "post_attention_layernorm"):
        t[f"model.layers.0.{n}.weight"] = np.ones(h, np.float32)
    (tmp_path / "hf_synthetic").mkdir()
    save_file(t, str(tmp_path / "hf_synthetic" / "model.safetensors"))
    ckpt = jax_ucp.convert(tmp_path / "hf_synthetic", tmp_path / "ucp")
    with pytest.raises(
        L.SpecError,
        match=_re(
            "unknown setting 'num_attention_heads' (also written num_heads, heads, n_head): "
            "needed here and not given (names known here: i). Pass the model's settings with "
            "the spec: jax_ucp.language.load_spec(<spec name or file>, num_attention_heads=..."
        ),
    ):
        jax_ucp.restore(ckpt, spec="hf_llama")
    with pytest.raises(L.SpecError, match=r"'head_dim'.*derived from hidden_size and num_att"):
        jax_ucp.restore(ckpt, spec=L.load_spec("hf_llama", num_heads=2))
    spec = L.load_spec("hf_llama", num_heads=2, num_kv_heads=2, hidden_size=h)
    assert sorted(jax_ucp.restore(ckpt, spec=spec)["params"]) == [
        "layers_0",
        "lm_head",
        "ln_f",
        "wte",
    ]


def _re(text: str) -> str:
    import re

    return re.escape(text)


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


def test_shipped_samples_are_the_test_fixtures_byte_for_byte():
    """jax_ucp.samples (what the docs and notebooks run on) are copies of real fixtures."""
    import json

    from jax_ucp import samples

    fixtures = os.path.join(REPO, "tests", "fixtures")
    copies = {
        "megatron_llama_tp2": os.path.join(fixtures, "megatron", "llama_tp2"),
        "deepspeed_z2_bf16_dp2": os.path.join(fixtures, "deepspeed", "z2_bf16_dp2", "ckpt"),
    }
    assert sorted(copies) == sorted(samples.NAMES)
    for name, fixture in copies.items():
        ours = {
            os.path.relpath(os.path.join(d, f), samples.path(name))
            for d, _, files in os.walk(samples.path(name))
            for f in files
        }
        theirs = {
            os.path.relpath(os.path.join(d, f), fixture)
            for d, _, files in os.walk(fixture)
            for f in files
        }
        assert ours == theirs, name
        for rel in ours:
            with open(os.path.join(samples.path(name), rel), "rb") as a:
                with open(os.path.join(fixture, rel), "rb") as b:
                    assert a.read() == b.read(), (name, rel)
    with open(os.path.join(fixtures, "megatron", "fixtures.json")) as f:
        assert samples.settings("megatron_llama_tp2") == json.load(f)["llama_tp2"]
    with open(os.path.join(fixtures, "deepspeed", "z2_bf16_dp2", "run.json")) as f:
        assert samples.settings("deepspeed_z2_bf16_dp2") == json.load(f)
    ref = np.load(os.path.join(fixtures, "megatron", "llama_tp2.logits.npz"))
    got = samples.reference("megatron_llama_tp2")
    assert sorted(got) == sorted(ref.files)
    for k in ref.files:
        np.testing.assert_array_equal(got[k], ref[k])
    with pytest.raises(KeyError, match="no sample named 'gpt5' \\(samples: megatron_llama_tp2, "):
        samples.path("gpt5")


def test_compression_is_an_option_of_save_and_ucpsave(tmp_path):
    """zstd through save() and through UCPSave in a CheckpointManager: restored bit for bit,
    the level recorded in zarr.json, zero moments (a fresh optimizer state) nearly free."""
    import json

    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    w = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32)
    w = jax.device_put(w, NamedSharding(mesh, P("data", "model")))
    state = {"params": {"w": w}, "opt_state": {"mu": {"w": np.zeros((64, 128), np.float32)}}}

    def disk(path, name):
        d = path / "arrays" / name
        return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())

    jax_ucp.save(tmp_path / "plain", state)
    jax_ucp.save(tmp_path / "zstd", state, compression="zstd")
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        args = jax_ucp.UCPSave(state, compression="zstd", compression_level=7)
        mngr.save(1, args=ocp.args.Composite(state=args))
        mngr.wait_until_finished()
    zarr = json.loads(
        (tmp_path / "run" / "1" / "state" / "arrays" / "params.w" / "zarr.json").read_text()
    )
    codecs = zarr["codecs"][0]["configuration"]["codecs"]
    assert {"name": "zstd", "configuration": {"level": 7, "checksum": False}} in codecs
    assert disk(tmp_path / "zstd", "opt_state.mu.w") * 50 < disk(
        tmp_path / "plain", "opt_state.mu.w"
    )
    new = Mesh(np.array(jax.devices()[:2]), ("data",))
    for path in (tmp_path / "zstd", tmp_path / "run" / "1"):
        got = jax_ucp.restore(path, mesh=new, strict=False)
        assert np.asarray(got["params"]["w"]).tobytes() == np.asarray(w).tobytes()
        assert not np.asarray(got["opt_state"]["mu"]["w"]).any()
