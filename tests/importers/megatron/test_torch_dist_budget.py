"""What a megatron-core torch_dist import holds between tensors (issue 33): a parameter's model
weight does not outlive its model-precision copy, and a state built whole reads its TP pieces a
block of rows at a time; neither changes a byte of the checkpoint."""

from __future__ import annotations

import os

import pytest

import jax_ucp
from jax_ucp._src.importers.megatron import rank_states, torch_dist
from jax_ucp.conversion import MegatronOptions
from tests.ucp_testing import tree_files

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SRC = os.path.join(
    REPO,
    "tests",
    "fixtures",
    "megatron",
    "mcore_versions",
    "0.16.1",
    "llama_distopt_bf16_tp2dp2_buckets",
)
VOCAB = 61  # the fixtures' tokenizer vocab (padded to 64 in the checkpoint)


@pytest.mark.timeout(300)
def test_no_model_weight_is_kept_once_its_copy_is_written(tmp_path, monkeypatch):
    """Every weight read whole (for the masters' check) is let go when its model-precision
    copy is built: kept, the generator held it beside the next parameter's states (+72 MiB at
    a 128 MiB budget on a 135M Llama)."""
    made: list = []
    init = torch_dist.ModelWeight.__init__

    def init_spy(self, reader, name):
        init(self, reader, name)
        made.append(self)

    read: list = []
    get = torch_dist.ModelWeight.get

    def get_spy(self):
        read.append(self.name)
        return get(self)

    monkeypatch.setattr(torch_dist.ModelWeight, "__init__", init_spy)
    monkeypatch.setattr(torch_dist.ModelWeight, "get", get_spy)
    jax_ucp.convert(SRC, tmp_path / "ucp", importing=MegatronOptions(vocab_size=VOCAB))
    assert len(made) > 5 and read
    assert [w.name for w in made if w.value is not None] == []


@pytest.mark.timeout(300)
def test_a_whole_state_read_in_row_blocks_is_the_same_checkpoint(tmp_path, monkeypatch):
    """With blocks of 256 bytes the TP pieces of whole states are read in many more, smaller
    ranges of the flat buckets than with the default blocks (one per piece on this small
    model; per-layer pieces of stacked tensors are read whole either way), and the checkpoint is the same, file for file."""
    ranges: list = []
    flat = rank_states.RankStates.flat

    def flat_spy(self, rank, bucket, state, start, end):
        ranges.append(end - start)
        return flat(self, rank, bucket, state, start, end)

    monkeypatch.setattr(rank_states.RankStates, "flat", flat_spy)
    default = jax_ucp.convert(
        SRC, tmp_path / "default", importing=MegatronOptions(vocab_size=VOCAB)
    )
    whole = list(ranges)
    ranges.clear()
    monkeypatch.setattr(rank_states, "BLOCK_BYTES", 256)
    small = jax_ucp.convert(SRC, tmp_path / "small", importing=MegatronOptions(vocab_size=VOCAB))
    assert len(ranges) > 2 * len(whole), (len(ranges), len(whole))
    assert sum(ranges) == sum(whole)  # every element read once either way
    assert tree_files(small, skip=("ucp.json",)) == tree_files(default, skip=("ucp.json",))
