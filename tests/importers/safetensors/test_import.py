"""Hugging Face safetensors import: files written by the `safetensors` package itself (torch-free),
single and sharded with an index, bf16/fp16/fp32, equal element for element; hostile files refused."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jax_ucp
from tests.ucp_testing import assert_bit_exact

pytestmark = pytest.mark.timeout(120)


def _weights(dtype):
    rng = np.random.default_rng(0)
    return {
        "model.embed_tokens.weight": rng.standard_normal((32, 16)).astype(dtype),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((16, 16)).astype(dtype),
        "model.layers.0.mlp.gate_proj.weight": rng.standard_normal((24, 16)).astype(dtype),
        "model.norm.weight": np.ones(16, dtype),
        "lm_head.weight": rng.standard_normal((32, 16)).astype(dtype),
    }


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16], ids=str)
def test_single_file_bit_exact(tmp_path, dtype):
    src = tmp_path / "hf"
    src.mkdir()
    save_file(_weights(dtype), str(src / "model.safetensors"), metadata={"format": "pt"})
    out = jax_ucp.convert(src, tmp_path / "ucp")
    got = jax_ucp.restore(out)["params"]
    want = load_file(str(src / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert_bit_exact(got[name], value, name)
    m = jax_ucp.inspect(out)
    assert m.source["framework"] == "safetensors" and m.source["metadata"] == {"format": "pt"}
    assert {e.role for e in m.tensors} == {"param"}


def test_sharded_with_index_and_a_single_file_path(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    weights = _weights(ml_dtypes.bfloat16)
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[:2],
        "model-00002-of-00002.safetensors": names[2:],
    }
    for file, part in shards.items():
        save_file({n: weights[n] for n in part}, str(src / file))
    index = {
        "metadata": {"total_size": 0},
        "weight_map": {n: f for f, p in shards.items() for n in p},
    }
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    got = jax_ucp.restore(jax_ucp.convert(src, tmp_path / "ucp"))["params"]
    for name, value in weights.items():
        assert_bit_exact(got[name], value, name)
    one = jax_ucp.convert(src / "model-00002-of-00002.safetensors", tmp_path / "one")
    assert sorted(jax_ucp.restore(one)["params"]) == names[2:]


def _header_file(path, header: dict, data: bytes = b""):
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


BAD = {
    "header longer than the file": (
        lambda p: p.write_bytes((10**6).to_bytes(8, "little") + b"{}"),
        "header of 1000000 bytes",
    ),
    "huge header": (lambda p: p.write_bytes((2**40).to_bytes(8, "little") + b"{}"), "at most"),
    "not json": (lambda p: p.write_bytes((4).to_bytes(8, "little") + b"nope"), "corrupt header"),
    "unknown dtype": (
        lambda p: _header_file(
            p, {"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8
        ),
        "dtype 'C64' is not supported",
    ),
    "range past the end": (
        lambda p: _header_file(
            p, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8
        ),
        "do not hold a F32 array",
    ),
    "shape and range disagree": (
        lambda p: _header_file(
            p, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}}, b"\0" * 16
        ),
        "do not hold",
    ),
    "overlapping tensors": (
        lambda p: _header_file(
            p,
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 16,
        ),
        "overlap",
    ),
    "fifo": (lambda p: os.mkfifo(p), "not a regular file"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_hostile_files_are_clear_errors(tmp_path, case):
    make, message = BAD[case]
    src = tmp_path / "hf"
    src.mkdir()
    make(src / "model.safetensors")
    with pytest.raises(jax_ucp.UCPError, match=message):
        jax_ucp.convert(src, tmp_path / "ucp")
    assert not os.path.exists(tmp_path / "ucp")


@pytest.mark.parametrize(
    "weight_map, message",
    [
        ({"a": "../outside.safetensors"}, "beside the index"),
        ({"a": "model.safetensors", "b": "model.safetensors"}, "weight_map and the files disagree"),
    ],
    ids=["path outside", "index names a missing tensor"],
)
def test_hostile_index(tmp_path, weight_map, message):
    src = tmp_path / "hf"
    src.mkdir()
    save_file({"a": np.ones(2, np.float32)}, str(src / "model.safetensors"))
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(jax_ucp.UCPError, match=message):
        jax_ucp.convert(src, tmp_path / "ucp")


def test_trainer_checkpoint_with_optimizer_state_needs_weights_only(tmp_path):
    """A Trainer ``checkpoint-N/`` (no DeepSpeed) holds optimizer.pt beside model.safetensors:
    importing the weights alone without saying so would drop the optimizer state silently; an
    optimizer.pt that is not a torch file is refused by name (real Trainer checkpoints import
    with their optimizer: tests/importers/torch/test_hf_trainer.py)."""
    folder = tmp_path / "checkpoint-10"
    folder.mkdir()
    tensors = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "optimizer.pt").write_bytes(b"not read")
    with pytest.raises(jax_ucp.UCPError, match=r"optimizer\.pt"):
        jax_ucp.convert(str(folder), str(tmp_path / "refused"))
    assert not (tmp_path / "refused").exists()
    ckpt = jax_ucp.convert(str(folder), str(tmp_path / "u"), weights_only=True)
    assert_bit_exact(jax_ucp.restore(ckpt)["params"]["w"], tensors["w"])
    assert jax_ucp.inspect(ckpt).source["skipped"] == {
        "optimizer.pt": "weights_only: Hugging Face Trainer's torch optimizer state"
    }
    # the file by its own path is that file only
    ckpt = jax_ucp.convert(str(folder / "model.safetensors"), str(tmp_path / "file"))
    assert_bit_exact(jax_ucp.restore(ckpt)["params"]["w"], tensors["w"])
