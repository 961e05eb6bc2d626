"""ZeRO-3 splits every parameter over the DP ranks: its states are joined only once the writer
has room for them in the memory budget (issue 33), and the import is the same at any budget."""

from __future__ import annotations

import os

import numpy as np

import jax_ucp
from jax_ucp._src.importers.deepspeed import zero
from jax_ucp._src.writer import shards
from tests.ucp_testing import tree_files

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SRC = os.path.join(REPO, "tests", "fixtures", "deepspeed", "z3_bf16_dp2", "ckpt")


def test_zero3_states_are_joined_only_when_the_writer_has_room(tmp_path, monkeypatch):
    """At a 1 KiB budget every state DeepSpeed split over the ranks is joined (and every bf16
    model copy cast) while the writer holds nothing else in flight, and the checkpoint is the
    default-budget one file for file; joined in the generator, each was built before the writer
    retired the previous tensors."""
    writers: list = []
    reserve = shards.PipelinedWriter.reserve

    async def reserve_spy(self, nbytes):
        writers.append(self)
        return await reserve(self, nbytes)

    joined: list = []
    join = zero.joined_parts

    def join_spy(parts, shape, dtype):
        value = join(parts, shape, dtype)
        joined.append((writers[-1].bytes_in_flight, value.nbytes))
        return value

    monkeypatch.setattr(shards.PipelinedWriter, "reserve", reserve_spy)
    monkeypatch.setattr(zero, "joined_parts", join_spy)
    small = jax_ucp.convert(SRC, tmp_path / "small", memory_budget="1KiB")
    # joined by rows (``zero.flat_rows``): a state over the budget comes in pieces within it
    assert len(joined) > 10 and sum(n for _, n in joined) > 8 * 1024, joined
    assert all(held == 0 or held + n <= 1024 for held, n in joined), joined
    monkeypatch.undo()
    default = jax_ucp.convert(SRC, tmp_path / "default")
    assert tree_files(small, skip=("ucp.json",)) == tree_files(default, skip=("ucp.json",))
    got, want = jax_ucp.restore(small), jax_ucp.restore(default)
    for key in ("params", "model_params"):
        for name, value in want[key].items():
            np.testing.assert_array_equal(np.asarray(got[key][name]), np.asarray(value))
