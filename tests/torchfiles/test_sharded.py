"""The pieces of DTensors / ShardedTensors as the allow-listed unpickler reads them from verl's
rank files (tests/fixtures/verl), and the layouts refused: what the file states, nothing
guessed."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest

from jax_ucp._src.torchfiles import allow_list, pickle_format, sharded, torch_zip
from jax_ucp._src.torchfiles.allow_list import TorchFileError
from tests.ucp_testing import REPO

ACTOR = os.path.join(REPO, "tests", "fixtures", "verl", "{}", "global_step_3", "actor")


def _load(kind: str, rank: int) -> dict:
    path = os.path.join(ACTOR.format(kind), f"model_world_size_2_rank_{rank}.pt")
    return torch_zip.load_torch_file(path, allow_list.SHARDED_TENSOR_CLASSES)


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
def test_two_ranks_pieces_tile_the_uneven_embedding(kind):
    """67 rows over 2 ranks: rows 0-33 and 34-66, as torch chunks them."""
    tensors = [_load(kind, r)["model.embed_tokens.weight"] for r in (0, 1)]
    assert all(t.shape == (67, 16) for t in tensors)
    pieces = [p for t in tensors for p in sharded.local_pieces(t, 2)]
    assert [(p.offsets, p.array.shape) for p in pieces] == [((0, 0), (34, 16)), ((34, 0), (33, 16))]
    assert sharded.covers((67, 16), pieces) is None
    whole = sharded.assemble((67, 16), np.dtype(np.float32), pieces)
    assert np.array_equal(
        sharded.assemble((67, 16), np.dtype(np.float32), pieces, 30, 40), whole[30:40]
    )
    assert sharded.covers((67, 16), pieces[:1]).startswith("the pieces hold 544")


def test_a_dtensor_layout_not_stated_plainly_is_refused():
    t = _load("fsdp2", 1)["model.norm.weight"]
    spec = t.state[1]["_spec"]
    strided = copy.copy(t)
    strided.state = (None, {**t.state[1], "_spec": copy.copy(spec)})
    strided.state[1]["_spec"].__dict__["placements"] = (
        allow_list.SHARDED_TENSOR_CLASSES[
            "torch.distributed.tensor.placement_types._StridedShard"
        ](),
    )
    with pytest.raises(sharded.ShardLayoutError, match="_StridedShard"):
        sharded.local_pieces(strided, 2)
    with pytest.raises(sharded.ShardLayoutError, match=r"expected \(4,\), found \(8,\)"):
        sharded.local_pieces(t, 4)  # 16 rows over 4 ranks: the file's piece is of 2 ranks


def test_getattr_in_a_pickle_reaches_only_sharded_tensors_process_group_state():
    """``getattr`` is allowed for one lookup a pickled ShardedTensor makes; any other (here an
    attribute of an allowed global) is refused, and without the sharded classes it is no
    global at all."""
    evil = b"\x80\x02cbuiltins\ngetattr\nccollections\nOrderedDict\nX\x08\x00\x00\x00__call__\x86R."
    with pytest.raises(allow_list.TorchFileError, match=r"getattr.*is not allowed"):
        pickle_format.restricted_loads(evil, extra_classes=allow_list.SHARDED_TENSOR_CLASSES)
    with pytest.raises(TorchFileError, match=r"builtins\.getattr"):
        pickle_format.restricted_loads(evil)


def test_pieces_of_another_dtype_are_refused_not_cast():
    """numpy casts an int32 piece into a float32 tensor without a word (other values)."""
    pieces = [
        sharded.Piece((0,), np.arange(2, dtype=np.float32)),
        sharded.Piece((2,), np.arange(2, dtype=np.int32)),
    ]
    with pytest.raises(sharded.ShardLayoutError, match=r"piece at \(2,\) holds int32.*float32"):
        sharded.assemble((4,), np.dtype(np.float32), pieces)


@pytest.mark.parametrize("dim, mesh", [(1, 2), (-1, 2), (0, 0)])
def test_a_shard_dim_the_tensor_lacks_is_a_layout_error(dim, mesh):
    """Shard(1) of a 1-D tensor was a raw IndexError, a 0-rank mesh a ZeroDivisionError."""
    with pytest.raises(sharded.ShardLayoutError, match=r"the tensor is \[6\], 1-D"):
        sharded.dtensor_box((6,), (mesh,), (0,), (dim,))
