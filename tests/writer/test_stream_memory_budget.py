"""A tensor larger than the memory budget, written in row slabs (issue 26 item 4): a
``writer.Deferred`` with ``rows`` is built slab by slab (whole inner chunks along dim 0, each
within the budget) straight into its shard file, byte for byte the file of the whole tensor."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

import jax_ucp
from jax_ucp._src import store, writer
from jax_ucp._src.writer import checkpoint as host_checkpoint
from jax_ucp._src.writer import shards
from jax_ucp.conversion import MegatronOptions
from jax_ucp.errors import SourceError
from tests.ucp_testing import REPO, peak_over_baseline, run_child, tree_files

MiB = 1 << 20


def _tensors_synthetic():
    rng = np.random.default_rng(7)
    return {
        # 16 MiB, inner chunks of 1024 rows (4 MiB): slabs of whole chunks
        "embed": rng.standard_normal((4096, 1024)).astype(np.float32),
        # rows of 6 MiB: inner chunks cut inside a row, slabs of one row
        "wide": rng.standard_normal((3, 3 << 20)).astype(ml_dtypes.bfloat16),
        "small": np.arange(12, dtype=np.int32).reshape(3, 4),  # under the budget: built whole
    }


def _items(tensors, slabs: list | None, whole: list):
    def make(name):
        def f():
            whole.append(name)
            return tensors[name].copy()

        return f

    def rows(name):
        def f(start, stop):
            slabs.append((name, start, stop))
            return tensors[name][start:stop].copy()

        return f

    return [
        writer.HostItem(
            ("params", name),
            writer.Deferred(
                t.shape, t.dtype, make(name), rows=None if slabs is None else rows(name)
            ),
            "param",
        )
        for name, t in tensors.items()
    ]


def _entries(root):
    return {e.name: e.to_json() for e in store.read_manifest(str(root)).entries}


def _assert_same_checkpoint(got_root, want_root) -> None:
    """Two checkpoints equal file for file (the manifests aside) and entry for entry (shard
    digests included)."""
    got, want = tree_files(got_root), tree_files(want_root)
    assert sorted(got) == sorted(want)
    for name in want:
        if name != "ucp.json":
            assert got[name] == want[name], name
    assert _entries(got_root) == _entries(want_root)


@pytest.mark.timeout(120)
def test_a_tensor_over_the_budget_is_written_in_slabs_byte_for_byte(tmp_path):
    tensors = _tensors_synthetic()
    slabs, whole = [], []
    with writer.memory_budget_scope(8 * MiB):
        host_checkpoint.write_host_checkpoint(tmp_path / "slabs", _items(tensors, slabs, whole))
    assert whole == ["small"]  # the two large tensors never built whole
    assert [s for s in slabs if s[0] == "embed"] == [
        ("embed", 0, 1024),
        ("embed", 1024, 2048),
        ("embed", 2048, 3072),
        ("embed", 3072, 4096),
    ]  # 4 MiB each: half the budget, whole inner chunks
    assert [s for s in slabs if s[0] == "wide"] == [("wide", 0, 1), ("wide", 1, 2), ("wide", 2, 3)]
    default_whole: list = []
    host_checkpoint.write_host_checkpoint(tmp_path / "whole", _items(tensors, None, default_whole))
    assert default_whole == ["embed", "wide", "small"]
    _assert_same_checkpoint(tmp_path / "slabs", tmp_path / "whole")
    e_got, e_want = _entries(tmp_path / "slabs"), _entries(tmp_path / "whole")
    assert e_want["params/embed"]["shard_digests"] == e_got["params/embed"]["shard_digests"]
    assert sorted(e_got["params/embed"]["shard_digests"]) == ["c/0/0"]
    restored = jax_ucp.restore(tmp_path / "slabs")
    for name, t in tensors.items():
        np.testing.assert_array_equal(restored["params"][name], t)
        assert restored["params"][name].dtype == t.dtype


@pytest.mark.timeout(120)
def test_a_compressed_tensor_over_the_budget_is_built_whole(tmp_path):
    """zstd shards are not written slab by slab: the tensor is built whole (the fallback)."""
    tensors = _tensors_synthetic()
    slabs, whole = [], []
    with writer.memory_budget_scope(8 * MiB):
        host_checkpoint.write_host_checkpoint(
            tmp_path / "z", _items(tensors, slabs, whole), compression="zstd"
        )
    assert slabs == [] and whole == ["embed", "wide", "small"]
    restored = jax_ucp.restore(tmp_path / "z")
    for name, t in tensors.items():
        np.testing.assert_array_equal(restored["params"][name], t)


@pytest.mark.timeout(60)
def test_an_importer_error_while_building_rows_passes_through(tmp_path):
    def rows(lo, hi):
        raise jax_ucp.UCPError(f"rows {lo}:{hi} of 'params/w' do not round to the weight")

    t = np.zeros((4096, 1024), np.float32)
    item = writer.HostItem(("params", "w"), writer.Deferred(t.shape, t.dtype, t.copy, rows=rows))
    with (
        writer.memory_budget_scope(8 * MiB),
        pytest.raises(jax_ucp.UCPError, match=r"^rows 0:1024 of 'params/w'.*round"),
    ):
        host_checkpoint.write_host_checkpoint(tmp_path / "ckpt", [item])
    assert not os.path.exists(tmp_path / "ckpt")


@pytest.mark.timeout(60)
def test_a_slab_must_be_what_was_asked(tmp_path):
    t = np.zeros((4096, 1024), np.float32)
    item = writer.HostItem(
        ("params", "w"),
        writer.Deferred(t.shape, t.dtype, t.copy, rows=lambda a, b: t[a : b + 1]),
        "param",
    )
    with (
        writer.memory_budget_scope(8 * MiB),
        pytest.raises(
            TypeError,
            match=r"HostItem 'params/w': rows 0:1024 built float32\[1025, 1024\], expected "
            r"float32\[1024, 1024\]",
        ),
    ):
        host_checkpoint.write_host_checkpoint(tmp_path / "ckpt", [item])
    assert not os.path.exists(tmp_path / "ckpt")


MEGATRON = os.path.join(REPO, "tests", "fixtures", "megatron")
MEGATRON_VOCAB = 61  # the fixtures' tokenizer vocab (padded to 64 in the checkpoint)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "fixture",
    [
        "mcore_versions/0.16.1/llama_distopt_bf16_tp2dp2_buckets",  # TP2, bf16 masters
        "mcore_versions/0.16.1/gpt_distopt_tp2pp2_dp_reshardable",  # pipeline stages
        "mcore_versions/0.16.1/llama_distopt_dp2_singleton_dp_reshardable",  # [w; v] halves
        "mcore_versions/0.16.1/moe_grouped_distopt_ep2_dp_reshardable",  # grouped, chained
        "mcore_versions/0.16.1/moe_distopt_tp2ep2_dp_reshardable",  # experts, TP2
        "mcore_versions/0.13.1/gpt_distopt_dp_zero_gather_scatter",  # pickled buffers
    ],
)
def test_a_megatron_bucket_import_in_row_slabs_equals_the_default_one(
    tmp_path, monkeypatch, fixture
):
    """Megatron's per-rank flat buckets put together rows lo:hi at a time (masters checked
    against the weight's rows): under a budget below every tensor, with inner chunks small
    enough for several slabs per tensor, the checkpoint is the default one file for file."""
    from jax_ucp._src.importers.megatron import rank_states

    monkeypatch.setattr(store, "DEFAULT_INNER_CHUNK_BYTES", 1 << 10)  # both imports alike
    asked: list = []
    read = rank_states.RankStates.read

    def spy(self, state, name, rows=None):
        asked.append(rows)
        return read(self, state, name, rows)

    monkeypatch.setattr(rank_states.RankStates, "read", spy)
    from jax_ucp._src.importers.megatron import torch_dist

    weights: list = []  # the model weights read whole: none larger than the budget
    weight_read = torch_dist.TorchDistReader.read

    def weight_spy(self, tensor, rule_name):
        value, pattern = weight_read(self, tensor, rule_name)
        weights.append(value.nbytes)
        return value, pattern

    monkeypatch.setattr(torch_dist.TorchDistReader, "read", weight_spy)
    src = os.path.join(MEGATRON, fixture)
    small = tmp_path / "small"
    jax_ucp.convert(
        src, str(small), importing=MegatronOptions(vocab_size=MEGATRON_VOCAB), memory_budget="2KiB"
    )
    slabs = [r for r in asked if r is not None]
    assert slabs and any(lo > 0 for lo, _ in slabs)  # rows read apart, not whole tensors
    assert weights and max(weights) <= 2 << 10, weights  # weights over it by rows, too
    asked.clear()
    default = tmp_path / "default"
    jax_ucp.convert(src, str(default), importing=MegatronOptions(vocab_size=MEGATRON_VOCAB))
    assert asked and all(r is None for r in asked)
    _assert_same_checkpoint(small, default)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "fixture",
    [
        "legacy_llama_tp2_synthetic",  # TP2 merges: vocab rows, qkv, swiglu, row-parallel
        "legacy_gpt_tp2pp2_synthetic",  # + pipeline-tied embeddings (built whole)
        "legacy_gpt_distopt_pp2dp2_synthetic",  # distrib_optim.pt states
    ],
)
def test_a_megatron_legacy_import_in_row_slabs_equals_the_default_one(
    tmp_path, monkeypatch, fixture
):
    """Legacy tensor-parallel merges read rows lo:hi of the lazy merge (a TensorStore view
    over the fragments): under a budget below every tensor, with small inner chunks, the
    checkpoint is the default one file for file."""
    from jax_ucp._src.importers.megatron import legacy_import

    monkeypatch.setattr(store, "DEFAULT_INNER_CHUNK_BYTES", 1 << 10)  # both imports alike
    views: list = []
    rows_view = legacy_import.LegacyMerger.rows_view

    def spy(self, name, stages):
        view = rows_view(self, name, stages)
        views.append(view is not None)
        return view

    monkeypatch.setattr(legacy_import.LegacyMerger, "rows_view", spy)
    streamed: list = []
    stream = shards.PipelinedWriter.stream

    async def stream_spy(self, p, rows, max_bytes):
        streamed.append(p.layout.shape[0] > shards.slab_rows(p, max_bytes))
        return await stream(self, p, rows, max_bytes)

    monkeypatch.setattr(shards.PipelinedWriter, "stream", stream_spy)
    src = os.path.join(MEGATRON, fixture)
    small, default = tmp_path / "small", tmp_path / "default"
    jax_ucp.convert(
        src, str(small), importing=MegatronOptions(vocab_size=MEGATRON_VOCAB), memory_budget="2KiB"
    )
    assert any(views) and any(streamed)  # several slabs for some tensors
    streamed.clear()
    jax_ucp.convert(src, str(default), importing=MegatronOptions(vocab_size=MEGATRON_VOCAB))
    assert streamed == []
    _assert_same_checkpoint(small, default)


TORCH = os.path.join(REPO, "tests", "fixtures", "torch")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fixture", ["fsdp2_fp32", "torchtitan_fp32"])
def test_a_torch_dcp_import_in_row_slabs_equals_the_default_one(tmp_path, monkeypatch, fixture):
    """torch DCP tensors read by rows of their chunks (a slab crossing the ranks' row shards):
    under a budget below every tensor, with small inner chunks, the checkpoint is the default
    one file for file, and no tensor over the budget is assembled whole."""
    from jax_ucp._src.torchfiles import dcp as torch_dcp

    monkeypatch.setattr(store, "DEFAULT_INNER_CHUNK_BYTES", 1 << 10)  # both imports alike
    slabs: list = []
    whole: list = []
    read_rows, read = torch_dcp.DcpCheckpoint.read_rows, torch_dcp.DcpCheckpoint.read

    def rows_spy(self, name, start, stop):
        out = read_rows(self, name, start, stop)
        slabs.append((name, start, stop, out.nbytes))
        return out

    def read_spy(self, name, rows=None):
        out = read(self, name, rows)
        whole.append(out.nbytes)
        return out

    monkeypatch.setattr(torch_dcp.DcpCheckpoint, "read_rows", rows_spy)
    monkeypatch.setattr(torch_dcp.DcpCheckpoint, "read", read_spy)
    src = os.path.join(TORCH, fixture)
    small, default = tmp_path / "small", tmp_path / "default"
    jax_ucp.convert(src, str(small), memory_budget="2KiB")
    assert any(start > 0 for _, start, _, _ in slabs)  # several slabs of a tensor
    assert all(n <= 1 << 10 for *_, n in slabs) and all(n <= 2 << 10 for n in whole)
    slabs.clear()
    jax_ucp.convert(src, str(default))
    assert slabs == []
    _assert_same_checkpoint(small, default)


def test_dcp_rows_are_the_rows_of_the_tensor():
    """``read_rows`` at every cut against the whole tensor, and out-of-range rows refused."""
    from jax_ucp._src.torchfiles import dcp as torch_dcp

    ck = torch_dcp.open_dcp(os.path.join(TORCH, "fsdp2_fp32"))
    name = "model.tok_embeddings.weight"  # (67, 16) in two row shards, 34 + 33
    full = ck.read(name)
    for start, stop in [(0, 67), (0, 1), (33, 35), (34, 67), (10, 60), (66, 67), (5, 5)]:
        np.testing.assert_array_equal(ck.read_rows(name, start, stop), full[start:stop])
    np.testing.assert_array_equal(ck.read(name, rows=40), full[:40])
    with pytest.raises(SourceError, match=r"no rows 60:68 in shape \[67, 16\]"):
        ck.read_rows(name, 60, 68)


@pytest.mark.torch
@pytest.mark.timeout(600)
def test_a_torch_dcp_tensor_over_the_budget_stays_within_it(tmp_path):
    """A 128 MiB tensor saved by torch DCP (two row chunks), imported at a 32 MiB budget:
    RssAnon stays well under the tensor (built whole it would be 128 MiB over the baseline)."""
    import subprocess
    import sys

    src = tmp_path / "dcp"
    make = (
        "import sys, torch, torch.distributed.checkpoint as dcp\n"
        "from torch.distributed.checkpoint.metadata import ChunkStorageMetadata\n"
        "g = torch.Generator().manual_seed(3)\n"
        "w = torch.randn(32768, 1024, generator=g)\n"
        "dcp.save({'embed.weight': w, 'small': torch.ones(3)}, checkpoint_id=sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", make, str(src)], check=True, timeout=600)
    over = peak_over_baseline(src, tmp_path / "ucp", "32MiB")
    assert over < 96 * MiB, over / MiB
    run_child(  # the tensors compared outside pytest's process, kept small (ru_maxrss)
        "import sys, numpy as np, jax_ucp, torch, torch.distributed.checkpoint as dcp\n"
        "got = jax_ucp.restore(sys.argv[2])['params']['embed.weight']\n"
        "want = {'embed.weight': torch.empty(32768, 1024), 'small': torch.empty(3)}\n"
        "dcp.load(want, checkpoint_id=sys.argv[1])\n"
        "assert np.array_equal(np.asarray(got), want['embed.weight'].numpy())\n",
        src,
        tmp_path / "ucp",
    )


_ORBAX_SAVE = """
import sys, jax, numpy as np, orbax.checkpoint as ocp
rows, cols, chunk = (int(x) for x in sys.argv[2:5])
embed = np.random.default_rng(11).standard_normal((rows, cols)).astype(np.float32)
tree = {"embed": embed, "b": np.ones(3)}
args = jax.tree.map(lambda x: ocp.SaveArgs(chunk_byte_size=chunk), tree)
with ocp.StandardCheckpointer() as c:
    c.save(sys.argv[1], tree, save_args=args)
"""

_ORBAX_CHECK = """
import sys, numpy as np, jax_ucp, orbax.checkpoint as ocp
rows, cols = int(sys.argv[2]), int(sys.argv[3])
embed = np.random.default_rng(11).standard_normal((rows, cols)).astype(np.float32)
if sys.argv[4] == "ucp":
    got = np.asarray(jax_ucp.restore(sys.argv[1])["embed"])
else:
    with ocp.StandardCheckpointer() as c:
        got = c.restore(sys.argv[1])["embed"]
assert got.dtype == embed.dtype and np.array_equal(got, embed)
"""


def _save_orbax_chunked(path, rows: int, cols: int, chunk_bytes: int) -> None:
    """An Orbax StandardCheckpointer save of a seeded (rows, cols) fp32 array in chunks of at
    most ``chunk_bytes`` (``SaveArgs.chunk_byte_size``), beside a small array."""
    run_child(_ORBAX_SAVE, os.path.abspath(path), rows, cols, chunk_bytes)


@pytest.mark.timeout(300)
def test_an_orbax_import_in_row_slabs_equals_the_default_one(tmp_path, monkeypatch):
    """An Orbax array saved in small chunks and larger than the budget is read rows lo:hi at a
    time (only the chunks holding them decoded) and re-chunked by the writer: the checkpoint
    is the default one file for file."""
    _save_orbax_chunked(tmp_path / "orbax", 256, 64, 4 << 10)  # 64 KiB, 4 KiB chunks
    embed = np.random.default_rng(11).standard_normal((256, 64)).astype(np.float32)
    monkeypatch.setattr(store, "DEFAULT_INNER_CHUNK_BYTES", 2 << 10)  # both imports alike
    streamed: list = []
    stream = shards.PipelinedWriter.stream

    async def stream_spy(self, p, rows, max_bytes):
        streamed.append((p.entry.name, shards.slab_rows(p, max_bytes)))
        return await stream(self, p, rows, max_bytes)

    monkeypatch.setattr(shards.PipelinedWriter, "stream", stream_spy)
    small, default = tmp_path / "small", tmp_path / "default"
    jax_ucp.convert(tmp_path / "orbax", str(small), memory_budget="32KiB")
    assert [n for n, _ in streamed] == ["embed"] and streamed[0][1] < 256
    streamed.clear()
    jax_ucp.convert(tmp_path / "orbax", str(default))
    assert streamed == []
    _assert_same_checkpoint(small, default)
    np.testing.assert_array_equal(jax_ucp.restore(str(small))["embed"], embed)


@pytest.mark.timeout(600)
def test_an_orbax_array_over_the_budget_stays_within_it(tmpfs_path):
    """A 160 MiB Orbax array saved in 4 MiB chunks, imported at a 32 MiB budget: RssAnon stays
    well under the array (read whole it would be 160 MiB and its decoded chunks over the
    baseline; in slabs ~60-110 MiB, glibc keeping TensorStore's freed chunk buffers)."""
    _save_orbax_chunked(tmpfs_path / "orbax", 40960, 1024, 4 << 20)
    over = peak_over_baseline(tmpfs_path / "orbax", tmpfs_path / "ucp", "32MiB")
    assert over < 136 * MiB, over / MiB
    run_child(_ORBAX_CHECK, tmpfs_path / "ucp", 40960, 1024, "ucp")


@pytest.mark.slow  # ~9 s; the default run keeps the import over the budget
@pytest.mark.timeout(600)
def test_an_orbax_export_over_the_budget_writes_chunk_by_chunk(tmpfs_path):
    """A 160 MiB tensor exported to Orbax at a 32 MiB budget: written in chunks of a sixteenth
    of the budget, a slab of them at a time (Orbax's one chunk per array held its compressed
    copy too: +314 MiB measured), and ``ocp.StandardCheckpointer().restore`` reads it
    bit-exact. The tensor itself is still read whole (+160 MiB)."""
    _save_orbax_chunked(tmpfs_path / "orbax", 40960, 1024, 4 << 20)
    ucp = jax_ucp.convert(tmpfs_path / "orbax", tmpfs_path / "ucp", memory_budget="64MiB")
    over = peak_over_baseline(ucp, tmpfs_path / "out", "32MiB", export_to="orbax")
    assert over < 240 * MiB, over / MiB
    run_child(_ORBAX_CHECK, tmpfs_path / "out", 40960, 1024, "orbax")
