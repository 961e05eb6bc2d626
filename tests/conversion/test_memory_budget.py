"""One memory budget for a conversion (issue 26 item 4): ``convert(memory_budget=...)`` bounds
the writer's tensors in flight together with the tensor an importer is building
(``writer.Deferred`` is built only once the writer has room for it)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src import writer
from jax_ucp._src.format.sizes import parse_size
from jax_ucp._src.writer import checkpoint as host_checkpoint
from jax_ucp.errors import RequestError
from tests.ucp_testing import REPO

FSDP2 = os.path.join(REPO, "tests", "fixtures", "torch", "fsdp2_fp32")


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "text, expected",
    [
        (4096, 4096),
        ("1048576", 1 << 20),
        ("256MiB", 256 << 20),
        ("256M", 256 << 20),
        ("1GiB", 1 << 30),
        ("1.5GiB", 3 << 29),
        ("500MB", 500 * 10**6),
        (" 64 kib ", 64 << 10),
    ],
)
def test_sizes_as_users_write_them(text, expected):
    assert parse_size(text) == expected


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "bad, why",
    [
        ("lots", r"memory_budget: cannot read 'lots' as a size \(expected e.g. 268435456, 256MiB"),
        ("12 parsecs", r"cannot read '12 parsecs' as a size"),
        (0, r"memory_budget: must be a positive number of bytes, got 0"),
        ("0MiB", r"must be a positive number of bytes, got '0MiB'"),
        (True, r"memory_budget: expected a number of bytes, got True"),
    ],
)
def test_unreadable_budgets_are_refused(bad, why):
    with pytest.raises(RequestError, match=why):
        parse_size(bad)


@pytest.mark.timeout(30)
def test_convert_refuses_a_bad_budget_before_reading(tmp_path):
    with pytest.raises(
        RequestError, match=r"^convert\(memory_budget=\): cannot read '1 lot' as a size"
    ):
        jax_ucp.convert(FSDP2, tmp_path / "ucp", memory_budget="1 lot")
    assert not os.path.exists(tmp_path / "ucp")


@pytest.mark.timeout(120)
def test_a_deferred_tensor_is_built_once_the_one_before_is_written(tmp_path):
    """Budget = one tensor: building the second needs the first retired, so its shard file is
    on disk when the second's ``make`` runs, and the values are exact."""
    a = np.arange(1024, dtype=np.float32).reshape(32, 32)
    b = -np.arange(1024, dtype=np.float32).reshape(32, 32)
    seen: list[bool] = []
    dest = tmp_path / "ckpt"

    def make_b():
        tmp = [p for p in os.listdir(tmp_path) if p.startswith("ckpt.ucp-tmp-")]
        assert len(tmp) == 1, tmp  # the import's temporary directory
        arrays = os.path.join(tmp_path, tmp[0], "arrays")
        found = [f for _, _, files in os.walk(arrays) for f in files if f != "zarr.json"]
        seen.append(bool(found))
        return b.copy()

    items = [
        writer.HostItem(("params", "a"), writer.Deferred((32, 32), np.float32, a.copy), "param"),
        writer.HostItem(("params", "b"), writer.Deferred((32, 32), np.float32, make_b), "param"),
    ]
    with writer.memory_budget_scope(a.nbytes):
        assert writer.memory_budget() == a.nbytes
        host_checkpoint.write_host_checkpoint(dest, items)
    assert writer.memory_budget() == writer.DEFAULT_MEMORY_BUDGET
    assert seen == [True]
    restored = jax_ucp.restore(dest)
    np.testing.assert_array_equal(restored["params"]["a"], a)
    np.testing.assert_array_equal(restored["params"]["b"], b)


@pytest.mark.timeout(60)
def test_a_deferred_tensor_must_be_what_it_announced(tmp_path):
    items = [
        writer.HostItem(
            ("params", "w"),
            writer.Deferred((4, 4), np.float32, lambda: np.zeros((4, 5), np.float32)),
            "param",
        )
    ]
    with pytest.raises(TypeError, match=r"HostItem 'params/w': built float32\[4, 5\], announced "):
        host_checkpoint.write_host_checkpoint(tmp_path / "ckpt", items)
    assert not os.path.exists(tmp_path / "ckpt")


@pytest.mark.timeout(120)
def test_a_dcp_import_under_a_tiny_budget_equals_the_default_one(tmp_path):
    """A budget below every tensor: one tensor at a time, the same checkpoint entry for entry."""
    small = jax_ucp.convert(FSDP2, tmp_path / "small", memory_budget="1KiB")
    default = jax_ucp.convert(FSDP2, tmp_path / "default")
    got, want = jax_ucp.restore(small), jax_ucp.restore(default)
    flat_got = dict(_flat(got))
    flat_want = dict(_flat(want))
    assert sorted(flat_got) == sorted(flat_want)
    for key, value in flat_want.items():
        np.testing.assert_array_equal(flat_got[key], value, err_msg=key)
        assert np.asarray(flat_got[key]).dtype == np.asarray(value).dtype, key


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}/{k}")
    else:
        yield prefix, tree


@pytest.mark.timeout(120)
def test_cli_memory_budget_flag(tmp_path):
    from typer.testing import CliRunner

    from jax_ucp.cli import app

    runner = CliRunner()
    out = tmp_path / "ucp"
    r = runner.invoke(
        app, ["convert", FSDP2, str(out), "--from", "torch", "--memory-budget", "64KiB"]
    )
    assert r.exit_code == 0, r.output
    want = jax_ucp.restore(jax_ucp.convert(FSDP2, tmp_path / "default"))
    got = jax_ucp.restore(out)
    for key, value in dict(_flat(want)).items():
        np.testing.assert_array_equal(dict(_flat(got))[key], value, err_msg=key)
    r = runner.invoke(
        app,
        ["convert", FSDP2, str(tmp_path / "bad"), "--from", "torch", "--memory-budget", "lots"],
        env={"COLUMNS": "300"},
    )
    assert r.exit_code != 0
    assert "'--memory-budget': cannot read 'lots' as a size" in r.output
    assert not os.path.exists(tmp_path / "bad")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("step", [None, 1])
def test_the_budget_reaches_the_writer(tmp_path, monkeypatch, step):
    """Also through a CheckpointManager step, whose write Orbax runs in another thread."""
    from jax_ucp._src.writer import shards

    seen: list[int] = []
    init = shards.PipelinedWriter.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen.append(self.max_bytes)

    monkeypatch.setattr(shards.PipelinedWriter, "__init__", recording_init)
    jax_ucp.convert(FSDP2, tmp_path / "ucp", step=step, memory_budget="3KiB")
    assert seen == [3072]
