"""megatron-core torch_dist checkpoints read through the DCP reader (``importers.megatron.dcp``):
hostile ``.metadata`` (chunks, shapes, shared bytes, JSON) refused by name, never partial or
uninitialised."""

from __future__ import annotations

import os

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.importers.megatron import MegatronImportError, dcp
from jax_ucp._src.store.storage import LocalDirectory
from jax_ucp._src.torchfiles import dtypes, pickle_format, torch_zip
from jax_ucp.conversion import MegatronOptions
from tests.megatron_testing import (
    assert_bit_equal,
    assert_megatron_refused,
    copy_megatron_fixture,
    load_reference,
)
from tests.ucp_testing import assert_convert_refused

_MD = "torch.distributed.checkpoint.metadata"


EXTRA_FILE = "__9_0.distcp"  # where the tests put the tensors and objects they add


def _dims(values):
    """A torch.Size when the values are ints (as torch pickles them), else the raw tuple (a
    hostile file can hold anything there)."""
    if isinstance(values, (tuple, list)) and all(type(v) is int for v in values):
        return pickle_format.torch_size(values)
    return tuple(values) if isinstance(values, (tuple, list)) else values


def _properties(dtype) -> pickle_format.New:
    torch_name, _ = dtypes.torch_dtype("t", np.dtype(dtype))
    return pickle_format.New(
        pickle_format.Global(_MD, "TensorProperties"),
        (
            pickle_format.Global("torch", torch_name),
            pickle_format.Call(
                pickle_format.Global("torch.serialization", "_get_layout"), ("torch.strided",)
            ),
            False,
            pickle_format.Call(pickle_format.Global(_MD, "_MEM_FORMAT_ENCODING"), (0,)),
            False,
        ),
    )


def _storage(file, offset, length) -> pickle_format.New:
    return pickle_format.New(
        pickle_format.Global("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        {"relative_path": file, "offset": offset, "length": length},
    )


def read_layout(src) -> tuple[dict, dict]:
    """The checkpoint's ``.metadata`` as plain, editable dicts (read without torch)."""
    ck = dcp.open_dcp(LocalDirectory(str(src)))
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
                pickle_format.New(
                    pickle_format.Global(_MD, "ChunkStorageMetadata"),
                    {"offsets": _dims(c["offsets"]), "sizes": _dims(c["sizes"])},
                )
            )
            key = pickle_format.New(
                pickle_format.Global(_MD, "MetadataIndex"),
                {"fqn": name, "offset": _dims(c.get("index_offsets", c["offsets"])), "index": 0},
            )
            storage.append((key, _storage(c["file"], c["offset"], c["length"])))
        sdm[name] = pickle_format.New(
            pickle_format.Global(_MD, "TensorStorageMetadata"),
            {"properties": _properties(t["dtype"]), "size": _dims(t["shape"]), "chunks": chunks},
        )
    for name, o in objects.items():
        sdm[name] = pickle_format.New(pickle_format.Global(_MD, "BytesStorageMetadata"), {})
        key = pickle_format.New(
            pickle_format.Global(_MD, "MetadataIndex"), {"fqn": name, "offset": None, "index": None}
        )
        storage.append((key, _storage(o["file"], o["offset"], o["length"])))
    meta = pickle_format.New(
        pickle_format.Global(_MD, "Metadata"),
        {
            "state_dict_metadata": sdm,
            "planner_data": {},
            "storage_data": pickle_format.Pairs(tuple(storage)),
            "version": "1.0.0",
        },
    )
    (src / ".metadata").write_bytes(pickle_format.dumps(meta))


class ExtraFile:
    """Appends ``torch.save`` archives (tensors, objects) to ``EXTRA_FILE`` of ``src``."""

    def __init__(self, src):
        self.path = src / EXTRA_FILE
        self.path.touch()

    def _append(self, **what) -> tuple[int, int]:
        # not mode "a": zipfile seeks back to finish a member's header, which "a" ignores
        with open(self.path, "r+b") as f:
            offset = f.seek(0, os.SEEK_END)
            return offset, torch_zip.write_torch_save(f, **what)

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


def test_metadata_writer_round_trips_a_real_fixture(tmp_path):
    """The writer the other tests rely on: a real fixture's metadata re-written unchanged
    imports exactly as the original."""
    src = copy_megatron_fixture("moe_ep2", tmp_path)
    before = (src / ".metadata").read_bytes()
    write_layout(src, *read_layout(src))
    assert (src / ".metadata").read_bytes() != before  # really re-written
    got = jax_ucp.restore(jax_ucp.convert(str(src), str(tmp_path / "ucp")))
    ref = load_reference("moe_ep2")
    assert sorted(got["params"]) == sorted(ref)
    for name, want in ref.items():
        assert_bit_equal(got["params"][name], want, name)


@pytest.mark.timeout(60)
def test_optimizer_namespace_inside_a_name_is_never_a_weight(tmp_path):
    """A key in the optimizer namespace the importer does not know (here
    ``model.optimizer.state.exp_avg.x``) is refused, never imported as a model weight."""
    src = copy_megatron_fixture("moe_ep2", tmp_path)
    tensors, objects = read_layout(src)
    name = "model.optimizer.state.exp_avg.output_layer.weight"
    tensors[name] = ExtraFile(src).tensor(np.ones((64, 32), np.float32))
    write_layout(src, tensors, objects)
    assert_convert_refused(
        str(src),
        str(tmp_path / "out"),
        rf"tensor '{name}'.*unsupported distributed-optimizer layout",
        error=MegatronImportError,
    )


@pytest.mark.timeout(60)
def test_missing_param_groups_points_at_weights_only(tmp_path):
    """fully_reshardable state whose step cannot be recovered (common.pt without param_groups):
    the error says how to import the weights alone."""
    src = copy_megatron_fixture("gpt_distopt_dp2", tmp_path)
    torch_zip.save_file(str(src / "common.pt"), {"optimizer": {"param_state_sharding_type": None}})
    assert_megatron_refused(
        src,
        tmp_path,
        r"common\.pt: optimizer param_groups missing or empty; cannot recover the step\. "
        r"To import the model weights .*weights_only=True",
    )


HUGE = [2**62, 32]


OUTPUT = "output_layer.weight"


def _edited(tmp_path, edit, name: str = "moe_ep2"):
    """A copy of fixture ``name`` whose ``.metadata`` entry of ``output_layer.weight`` (a
    64 x 32 float32 tensor in one chunk) has been changed by ``edit(entry, chunk, file_size)``."""
    src = copy_megatron_fixture(name, tmp_path)
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
    assert_convert_refused(
        str(src),
        str(tmp_path / "out"),
        rf"tensor '{OUTPUT}' in \S+/\.metadata: .*{error}",
        error=MegatronImportError,
        importing=MegatronOptions(vocab_size=vocab_size),
    )


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
    assert_megatron_refused(src, tmp_path, rf"tensor '{OUTPUT}'{where}: {error}")


@pytest.mark.timeout(60)
def test_chunks_sharing_bytes_are_refused(tmp_path):
    """Two chunks of one tensor whose storage entries point at the same bytes (each declaring
    rows of its own): refused, so a tensor never takes more memory than its bytes on disk."""

    def split(entry, chunk, size):
        top = dict(chunk, sizes=[32, 32])
        bottom = dict(chunk, offsets=[32, 0], sizes=[32, 32])
        entry["chunks"] = [top, bottom]

    src = _edited(tmp_path, split)
    assert_megatron_refused(
        src,
        tmp_path,
        rf"tensor '{OUTPUT}' in \S+/\.metadata: two chunks share bytes \[\d+, \d+\.\.\.\) "
        r"of __0_0\.distcp",
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["fifo", "huge", "deep"])
def test_mcore_metadata_json_is_read_bounded(tmp_path, kind):
    """megatron-core's metadata.json as a FIFO (no hang), larger than 1 MiB, or nested too deep
    for the JSON parser: an error naming the file, nothing written."""
    src = copy_megatron_fixture("moe_ep2", tmp_path)
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
    assert_convert_refused(
        str(src), str(tmp_path / "out"), rf"metadata\.json: .*{error}", error=MegatronImportError
    )
