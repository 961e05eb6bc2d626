"""Megatron / torch_dist imports are never silently partial or uninitialised.

Every hostile checkpoint here is built by the test from a real megatron-core fixture copied into
tmp_path: its ``.metadata`` is parsed with jax_ucp's torch-free reader, edited, and written back
as the pickle torch writes (nodes of ``jax_ucp.exporters.torch_out``); extra tensors and objects
go into an extra ``.distcp`` file of ``torch.save`` archives. No torch needed.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import jax_ucp
from jax_ucp.exporters import torch_out as T
from jax_ucp.importers.megatron import MegatronImportError, dcp
from tests.megatron_testing import FIX, assert_bit_equal, load_reference

_MD = "torch.distributed.checkpoint.metadata"
EXTRA_FILE = "__9_0.distcp"  # where the tests put the tensors and objects they add


# ----------------------------------------------------------------------- .metadata writer


def _dims(values):
    """A torch.Size when the values are ints (as torch pickles them), else the raw tuple (a
    hostile file can hold anything there)."""
    if isinstance(values, (tuple, list)) and all(type(v) is int for v in values):
        return T.torch_size(values)
    return tuple(values) if isinstance(values, (tuple, list)) else values


def _properties(dtype) -> T.New:
    torch_name, _ = T.torch_dtype("t", np.dtype(dtype))
    return T.New(
        T.Global(_MD, "TensorProperties"),
        (
            T.Global("torch", torch_name),
            T.Call(T.Global("torch.serialization", "_get_layout"), ("torch.strided",)),
            False,
            T.Call(T.Global(_MD, "_MEM_FORMAT_ENCODING"), (0,)),
            False,
        ),
    )


def _storage(file, offset, length) -> T.New:
    return T.New(
        T.Global("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        {"relative_path": file, "offset": offset, "length": length},
    )


def read_layout(src) -> tuple[dict, dict]:
    """The checkpoint's ``.metadata`` as plain, editable dicts (read without torch)."""
    ck = dcp.open_dcp(src)
    tensors = {
        name: {
            "shape": list(t.shape),
            "dtype": t.dtype,
            "chunks": [
                {
                    "offsets": list(c.offsets),
                    "sizes": list(c.sizes),
                    "file": c.file,
                    "offset": c.byte_offset,
                    "length": c.byte_length,
                }
                for c in t.chunks
            ],
        }
        for name, t in ck.tensors.items()
    }
    objects = {
        name: {"file": o.file, "offset": o.byte_offset, "length": o.byte_length}
        for name, o in ck.objects.items()
    }
    return tensors, objects


def write_layout(src, tensors: dict, objects: dict) -> None:
    """Writes ``.metadata`` for ``tensors`` / ``objects`` (as :func:`read_layout` gives them;
    values are written as they are, hostile ones included). A chunk's storage key uses its
    ``index_offsets`` when given (ints), else its offsets."""
    sdm, storage = {}, []
    for name, t in tensors.items():
        chunks = [] if isinstance(t["chunks"], list) else t["chunks"]
        for c in t["chunks"] or ():
            chunks.append(
                T.New(
                    T.Global(_MD, "ChunkStorageMetadata"),
                    {"offsets": _dims(c["offsets"]), "sizes": _dims(c["sizes"])},
                )
            )
            key = T.New(
                T.Global(_MD, "MetadataIndex"),
                {"fqn": name, "offset": _dims(c.get("index_offsets", c["offsets"])), "index": 0},
            )
            storage.append((key, _storage(c["file"], c["offset"], c["length"])))
        sdm[name] = T.New(
            T.Global(_MD, "TensorStorageMetadata"),
            {"properties": _properties(t["dtype"]), "size": _dims(t["shape"]), "chunks": chunks},
        )
    for name, o in objects.items():
        sdm[name] = T.New(T.Global(_MD, "BytesStorageMetadata"), {})
        key = T.New(T.Global(_MD, "MetadataIndex"), {"fqn": name, "offset": None, "index": None})
        storage.append((key, _storage(o["file"], o["offset"], o["length"])))
    meta = T.New(
        T.Global(_MD, "Metadata"),
        {
            "state_dict_metadata": sdm,
            "planner_data": {},
            "storage_data": T.Pairs(tuple(storage)),
            "version": "1.0.0",
        },
    )
    (src / ".metadata").write_bytes(T.dumps(meta))


class ExtraFile:
    """Appends ``torch.save`` archives (tensors, objects) to ``EXTRA_FILE`` of ``src``."""

    def __init__(self, src):
        self.path = src / EXTRA_FILE
        self.path.touch()

    def _append(self, **what) -> tuple[int, int]:
        # not mode "a": zipfile seeks back to finish a member's header, which "a" ignores
        with open(self.path, "r+b") as f:
            offset = f.seek(0, os.SEEK_END)
            return offset, T.write_torch_save(f, **what)

    def tensor(self, array: np.ndarray) -> dict:
        offset, length = self._append(array=array)
        shape = list(array.shape)
        return {
            "shape": shape,
            "dtype": array.dtype,
            "chunks": [
                {
                    "offsets": [0] * len(shape),
                    "sizes": shape,
                    "file": EXTRA_FILE,
                    "offset": offset,
                    "length": length,
                }
            ],
        }

    def object(self, value) -> dict:
        offset, length = self._append(obj=value)
        return {"file": EXTRA_FILE, "offset": offset, "length": length}


def _copy(name, tmp_path):
    dst = tmp_path / name.replace("/", "_")
    shutil.copytree(FIX / name, dst)
    return dst


def _untouched(dest):
    assert not dest.exists()
    assert not [p for p in dest.parent.iterdir() if p.name.startswith(dest.name + ".")]


def test_metadata_writer_round_trips_a_real_fixture(tmp_path):
    """The writer the other tests rely on: a real fixture's metadata re-written unchanged
    imports exactly as the original."""
    src = _copy("moe_ep2", tmp_path)
    before = (src / ".metadata").read_bytes()
    write_layout(src, *read_layout(src))
    assert (src / ".metadata").read_bytes() != before  # really re-written
    got = jax_ucp.restore(jax_ucp.convert(str(src), str(tmp_path / "ucp")))
    ref = load_reference("moe_ep2")
    assert sorted(got["params"]) == sorted(ref)
    for name, want in ref.items():
        assert_bit_equal(got["params"][name], want, name)


# ------------------------------------------------------ 1. ChainedOptimizer (MoE) state

_DTYPE = "dtype_(torch.float32, torch.float32)"
_GROUPS = [{"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-08, "weight_decay": 0.0, "step": 2.0}]


def _chained_moe(tmp_path, layout: str):
    """Synthetic: the real ``moe_ep2`` torch_dist fixture (megatron-core 0.16.1) with the state
    megatron-core's ChainedOptimizer saves for a MoE model with the distributed optimizer added:
    optimizer 0 for the dense parameters, optimizer 1 for the experts (their own grad buffer),
    ``common.pt['optimizer']`` keyed by optimizer index. ``dp_reshardable``: flat bucket vectors
    under ``chained_N.optimizer.distributed.*`` and per-rank objects; ``fully_reshardable``:
    model-space ``optimizer.state.{param,exp_avg,exp_avg_sq}.<name>`` (no prefix)."""
    src = _copy("moe_ep2", tmp_path)
    tensors, objects = read_layout(src)
    model = dict(tensors)
    extra = ExtraFile(src)
    rng = np.random.default_rng(0)
    added = []
    if layout == "dp_reshardable":
        for index, numel in ((0, 6208), (1, 6144)):
            prefix = f"chained_{index}.optimizer.distributed.dp_group_idx_0"
            for state in ("param", "exp_avg", "exp_avg_sq"):
                name = f"{prefix}.gbuf_idx_0.{_DTYPE}.bucket_idx_0.{state}"
                tensors[name] = extra.tensor(rng.standard_normal(numel, np.float32))
                added.append(name)
            objects[f"{prefix}.optimizer/shard_0_1"] = extra.object([{"param_groups": _GROUPS}])
            for what in ("per_bucket_numel", "per_bucket_numel_unpadded"):
                objects[f"{prefix}.{what}/shard_0_1"] = extra.object([[{("f", "f"): [numel]}]])
    else:
        for name, t in model.items():
            for state in ("param", "exp_avg", "exp_avg_sq"):
                key = f"optimizer.state.{state}.{name}"
                value = rng.standard_normal(t["shape"]).astype(np.float32)
                tensors[key] = extra.tensor(value)
                added.append(key)
    write_layout(src, tensors, objects)
    common = {
        "optimizer": {
            index: {
                "param_state_sharding_type": layout,
                **({"optimizer": {"param_groups": _GROUPS}} if layout != "dp_reshardable" else {}),
            }
            for index in (0, 1)
        }
    }
    T.save_file(str(src / "common.pt"), common)
    return src, added


@pytest.mark.timeout(60)
def test_synthetic_moe_chained_optimizer_of_another_layout_is_refused(tmp_path):
    """A MoE run's ChainedOptimizer state (dense and expert parameters each with their own
    optimizer) is imported when its buckets are megatron-core's layout (real fixtures:
    tests/importers/megatron/test_moe_distopt.py); synthetic buckets of other sizes are refused naming
    the bucket, the recorded size and the way out, nothing written. Before: dp_reshardable
    exited 0 with the flat bucket buffers written as weights under params/ and the Adam state
    dropped."""
    src, _ = _chained_moe(tmp_path, "dp_reshardable")
    dest = tmp_path / "out"
    with pytest.raises(
        MegatronImportError,
        match=r"\.metadata \(model-parallel rank 0\): bucket 0 would end after "
        r"'embedding\.word_embeddings\.weight' at element 7488, but megatron-core recorded 6208 "
        r".*convert\(\.\.\., weights_only=True\) / jax-ucp convert --weights-only",
    ):
        jax_ucp.convert(str(src), str(dest), vocab_size=61)
    _untouched(dest)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", ["dp_reshardable", "fully_reshardable"])
def test_synthetic_moe_chained_optimizer_weights_only_lists_every_optimizer_tensor(
    tmp_path, layout
):
    """weights_only=True: the model weights exactly as saved, nothing else under params/, and
    every optimizer tensor named in source.skipped with its reason."""
    src, added = _chained_moe(tmp_path, layout)
    ckpt = jax_ucp.convert(str(src), str(tmp_path / "ucp"), weights_only=True)
    got = jax_ucp.restore(ckpt)
    ref = load_reference("moe_ep2")
    assert sorted(got) == ["params"] and sorted(got["params"]) == sorted(ref)
    for name, want in ref.items():
        assert_bit_equal(got["params"][name], want, name)
    skipped = jax_ucp.inspect(ckpt).source["skipped"]
    assert sorted(skipped) == sorted(added)
    assert all(why.startswith("weights_only: optimizer state") for why in skipped.values())


@pytest.mark.timeout(60)
def test_optimizer_namespace_inside_a_name_is_never_a_weight(tmp_path):
    """A key in the optimizer namespace the importer does not know (here
    ``model.optimizer.state.exp_avg.x``) is refused, never imported as a model weight."""
    src = _copy("moe_ep2", tmp_path)
    tensors, objects = read_layout(src)
    name = "model.optimizer.state.exp_avg.output_layer.weight"
    tensors[name] = ExtraFile(src).tensor(np.ones((64, 32), np.float32))
    write_layout(src, tensors, objects)
    with pytest.raises(
        MegatronImportError, match=rf"tensor '{name}'.*unsupported distributed-optimizer layout"
    ):
        jax_ucp.convert(str(src), str(tmp_path / "out"))
    _untouched(tmp_path / "out")


@pytest.mark.timeout(60)
def test_missing_param_groups_points_at_weights_only(tmp_path):
    """fully_reshardable state whose step cannot be recovered (common.pt without param_groups):
    the error says how to import the weights alone."""
    src = _copy("gpt_distopt_dp2", tmp_path)
    T.save_file(str(src / "common.pt"), {"optimizer": {"param_state_sharding_type": None}})
    with pytest.raises(
        MegatronImportError,
        match=r"common\.pt: optimizer param_groups missing or empty; cannot recover the step\. "
        r"To import the model weights .*weights_only=True",
    ):
        jax_ucp.convert(str(src), str(tmp_path / "out"), vocab_size=61)
    _untouched(tmp_path / "out")


# ------------------------------------------- 2. every element of every tensor from a chunk

HUGE = [2**62, 32]
OUTPUT = "output_layer.weight"


def _edited(tmp_path, edit, name: str = "moe_ep2"):
    """A copy of fixture ``name`` whose ``.metadata`` entry of ``output_layer.weight`` (a
    64 x 32 float32 tensor in one chunk) has been changed by ``edit(entry, chunk, file_size)``."""
    src = _copy(name, tmp_path)
    tensors, objects = read_layout(src)
    entry = tensors[OUTPUT]
    chunk = entry["chunks"][0]
    edit(entry, chunk, (src / chunk["file"]).stat().st_size)
    write_layout(src, tensors, objects)
    return src


def _no_chunks(entry, chunk, size):
    entry["shape"], entry["chunks"] = list(HUGE), []


def _huge_chunk(entry, chunk, size):
    entry["shape"] = chunk["sizes"] = list(HUGE)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("vocab_size", [48, None])
@pytest.mark.parametrize(
    "edit, error",
    [
        (
            _no_chunks,
            r"chunks hold 0 of 147573952589676412928 elements of shape "
            r"\[4611686018427387904, 32\]",
        ),
        (
            _huge_chunk,
            r"chunk at offsets \[0, 0\] sizes \[4611686018427387904, 32\] in \S+\.distcp: "
            r"declares 590295810358705651712 bytes \(float32\), its storage entry holds only "
            r"\d+",
        ),
    ],
    ids=["no_chunks", "chunk_larger_than_its_bytes"],
)
def test_tensor_never_read_beyond_its_chunks(tmp_path, edit, error, vocab_size):
    """.metadata declaring output_layer.weight as [2**62, 32] with no chunk (the element count
    wrapped to 0 in int64, so the coverage check passed and the import returned uninitialised
    memory with exit 0; with vocab_size=48, 48 rows of it), or with one chunk that claims the
    whole shape over a few KiB of bytes: refused before anything is allocated or written,
    naming the tensor and the file."""
    src = _edited(tmp_path, edit)
    with pytest.raises(
        MegatronImportError, match=rf"tensor '{OUTPUT}' in \S+/\.metadata: .*{error}"
    ):
        jax_ucp.convert(str(src), str(tmp_path / "out"), vocab_size=vocab_size)
    _untouched(tmp_path / "out")


def _chunk_field(field, value, index_offsets=None):
    def edit(entry, chunk, size):
        if index_offsets is not None:
            chunk["index_offsets"] = index_offsets
        chunk[field] = value(size) if callable(value) else value

    return edit


def _shape_field(value):
    def edit(entry, chunk, size):
        entry["shape"] = value

    return edit


def _chunks_field(value):
    def edit(entry, chunk, size):
        entry["chunks"] = value

    return edit


HOSTILE_FIELDS = {
    # what the file says -> what the error must say
    "float_offsets": (
        _chunk_field("offsets", [0.0, 0.0], index_offsets=[0, 0]),
        r"chunk 0 offsets \(0\.0, 0\.0\): expected non-negative integers",
    ),
    "negative_offset": (
        _chunk_field("offsets", [-32, 0]),
        r"chunk 0 offsets \(-32, 0\): expected non-negative integers",
    ),
    "negative_size": (
        _chunk_field("sizes", [-64, 32]),
        r"chunk 0 sizes \(-64, 32\): expected non-negative integers",
    ),
    "bool_size": (
        _chunk_field("sizes", [True, 32]),
        r"chunk 0 sizes \(True, 32\): expected non-negative integers",
    ),
    "string_shape": (_shape_field("ab"), r"size 'ab': expected non-negative integers"),
    "float_shape": (
        _shape_field([64.0, 32]),
        r"size \(64\.0, 32\): expected non-negative integers",
    ),
    "chunks_not_a_list": (_chunks_field(None), r"chunks None: expected a list"),
    "chunk_rank": (
        _chunk_field("sizes", [64, 32, 1], index_offsets=[0, 0]),
        r"chunk 0 sizes \[64, 32, 1\] has rank 3, the tensor rank 2",
    ),
    "storage_past_the_file": (
        _chunk_field("offset", lambda size: size + 10),
        r"shard file \S+/__0_0\.distcp has 32660 bytes, metadata needs 42439 \(truncated\)",
    ),
    "negative_storage_offset": (
        _chunk_field("offset", -5),
        r"chunk 0 storage entry \(file '__0_0\.distcp', offset -5, length \d+, transforms "
        r"\(\)\): expected a file name in the checkpoint directory, non-negative integer",
    ),
    "float_storage_length": (
        _chunk_field("length", 100.0),
        r"chunk 0 storage entry \(file '__0_0\.distcp', offset \d+, length 100\.0, transforms "
        r"\(\)\): expected a file name in the checkpoint directory, non-negative integer",
    ),
    "storage_file_outside": (
        _chunk_field("file", "../__0_0.distcp"),
        r"chunk 0 storage entry \(file '\.\./__0_0\.distcp', .*expected a file name in the "
        r"checkpoint directory",
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(HOSTILE_FIELDS))
def test_hostile_chunk_metadata_is_a_clear_error(tmp_path, case):
    """Chunk offsets as floats (a TypeError from slicing before), negative offsets or sizes,
    bools, a shape that is a string, a storage entry past the end of its .distcp file or with a
    negative offset / a float length, a file outside the checkpoint: each an error naming the
    tensor and the .metadata file, nothing written."""
    edit, error = HOSTILE_FIELDS[case]
    src = _edited(tmp_path, edit)
    where = "" if case == "storage_past_the_file" else r" in \S+/\.metadata"
    with pytest.raises(MegatronImportError, match=rf"tensor '{OUTPUT}'{where}: {error}"):
        jax_ucp.convert(str(src), str(tmp_path / "out"), vocab_size=61)
    _untouched(tmp_path / "out")


# --------------------------------------------------------- 4. legacy mp_rank_* checkpoints

LEGACY_LLAMA = "legacy_llama_tp2_synthetic"  # TP=2, each rank's real megatron-core weights


def _rewrite_rank(path, edit, top=None) -> None:
    """Re-writes a legacy ``model_optim_rng.pt`` (torch-free) after ``edit(model)``: the run
    arguments, version, iteration and model state dict kept, the RNG state left out; ``top``:
    more top-level entries (nested dicts of arrays and values)."""
    from jax_ucp.importers.megatron import legacy as megatron_legacy
    from jax_ucp.importers.torch import unpickler as torch_pickle

    saved = torch_pickle.load_torch_file(str(path), megatron_legacy.LEGACY_CLASSES)
    # copies: the loaded arrays are memory-mapped views of the file rewritten below
    model = {k: np.array(v) if isinstance(v, np.ndarray) else v for k, v in saved["model"].items()}
    edit(model)
    arrays = []

    def slots(value):
        if isinstance(value, np.ndarray):
            arrays.append(value)
            return T.TensorSlot(len(arrays) - 1, value.shape, value.dtype)
        if isinstance(value, dict):
            return {k: slots(v) for k, v in value.items()}
        if isinstance(value, list):
            return [slots(v) for v in value]
        return value

    state = slots(model)
    args = {
        k: v
        for k, v in vars(saved["args"]).items()
        if k != "args" and isinstance(v, (int, float, str, bool, type(None)))
    }
    obj = {
        "args": T.New(T.Global("argparse", "Namespace"), args),
        "checkpoint_version": saved["checkpoint_version"],
        "iteration": saved["iteration"],
        "model": state,
        **slots(top or {}),
    }
    T.save_file(str(path), obj, arrays)


def _set(name, value):
    return lambda model: model.__setitem__(name, value(model[name]))


LEGACY_HOLES = {
    "unchanged": (lambda model: None, None),
    "tensor_missing_on_rank_1": (
        lambda model: model.pop("decoder.layers.0.mlp.linear_fc2.weight"),
        r"mp_rank_01/model_optim_rng\.pt and \S+/mp_rank_00/model_optim_rng\.pt hold different "
        r"tensor names \(e\.g\. \['decoder\.layers\.0\.mlp\.linear_fc2\.weight'\]\)",
    ),
    "row_split_shape": (
        _set("decoder.layers.0.self_attention.linear_proj.weight", lambda v: v[:31]),
        r"tensor 'decoder\.layers\.0\.self_attention\.linear_proj\.weight': \S+/mp_rank_01/"
        r"model_optim_rng\.pt holds \[31, 16\] float32, \S+/mp_rank_00/model_optim_rng\.pt "
        r"holds \[32, 16\] float32; every tensor-parallel rank holds an equal share",
    ),
    "vocab_rows_uneven": (
        _set("embedding.word_embeddings.weight", lambda v: v[:31]),
        r"tensor 'embedding\.word_embeddings\.weight': \S+/mp_rank_01/model_optim_rng\.pt holds "
        r"\[31, 32\] float32, .* holds \[32, 32\] float32; every tensor-parallel rank",
    ),
    "dtype_on_one_rank": (
        _set("decoder.layers.0.mlp.linear_fc2.weight", lambda v: v.astype(np.float16)),
        r"tensor 'decoder\.layers\.0\.mlp\.linear_fc2\.weight': \S+/mp_rank_01/"
        r"model_optim_rng\.pt holds \[32, 24\] float16, .* holds \[32, 24\] float32",
    ),
    "not_a_tensor": (
        _set("decoder.layers.0.mlp.linear_fc2.weight", lambda v: 3),
        r"tensor 'decoder\.layers\.0\.mlp\.linear_fc2\.weight' in \S+/mp_rank_01/"
        r"model_optim_rng\.pt: a int, expected a tensor",
    ),
    "replicated_norm_differs": (
        _set("decoder.final_layernorm.weight", lambda v: v + 1),
        r"decoder\.final_layernorm\.weight: replicated fragments disagree across TP ranks",
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(LEGACY_HOLES))
def test_legacy_rank_that_does_not_fit_is_a_clear_error(tmp_path, case):
    """Legacy TP=2 checkpoint whose rank 1 lacks a tensor, holds a share of another shape (a
    row-parallel weight, the vocab-parallel embedding) or dtype, a non-tensor, or a replicated
    norm that differs: an error naming the tensor and both rank files, nothing written. Before,
    uneven vocab rows and a float16 share on one rank were imported with exit 0 (the rows
    concatenated to the wrong size, the dtypes promoted). Unchanged, the re-written rank
    imports bit-exact (the test's writer is faithful)."""
    edit, error = LEGACY_HOLES[case]
    src = _copy(LEGACY_LLAMA, tmp_path)
    _rewrite_rank(src / "iter_0000007" / "mp_rank_01" / "model_optim_rng.pt", edit)
    dest = tmp_path / "out"
    if error is None:
        got = jax_ucp.restore(jax_ucp.convert(str(src), str(dest), vocab_size=61))["params"]
        original = FIX / LEGACY_LLAMA
        ref = jax_ucp.restore(jax_ucp.convert(str(original), str(tmp_path / "ref"), vocab_size=61))
        assert sorted(got) == sorted(ref["params"]) and len(got) == 15
        for name, want in ref["params"].items():
            assert_bit_equal(got[name], want, name)
        return
    with pytest.raises(MegatronImportError, match=error):
        jax_ucp.convert(str(src), str(dest), vocab_size=61)
    _untouched(dest)


@pytest.mark.timeout(60)
def test_chunks_sharing_bytes_are_refused(tmp_path):
    """Two chunks of one tensor whose storage entries point at the same bytes (each declaring
    rows of its own): refused, so a tensor never takes more memory than its bytes on disk."""

    def split(entry, chunk, size):
        top = dict(chunk, sizes=[32, 32])
        bottom = dict(chunk, offsets=[32, 0], sizes=[32, 32])
        entry["chunks"] = [top, bottom]

    src = _edited(tmp_path, split)
    with pytest.raises(
        MegatronImportError,
        match=rf"tensor '{OUTPUT}' in \S+/\.metadata: two chunks share bytes \[\d+, \d+\.\.\.\) "
        r"of __0_0\.distcp",
    ):
        jax_ucp.convert(str(src), str(tmp_path / "out"), vocab_size=61)
    _untouched(tmp_path / "out")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["fifo", "huge", "deep"])
def test_mcore_metadata_json_is_read_bounded(tmp_path, kind):
    """megatron-core's metadata.json as a FIFO (no hang), larger than 1 MiB, or nested too deep
    for the JSON parser: an error naming the file, nothing written."""
    src = _copy("moe_ep2", tmp_path)
    mj = src / "metadata.json"
    mj.unlink()
    if kind == "fifo":
        os.mkfifo(mj)
        error = r"not a regular file \(a FIFO\)"
    elif kind == "huge":
        mj.write_bytes(b" " * (2 << 20) + b"{}")
        error = r"2097154 bytes, more than the 1048576"
    else:
        mj.write_bytes(b"[" * 200_000 + b"]" * 200_000)
        error = r"not JSON"
    with pytest.raises(MegatronImportError, match=rf"metadata\.json: .*{error}"):
        jax_ucp.convert(str(src), str(tmp_path / "out"))
    _untouched(tmp_path / "out")


def _legacy_with(tmp_path, edit, top):
    """The legacy Llama TP=2 fixture with both rank files re-written (``edit``, ``top``)."""
    src = _copy(LEGACY_LLAMA, tmp_path)
    for rank in ("mp_rank_00", "mp_rank_01"):
        _rewrite_rank(src / "iter_0000007" / rank / "model_optim_rng.pt", edit, top)
    return src


@pytest.mark.timeout(60)
def test_legacy_non_distributed_optimizer_state_is_refused_or_listed(tmp_path):
    """Megatron-LM without --use-distributed-optimizer keeps Adam's state in
    model_optim_rng.pt, which is not read: refused, naming the file and the way out (before, the
    weights were imported with exit 0 and the state dropped with a note). weights_only: the
    weights imported bit-exact, every optimizer tensor of both ranks listed in source.skipped."""
    moments = {"exp_avg": np.ones(4, np.float32), "exp_avg_sq": np.ones(4, np.float32)}
    optimizer = {
        "optimizer": {"state": {0: moments}, "param_groups": [{"step": 2, "lr": 0.1}]},
        "fp32_from_fp16_params": {"0": np.zeros(4, np.float32)},
    }
    src = _legacy_with(tmp_path, lambda model: None, {"optimizer": optimizer})
    dest = tmp_path / "out"
    with pytest.raises(
        MegatronImportError,
        match=r"iter_0000007: the rank files hold the state of a non-distributed optimizer \(6 "
        r"tensors, e\.g\. 'mp_rank_00/model_optim_rng\.pt:optimizer\.optimizer\.state\.0\."
        r"exp_avg'\), which is not supported \(only the distributed "
        r"optimizer's distrib_optim\.pt is read\)\. To import the model weights without the "
        r"optimizer state: convert\(\.\.\., weights_only=True\)",
    ):
        jax_ucp.convert(str(src), str(dest), vocab_size=61)
    _untouched(dest)
    ckpt = jax_ucp.convert(str(src), str(dest), vocab_size=61, weights_only=True)
    ref = jax_ucp.restore(
        jax_ucp.convert(str(FIX / LEGACY_LLAMA), str(tmp_path / "ref"), vocab_size=61)
    )
    got = jax_ucp.restore(ckpt)
    assert sorted(got) == ["params"] and sorted(got["params"]) == sorted(ref["params"])
    for name, want in ref["params"].items():
        assert_bit_equal(got["params"][name], want, name)
    skipped = jax_ucp.inspect(ckpt).source["skipped"]
    assert skipped == {
        f"{rank}/model_optim_rng.pt:optimizer.{path}": (
            f"weights_only: optimizer state ({rank}/model_optim_rng.pt)"
        )
        for rank in ("mp_rank_00", "mp_rank_01")
        for path in (
            "optimizer.state.0.exp_avg",
            "optimizer.state.0.exp_avg_sq",
            "fp32_from_fp16_params.0",
        )
    }


@pytest.mark.timeout(60)
def test_legacy_tensor_the_importer_does_not_know_commits_nothing(tmp_path):
    """A tensor in a rank file that the importer neither reads nor knows to skip (here a
    top-level ``grad_norms`` buffer, and a model entry holding a list of tensors): the import is
    refused naming it, nothing written, instead of exiting 0 without it."""
    from jax_ucp.importers.plan import UnaccountedTensorsError

    src = _legacy_with(
        tmp_path,
        lambda model: model.__setitem__("decoder.extra", [np.ones(2, np.float32)]),
        {"grad_norms": np.ones(3, np.float32)},
    )
    with pytest.raises(
        UnaccountedTensorsError,
        match=r"4 of the checkpoint's 34 tensors have no place in the import and no reason to be "
        r"left out: 'mp_rank_00/model_optim_rng\.pt:grad_norms', "
        r"'mp_rank_00/model_optim_rng\.pt:model\.decoder\.extra\.0', "
        r"'mp_rank_01/model_optim_rng\.pt:grad_norms', .*Nothing was committed",
    ):
        jax_ucp.convert(str(src), str(tmp_path / "out"), vocab_size=61)
    _untouched(tmp_path / "out")


@pytest.mark.timeout(60)
def test_legacy_extra_state_tensor_is_listed_not_imported(tmp_path):
    """TransformerEngine's ``_extra_state`` saved as a tensor (FP8 metadata bytes): not a
    weight, so not imported, and listed in source.skipped for each rank with the reason."""
    name = "decoder.layers.0.self_attention.linear_proj._extra_state"
    src = _legacy_with(
        tmp_path, lambda model: model.__setitem__(name, np.arange(8, dtype=np.uint8)), None
    )
    ckpt = jax_ucp.convert(str(src), str(tmp_path / "out"), vocab_size=61)
    assert name not in jax_ucp.restore(ckpt)["params"]
    skipped = jax_ucp.inspect(ckpt).source["skipped"]
    assert skipped == {
        f"{rank}/model_optim_rng.pt:model.{name}": (
            "TransformerEngine _extra_state (FP8 scaling metadata), not a weight"
        )
        for rank in ("mp_rank_00", "mp_rank_01")
    }


@pytest.mark.timeout(60)
def test_legacy_expert_parallel_distrib_optim_is_refused_or_listed(tmp_path):
    """Legacy MoE with EP=2 and a distributed optimizer: the expert buffers of distrib_optim.pt
    are not read, so the import is refused naming the layout and the way out (before, EP rank
    1's distrib_optim.pt was never opened). weights_only: every tensor of every EP rank's
    distrib_optim.pt listed in source.skipped (EP rank 1's directory included)."""
    src = _copy("legacy_moe_ep2_synthetic", tmp_path)
    flat = np.zeros(8, np.float32)
    for rank in ("mp_rank_00_000", "mp_rank_00_001"):
        buffer = {"param": T.TensorSlot(0, flat.shape, flat.dtype), "numel_unpadded": 8}
        T.save_file(
            str(src / "iter_0000007" / rank / "distrib_optim.pt"),
            {"buckets_coalesced": True, 0: {"f32": buffer}},
            [flat],
        )
    with pytest.raises(
        MegatronImportError,
        match=r"iter_0000007: distrib_optim\.pt with expert-parallel experts is not supported\. "
        r"To import the model weights without the optimizer state",
    ):
        jax_ucp.convert(str(src), str(tmp_path / "out"), vocab_size=61)
    _untouched(tmp_path / "out")
    ckpt = jax_ucp.convert(str(src), str(tmp_path / "out"), vocab_size=61, weights_only=True)
    skipped = jax_ucp.inspect(ckpt).source["skipped"]
    assert {k: v for k, v in skipped.items() if "distrib_optim" in k} == {
        f"{rank}/distrib_optim.pt:0.f32.param": f"weights_only: optimizer state ({rank}/distrib_optim.pt)"
        for rank in ("mp_rank_00_000", "mp_rank_00_001")
    }
