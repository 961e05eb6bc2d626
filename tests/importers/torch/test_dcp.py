"""Plain torch DCP checkpoints written by torch 2.13 itself (tools/fixtures/make_torch_fixtures.py:
FSDP2 fully_shard over 2 gloo ranks, get_state_dict fp32 and bf16, torchtitan's layout,
Accelerate's sharded save_state folders, SGD momentum, FSDP1 SHARDED_STATE_DICT +
FSDP.optim_state_dict on 2 CPU ranks), imported torch-free and compared bit for
bit with the run's own live state (<name>.truth.npz); layouts and damage built by the tests."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.importers import registry
from jax_ucp._src.torchfiles import dcp as torch_dcp
from jax_ucp._src.torchfiles import torch_zip
from jax_ucp.conversion import ImportOptions
from jax_ucp.errors import SourceError
from tests.ucp_testing import REPO, assert_bit_exact, assert_destination_untouched, load_truth

FIX = os.path.join(REPO, "tests", "fixtures", "torch")
STATES = {"exp_avg": "mu", "exp_avg_sq": "nu", "momentum_buffer": "trace"}

pytestmark = pytest.mark.timeout(120)


def truth(name: str) -> dict[str, np.ndarray]:
    """The run's live state: ``{"param/<name>": array, ..., "step": float}``, bf16 restored."""
    return load_truth(os.path.join(FIX, name + ".truth.npz"))


def assert_matches_run(restored: dict, name: str, prefix: str = "") -> None:
    """params, every optimizer state and the step equal the live run's, bit for bit (the
    imported names are the run's with ``prefix`` before them)."""
    want = {
        k if k == "step" else k.replace("/", "/" + prefix, 1): v for k, v in truth(name).items()
    }
    params = {k.split("/", 1)[1]: v for k, v in want.items() if k.startswith("param/")}
    assert sorted(restored["params"]) == sorted(params)
    for key, value in want.items():
        if key == "step":
            assert restored["opt_state"]["count"] == np.int32(value), key
            assert np.asarray(restored["opt_state"]["count"]).dtype == np.int32
            continue
        state, param = key.split("/", 1)
        got = (
            restored["params"][param]
            if state == "param"
            else restored["opt_state"][STATES[state]][param]
        )
        assert_bit_exact(got, value, key)
    if "step" not in want:
        assert "count" not in restored.get("opt_state", {})


@pytest.mark.parametrize(
    "name",
    [
        "fsdp2_fp32",
        "fsdp2_bf16",
        "torchtitan_fp32",
        "accelerate_fsdp",
        "sgd_single",
        "fsdp1_sharded",
    ],
)
def test_real_dcp_checkpoints_import_bit_exact(tmp_path, name):
    src = os.path.join(FIX, name)
    assert registry.detect_format(src) == "torch"
    out = jax_ucp.convert(src, tmp_path / "ucp")
    assert_matches_run(jax_ucp.restore(out), name)
    m = jax_ucp.inspect(out)
    assert m.source["framework"] == "torch_dcp"
    group = m.source["optimizer"]["param_groups"][0]
    assert group["lr"] > 0 and len(group["params"]) == 12
    assert m.source["optimizer"]["no_state"] == []


def test_torch_215_several_shards_per_rank_with_padding_and_strides_import_bit_exact(tmp_path):
    """torch 2.15's DCP (fixture written by torch 2.15 itself): a rank's local tensor holding two
    shards of one global tensor with padding between them (``CheckpointableTensor``: several
    chunks per rank, rows for float32, columns for bfloat16) and ``TensorProperties`` pickles
    carrying the new ``strides`` field (a transposed view): every element where torch 2.15's own
    ``dcp.load`` puts it, no padding value anywhere."""
    name = "dcp_torch215_multishard"
    out = jax_ucp.convert(os.path.join(FIX, name), tmp_path / "ucp")
    restored = jax_ucp.restore(out)
    want = truth(name)
    assert sorted(restored["params"]) == sorted(k.split("/", 1)[1] for k in want)
    for key, value in want.items():
        assert_bit_exact(restored["params"][key.split("/", 1)[1]], value, key)
        assert not np.any(np.asarray(restored["params"][key.split("/", 1)[1]]) == -7.0), key


def test_fsdp1_sharded_state_dict_is_read_from_its_sharded_tensors():
    """FSDP1 (flat parameters, one per Block and the root) saves each parameter as a
    ShardedTensor of its rows: 67 vocabulary rows in 34 + 33, the optimizer state alike."""
    ck = torch_dcp.open_dcp(os.path.join(FIX, "fsdp1_sharded"))
    for name in ("model.tok_embeddings.weight", "optim.state.tok_embeddings.weight.exp_avg"):
        chunks = ck.tensors[name].chunks
        assert [(c.offsets, c.sizes, c.file) for c in chunks] == [
            ((0, 0), (34, 16), "__0_0.distcp"),
            ((34, 0), (33, 16), "__1_0.distcp"),
        ], name
    assert not [n for n in ck.tensors if "_flat_param" in n or "_fsdp_wrapped" in n]


def test_bf16_run_is_recorded_as_bf16_without_masters(tmp_path):
    out = jax_ucp.convert(os.path.join(FIX, "fsdp2_bf16"), tmp_path / "ucp")
    m = jax_ucp.inspect(out)
    assert m.source["model_dtype"] == "bfloat16"
    assert any("no fp32 master weights" in n for n in m.source["notes"])
    assert {str(e.dtype) for e in m.tensors if e.role == "param"} == {"bfloat16"}


def test_torchtitan_training_state_is_listed_as_skipped(tmp_path):
    out = jax_ucp.convert(os.path.join(FIX, "torchtitan_fp32"), tmp_path / "ucp")
    source = jax_ucp.inspect(out).source
    assert source["model_container"] is None and source["optimizer_root"] == "optimizer"
    skipped = source["skipped"]
    assert skipped["train_state.step"] == "train_state: training state, not a model parameter"
    assert skipped["train_state.losses"] == "a pickled object, not a tensor"
    assert any(k.startswith("lr_scheduler.") for k in skipped)
    # the flattened per-parameter hyper-parameters collapse into the one group they came from
    assert len(source["optimizer"]["param_groups"]) == 1
    assert source["optimizer"]["param_groups"][0]["initial_lr"] == 0.01


def test_sgd_momentum_becomes_trace(tmp_path):
    out = jax_ucp.convert(os.path.join(FIX, "sgd_single"), tmp_path / "ucp")
    m = jax_ucp.inspect(out)
    traces = [e for e in m.tensors if e.key[:2] == ("opt_state", "trace")]
    assert len(traces) == 12 and {e.sub_role for e in traces} == {"trace"}


def test_weights_only_skips_and_records_the_optimizer(tmp_path):
    out = jax_ucp.convert(
        os.path.join(FIX, "fsdp2_fp32"),
        tmp_path / "ucp",
        importing=ImportOptions(weights_only=True),
    )
    restored = jax_ucp.restore(out)
    assert set(restored) == {"params"}
    want = truth("fsdp2_fp32")
    for name, value in restored["params"].items():
        assert_bit_exact(value, want[f"param/{name}"], name)
    skipped = jax_ucp.inspect(out).source["skipped"]
    optimizer = {k: v for k, v in skipped.items() if k.startswith("optim.")}
    assert len(optimizer) == 36 + 12  # exp_avg, exp_avg_sq, step of 12; 12 hyper-parameters
    assert set(optimizer.values()) == {"weights_only: optimizer state not imported"}


def test_cli_convert_torch(tmp_path):
    from typer.testing import CliRunner

    from jax_ucp.cli import app

    dst = tmp_path / "ucp"
    result = CliRunner().invoke(
        app, ["convert", os.path.join(FIX, "fsdp2_fp32"), str(dst), "--from", "torch"]
    )
    assert result.exit_code == 0, result.output
    assert_matches_run(jax_ucp.restore(dst), "fsdp2_fp32")


def test_megatron_torch_dist_still_detected_as_megatron(tmp_path):
    src = tmp_path / "mcore"
    shutil.copytree(os.path.join(FIX, "fsdp2_fp32"), src)
    (src / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    assert registry.detect_format(src) == "megatron"


def test_unknown_folder_lists_what_it_holds(tmp_path):
    (tmp_path / "weights.npy").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(
        SourceError,
        match=r"cannot tell the checkpoint format; it holds: notes\.txt, weights\.npy\. .*"
        r"torch\.save files .*`\.bin`/`\.pt`/`\.pth`/`\.ckpt`",
    ):
        jax_ucp.convert(tmp_path, tmp_path.parent / "out")


# ----------------------------------------------------------------------------- damage


def _copy(tmp_path, name="fsdp2_fp32"):
    src = tmp_path / name
    shutil.copytree(os.path.join(FIX, name), src)
    return src


def test_missing_rank_file_is_an_error_before_writing(tmp_path):
    src = _copy(tmp_path)
    os.remove(src / "__1_0.distcp")
    dst = tmp_path / "out"
    with pytest.raises(SourceError, match=r"__1_0\.distcp is missing"):
        jax_ucp.convert(src, dst)
    assert_destination_untouched(dst)


def test_truncated_rank_file_is_an_error(tmp_path):
    src = _copy(tmp_path)
    f = src / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:5000])
    with pytest.raises(SourceError, match=r"__0_0\.distcp has 5000 bytes.*truncated"):
        jax_ucp.convert(src, tmp_path / "out")


def test_flipped_byte_in_a_chunk_is_an_error(tmp_path):
    src = _copy(tmp_path)
    ck = torch_dcp.open_dcp(src)
    tensor = ck.tensors["model.output.weight"]
    values = ck.read_chunk(tensor, tensor.chunks[0]).tobytes()
    f = src / tensor.chunks[0].file
    data = bytearray(f.read_bytes())
    at = data.index(values) + len(values) // 2  # inside the tensor's own bytes
    data[at] ^= 0xFF
    f.write_bytes(bytes(data))
    dst = tmp_path / "out"
    with pytest.raises(SourceError, match=r"model\.output\.weight.*CRC-32 mismatch"):
        jax_ucp.convert(src, dst)
    assert_destination_untouched(dst)


def test_metadata_naming_code_is_refused_without_running_it(tmp_path):
    src = _copy(tmp_path)
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (src / ".metadata").write_bytes(pickle.dumps(Evil(), protocol=2))
    with pytest.raises(SourceError, match=r"refusing to load global '(posix|os)\.system'"):
        jax_ucp.convert(src, tmp_path / "out")
    assert not marker.exists()


def test_optimizer_state_of_another_shape_is_an_error(tmp_path, monkeypatch):
    src = _copy(tmp_path)
    real = torch_dcp.open_dcp

    def shrunk(path, extra_classes=None):
        ck = real(path, extra_classes)
        name = "optim.state.norm.weight.exp_avg"
        t = ck.tensors[name]
        ck.tensors[name] = torch_dcp.DcpTensor(t.name, (8,), t.dtype, t.chunks[:1])
        return ck

    monkeypatch.setattr(torch_dcp, "open_dcp", shrunk)
    with pytest.raises(
        SourceError,
        match=r"optimizer state 'exp_avg' of 'norm.weight' has shape \[8\], "
        r"the parameter \[16\]",
    ):
        jax_ucp.convert(src, tmp_path / "out")


def test_steps_that_disagree_are_an_error(tmp_path, monkeypatch):
    src = _copy(tmp_path)
    real = torch_dcp.DcpCheckpoint.read

    def read(self, name, rows=None):
        value = real(self, name, rows)
        return np.asarray(7.0, value.dtype) if name == "optim.state.norm.weight.step" else value

    monkeypatch.setattr(torch_dcp.DcpCheckpoint, "read", read)
    with pytest.raises(SourceError, match=r"optimizer step: 3 .*7"):
        jax_ucp.convert(src, tmp_path / "out")


def test_a_name_in_two_folders_is_refused(tmp_path):
    src = _copy(tmp_path, "accelerate_fsdp")
    shutil.copytree(src / "optimizer_0", src / "optimizer_1")
    with pytest.raises(SourceError, match=r"is saved in two DCP folders"):
        jax_ucp.convert(src, tmp_path / "out")


@pytest.mark.parametrize("parallel", [False, True], ids=["in_turn", "threads"])
def test_chunks_read_into_the_tensor_equal_the_mapped_chunks(monkeypatch, parallel):
    """``DcpCheckpoint.read`` reads each chunk with preadv straight into its place in the
    tensor (CRC-32 on the bytes read; large tensors' chunks on threads): every tensor of four
    fixtures equals its chunks read through the memory map (``read_chunk``, CRC on the map)
    placed at their offsets, byte for byte; ``rows`` cuts through a chunk as ``[:rows]``."""
    monkeypatch.setattr(torch_dcp, "PARALLEL_BYTES", 0 if parallel else 1 << 62)
    real_preadv, calls = os.preadv, []

    def preadv(fd, buffers, offset):
        calls.append(offset)
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    chunks = 0
    for fixture in ("fsdp2_fp32", "fsdp2_bf16", "torchtitan_fp32", "sgd_single"):
        ck = torch_dcp.open_dcp(os.path.join(FIX, fixture))
        for name, t in ck.tensors.items():
            got = ck.read(name)
            want = np.zeros(t.shape, t.dtype)
            for c in t.chunks:
                want[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))] = ck.read_chunk(
                    t, c
                )
                chunks += bool(np.prod(c.sizes))
            assert (got.dtype, got.shape, got.tobytes()) == (t.dtype, t.shape, want.tobytes())
            if len(t.shape) == 2 and len(t.chunks) > 1:
                rows = t.chunks[0].sizes[0] + 1  # one row into the second chunk
                assert ck.read(name, rows=rows).tobytes() == want[:rows].tobytes()
    assert len(calls) >= chunks > 100


def test_flipped_byte_in_a_chunk_read_on_threads_is_an_error(tmp_path, monkeypatch):
    """Read slab by slab (no chunk small enough to be read whole), the CRC-32 carried over the
    slabs finds a flipped last byte."""
    monkeypatch.setattr(torch_dcp, "PARALLEL_BYTES", 0)
    monkeypatch.setattr(torch_dcp, "SMALL", 0)
    src = _copy(tmp_path)
    ck = torch_dcp.open_dcp(src)
    tensor = ck.tensors["optim.state.output.weight.exp_avg"]
    chunk = tensor.chunks[1]
    values = ck.read_chunk(tensor, chunk).tobytes()
    f = src / chunk.file
    data = bytearray(f.read_bytes())
    data[data.index(values) + len(values) - 1] ^= 0x01  # the last byte of the second chunk
    f.write_bytes(bytes(data))
    with pytest.raises(
        SourceError,
        match=r"optim\.state\.output\.weight\.exp_avg' chunk at offsets \[\d+, 0\] in "
        r".*__1_0\.distcp: CRC-32 mismatch",
    ):
        torch_dcp.open_dcp(src).read("optim.state.output.weight.exp_avg")


@pytest.mark.timeout(10)
def test_the_chunk_crc_is_zips_crc32():
    """The CRC the reader checks chunks with (ISA-L's when installed) is zip's CRC-32, also
    continued slab by slab as a chunk's reads do: the value torch writes per member."""
    import zlib

    data = np.random.default_rng(0).integers(0, 256, 3 * 1024 * 1024 + 17, np.uint8)
    pieces = [data[:5], data[5 : 1 << 20], data[1 << 20 :]]
    running = 0
    for piece in pieces:
        running = torch_zip.zip_crc32(piece, running)
    assert running == torch_zip.zip_crc32(data) == zlib.crc32(data.tobytes())
    assert torch_zip.zip_crc32(b"123456789") == 0xCBF43926  # CRC-32/ISO-HDLC check value


def test_chunks_not_read_in_place_are_crc_checked_and_copied(tmp_path, monkeypatch):
    """A chunk whose tensor is not exactly its storage's bytes (here: the unpickled tensor made
    a copy, so it is not at the storage's address) is read whole, not slab by slab: the
    storage's CRC-32 is checked on its bytes, then the tensor copied into place."""
    from jax_ucp._src.torchfiles import torch_zip

    real_load = torch_zip.TorchArchive.load
    monkeypatch.setattr(torch_zip.TorchArchive, "load", lambda self, *a: real_load(self, *a).copy())
    src = _copy(tmp_path)
    ck = torch_dcp.open_dcp(src)
    tensor = ck.tensors["model.output.weight"]
    want = np.concatenate([ck.read_chunk(tensor, c) for c in tensor.chunks])
    calls = []
    real_chunk = torch_dcp.DcpCheckpoint.read_chunk
    monkeypatch.setattr(
        torch_dcp.DcpCheckpoint, "read_chunk", lambda *a: calls.append(a) or real_chunk(*a)
    )
    assert ck.read("model.output.weight").tobytes() == want.tobytes()
    assert len(calls) == len(tensor.chunks)  # each read whole
    values = ck.read_chunk(tensor, tensor.chunks[0]).tobytes()
    f = src / tensor.chunks[0].file
    data = bytearray(f.read_bytes())
    data[data.index(values)] ^= 0x80
    f.write_bytes(bytes(data))
    with pytest.raises(
        SourceError,
        match=r"'model\.output\.weight' chunk at offsets \[0, 0\] .*CRC-32 mismatch \(the archive "
        r"records",
    ):
        torch_dcp.open_dcp(src).read("model.output.weight")


@pytest.mark.timeout(60)
def test_a_forked_child_reads_chunks_on_its_own_threads(monkeypatch):
    """A process forked after a threaded read has none of its parent's reading threads: work
    queued to the inherited pool would never run (the child hung). It reads on its own."""
    import signal
    import time

    monkeypatch.setattr(torch_dcp, "PARALLEL_BYTES", 0)
    src = os.path.join(FIX, "fsdp2_fp32")
    want = torch_dcp.open_dcp(src).read("model.output.weight").tobytes()
    time.sleep(0.5)  # the parent's threads idle: an inherited pool would start no new ones
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        same = torch_dcp.open_dcp(src).read("model.output.weight").tobytes() == want
        os._exit(0 if same else 3)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0


# Hostile inputs, each built here: a clear error naming the file, or an exact import.


def _dcp_shards(src, full: np.ndarray) -> list:
    """What torch DCP's HuggingFaceStorageWriter writes without consolidation for a tensor
    row-sharded over 2 ranks plus a replicated one: one file per rank, each tensor that rank's
    piece, its place in the full tensor in ``__metadata__["DCP_SHARDING_INFO"]``."""
    from safetensors.numpy import save_file

    rows = full.shape[0] // 2
    paths = []
    for rank in range(2):
        piece = np.ascontiguousarray(full[rank * rows : (rank + 1) * rows])
        sharding = {"w": {"saved_offsets": [rank * rows, 0]}, "b": {"saved_offsets": [0]}}
        path = src / f"shard-{rank:05d}-model-00001-of-00001.safetensors"
        save_file(
            {"w": piece, "b": np.ones(3, np.float32)},
            str(path),
            metadata={"DCP_SHARDING_INFO": json.dumps(sharding), "DCP_VERSION": "1.0"},
        )
        paths.append(path)
    return paths


@pytest.mark.timeout(30)
def test_unconsolidated_dcp_shards_are_read_as_a_folder_never_one_file(tmp_path):
    """One rank's file alone is refused (rank 0's half as the whole); the folder is read as
    torch DCP, each tensor from its pieces: here ``b`` is written by both ranks at the same
    offsets (torch's planner writes a replicated tensor once), refused as an overlap."""
    from safetensors.numpy import save_file

    src = tmp_path / "dcp_hf"
    src.mkdir()
    full = np.arange(24, dtype=np.float32).reshape(4, 6)
    first, _ = _dcp_shards(src, full)
    expected = (
        r"shard-00000-model-00001-of-00001\.safetensors: an unconsolidated shard of "
        r"torch\.distributed\.checkpoint's Hugging Face writer \(__metadata__ has "
        r"DCP_SHARDING_INFO\): its tensors are pieces of larger ones \(e\.g\. 'w' has "
        r"saved_offsets \[0, 0\]\).*Pass the folder holding all of them"
    )
    with pytest.raises(jax_ucp.UCPError, match=expected):  # rank 0's half as the whole: refused
        jax_ucp.convert(first, tmp_path / "one")
    assert not os.path.exists(tmp_path / "one")
    overlap = r"tensor 'b': overlapping shards: \[0\]\+\[3\] in shard-00000.* and \[0\]\+\[3\]"
    with pytest.raises(jax_ucp.UCPError, match=overlap):
        jax_ucp.convert(src, tmp_path / "all")
    assert not os.path.exists(tmp_path / "all")
    save_file(  # b only in rank 1's file, as torch writes it
        {"w": np.ascontiguousarray(full[:2])},
        str(first),
        metadata={
            "DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [0, 0]}}),
            "DCP_VERSION": "1.0",
        },
    )
    out = jax_ucp.convert(src, tmp_path / "ok")
    restored = jax_ucp.restore(out)["params"]
    assert_bit_exact(restored["w"], full, "w")
    assert_bit_exact(restored["b"], np.ones(3, np.float32), "b")
