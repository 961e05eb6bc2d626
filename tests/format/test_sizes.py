"""One parser for every byte-size option, on the command line and in the Python API."""

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

import jax_ucp
from jax_ucp._src.format.sizes import parse_size
from jax_ucp._src.restoring.options import RestoreOptions
from jax_ucp.cli import app
from jax_ucp.errors import RequestError
from jax_ucp.exporters import SafetensorsExport

runner = CliRunner()
WIDE = {"COLUMNS": "300"}
# (command, option) for every byte-size option of the CLI; the test below checks the list is whole
SIZE_OPTIONS = [
    ("convert", "--memory-budget"),
    ("verify", "--memory-budget"),
    ("export", "--memory-budget"),
    ("export", "--max-file-size"),
]


@pytest.mark.parametrize(
    "value, expected",
    [
        ("5G", 5 << 30),
        ("5GiB", 5 << 30),
        ("5GB", 5 * 10**9),
        ("256MiB", 256 << 20),
        ("1.5GB", 1_500_000_000),
        ("1048576", 1 << 20),
        (4096, 4096),
        (np.int64(4096), 4096),
        (2e9, 2_000_000_000),
    ],
)
def test_sizes_are_read_as_users_write_them(value, expected):
    assert parse_size(value, "x") == expected


@pytest.mark.parametrize(
    "value, message",
    [
        ("-5G", "must be a positive number of bytes"),
        (-1, "must be a positive number of bytes"),
        ("0", "must be a positive number of bytes"),
        ("garbage", "cannot read 'garbage' as a size"),
        ("5 lots", "cannot read '5 lots' as a size"),
        (1.5, "expected a number of bytes or a string"),
        (True, "expected a number of bytes"),
    ],
)
def test_bad_sizes_name_the_option(value, message):
    with pytest.raises(RequestError, match="^--the-option: " + message):
        parse_size(value, "--the-option")


def test_every_byte_size_option_of_the_cli_goes_through_the_parser():
    group = typer.main.get_command(app)
    found = []
    for name, command in group.commands.items():
        for p in command.params:
            words = " ".join(p.opts) + " " + (getattr(p, "help", "") or "")
            if any(w in words for w in ("size", "budget", "bytes", "MiB", "GB")):
                if p.name in (
                    "vocab_size",
                    "tp",
                    "pp",
                    "ep",
                    "etp",
                    "vpp",
                    "make_vocab_size_divisible_by",
                ):  # counts, not bytes
                    continue
                found.append((name, p.opts[0]))
                assert p.callback is not None and p.callback.__name__ == "_size_option", (
                    name,
                    p.opts,
                )
    assert sorted(found) == sorted(SIZE_OPTIONS)


def _hf(tmp_path):
    from safetensors.numpy import save_file

    src = tmp_path / "hf"
    src.mkdir()
    save_file({"w": np.arange(6, dtype=np.float32)}, str(src / "model.safetensors"))
    return src


def _args(command: str, option: str, value: str, tmp_path) -> list[str]:
    if command == "convert":
        return ["convert", str(_hf(tmp_path)), str(tmp_path / "out"), option, value]
    ckpt = jax_ucp.save(tmp_path / "ucp", {"params": {"w": np.arange(6, dtype=np.float32)}})
    if command == "verify":
        return ["verify", ckpt, option, value]
    return ["export", ckpt, str(tmp_path / "out"), option, value]


@pytest.mark.parametrize("command, option", SIZE_OPTIONS)
def test_every_size_option_accepts_mib(tmp_path, command, option):
    r = runner.invoke(app, _args(command, option, "64MiB", tmp_path), env=WIDE)
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("command, option", SIZE_OPTIONS)
@pytest.mark.parametrize("value", ["-5G", "lots"])
def test_a_bad_size_is_a_usage_error_naming_the_option(tmp_path, command, option, value):
    r = runner.invoke(app, _args(command, option, value, tmp_path), env=WIDE)
    assert r.exit_code == 2, r.output
    assert f"Invalid value for '{option}': " in r.output and repr(value) in r.output
    assert not (tmp_path / "out").exists()


def test_max_file_size_takes_the_units_memory_budget_does(tmp_path):
    """``--max-file-size 5G`` (refused before) is 5 GiB: one file for a small model."""
    r = runner.invoke(app, _args("export", "--max-file-size", "5G", tmp_path), env=WIDE)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_python_api_byte_sizes_take_the_same_strings(tmp_path):
    tree = {"params": {"w": np.arange(4096, dtype=np.float32), "b": np.ones(3, np.float32)}}
    assert jax_ucp.UCPSave(tree, inner_chunk_bytes="4KiB").inner_chunk_bytes == 4096
    assert RestoreOptions(memory_budget="1MiB").read_budget == 1 << 20
    assert RestoreOptions(memory_budget=7).read_budget == 7  # ints as before
    assert jax_ucp.UCPRestore(memory_budget="2MiB").memory_budget == 2 << 20
    path = jax_ucp.save(tmp_path / "c", tree, inner_chunk_bytes="4KiB")
    back = jax_ucp.restore(path, memory_budget="1KiB")
    np.testing.assert_array_equal(back["params"]["w"], tree["params"]["w"])
    assert jax_ucp.verify(path, memory_budget="1KiB") == []
    out = jax_ucp.export(path, tmp_path / "st", SafetensorsExport(max_file_bytes="10KB"))
    assert "model-00002-of-00002.safetensors" in out.files  # 16 KB of w split off from b
    assert jax_ucp.export(
        path, tmp_path / "one", SafetensorsExport(max_file_bytes="20KB")
    ).files == ["model.safetensors"]
    with pytest.raises(RequestError, match=r"^restore\(memory_budget=\): cannot read 'lots'"):
        jax_ucp.restore(path, memory_budget="lots")
    with pytest.raises(RequestError, match=r"^UCPSave\.inner_chunk_bytes:.*positive"):
        jax_ucp.UCPSave(tree, inner_chunk_bytes="-1MiB")
    with pytest.raises(RequestError, match=r"^verify\(memory_budget=\): cannot read"):
        jax_ucp.verify(path, memory_budget="1 lot")
    with pytest.raises(jax_ucp.UCPError, match=r"^max_file_bytes: cannot read '5 lots'"):
        jax_ucp.export(path, tmp_path / "bad", SafetensorsExport(max_file_bytes="5 lots"))
