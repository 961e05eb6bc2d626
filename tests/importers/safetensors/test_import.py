"""Hugging Face safetensors import: files written by the `safetensors` package itself (torch-free),
single and sharded with an index, bf16/fp16/fp32, equal element for element; hostile files refused."""

from __future__ import annotations

import json
import os
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jax_ucp
from jax_ucp.conversion import ImportOptions
from tests.ucp_testing import (
    assert_bit_exact,
    assert_convert_refused,
    restored_params,
)

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
        ({}, r"index\.json: its 'weight_map' names no tensor"),  # before: an empty import
    ],
    ids=["path outside", "index names a missing tensor", "empty weight_map"],
)
def test_hostile_index(tmp_path, weight_map, message):
    src = tmp_path / "hf"
    src.mkdir()
    save_file({"a": np.ones(2, np.float32)}, str(src / "model.safetensors"))
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(jax_ucp.UCPError, match=message):
        jax_ucp.convert(src, tmp_path / "ucp")


@pytest.mark.parametrize("how", ["deleted", "renamed"])
def test_a_shard_the_index_names_but_the_folder_lacks_is_named(tmp_path, how):
    """A shard deleted, or renamed (``model-0000002-of-00002.safetensors``): the index's entry
    and the file named, on import and on restore; before: a raw FileNotFoundError (found by
    tests/hostile)."""
    src = tmp_path / "hf"
    src.mkdir()
    save_file({"a": np.ones(2, np.float32)}, str(src / "model-00001-of-00002.safetensors"))
    save_file({"b": np.zeros(3, np.float32)}, str(src / "model-00002-of-00002.safetensors"))
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shard = src / "model-00002-of-00002.safetensors"
    if how == "deleted":
        shard.unlink()
    else:
        shard.rename(src / "model-0000002-of-00002.safetensors")
    message = (
        r"index\.json: weight_map entry 'b' names the file 'model-00002-of-00002\.safetensors'"
    )
    with pytest.raises(jax_ucp.SourceError, match=message):
        jax_ucp.convert(src, tmp_path / "ucp")
    assert not os.path.exists(tmp_path / "ucp")
    with pytest.raises(jax_ucp.SourceError, match=message):
        jax_ucp.restore(src)


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
    ckpt = jax_ucp.convert(
        str(folder), str(tmp_path / "u"), importing=ImportOptions(weights_only=True)
    )
    assert_bit_exact(jax_ucp.restore(ckpt)["params"]["w"], tensors["w"])
    assert jax_ucp.inspect(ckpt).source["skipped"] == {
        "optimizer.pt": "weights_only: Hugging Face Trainer's torch optimizer state"
    }
    # the file by its own path is that file only
    ckpt = jax_ucp.convert(str(folder / "model.safetensors"), str(tmp_path / "file"))
    assert_bit_exact(jax_ucp.restore(ckpt)["params"]["w"], tensors["w"])


# Hostile inputs, each built here: a clear error naming the file, or an exact import.


def _safetensors(path, header_json: str, data: bytes) -> None:
    """A safetensors file with this exact header text (duplicate keys survive)."""
    raw = header_json.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


F32 = '{{"dtype": "F32", "shape": [2], "data_offsets": [{0}, {1}]}}'


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "header, message",
    [
        (
            '{"w": ' + F32.format(0, 8) + ', "w": ' + F32.format(8, 16) + "}",
            r"model\.safetensors: the header: names 'w' twice \(a JSON object with a duplicate key",
        ),
        (
            '{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "dtype": "I32"}}',
            r"model\.safetensors: the header: names 'dtype' twice",
        ),
        (
            '{"__metadata__": {"format": "pt", "format": "np"}, "w": ' + F32.format(0, 8) + "}",
            r"model\.safetensors: the header: names 'format' twice",
        ),
    ],
    ids=["tensor", "field", "metadata"],
)
def test_safetensors_header_with_a_duplicate_key_is_refused(tmp_path, header, message):
    src = tmp_path / "hf"
    src.mkdir()
    _safetensors(src / "model.safetensors", header, np.arange(4, dtype=np.float32).tobytes())
    with pytest.raises(jax_ucp.UCPError, match=message):
        jax_ucp.convert(src, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.timeout(30)
def test_safetensors_index_with_a_duplicate_tensor_is_refused(tmp_path):
    from safetensors.numpy import save_file

    src = tmp_path / "hf"
    src.mkdir()
    save_file({"a": np.ones(2, np.float32)}, str(src / "one.safetensors"))
    save_file({"b": np.ones(2, np.float32)}, str(src / "two.safetensors"))
    (src / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "one.safetensors", "b": "two.safetensors", "a": "two.safetensors"}}'
    )
    with pytest.raises(jax_ucp.UCPError, match=r"model\.safetensors\.index\.json: names 'a' twice"):
        jax_ucp.convert(src, tmp_path / "out")


# Nothing outside the checkpoint is read, and no tensor borrows another's bytes.


def _hf_cache(tmp_path, tensors: dict) -> tuple:
    """A Hugging Face cache repo as ``huggingface_hub`` lays it out: the files in
    ``blobs/<sha256>``, ``snapshots/<rev>/`` holding relative links to them (index included)."""
    import hashlib

    from safetensors.numpy import save_file

    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / ("c0ffee" * 6 + "beef")
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snap.name)
    staging = tmp_path / "staging"
    staging.mkdir()
    weight_map = {}
    for i, (name, value) in enumerate(sorted(tensors.items())):
        shard = f"model-{i + 1:05d}-of-{len(tensors):05d}.safetensors"
        save_file({name: value}, str(staging / shard))
        weight_map[name] = shard
    (staging / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for f in sorted(staging.iterdir()):
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.move(f, blobs / sha)
        (snap / f.name).symlink_to(f"../../blobs/{sha}")
    return repo, snap


@pytest.mark.timeout(120)
def test_hugging_face_cache_snapshot_imports_and_restores(tmp_path):
    """Every file of a cache snapshot is a link to ``../../blobs/<sha>``, outside the snapshot
    folder but inside the cache repo: imported and restored straight from it, exactly, under the
    snapshot's file names."""
    want = {
        "embed.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "norm.weight": np.linspace(0, 1, 4).astype(np.float32),
    }
    _, snap = _hf_cache(tmp_path, want)
    out = jax_ucp.convert(snap, tmp_path / "out")
    got = restored_params(out)
    for name, value in want.items():
        assert_bit_exact(got[name], value, name)
    assert jax_ucp.inspect(out).source["files"] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    direct = jax_ucp.restore(snap)  # restore straight from safetensors: the same checks
    for name, value in want.items():
        assert_bit_exact(direct["params"][name], value, name)


@pytest.mark.timeout(60)
def test_safetensors_shard_linked_outside_is_refused(tmp_path):
    """A snapshot link leading out of the cache repo, a folder's one file and an index's shard
    linked elsewhere: refused naming the entry, on import and on restore."""
    _repo, snap = _hf_cache(tmp_path, {"a": np.ones(2, np.float32), "b": np.zeros(3, np.float32)})
    shard = snap / "model-00002-of-00002.safetensors"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(shard, elsewhere / "b.safetensors")
    shard.unlink()
    shard.symlink_to(elsewhere / "b.safetensors")
    message = (
        r"model\.safetensors\.index\.json: weight_map entry 'b': file name "
        r"'model-00002-of-00002\.safetensors' resolves to \S+/elsewhere/b\.safetensors, outside "
        r"the checkpoint"
    )
    assert_convert_refused(snap, tmp_path / "out", message)
    with pytest.raises(jax_ucp.UCPError, match=message):
        jax_ucp.restore(snap)
    single = tmp_path / "single"
    single.mkdir()
    (single / "model.safetensors").symlink_to(elsewhere / "b.safetensors")
    assert_convert_refused(single, tmp_path / "out1", r"'model\.safetensors' resolves to .*outside")


@pytest.mark.timeout(60)
def test_safetensors_index_naming_a_file_with_a_nul_is_a_clear_error(tmp_path):
    """Before: a raw ``ValueError: embedded null byte`` naming neither the index nor the entry."""
    from safetensors.numpy import save_file

    src = tmp_path / "hf"
    src.mkdir()
    save_file({"a": np.ones(2, np.float32)}, str(src / "model.safetensors"))
    (src / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model.safetensors", "b": "mod\\u0000el.safetensors"}}'
    )
    assert_convert_refused(
        src,
        tmp_path / "out",
        r"hf/model\.safetensors\.index\.json: weight_map entry 'b':.*'mod\\x00el\.safetensors'.*NUL",
    )


@pytest.mark.timeout(60)
def test_safetensors_index_linked_outside_is_refused(tmp_path):
    """The index itself a link to another model's index (its shards beside it here): refused
    before its names are read."""
    _, snap = _hf_cache(tmp_path, {"a": np.ones(2, np.float32)})
    other = tmp_path / "other"
    other.mkdir()
    index = snap / "model.safetensors.index.json"
    shutil.copy(index, other / "index.json")
    index.unlink()
    index.symlink_to(other / "index.json")
    assert_convert_refused(
        snap,
        tmp_path / "out",
        r"file name 'model\.safetensors\.index\.json' resolves to \S+/other/index\.json, "
        r"outside the checkpoint",
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["other_repo", "out_of_cache", "linked_blobs", "non_blob"])
def test_one_cache_rule_for_convert_and_restore_of_a_file(tmp_path, how):
    """A snapshot file linking into another repo's blobs/, out of the cache, through a blobs/
    that is itself a link, or to a file of the repo that is no blob (a folder merely laid out as
    ``x/blobs/`` + ``x/snapshots/run1/``): refused by convert and by restore of the folder and
    of the file itself — restore no longer follows what convert refuses."""
    repo, snap = _hf_cache(tmp_path, {"a": np.ones(2, np.float32)})
    shard = snap / "model-00001-of-00001.safetensors"
    target = shard.resolve()
    if how == "other_repo":
        other, _ = _hf_cache(tmp_path / "o", {"z": np.zeros(2, np.float32)})
        blob = next(p for p in (other / "blobs").iterdir() if p.read_bytes()[:1] != b"{")
        shard.unlink()
        shard.symlink_to(blob)
    elif how == "out_of_cache":
        private = tmp_path / "private.safetensors"
        shutil.copy(target, private)
        shard.unlink()
        shard.symlink_to("../../blobs/../../../private.safetensors")
    elif how == "linked_blobs":
        real_blobs = tmp_path / "real_blobs"
        shutil.move(repo / "blobs", real_blobs)
        (repo / "blobs").symlink_to(real_blobs)
    else:
        (repo / "private").mkdir()
        shutil.copy(target, repo / "private" / "weights.safetensors")
        shard.unlink()
        shard.symlink_to("../../private/weights.safetensors")
    with pytest.raises(jax_ucp.UCPError, match=r"outside"):
        jax_ucp.convert(snap, tmp_path / "out")
    with pytest.raises(jax_ucp.UCPError, match=r"outside"):
        jax_ucp.restore(snap)
    with pytest.raises(jax_ucp.UCPError, match=r"outside"):
        jax_ucp.restore(shard)
